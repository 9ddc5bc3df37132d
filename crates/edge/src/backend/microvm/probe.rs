//! Finding the Firecracker binary and learning its version, which decides whether the
//! backend runs at all (v1.16 or a later v1 minor) and which request fields may be sent:
//! Firecracker parses request bodies strictly and answers 400 to a field it does not know.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsec_common::{IoContext, IoFailure};

use super::MicrovmError;

/// The oldest release the backend drives: the first with `vsock_override` on snapshot
/// load, the kvm-clock restore fix and the VMGenID HID fix.
pub const MIN_VERSION: Version = Version {
    major: 1,
    minor: 16,
    patch: 0,
};

/// Where Firecracker is looked for when the configuration names none.
const SEARCH: &[&str] = &["/usr/local/bin", "/usr/bin"];

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl Version {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
        }
    }

    /// `v1.16.1`, `1.16.1`, `v1.17.0-dev` (the pre-release part is ignored).
    pub fn parse(s: &str) -> Option<Version> {
        let s = s.trim().strip_prefix('v').unwrap_or(s.trim());
        let core = s.split(['-', '+']).next()?;
        let mut it = core.split('.').map(|p| p.parse::<u32>().ok());
        let v = Version::new(it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    }
}

/// The version in `firecracker --version` output: its first line is
/// `Firecracker v1.16.1` (later lines, if any, are ignored).
pub fn parse_version_output(out: &str) -> Option<Version> {
    let first = out.lines().find(|l| !l.trim().is_empty())?;
    let mut words = first.split_whitespace();
    if words.next()? != "Firecracker" {
        return None;
    }
    Version::parse(words.next()?)
}

/// The snapshot format in `firecracker --snapshot-version` output: the first line that is
/// a version (`v10.0.0`). Firecracker logs `... Firecracker exiting successfully` to
/// stdout after it.
pub fn parse_snapshot_version(out: &str) -> Option<String> {
    out.lines()
        .map(str::trim)
        .find(|l| Version::parse(l).is_some())
        .map(str::to_string)
}

/// Whether the backend drives this version: v1.16 or a later minor within v1 (a new
/// major may change the API).
pub fn check_supported(v: Version) -> Result<(), MicrovmError> {
    if v.major != MIN_VERSION.major || v < MIN_VERSION {
        return Err(MicrovmError::Unavailable(format!(
            "Firecracker {v} is not supported: the microvm backend needs {MIN_VERSION} or a later v{}.x release",
            MIN_VERSION.major
        )));
    }
    Ok(())
}

/// Which optional request fields the probed version knows (the "since" column of its API
/// spec). Only these are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// `mtu` on `PUT /network-interfaces` (1.16.0).
    pub net_mtu: bool,
    /// `vsock_override` on `PUT /snapshot/load` (1.16.0).
    pub vsock_override: bool,
    /// `network_overrides` on `PUT /snapshot/load` (1.12.0).
    pub network_overrides: bool,
    /// `track_dirty_pages` on `PUT /snapshot/load` (1.13.0; `enable_diff_snapshots` before).
    pub load_track_dirty_pages: bool,
    /// `PUT /serial` (1.14.0).
    pub serial: bool,
    /// `PUT /entropy` (1.4.0).
    pub entropy: bool,
}

impl Capabilities {
    pub fn of(v: Version) -> Capabilities {
        let at_least = |maj, min| v >= Version::new(maj, min, 0);
        Capabilities {
            net_mtu: at_least(1, 16),
            vsock_override: at_least(1, 16),
            network_overrides: at_least(1, 12),
            load_track_dirty_pages: at_least(1, 13),
            serial: at_least(1, 14),
            entropy: at_least(1, 4),
        }
    }
}

/// A Firecracker binary the backend may use.
#[derive(Debug, Clone)]
pub struct Firecracker {
    pub path: PathBuf,
    pub version: Version,
    /// `--snapshot-version` (e.g. `v10.0.0`): snapshots load only into the same format.
    pub snapshot_version: String,
    pub caps: Capabilities,
}

/// The configured binary, else `firecracker` on PATH, in /usr/local/bin or /usr/bin.
pub fn find(configured: Option<&Path>) -> Result<PathBuf, MicrovmError> {
    if let Some(p) = configured {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(MicrovmError::Unavailable(format!(
                "firecracker_binary {} does not exist (set [edge] firecracker_binary to the Firecracker v1.16 binary)",
                p.display()
            )))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SEARCH.iter().map(PathBuf::from))
        .map(|d| d.join("firecracker"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            MicrovmError::Unavailable("no firecracker binary (install Firecracker v1.16 in /usr/local/bin or set [edge] firecracker_binary)".into())
        })
}

/// Runs `bin arg` and returns its stdout, killing it after `within`.
fn run_for_output(bin: &Path, arg: &str, within: Duration) -> Result<String, MicrovmError> {
    let t0 = Instant::now();
    let mut child = loop {
        match Command::new(bin)
            .arg(arg)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => break c,
            // A binary just written (an upgrade in progress) is briefly busy.
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && t0.elapsed() < within => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                return Err(IoFailure::new(format!("running {} {arg}", bin.display()), e).into());
            }
        }
    };
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if t0.elapsed() > within => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(MicrovmError::Timeout {
                    what: format!("{} {arg}", bin.display()),
                    secs: within.as_secs(),
                });
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                return Err(
                    IoFailure::new(format!("waiting for {} {arg}", bin.display()), e).into(),
                );
            }
        }
    }
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out)
            .ctx(|| format!("reading the output of {} {arg}", bin.display()))?;
    }
    Ok(out)
}

/// Probes `bin`: its version (refused unless supported) and snapshot format.
pub fn probe(bin: &Path) -> Result<Firecracker, MicrovmError> {
    let within = Duration::from_secs(10);
    let out = run_for_output(bin, "--version", within)?;
    let version = parse_version_output(&out).ok_or_else(|| {
        MicrovmError::Unavailable(format!(
            "{} --version printed {:?}, not `Firecracker vX.Y.Z`; is it Firecracker?",
            bin.display(),
            out.lines().next().unwrap_or("")
        ))
    })?;
    check_supported(version)?;
    let snapshot_version = run_for_output(bin, "--snapshot-version", within)
        .ok()
        .and_then(|s| parse_snapshot_version(&s))
        .unwrap_or_default();
    Ok(Firecracker {
        path: bin.to_path_buf(),
        version,
        snapshot_version,
        caps: Capabilities::of(version),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn versions_parse() {
        assert_eq!(
            parse_version_output("Firecracker v1.16.1\n"),
            Some(Version::new(1, 16, 1))
        );
        assert_eq!(
            parse_version_output("\nFirecracker v1.17.0-dev\n\nextra\n"),
            Some(Version::new(1, 17, 0))
        );
        assert_eq!(parse_version_output("firecracker 1.16.1"), None);
        assert_eq!(parse_version_output("Firecracker v1.16"), None);
        assert_eq!(parse_version_output("Firecracker v1.16.1.2"), None);
        assert_eq!(parse_version_output("QEMU emulator version 7.2.0"), None);
        assert_eq!(parse_version_output(""), None);
        // What v1.16.1 prints: the format, then its exit log line.
        assert_eq!(
            parse_snapshot_version(
                "v10.0.0\n2026-12-04T20:50:14.391373430 [anonymous-instance:main] Firecracker exiting successfully. exit_code=0\n"
            ),
            Some("v10.0.0".into())
        );
        assert_eq!(parse_snapshot_version("exiting\n"), None);
        assert_eq!(Version::parse("1.2.3"), Some(Version::new(1, 2, 3)));
        assert!(Version::new(1, 16, 0) < Version::new(1, 16, 1));
        assert!(Version::new(1, 9, 9) < Version::new(1, 16, 0));
    }

    #[test]
    fn only_v1_16_and_later_minors_are_accepted() {
        assert!(check_supported(Version::new(1, 16, 0)).is_ok());
        assert!(check_supported(Version::new(1, 16, 1)).is_ok());
        assert!(check_supported(Version::new(1, 17, 0)).is_ok());
        let e = check_supported(Version::new(1, 15, 2)).unwrap_err();
        assert!(matches!(e, MicrovmError::Unavailable(_)), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("v1.15.2 is not supported") && e.contains("v1.16.0"),
            "{e}"
        );
        assert!(check_supported(Version::new(2, 0, 0)).is_err());
        assert!(check_supported(Version::new(0, 25, 0)).is_err());
    }

    #[test]
    fn capabilities_follow_the_version() {
        let c = Capabilities::of(Version::new(1, 16, 1));
        assert!(c.vsock_override && c.net_mtu && c.load_track_dirty_pages && c.serial);
        let c = Capabilities::of(Version::new(1, 12, 0));
        assert!(!c.vsock_override && !c.net_mtu && !c.load_track_dirty_pages);
        assert!(c.network_overrides && c.entropy);
    }

    /// A stand-in binary: a script that prints `version` for --version.
    fn fake(dir: &Path, version: &str) -> PathBuf {
        let p = dir.join("firecracker");
        std::fs::write(
            &p,
            format!(
                "#!/bin/sh\ncase \"$1\" in\n--version) echo '{version}' ;;\n--snapshot-version) echo v10.0.0 ;;\nesac\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn the_probe_runs_the_binary_and_accepts_or_refuses_it() {
        let d = tempfile::tempdir().unwrap();
        let ok = fake(d.path(), "Firecracker v1.16.1");
        let fc = probe(&ok).unwrap();
        assert_eq!(fc.version, Version::new(1, 16, 1));
        assert_eq!(fc.snapshot_version, "v10.0.0");
        assert!(fc.caps.vsock_override);
        assert_eq!(find(Some(&ok)).unwrap(), ok);

        let d2 = tempfile::tempdir().unwrap();
        let old = fake(d2.path(), "Firecracker v1.15.1");
        let e = probe(&old).unwrap_err().to_string();
        assert!(e.contains("v1.15.1 is not supported"), "{e}");

        let d3 = tempfile::tempdir().unwrap();
        let other = fake(d3.path(), "something else 1.16.1");
        let e = probe(&other).unwrap_err().to_string();
        assert!(e.contains("is it Firecracker?"), "{e}");

        let e = find(Some(&d3.path().join("missing"))).unwrap_err();
        assert!(matches!(e, MicrovmError::Unavailable(_)), "{e:?}");
        assert!(e.to_string().contains("does not exist"), "{e}");
    }
}
