//! The one place the edge's typed errors become API errors: each concern (a backend, the
//! network, the mount namespace, cgroups, volumes) has its own `thiserror` enum, and here
//! each variant gets its API code. The message is the error's own text, which says what
//! failed and, where the operator can act, what to do.

use dsec_common::{ApiError, ErrorCode};

/// An error with a code of the API: what the edge's typed errors implement.
pub trait Coded: std::error::Error {
    fn code(&self) -> ErrorCode;

    fn api(&self) -> ApiError {
        ApiError::new(self.code(), self.to_string())
    }
}

/// `e` as the API's error, its message led by what was being done.
pub fn during(what: &str, e: &dyn Coded) -> ApiError {
    ApiError::new(e.code(), format!("{what}: {e}"))
}

/// `impl From<$t> for ApiError` through [`Coded`], for each error type listed.
macro_rules! into_api_error {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for ApiError {
            fn from(e: $t) -> ApiError {
                Coded::api(&e)
            }
        }
    )*};
}

// ---- The network, the mount namespace, cgroups, volumes, containers -------------------

into_api_error!(
    crate::mountns::MountNsError,
    crate::volumes::VolumeError,
    crate::net::NetError,
    crate::net::NetlinkError,
    crate::backend::container::ContainerError,
);

// ---- The VM backends (QEMU and Firecracker) --------------------------------------------

into_api_error!(
    crate::backend::StateError,
    crate::backend::vm::VmError,
    crate::backend::vm::QmpError,
    crate::backend::microvm::MicrovmError,
);
