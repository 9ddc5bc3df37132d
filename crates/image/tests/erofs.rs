//! EROFS images built by `dsec_image::erofs` are read back by the kernel: mounted from
//! the file (file-backed EROFS), every entry's metadata, attributes and bytes must match
//! the tree they were made of; stacked under overlayfs, whiteouts and opaque directories
//! must hide what they hide in a layer directory.

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use common::{Mounted, pseudo_random};
use dsec_image::erofs;

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Whether this process can mount EROFS from a file; the tests say why they cannot.
fn can_mount() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting needs root");
        return false;
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs
        .lines()
        .any(|l| l.split_whitespace().last() == Some("erofs"))
    {
        eprintln!("skipped: this kernel has no EROFS");
        return false;
    }
    true
}

fn mount(fstype: &str, src: &Path, target: &Path, data: Option<&str>) -> Mounted {
    std::fs::create_dir_all(target).unwrap();
    let fstype = CString::new(fstype).unwrap();
    let data = data.map(|d| CString::new(d).unwrap());
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c(src).as_ptr(),
            c(target).as_ptr(),
            fstype.as_ptr(),
            libc::MS_RDONLY,
            data.as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    assert_eq!(
        rc,
        0,
        "mounting {} on {}: {}",
        src.display(),
        target.display(),
        std::io::Error::last_os_error()
    );
    Mounted(target.to_path_buf())
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).unwrap();
    // SAFETY: NUL-terminated path and name; the value's pointer and length.
    let rc = unsafe {
        libc::lsetxattr(
            c(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        rc,
        0,
        "setxattr {name}: {}",
        std::io::Error::last_os_error()
    );
}

fn mknod(p: &Path, mode: u32, major: u32, minor: u32) {
    // SAFETY: a NUL-terminated path.
    let rc = unsafe { libc::mknod(c(p).as_ptr(), mode, libc::makedev(major, minor)) };
    assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
}

fn set_times(p: &Path, sec: i64, nsec: i64) {
    let t = [
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
        libc::timespec {
            tv_sec: sec,
            tv_nsec: nsec,
        },
    ];
    // SAFETY: a NUL-terminated path and two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c(p).as_ptr(),
            t.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(rc, 0);
}

/// A tree with what layers hold: files of every size class around a block, a sparse
/// file, links short and long, a hard link, a whiteout, a FIFO, odd names, a
/// directory of many blocks, attributes, owners, modes and times.
fn make_tree(root: &Path) {
    let d = |p: &str| {
        let p = root.join(p);
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let w = |p: &str, b: &[u8]| std::fs::write(root.join(p), b).unwrap();
    d("usr/lib/deep/er/still");
    w("empty", b"");
    w("hello", b"hello\n");
    for n in [4095usize, 4096, 4097, 8191, (1 << 20) + 123] {
        w(&format!("usr/lib/f{n}"), &pseudo_random(n, n as u64));
    }
    // A tail that does not fit after its inode in the block left.
    w("usr/lib/deep/t4000", &pseudo_random(4000, 7));
    let sparse = root.join("usr/lib/sparse");
    let f = std::fs::File::create(&sparse).unwrap();
    f.set_len(3 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(b"middle", 1 << 20).unwrap();
    symlink("hello", root.join("short-link")).unwrap();
    symlink("x".repeat(4000), root.join("usr/long-link")).unwrap();
    symlink("/abs/../dangling", root.join("usr/lib/dangling")).unwrap();
    w("usr/lib/linked", b"one file, two names\n");
    std::fs::hard_link(root.join("usr/lib/linked"), root.join("usr/also-linked")).unwrap();
    mknod(&root.join("usr/gone"), libc::S_IFCHR | 0o600, 0, 0);
    mknod(&root.join("usr/fifo"), libc::S_IFIFO | 0o644, 0, 0);
    mknod(&root.join("usr/tty"), libc::S_IFCHR | 0o620, 136, 300);
    let many = d("many");
    for i in 0..2000 {
        let len = 1 + (i * 37) % 200;
        let name = format!("{i:04}{}", "n".repeat(len));
        std::fs::write(many.join(name), i.to_string()).unwrap();
    }
    // Names that sort before "." and "..", and bytes that are not UTF-8.
    w("many/-dash", b"");
    w("many/!bang", b"");
    std::fs::write(
        many.join(std::ffi::OsStr::from_bytes(b"\xff\x01odd")),
        b"odd",
    )
    .unwrap();
    w(&"L".repeat(255), b"long name");
    let opaque = d("opaque");
    setxattr(&opaque, "trusted.overlay.opaque", b"y");
    setxattr(&root.join("hello"), "user.comment", b"a value");
    setxattr(&root.join("hello"), "user.second", &pseudo_random(300, 3));
    setxattr(&root.join("hello"), "trusted.note", b"t");
    let suid = root.join("usr/lib/f4096");
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::os::unix::fs::lchown(root.join("hello"), Some(100_000), Some(12_345)).unwrap();
    std::os::unix::fs::lchown(root.join("short-link"), Some(7), Some(8)).unwrap();
    set_times(&root.join("hello"), 1_700_000_000, 123_456_789);
    set_times(&root.join("short-link"), 1_600_000_000, 5);
    set_times(&root.join("usr/lib"), 1_500_000_000, 0);
}

#[derive(Debug, PartialEq)]
struct Seen {
    mode: u32,
    uid: u32,
    gid: u32,
    size: Option<u64>,
    mtime: (i64, i64),
    nlink: u64,
    rdev: u64,
    xattrs: BTreeMap<String, Vec<u8>>,
    content: Option<Vec<u8>>,
    link: Option<PathBuf>,
}

fn walk(root: &Path) -> BTreeMap<Vec<u8>, Seen> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        let rel = p
            .strip_prefix(root)
            .unwrap()
            .as_os_str()
            .as_bytes()
            .to_vec();
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
        out.insert(
            rel,
            Seen {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                size: (!m.is_dir()).then_some(m.len()),
                mtime: (m.mtime(), m.mtime_nsec()),
                nlink: m.nlink(),
                rdev: m.rdev(),
                xattrs: dsec_common::tree::read_xattrs(&p).unwrap(),
                content: m.is_file().then(|| std::fs::read(&p).unwrap()),
                link: m.is_symlink().then(|| std::fs::read_link(&p).unwrap()),
            },
        );
    }
    out
}

#[test]
fn an_erofs_image_holds_the_tree_it_was_made_of() {
    if !can_mount() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    make_tree(&src);
    let img = t.path().join("layer.erofs");
    let stats = erofs::build(&src, &img).unwrap();
    assert_eq!(stats.bytes, std::fs::metadata(&img).unwrap().len());
    assert!(stats.meta_bytes < stats.bytes);

    // The same tree gives the same bytes.
    let again = t.path().join("again.erofs");
    erofs::build(&src, &again).unwrap();
    assert!(std::fs::read(&img).unwrap() == std::fs::read(&again).unwrap());

    let mnt = t.path().join("mnt");
    let _m = mount("erofs", &img, &mnt, None);
    let want = walk(&src);
    let got = walk(&mnt);
    assert_eq!(want.len(), got.len(), "entries");
    for (path, w) in &want {
        let name = String::from_utf8_lossy(path);
        let g = got.get(path).unwrap_or_else(|| panic!("{name} is missing"));
        if path.is_empty() {
            // The mount point's root: everything but its times comes from the image.
            assert_eq!(
                (w.mode, w.uid, w.gid, w.nlink),
                (g.mode, g.uid, g.gid, g.nlink)
            );
            continue;
        }
        assert_eq!(w, g, "{name}");
    }
    // Lookups by name (the kernel's binary search over a directory's blocks).
    for name in [
        "0000n",
        "1999nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn",
        "-dash",
        "!bang",
    ] {
        let hits: Vec<_> = std::fs::read_dir(mnt.join("many"))
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name();
                n.to_string_lossy().starts_with(&name[..4]).then_some(n)
            })
            .collect();
        assert!(!hits.is_empty(), "{name}");
        for h in hits {
            assert!(mnt.join("many").join(&h).exists(), "lookup of {h:?}");
        }
    }
    assert!(!mnt.join("many/nothere").exists());
    let a = std::fs::metadata(mnt.join("usr/lib/linked")).unwrap();
    let b = std::fs::metadata(mnt.join("usr/also-linked")).unwrap();
    assert_eq!(a.ino(), b.ino(), "a hard link is one inode");
    assert_eq!(a.nlink(), 2);
}

#[test]
fn erofs_layers_stack_under_overlayfs_with_whiteouts_and_opaque_directories() {
    if !can_mount() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base");
    for p in ["keep", "drop", "dir/old", "dir/sub/older"] {
        std::fs::create_dir_all(base.join(p).parent().unwrap()).unwrap();
        std::fs::write(base.join(p), p).unwrap();
    }
    let top = t.path().join("top");
    std::fs::create_dir_all(top.join("dir")).unwrap();
    mknod(&top.join("drop"), libc::S_IFCHR, 0, 0);
    setxattr(&top.join("dir"), "trusted.overlay.opaque", b"y");
    std::fs::write(top.join("dir/new"), b"new").unwrap();
    let (bi, ti) = (t.path().join("base.erofs"), t.path().join("top.erofs"));
    erofs::build(&base, &bi).unwrap();
    erofs::build(&top, &ti).unwrap();
    let (bm, tm, om) = (t.path().join("b"), t.path().join("t"), t.path().join("o"));
    let _b = mount("erofs", &bi, &bm, None);
    let _t = mount("erofs", &ti, &tm, None);
    let lower = format!("lowerdir={}:{}", tm.display(), bm.display());
    let _o = mount("overlay", Path::new("overlay"), &om, Some(&lower));
    assert_eq!(std::fs::read(om.join("keep")).unwrap(), b"keep");
    assert!(
        !om.join("drop").exists(),
        "the whiteout hides the lower file"
    );
    let mut names: Vec<_> = std::fs::read_dir(om.join("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["new"], "the opaque directory hides the lower one");
}
