//! Images: a directory-backed store of content-addressed layers and named references
//! (`root/py:3.11`), and a builder that makes images from Debian packages plus steps.
//!
//! Store layout (any directory; a shared filesystem for a cluster):
//! ```text
//! layers/<sha256>/        one unpacked layer, used read-only as an overlay lowerdir
//! manifests/<sha256>.json image manifest (layers bottom-up, env, cmd)
//! refs/<ns>/<name>/<tag>  the manifest digest a reference points at
//! tmp/                    work in progress; renamed into place when complete
//! guest/                  VM guest kernel, initramfs and root disks (see [`guest`])
//! ```

pub mod archive;
pub mod build;
pub mod cpio;
pub mod credentials;
pub mod digest;
pub mod erofs;
pub mod guest;
pub mod import;
pub mod layer;
pub mod lazy;
pub mod lazyfs;
mod oci;
pub mod pull;
pub mod push;
pub mod store;
pub mod vmlinux;

pub use dsec_common::image_ref::{BadImageRef, ImageRef};
pub use guest::{
    DiskSource, Kernel, ensure_initramfs, ensure_kernel, ensure_root_disks, ensure_vmlinux,
};
pub use store::{ImageStore, Manifest};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{0}")]
    BadReference(String),
    #[error(
        "image {0} does not exist in the image store; build it with `dsec image build` or list images with `dsec image ls`"
    )]
    NotFound(String),
    #[error("image store is damaged: {0}")]
    Corrupt(String),
    #[error("image build failed: {0}")]
    Build(String),
    #[error("image {0} already exists; commit with overwrite to replace it")]
    AlreadyExists(String),
    /// A tree sent for a commit broke the format's rules.
    #[error("the sandbox sent a malformed file tree: {0}")]
    BadTree(String),
    /// The sender of a tree stopped with this reason.
    #[error("the sandbox could not send its files: {0}")]
    Export(String),
    /// The sandbox's files hold something a layer cannot carry.
    #[error("cannot commit: {0}")]
    Uncommittable(String),
    /// A pull from a registry failed; `kind` says why, for the API's status.
    #[error("pulling {reference}: {message}")]
    Pull {
        reference: String,
        kind: pull::PullFailure,
        message: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

impl From<BadImageRef> for ImageError {
    fn from(e: BadImageRef) -> Self {
        ImageError::BadReference(e.0)
    }
}

pub(crate) trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, ImageError>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, ImageError> {
        self.map_err(|source| ImageError::Io {
            context: context(),
            source,
        })
    }
}
