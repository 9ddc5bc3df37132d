//! Guest artefacts for the VM backends, built from Debian packages and cached in the
//! image store:
//!
//! ```text
//! guest/kernel-<release>/vmlinuz                 from linux-image-<release> (the package
//! guest/kernel-<release>/modules/<name>.ko         behind linux-image-cloud-amd64)
//! guest/kernel-<release>/vmlinux                 the ELF kernel inside vmlinuz (Firecracker)
//! guest/kernel-<release>/kernel.json             release, package version, sha256 of vmlinuz
//! guest/kernel-<release>/initramfs-<hash>.cpio.gz busybox + the modules + /init
//! guest/disks/stage-<key>.erofs                  aether and the root's mount points
//! guest/disks/merged-<key>.erofs                 the bottom layers of a deep image, as one
//! erofs/<layer>.img                              a layer as an EROFS disk (a lazily pulled
//!                                                  layer's is its file on lazyfs/ instead)
//! ```
//!
//! A VM's root is a stack of read-only EROFS disks, one per image layer (so VMs of images
//! that share layers share their disks, and a lazily pulled layer is fetched as the guest
//! reads it), under the stage. The initramfs `/init` loads the virtio and EROFS modules
//! (and, with `dsec.channel=vsock` on the command line, the vsock ones), mounts the
//! `dsec.layers=N` disks under an overlayfs whose upper layer is a tmpfs, prints
//! `dsec-guest: root ready` and `switch_root`s into the program named by `dsec.init=` on
//! the kernel command line (default `/.dsec/aether`), passing it the words after `--` on
//! the command line.
//!
//! Everything is built in a temporary path next to its final place and renamed (a root
//! disk: linked) into it, so a crash leaves nothing half-written under a cached name.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::build::run_logged;
use crate::store::remove_tree;
use crate::{ImageError, IoContext};

mod disk;
mod initramfs;
mod kernel;

pub use disk::*;
pub use initramfs::*;
pub use kernel::*;

/// Where the root disk puts the in-sandbox agent, and what `/init` runs by default.
pub const AETHER_GUEST_PATH: &str = "/.dsec/aether";

/// The line `/init` prints on the console once the root filesystem is in place.
pub const ROOT_READY_LINE: &str = "dsec-guest: root ready";

fn guest_dir(store_root: &Path) -> PathBuf {
    store_root.join("guest")
}

fn build_err(msg: impl Into<String>) -> ImageError {
    ImageError::Build(msg.into())
}

/// The message of an error about to be wrapped in another, without a second
/// "image build failed" prefix.
fn detail(e: &ImageError) -> String {
    match e {
        ImageError::Build(m) => m.clone(),
        e => e.to_string(),
    }
}

/// A path removed on drop unless [`TempPath::keep`] was called.
struct TempPath(Option<PathBuf>);

impl TempPath {
    fn new(p: PathBuf) -> TempPath {
        TempPath(Some(p))
    }
    fn path(&self) -> &Path {
        self.0.as_deref().expect("temp path is kept")
    }
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            if p.is_dir() {
                let _ = remove_tree(&p);
            } else {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
}

/// Runs a command to completion, logging its output at debug level.
fn run(cmd: &mut Command, what: &str) -> Result<(), ImageError> {
    run_logged(
        cmd,
        what,
        &mut |line| tracing::debug!(target: "dsec_image::guest", "{what}: {line}"),
    )
}

/// Runs a command and returns its stdout; the error carries stderr.
fn output(cmd: &mut Command, what: &str) -> Result<String, ImageError> {
    let out = cmd.output().ctx(|| format!("running {what}"))?;
    if !out.status.success() {
        return Err(build_err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ImageStore;
    use crate::cpio::{S_IFCHR, S_IFLNK, read_newc};
    use std::collections::HashSet;

    #[test]
    fn kernel_release_comes_from_the_meta_package_dependency() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n";
        assert_eq!(
            parse_kernel_depends(out).as_deref(),
            Some("6.1.0-57-cloud-amd64")
        );
        let alt =
            "linux-image-cloud-amd64\n |Depends: <linux-image-6.1.0-9-cloud-amd64>\n  Depends: x\n";
        assert_eq!(
            parse_kernel_depends(alt).as_deref(),
            Some("6.1.0-9-cloud-amd64")
        );
        assert_eq!(
            parse_kernel_depends("x\n  Depends: linux-image-6.1.0-57-amd64\n"),
            None
        );
        assert_eq!(
            parse_kernel_depends("  Depends: linux-image-../../x-cloud-amd64\n"),
            None
        );
        let policy =
            "linux-image-6.1.0-57-cloud-amd64:\n  Installed: (none)\n  Candidate: 6.1.192-3\n";
        assert_eq!(parse_candidate(policy).as_deref(), Some("6.1.192-3"));
        assert_eq!(parse_candidate("x:\n  Candidate: (none)\n"), None);
    }

    #[test]
    fn finds_plain_and_compressed_modules_with_dash_or_underscore() {
        let tmp = tempfile::tempdir().unwrap();
        let k = tmp.path().join("kernel");
        std::fs::create_dir_all(k.join("drivers/char/hw_random")).unwrap();
        std::fs::create_dir_all(k.join("fs/overlayfs")).unwrap();
        std::fs::write(k.join("drivers/char/hw_random/virtio-rng.ko"), b"rng").unwrap();
        std::fs::write(k.join("fs/overlayfs/overlay.ko.xz"), b"xz").unwrap();
        std::fs::write(k.join("fs/overlayfs/README"), b"no").unwrap();
        let m = find_modules(&k).unwrap();
        assert_eq!(m.len(), 2);
        assert!(m[&module_key("virtio-rng")].ends_with("virtio-rng.ko"));
        assert!(m["overlay"].ends_with("overlay.ko.xz"));
    }

    #[test]
    fn compressed_modules_are_decompressed() {
        if Command::new("xz").arg("--version").output().is_err() {
            eprintln!("skipped: xz is not installed");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let plain = tmp.path().join("m.ko");
        std::fs::write(&plain, b"module bytes").unwrap();
        assert!(
            Command::new("xz")
                .arg("-k")
                .arg(&plain)
                .status()
                .unwrap()
                .success()
        );
        let out = tmp.path().join("out.ko");
        install_module(&tmp.path().join("m.ko.xz"), &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"module bytes");
    }

    #[test]
    fn elf_check_tells_static_from_dynamic() {
        let sh = std::fs::read("/bin/sh").unwrap();
        assert_eq!(
            dsec_common::elf::has_interpreter(&sh),
            Ok(true),
            "/bin/sh is dynamic"
        );
        if let Ok(bb) = std::fs::read(HOST_BUSYBOX) {
            // Debian's busybox-static; the dynamic `busybox` package also installs here.
            let dynamic = Command::new("file")
                .arg("-L")
                .arg(HOST_BUSYBOX)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("dynamically"))
                .unwrap_or(false);
            assert_eq!(dsec_common::elf::has_interpreter(&bb), Ok(dynamic));
        }
        assert!(dsec_common::elf::has_interpreter(b"#!/bin/sh\n").is_err());
    }

    #[test]
    fn initramfs_has_busybox_applets_modules_console_and_init() {
        let modules = vec![
            ("virtio_ring".to_string(), b"ring".to_vec()),
            ("virtio-rng".to_string(), b"rng".to_vec()),
        ];
        let a = initramfs_archive(b"\x7fELFbusybox", &modules).unwrap();
        let e = read_newc(&a).unwrap();
        let get = |n: &str| {
            e.iter()
                .find(|e| e.name == n)
                .unwrap_or_else(|| panic!("{n} missing"))
        };
        assert_eq!(get("bin/busybox").mode, 0o100755);
        assert_eq!(get("bin/busybox").data, b"\x7fELFbusybox");
        for a in [
            "sh",
            "mount",
            "insmod",
            "switch_root",
            "mkdir",
            "echo",
            "cat",
            "sleep",
        ] {
            let l = get(&format!("bin/{a}"));
            assert_eq!(l.file_type(), S_IFLNK, "{a}");
            assert_eq!(l.data, b"busybox", "{a}");
        }
        assert_eq!(get("dev/console").file_type(), S_IFCHR);
        assert_eq!(get("dev/console").rdev, (5, 1));
        assert_eq!(get("lib/modules/virtio-rng.ko").data, b"rng");
        let init = get("init");
        assert_eq!(init.mode, 0o100755);
        let script = String::from_utf8(init.data.clone()).unwrap();
        assert!(script.starts_with("#!/bin/sh\n"));
        assert!(script.contains(ROOT_READY_LINE));
        assert!(script.contains("exec switch_root /newroot \"$init\" \"$@\""));
        assert!(script.contains(&format!("init={AETHER_GUEST_PATH}\n")));
        // Modules load in the documented order.
        let for_line = script.lines().find(|l| l.starts_with("for m in ")).unwrap();
        assert_eq!(
            for_line,
            format!("for m in {}; do", GUEST_MODULES.join(" "))
        );
        for d in ["proc", "sys", "mnt/lower", "mnt/rw", "newroot"] {
            assert_eq!(get(d).mode, 0o040755, "{d}");
        }
    }

    #[test]
    fn init_script_parses_with_busybox_sh() {
        let Ok(out) = Command::new(HOST_BUSYBOX)
            .args(["sh", "-n", "-c", &init_script()])
            .output()
        else {
            eprintln!("skipped: {HOST_BUSYBOX} is not installed");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Mounts `disks` (EROFS, top first) stacked read-only under an overlay, as the
    /// guest's `/init` does, in a thread with a mount namespace of its own, and gives
    /// `look` the merged tree.
    fn stacked<T: Send + 'static>(
        disks: &[PathBuf],
        look: impl FnOnce(&Path) -> T + Send + 'static,
    ) -> T {
        let disks = disks.to_vec();
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap();
            own_mount_namespace().unwrap();
            let mut lowers = Vec::new();
            for (i, d) in disks.iter().enumerate() {
                let m = dir.path().join(i.to_string());
                std::fs::create_dir(&m).unwrap();
                crate::erofs::mount(d, &m).unwrap();
                lowers.push(m.display().to_string());
            }
            let merged = dir.path().join("merged");
            std::fs::create_dir(&merged).unwrap();
            overlay_ro(&lowers.join(":"), &merged).unwrap();
            look(&merged)
        })
        .join()
        .unwrap()
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A throw-away store, where root disks can be built and mounted (root, and a kernel
    /// that mounts EROFS from a file); `None`, said, elsewhere.
    fn erofs_store() -> Option<(tempfile::TempDir, ImageStore)> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || crate::lazy::unsupported().is_some() {
            eprintln!("skipped: needs root and a kernel that mounts EROFS from a file");
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        Some((tmp, store))
    }

    /// An overlayfs whiteout (a 0/0 character device) at `p`.
    fn whiteout(p: &Path) {
        let c = cstring(p).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(
            unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, libc::makedev(0, 0)) },
            0
        );
    }

    /// Layers with overlayfs and OCI whiteouts become EROFS disks that stack, under the
    /// stage, into the image's tree; disks are cached per layer and shared by images.
    #[test]
    fn root_disks_stack_layers_honour_whiteouts_and_cache() {
        let Some((tmp, store)) = erofs_store() else {
            return;
        };
        let mk = |files: &[(&str, &str)]| {
            let d = store.temp_dir("l").unwrap();
            for (p, c) in files {
                let p = d.join(p);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(p, c).unwrap();
            }
            d
        };
        let base = mk(&[
            ("etc/keep", "base"),
            ("etc/over", "base"),
            ("etc/gone-overlay", "x"),
            ("etc/gone-oci", "x"),
            ("opq/old", "x"),
            ("opq-oci/old", "x"),
        ]);
        std::os::unix::fs::chown(base.join("etc/keep"), Some(1000), Some(1001)).unwrap();
        let (l1, _) = store.add_layer(&base).unwrap();
        let top = mk(&[("etc/over", "top"), ("opq/new", "y"), ("opq-oci/new", "y")]);
        // overlayfs-style whiteout and opaque dir, as `run` steps produce them.
        whiteout(&top.join("etc/gone-overlay"));
        let opq = cstring(&top.join("opq")).unwrap();
        assert_eq!(
            unsafe {
                libc::setxattr(
                    opq.as_ptr(),
                    c"trusted.overlay.opaque".as_ptr(),
                    b"y".as_ptr().cast(),
                    1,
                    0,
                )
            },
            0
        );
        let (l2, _) = store.add_layer(&top).unwrap();
        // OCI-style whiteouts in a third layer.
        let oci = mk(&[
            ("etc/.wh.gone-oci", ""),
            ("opq-oci/.wh..wh..opq", ""),
            ("opq-oci/fresh", "z"),
        ]);
        let (l3, _) = store.add_layer(&oci).unwrap();
        let aether = tmp.path().join("aether");
        std::fs::write(&aether, b"#!/bin/sh\necho aether\n").unwrap();

        let layers = vec![l1.clone(), l2.clone(), l3.clone()];
        let disks = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_eq!(disks.len(), 4, "{disks:?}");
        assert!(disks[0].starts_with(tmp.path().join("guest/disks")));
        // Top first, each layer its own disk.
        for (d, l) in disks[1..].iter().zip([&l3, &l2, &l1]) {
            assert_eq!(*d, tmp.path().join("erofs").join(format!("{l}.img")));
        }
        let (keep, over, aether_text, root, etc, opq_ls, opq_oci, owner, mode) =
            stacked(&disks, |m| {
                use std::os::unix::fs::MetadataExt;
                let keep = std::fs::metadata(m.join("etc/keep")).unwrap();
                (
                    std::fs::read_to_string(m.join("etc/keep")).unwrap(),
                    std::fs::read_to_string(m.join("etc/over")).unwrap(),
                    std::fs::read_to_string(m.join(".dsec/aether")).unwrap(),
                    names(m),
                    names(&m.join("etc")),
                    names(&m.join("opq")),
                    names(&m.join("opq-oci")),
                    (keep.uid(), keep.gid()),
                    std::fs::metadata(m.join(".dsec/aether")).unwrap().mode() & 0o7777,
                )
            });
        assert_eq!(keep, "base");
        assert_eq!(over, "top");
        assert_eq!(aether_text, "#!/bin/sh\necho aether\n");
        for d in ["proc", "sys", "dev", "mnt", "etc", ".dsec"] {
            assert!(root.contains(&d.to_string()), "/{d} missing in {root:?}");
        }
        assert_eq!(etc, ["keep", "over"], "whiteouts ignored");
        assert_eq!(opq_ls, ["new"]);
        // The opaque marker hides everything below its layer, even l2's newer file.
        assert_eq!(opq_oci, ["fresh"]);
        assert_eq!(owner, (1000, 1001));
        assert_eq!(mode, 0o755);

        // Cache hit: same paths, not rewritten; another image with a shared layer
        // shares its disk.
        let mtime = std::fs::metadata(&disks[1]).unwrap().modified().unwrap();
        assert_eq!(
            ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap(),
            disks
        );
        assert_eq!(
            std::fs::metadata(&disks[1]).unwrap().modified().unwrap(),
            mtime
        );
        let other = ensure_root_disks(&store, DiskSource::Layers(&layers[..1]), &aether).unwrap();
        assert_eq!(other[1], disks[3]);
        // Another aether, another stage; the layers' disks stay.
        std::fs::write(&aether, b"other").unwrap();
        let disks2 = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_ne!(disks[0], disks2[0]);
        assert_eq!(disks[1..], disks2[1..]);
        // Nothing left behind in tmp/, and the store's layers are untouched.
        assert_eq!(
            std::fs::read_dir(tmp.path().join("tmp")).unwrap().count(),
            0
        );
        assert!(store.layer_path(&l3).join("etc/.wh.gone-oci").exists());
        // A layer's disk goes with the layer.
        store.gc(&HashSet::new()).unwrap();
        assert!(!disks[1].exists());
    }

    /// An image deeper than [`MAX_ROOT_DISKS`] keeps its top layers as their own disks and
    /// merges the rest into one, whiteouts across the cut included.
    #[test]
    fn deep_images_merge_their_bottom_layers() {
        let Some((tmp, store)) = erofs_store() else {
            return;
        };
        let n = MAX_ROOT_DISKS + 4;
        let mut layers = Vec::new();
        for i in 0..n {
            let d = store.temp_dir("l").unwrap();
            std::fs::create_dir(d.join("f")).unwrap();
            std::fs::write(d.join(format!("f/{i}")), i.to_string()).unwrap();
            // Layer 1 deletes layer 0's file (both merged); the top deletes layer 2's.
            let gone = match i {
                1 => Some(0),
                i if i == n - 1 => Some(2),
                _ => None,
            };
            if let Some(g) = gone {
                whiteout(&d.join(format!("f/{g}")));
            }
            layers.push(store.add_layer(&d).unwrap().0);
        }
        let aether = tmp.path().join("aether");
        std::fs::write(&aether, b"a").unwrap();
        let disks = ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap();
        assert_eq!(disks.len(), MAX_ROOT_DISKS);
        assert!(
            disks[MAX_ROOT_DISKS - 1]
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("merged-")
        );
        let seen = stacked(&disks, |m| names(&m.join("f")));
        let mut want: Vec<String> = (0..n)
            .filter(|i| *i != 0 && *i != 2)
            .map(|i| i.to_string())
            .collect();
        want.sort();
        assert_eq!(seen, want);
        assert_eq!(
            ensure_root_disks(&store, DiskSource::Layers(&layers), &aether).unwrap(),
            disks
        );
    }
}
