//! Types every OpenDsec component shares: the public API models, the error model,
//! sandbox ids (which name their edge) and the client configuration file.

pub mod api;
pub mod beneath;
pub mod channel;
pub mod client_config;
pub mod disk;
pub mod elf;
pub mod error;
#[cfg(feature = "http")]
pub mod http;
pub mod id;
pub mod image_ref;
pub mod mountinfo;
pub mod private;
pub mod project;
pub mod tree;
pub mod vmux;
pub mod vsock;

pub use error::{ApiError, ErrorCode, IoContext, IoFailure};

/// Milliseconds since the Unix epoch (0 on a clock before it): the one clock of every
/// timestamp the API and the stores keep.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Inputs each fuzz target runs as a property test under `cargo test` (CI).
#[cfg(test)]
pub(crate) const FUZZ_CASES: usize = 2000;
