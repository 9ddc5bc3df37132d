//! What the image crate's mount tests share.

use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// A mount point, detached when dropped.
pub struct Mounted(pub PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// `n` bytes of xorshift noise from `seed`: the same for the same seed.
pub fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
