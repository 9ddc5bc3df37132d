//! What goes wrong talking netlink to the kernel, for both families the edge speaks:
//! nf_tables ([`super::nfnl`]) and rtnetlink ([`super::rtnl`]).

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    /// The kernel refused a request: the first message it refused, and why.
    #[error("the kernel refused {what}: {source}")]
    Refused { what: String, source: io::Error },
    #[error("no answer from the kernel to {what}")]
    Timeout { what: String },
    #[error(transparent)]
    MountNs(#[from] crate::mountns::MountNsError),
    #[error(transparent)]
    Os(#[from] dsec_common::IoFailure),
    /// An argument the kernel was never asked about (a name with a NUL byte, a
    /// malformed answer), or a helper thread that died.
    #[error("{0}")]
    Other(String),
}

impl NetlinkError {
    /// The errno of a refusal (`ENOENT`: the set or element is not there).
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Refused { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
