//! Content digests. A layer's digest is the sha256 of a canonical tar of its directory
//! (GNU tar, sorted names, numeric owners, xattrs, fixed mtime), so equal trees get equal
//! digests wherever they were built.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::{ImageError, IoContext};

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

pub fn valid_digest(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Digest of a directory tree, and its size in bytes (the tar stream's length).
pub fn tree_digest(dir: &Path) -> Result<(String, u64), ImageError> {
    let mut child = Command::new("tar")
        .args([
            "--sort=name",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--mtime=@0",
            "--format=posix",
            "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
            "-cf",
            "-",
            "-C",
        ])
        .arg(dir)
        .arg(".")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ctx(|| "running tar to digest a layer".into())?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    if let Some(mut out) = child.stdout.take() {
        loop {
            let n = out.read(&mut buf).ctx(|| "reading tar output".into())?;
            if n == 0 {
                break;
            }
            size += n as u64;
            hasher.update(&buf[..n]);
        }
    }
    let output = child.wait_with_output().ctx(|| "waiting for tar".into())?;
    if !output.status.success() {
        return Err(ImageError::Build(format!(
            "tar failed on {}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// The SHA-256 (hex) of a file's bytes.
pub fn file_sha256(path: &Path) -> Result<String, ImageError> {
    let mut f = std::fs::File::open(path).ctx(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .ctx(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}
