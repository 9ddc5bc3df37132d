//! The guest initramfs: a static busybox, the kernel's modules the guest needs and the
//! `/init` script that mounts the root disks under an overlay and switches into aether.

use std::io::Write;
use std::path::{Path, PathBuf};

use dsec_common::id::random_hex;
use sha2::{Digest, Sha256};

use super::*;
use crate::cpio::CpioWriter;
use crate::{ImageError, IoContext};

/// The host's static busybox (Debian package busybox-static), copied into the initramfs.
pub const HOST_BUSYBOX: &str = "/bin/busybox";

/// Busybox applets linked in the initramfs's /bin.
pub(super) const INITRAMFS_APPLETS: &[&str] = &[
    "sh",
    "mount",
    "insmod",
    "switch_root",
    "mkdir",
    "echo",
    "cat",
    "sleep",
    "poweroff",
];

/// Bumped whenever the initramfs or root disk layout changes, so old cache entries are
/// not reused.
pub(super) const INITRAMFS_FORMAT: &str = "dsec-initramfs-v2";

/// The `/init` script of the initramfs.
pub(super) fn init_script() -> String {
    let modules = GUEST_MODULES.join(" ");
    let vsock_modules = VSOCK_MODULES.join(" ");
    format!(
        r#"#!/bin/sh
# OpenDsec guest init: load the virtio modules, mount the root read-only under an
# overlayfs with a tmpfs upper layer, and switch_root into the agent.
# Kernel command line: dsec.init=PATH (default {AETHER_GUEST_PATH}); dsec.layers=N: the
# root is N EROFS disks, top first (a disk whose virtio serial is dsec_lI is layer I;
# without serials, the first N in the order the kernel names them); without it, one disk
# dsec.root=DEV (default /dev/vda) of type dsec.rootfstype=TYPE (default ext4). The words
# after `--` become the arguments of dsec.init.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {{
    echo "dsec-guest: error: $*"
    /bin/busybox poweroff -f
    exit 1
}}

init={AETHER_GUEST_PATH}
root=/dev/vda
rootfstype=ext4
layers=
channel=virtio-serial
set -f
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
    case "$arg" in
        --) break ;;
        dsec.init=*) init="${{arg#dsec.init=}}" ;;
        dsec.root=*) root="${{arg#dsec.root=}}" ;;
        dsec.rootfstype=*) rootfstype="${{arg#dsec.rootfstype=}}" ;;
        dsec.layers=*) layers="${{arg#dsec.layers=}}" ;;
        dsec.channel=*) channel="${{arg#dsec.channel=}}" ;;
    esac
done
set +f

for m in {modules}; do
    if [ -f /lib/modules/$m.ko ]; then
        insmod /lib/modules/$m.ko || echo "dsec-guest: warning: insmod $m failed"
    fi
done
if [ "$channel" = vsock ]; then
    for m in {vsock_modules}; do
        if [ -f /lib/modules/$m.ko ]; then
            insmod /lib/modules/$m.ko || echo "dsec-guest: warning: insmod $m failed"
        fi
    done
fi

mkdir -p /mnt/lower /mnt/rw /newroot
if [ -n "$layers" ]; then
    case "$layers" in
        *[!0-9]*|'') fail "dsec.layers=$layers is not a number" ;;
    esac
    # A tmpfs holding every disk's mount, so that they move into the root as one.
    mount -t tmpfs -o mode=0755 dsec-lower /mnt/lower || fail "cannot mount the tmpfs for the root disks"
    i=0
    while :; do
        n=0
        for d in /sys/block/vd*; do
            [ -e "$d" ] && n=$((n + 1))
        done
        [ $n -ge "$layers" ] && break
        i=$((i + 1))
        [ $i -gt 200 ] && fail "$n of $layers root disks after 10 s (are the virtio-blk devices attached?)"
        sleep 0.05
    done
    # Disks with a dsec_l<I> serial are layer I; where none has one, the first N in the
    # kernel's order are the layers. Other disks are not the root's.
    byserial=
    for d in /sys/block/vd*; do
        serial=
        [ -r "$d/serial" ] && read -r serial < "$d/serial"
        case "$serial" in dsec_l[0-9]*) byserial=1 ;; esac
    done
    k=0
    for d in /sys/block/vd*; do
        dev=${{d##*/}}
        serial=
        [ -r "$d/serial" ] && read -r serial < "$d/serial"
        idx=
        case "$serial" in
            dsec_l[0-9]*) idx=${{serial#dsec_l}} ;;
            *) [ -z "$byserial" ] && idx=$k && k=$((k + 1)) ;;
        esac
        case "$idx" in
            ''|*[!0-9]*) continue ;;
        esac
        [ "$idx" -lt "$layers" ] || continue
        [ -e /mnt/lower/$idx ] && fail "two disks are root disk $idx"
        mkdir /mnt/lower/$idx
        mount -t erofs -o ro "/dev/$dev" /mnt/lower/$idx || fail "cannot mount root disk $idx (/dev/$dev, EROFS)"
    done
    lowerdir=
    i=0
    while [ $i -lt "$layers" ]; do
        [ -d /mnt/lower/$i ] || fail "no root disk $i"
        lowerdir="$lowerdir${{lowerdir:+:}}/mnt/lower/$i"
        i=$((i + 1))
    done
else
    i=0
    while [ ! -b "$root" ]; do
        i=$((i + 1))
        [ $i -gt 200 ] && fail "no root disk $root after 10 s (is a virtio-blk device attached?)"
        sleep 0.05
    done
    mount -t "$rootfstype" -o ro "$root" /mnt/lower || fail "cannot mount $root ($rootfstype) read-only"
    lowerdir=/mnt/lower
fi
mount -t tmpfs -o mode=0755 dsec-rw /mnt/rw || fail "cannot mount the tmpfs for the writable layer"
mkdir -p /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=$lowerdir,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work dsec-root /newroot \
    || fail "cannot mount the overlay root (is the overlay module loaded?)"
for d in proc sys dev; do
    mkdir -p /newroot/$d
    mount --move /$d /newroot/$d || fail "cannot move /$d into the new root"
done
# The root disks and the writable layer stay reachable for the agent (e.g. to commit the
# sandbox's changes) where the root has mount points for them.
[ -d /newroot/.dsec/lower ] && mount --move /mnt/lower /newroot/.dsec/lower
[ -d /newroot/.dsec/rw ] && mount --move /mnt/rw /newroot/.dsec/rw
[ -x "/newroot$init" ] || [ -L "/newroot$init" ] || fail "$init is not an executable in the root disk"

echo "{ROOT_READY_LINE}"
exec switch_root /newroot "$init" "$@"
"#
    )
}

pub(super) fn read_static_busybox() -> Result<Vec<u8>, ImageError> {
    let fix = "install Debian's busybox-static package (`apt-get install busybox-static`), which provides a statically linked /bin/busybox";
    let bytes = std::fs::read(HOST_BUSYBOX)
        .map_err(|e| build_err(format!("cannot read {HOST_BUSYBOX} ({e}); {fix}")))?;
    match dsec_common::elf::has_interpreter(&bytes) {
        Ok(false) => Ok(bytes),
        Ok(true) => Err(build_err(format!(
            "{HOST_BUSYBOX} is dynamically linked and cannot run in the guest's initramfs; {fix}"
        ))),
        Err(e) => Err(build_err(format!("{HOST_BUSYBOX}: {e}; {fix}"))),
    }
}

/// The initramfs as an uncompressed newc archive.
pub(super) fn initramfs_archive(
    busybox: &[u8],
    modules: &[(String, Vec<u8>)],
) -> std::io::Result<Vec<u8>> {
    let mut w = CpioWriter::new(Vec::new());
    for d in [
        "bin",
        "dev",
        "proc",
        "sys",
        "mnt",
        "mnt/lower",
        "mnt/rw",
        "newroot",
        "lib",
        "lib/modules",
    ] {
        w.dir(d, 0o755)?;
    }
    // The kernel opens /dev/console for /init's stdio before anything is mounted.
    w.char_device("dev/console", 0o600, 5, 1)?;
    w.file("bin/busybox", 0o755, busybox)?;
    for a in INITRAMFS_APPLETS {
        w.symlink(&format!("bin/{a}"), "busybox")?;
    }
    for (name, bytes) in modules {
        w.file(&format!("lib/modules/{name}.ko"), 0o644, bytes)?;
    }
    w.file("init", 0o755, init_script().as_bytes())?;
    w.finish()
}

/// Makes sure the initramfs for `kernel` is cached (busybox from the host, the kernel's
/// virtio modules, and the `/init` described in the module docs); returns its path,
/// `<store_root>/guest/kernel-<release>/initramfs-<hash of its inputs>.cpio.gz`.
pub fn ensure_initramfs(store_root: &Path, kernel: &Kernel) -> Result<PathBuf, ImageError> {
    let busybox = read_static_busybox()?;
    let mut modules = Vec::new();
    for p in &kernel.modules {
        let name = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bytes = std::fs::read(p).ctx(|| format!("reading {}", p.display()))?;
        modules.push((name, bytes));
    }
    let mut h = Sha256::new();
    h.update(INITRAMFS_FORMAT.as_bytes());
    h.update(kernel.version.as_bytes());
    h.update(init_script().as_bytes());
    h.update(INITRAMFS_APPLETS.join(" ").as_bytes());
    h.update(Sha256::digest(&busybox));
    for (name, bytes) in &modules {
        h.update(name.as_bytes());
        h.update(Sha256::digest(bytes));
    }
    let hash = hex::encode(h.finalize());
    let dir = kernel_dir(store_root, &kernel.version);
    let dest = dir.join(format!("initramfs-{}.cpio.gz", &hash[..16]));
    if dest.is_file() {
        tracing::debug!("initramfs is cached at {}", dest.display());
        return Ok(dest);
    }
    tracing::info!(
        "building initramfs for {} ({} modules)",
        kernel.version,
        modules.len()
    );
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let archive =
        initramfs_archive(&busybox, &modules).ctx(|| "writing the initramfs archive".into())?;
    let tmp = TempPath::new(dir.join(format!(".tmp-initramfs-{}", random_hex(8))));
    let file =
        std::fs::File::create(tmp.path()).ctx(|| format!("creating {}", tmp.path().display()))?;
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::best());
    gz.write_all(&archive)
        .and_then(|_| gz.finish())
        .and_then(|f| f.sync_all())
        .ctx(|| format!("writing {}", tmp.path().display()))?;
    std::fs::rename(tmp.path(), &dest).ctx(|| format!("writing {}", dest.display()))?;
    tmp.keep();
    tracing::info!("initramfs cached at {}", dest.display());
    Ok(dest)
}
