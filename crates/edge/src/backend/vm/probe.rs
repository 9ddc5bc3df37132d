//! What the node offers VMs: QEMU (where it is, its version), the accelerator (KVM or
//! TCG), the machine types the backend wires, and the `[edge.vm]` settings checked.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::VmError;

/// How a VM's CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// KVM when `/dev/kvm` is there and the CPU has hardware virtualisation behind it
    /// (`vmx`/`svm` and the kvm_intel/kvm_amd module); anything else (e.g. a paravirtual
    /// KVM module that cannot run an unmodified guest) gets TCG.
    pub fn detect() -> Accel {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap_or_default();
        let hw = flags.split_whitespace().any(|f| f == "vmx" || f == "svm");
        let module = Path::new("/sys/module/kvm_intel").exists()
            || Path::new("/sys/module/kvm_amd").exists();
        if Path::new("/dev/kvm").exists() && hw && module {
            Accel::Kvm
        } else {
            Accel::Tcg
        }
    }
}

/// Machine types the backend knows how to wire: the `-M` value and the virtio transport
/// suffix of its devices.
pub(super) fn machine(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "microvm" => Some(("microvm", "device")),
        "q35" => Some(("q35", "pci")),
        _ => None,
    }
}

pub(super) fn check_options(
    o: crate::config::VmOptions,
) -> Result<crate::config::VmOptions, VmError> {
    if machine(&o.machine).is_none() {
        return Err(VmError::Config(format!(
            "[edge.vm] machine = {:?} is not supported: use \"microvm\" or \"q35\"",
            o.machine
        )));
    }
    if let Some(d) = o
        .devices
        .iter()
        .find(|d| d.is_empty() || d.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        return Err(VmError::Config(format!(
            "[edge.vm] devices entry {d:?} is not a QEMU -device argument"
        )));
    }
    if !o.run_as.is_empty() && !user_exists(&o.run_as) {
        return Err(VmError::Config(format!(
            "[edge.vm] run_as = {:?} is not a user of this host (QEMU drops to it after start-up; create it, or give \"nobody\")",
            o.run_as
        )));
    }
    Ok(o)
}

/// Whether `name` is in the host's user database.
pub(super) fn user_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: a NUL-terminated name; the result is only checked for NULL.
    !unsafe { libc::getpwnam(c.as_ptr()) }.is_null()
}

/// The `(major, minor)` version `qemu --version` prints; (0, 0) if it prints none.
pub(super) fn qemu_version(qemu: &Path) -> (u32, u32) {
    let out = Command::new(qemu)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    parse_version(&out).unwrap_or((0, 0))
}

pub(super) fn parse_version(said: &str) -> Option<(u32, u32)> {
    let v = said
        .lines()
        .next()?
        .strip_prefix("QEMU emulator version ")?;
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

pub(super) fn find_qemu() -> Result<PathBuf, VmError> {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/libexec"] {
        let p = Path::new(dir).join("qemu-system-x86_64");
        if p.exists() {
            return Ok(p);
        }
    }
    Err(VmError::Unavailable(
        "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)".into(),
    ))
}

/// The host's TSC rate in kHz: the guest is told it, so its boot does not stall trying to
/// calibrate against an emulated PIT on a busy host.
pub(super) fn tsc_khz() -> u64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|mhz| (mhz * 1000.0) as u64)
        .unwrap_or(2_000_000)
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::VmOptions;

    #[test]
    fn qemu_versions_are_read() {
        let v = "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\nCopyright";
        assert_eq!(parse_version(v), Some((10, 0)));
        assert_eq!(
            parse_version("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7)"),
            Some((7, 2))
        );
        assert_eq!(parse_version("qemu-system-x86_64: not found"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn vm_options_are_checked() {
        let ok = |m: &str, d: &[&str]| {
            check_options(VmOptions {
                machine: m.into(),
                devices: d.iter().map(|s| s.to_string()).collect(),
                run_as: "nobody".into(),
                ..VmOptions::default()
            })
        };
        assert!(ok("microvm", &[]).is_ok());
        assert!(ok("q35", &["vfio-pci,host=0000:65:00.0"]).is_ok());
        let e = ok("pc-i440fx", &[]).unwrap_err();
        assert!(matches!(e, VmError::Config(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("microvm") && e.contains("q35"), "{e}");
        assert!(ok("q35", &["vfio-pci,host=1 -monitor stdio"]).is_err());
        assert!(ok("q35", &[""]).is_err());
        assert_eq!(machine("q35"), Some(("q35", "pci")));
        assert_eq!(machine("microvm"), Some(("microvm", "device")));
        let no_such = check_options(VmOptions {
            run_as: "dsec-no-such-user".into(),
            ..VmOptions::default()
        });
        assert!(no_such.unwrap_err().to_string().contains("run_as"));
    }
}
