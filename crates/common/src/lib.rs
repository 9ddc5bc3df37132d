//! Types every OpenDsec component shares: the public API models, the error model,
//! sandbox ids (which name their edge) and the client configuration file.

pub mod api;
pub mod beneath;
pub mod channel;
pub mod client_config;
pub mod disk;
pub mod e2b;
pub mod elf;
pub mod error;
#[cfg(feature = "http")]
pub mod event_query;
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

/// Unix milliseconds as RFC 3339 UTC.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Inputs each fuzz target runs as a property test under `cargo test` (CI).
#[cfg(test)]
pub(crate) const FUZZ_CASES: usize = 2000;
