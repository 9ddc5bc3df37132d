//! The "newc" cpio format (`070701` headers), which the Linux kernel unpacks as an
//! initramfs: a writer for building guest initramfs images and a reader for checking them.
//!
//! Each entry is a 110-byte ASCII header (magic plus 13 eight-digit hex fields), the name
//! with its NUL, padding to a multiple of 4, then the data, padded to a multiple of 4. The
//! archive ends with an entry named `TRAILER!!!`.

use std::io::{self, Write};

const MAGIC: &[u8; 6] = b"070701";
const HEADER_LEN: usize = 110;
const TRAILER: &str = "TRAILER!!!";

pub const S_IFMT: u32 = 0o170000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFCHR: u32 = 0o020000;

fn pad4(n: usize) -> usize {
    (4 - n % 4) % 4
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Writes a newc archive: owners are root, times are 0, inode numbers count up from 1.
pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> CpioWriter<W> {
        CpioWriter { out, next_ino: 1 }
    }

    /// A directory; `perm` is the permission bits (e.g. 0o755).
    pub fn dir(&mut self, name: &str, perm: u32) -> io::Result<()> {
        self.entry(name, S_IFDIR | (perm & 0o7777), 2, (0, 0), b"")
    }

    /// A regular file with `data` as its contents.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, S_IFREG | (perm & 0o7777), 1, (0, 0), data)
    }

    /// A symbolic link to `target` (relative or absolute, as in `ln -s`).
    pub fn symlink(&mut self, name: &str, target: &str) -> io::Result<()> {
        if target.is_empty() || target.contains('\0') {
            return Err(invalid(format!(
                "symlink {name:?} has an empty or NUL-containing target"
            )));
        }
        self.entry(name, S_IFLNK | 0o777, 1, (0, 0), target.as_bytes())
    }

    /// A character device node, e.g. `dev/console` (5, 1).
    pub fn char_device(&mut self, name: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(name, S_IFCHR | (perm & 0o7777), 1, (major, minor), b"")
    }

    /// Writes the trailer and returns the underlying writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.header(0, 0, 1, 0, (0, 0), TRAILER)?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        check_name(name)?;
        let size = u32::try_from(data.len())
            .map_err(|_| invalid(format!("{name} is larger than cpio's 4 GiB limit")))?;
        let ino = self.next_ino;
        self.next_ino += 1;
        self.header(ino, mode, nlink, size, rdev, name)?;
        self.out.write_all(data)?;
        self.out.write_all(&[0u8; 3][..pad4(data.len())])?;
        Ok(())
    }

    fn header(
        &mut self,
        ino: u32,
        mode: u32,
        nlink: u32,
        size: u32,
        rdev: (u32, u32),
        name: &str,
    ) -> io::Result<()> {
        let namesize = name.len() + 1;
        let fields = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            size,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            namesize as u32,
            0, // check
        ];
        let mut h = Vec::with_capacity(HEADER_LEN + namesize + 3);
        h.extend_from_slice(MAGIC);
        for f in fields {
            h.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        h.extend_from_slice(name.as_bytes());
        h.push(0);
        h.extend_from_slice(&[0u8; 3][..pad4(HEADER_LEN + namesize)]);
        self.out.write_all(&h)
    }
}

/// Archive names are relative (`bin/sh`, not `/bin/sh`), with no `.`/`..` components.
fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty()
        || name.starts_with('/')
        || name.contains('\0')
        || name == TRAILER
        || name
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(invalid(format!(
            "{name:?} is not a valid archive name (relative, no '.', '..' or empty components)"
        )));
    }
    Ok(())
}

/// One entry read back from a newc archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpioEntry {
    pub name: String,
    pub ino: u32,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub mtime: u32,
    pub rdev: (u32, u32),
    /// File contents, or the target of a symlink.
    pub data: Vec<u8>,
}

impl CpioEntry {
    pub fn file_type(&self) -> u32 {
        self.mode & S_IFMT
    }
}

/// Reads every entry of a newc archive up to (not including) its trailer.
pub fn read_newc(mut buf: &[u8]) -> io::Result<Vec<CpioEntry>> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let mut out = Vec::new();
    let mut offset = 0usize;
    loop {
        if buf.len() < HEADER_LEN {
            return Err(bad(format!("truncated header at offset {offset}")));
        }
        if &buf[..6] != MAGIC {
            return Err(bad(format!("bad magic at offset {offset}")));
        }
        let mut f = [0u32; 13];
        for (i, v) in f.iter_mut().enumerate() {
            let s = std::str::from_utf8(&buf[6 + i * 8..14 + i * 8])
                .map_err(|_| bad(format!("non-ASCII header at offset {offset}")))?;
            *v = u32::from_str_radix(s, 16)
                .map_err(|_| bad(format!("bad hex field {s:?} at offset {offset}")))?;
        }
        let namesize = f[11] as usize;
        let size = f[6] as usize;
        let name_end = HEADER_LEN + namesize;
        let data_start = name_end + pad4(name_end);
        let data_end = data_start + size;
        let next = data_end + pad4(data_end);
        if namesize == 0 || buf.len() < data_end {
            return Err(bad(format!("truncated entry at offset {offset}")));
        }
        if buf[name_end - 1] != 0 {
            return Err(bad(format!("name not NUL-terminated at offset {offset}")));
        }
        let name = String::from_utf8_lossy(&buf[HEADER_LEN..name_end - 1]).into_owned();
        if name == TRAILER {
            return Ok(out);
        }
        out.push(CpioEntry {
            name,
            ino: f[0],
            mode: f[1],
            uid: f[2],
            gid: f[3],
            nlink: f[4],
            mtime: f[5],
            rdev: (f[9], f[10]),
            data: buf[data_start..data_end].to_vec(),
        });
        let skip = next.min(buf.len());
        buf = &buf[skip..];
        offset += skip;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("bin", 0o755).unwrap();
        w.file("bin/busybox", 0o755, b"\x7fELF fake").unwrap();
        w.symlink("bin/sh", "busybox").unwrap();
        w.dir("dev", 0o755).unwrap();
        w.char_device("dev/console", 0o600, 5, 1).unwrap();
        // Sizes 0..=4 exercise every padding length.
        for n in 0..5 {
            w.file(&format!("f{n}"), 0o644, &b"abcd"[..n]).unwrap();
        }
        w.file("init", 0o755, b"#!/bin/sh\necho hi\n").unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trips_names_modes_links_devices_and_padding() {
        let bytes = sample();
        assert_eq!(bytes.len() % 4, 0, "archive length is 4-aligned");
        assert!(bytes.starts_with(b"070701"));
        let e = read_newc(&bytes).unwrap();
        let names: Vec<&str> = e.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "f0",
                "f1",
                "f2",
                "f3",
                "f4",
                "init"
            ]
        );
        assert_eq!(e[0].mode, 0o040755);
        assert_eq!(e[1].mode, 0o100755);
        assert_eq!(e[1].data, b"\x7fELF fake");
        assert_eq!(e[2].mode, 0o120777);
        assert_eq!(e[2].data, b"busybox");
        assert_eq!(e[4].file_type(), S_IFCHR);
        assert_eq!(e[4].mode & 0o7777, 0o600);
        assert_eq!(e[4].rdev, (5, 1));
        for n in 0..5 {
            assert_eq!(e[5 + n].data, &b"abcd"[..n], "file f{n}");
        }
        assert_eq!(e[10].data, b"#!/bin/sh\necho hi\n");
        let mut inos: Vec<u32> = e.iter().map(|e| e.ino).collect();
        inos.dedup();
        assert_eq!(inos.len(), e.len(), "inode numbers are unique");
        assert!(e.iter().all(|e| e.uid == 0 && e.gid == 0 && e.mtime == 0));
    }

    #[test]
    fn reader_rejects_damage_and_writer_rejects_bad_names() {
        let bytes = sample();
        assert!(
            read_newc(&bytes[..bytes.len() - 120]).is_err(),
            "no trailer"
        );
        let mut bad = bytes.clone();
        bad[0] = b'1';
        assert!(read_newc(&bad).is_err());
        let mut w = CpioWriter::new(Vec::new());
        for name in ["/abs", "", "a/../b", "a//b", "./a", "TRAILER!!!"] {
            assert!(w.file(name, 0o644, b"").is_err(), "{name:?} accepted");
        }
        assert!(w.symlink("l", "").is_err());
    }

    /// Cross-checks against GNU cpio where it is installed.
    #[test]
    fn gnu_cpio_lists_and_extracts_what_we_write() {
        if std::process::Command::new("cpio")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("skipped: cpio is not installed");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("a.cpio");
        std::fs::write(&archive, sample()).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("cpio -t --quiet < a.cpio")
            .current_dir(tmp.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let listing = String::from_utf8(out.stdout).unwrap();
        assert_eq!(
            listing.lines().collect::<Vec<_>>(),
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "f0",
                "f1",
                "f2",
                "f3",
                "f4",
                "init"
            ]
        );
        let x = tmp.path().join("x");
        std::fs::create_dir(&x).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("cpio -id --quiet --no-absolute-filenames < ../a.cpio")
            .current_dir(&x)
            .output()
            .unwrap();
        // Making dev/console needs root; everything else must extract.
        let _ = out;
        assert_eq!(
            std::fs::read_link(x.join("bin/sh")).unwrap(),
            std::path::Path::new("busybox")
        );
        assert_eq!(std::fs::read(x.join("f3")).unwrap(), b"abc");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(x.join("init"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o755
        );
    }
}
