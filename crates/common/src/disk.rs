//! A filesystem's size and use (`statvfs`).

use std::path::Path;

/// Bytes of the filesystem holding a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub total: u64,
    /// Free, the root-reserved blocks included.
    pub free: u64,
    /// Free for unprivileged users.
    pub available: u64,
}

impl DiskUsage {
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free)
    }
}

pub fn usage(path: &Path) -> std::io::Result<DiskUsage> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs fills the zeroed struct for a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let unit = s.f_frsize as u64;
    Ok(DiskUsage {
        total: (s.f_blocks as u64).saturating_mul(unit),
        free: (s.f_bfree as u64).saturating_mul(unit),
        available: (s.f_bavail as u64).saturating_mul(unit),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_filesystem_has_a_size() {
        let u = usage(Path::new("/")).unwrap();
        assert!(u.total > 0 && u.free <= u.total && u.available <= u.free);
        assert!(usage(Path::new("/no/such/path")).is_err());
    }
}
