//! The sandboxes' seccomp policy (`oci.rs`, as OCI JSON) compiled to a BPF program once,
//! with the host's libseccomp: the compiler crun itself uses, loaded with `dlopen` so the
//! edge needs no build-time dependency on it. crun takes the program as the annotation
//! `run.oci.seccomp_bpf_data` and skips compiling the policy, which it otherwise does on
//! every create: about 10 ms of CPU each, the largest part of a create after the
//! runtime's own work. Without libseccomp on the host, or for another runtime, the OCI
//! section is used as before.

use std::ffi::{CStr, CString, c_int, c_uint, c_void};
use std::os::fd::AsRawFd;

use dsec_common::{IoContext, IoFailure};
use serde_json::Value;

/// Why the seccomp policy could not be compiled (crun then compiles it itself).
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("libseccomp.so.2 is not installed")]
    NoLibrary,
    #[error("libseccomp has no {0}")]
    NoSymbol(String),
    /// The policy names something this compiler does not translate.
    #[error("seccomp {kind} {name} is not compiled here")]
    Unsupported { kind: &'static str, name: String },
    /// libseccomp refused a step, with its (negative errno) return code.
    #[error("libseccomp: {step}: error {rc}")]
    Refused { step: String, rc: i32 },
    #[error("libseccomp wrote {0} bytes, not a program")]
    NotAProgram(usize),
    #[error(transparent)]
    Io(#[from] IoFailure),
}

/// `struct scmp_arg_cmp` of <seccomp.h>.
#[repr(C)]
struct ArgCmp {
    arg: c_uint,
    op: c_uint,
    datum_a: u64,
    datum_b: u64,
}

type Init = unsafe extern "C" fn(u32) -> *mut c_void;
type Release = unsafe extern "C" fn(*mut c_void);
type ArchAdd = unsafe extern "C" fn(*mut c_void, u32) -> c_int;
type Resolve = unsafe extern "C" fn(*const libc::c_char) -> c_int;
type RuleAdd = unsafe extern "C" fn(*mut c_void, u32, c_int, c_uint, *const ArgCmp) -> c_int;
type Export = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;

struct Lib {
    init: Init,
    release: Release,
    arch_add: ArchAdd,
    resolve: Resolve,
    rule_add: RuleAdd,
    export: Export,
}

fn lib() -> Result<Lib, SeccompError> {
    // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast to the type
    // <seccomp.h> declares for it. The library stays loaded (never dlclose'd).
    unsafe {
        let h = libc::dlopen(
            c"libseccomp.so.2".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        );
        if h.is_null() {
            return Err(SeccompError::NoLibrary);
        }
        let sym = |name: &CStr| -> Result<*mut c_void, SeccompError> {
            let p = libc::dlsym(h, name.as_ptr());
            if p.is_null() {
                Err(SeccompError::NoSymbol(name.to_string_lossy().into_owned()))
            } else {
                Ok(p)
            }
        };
        Ok(Lib {
            init: std::mem::transmute::<*mut c_void, Init>(sym(c"seccomp_init")?),
            release: std::mem::transmute::<*mut c_void, Release>(sym(c"seccomp_release")?),
            arch_add: std::mem::transmute::<*mut c_void, ArchAdd>(sym(c"seccomp_arch_add")?),
            resolve: std::mem::transmute::<*mut c_void, Resolve>(sym(
                c"seccomp_syscall_resolve_name",
            )?),
            rule_add: std::mem::transmute::<*mut c_void, RuleAdd>(sym(c"seccomp_rule_add_array")?),
            export: std::mem::transmute::<*mut c_void, Export>(sym(c"seccomp_export_bpf")?),
        })
    }
}

const ACT_ALLOW: u32 = 0x7fff_0000;
const ACT_ERRNO: u32 = 0x0005_0000;

fn action(name: &str, errno: Option<u64>) -> Result<u32, SeccompError> {
    match name {
        "SCMP_ACT_ALLOW" => Ok(ACT_ALLOW),
        "SCMP_ACT_ERRNO" => Ok(ACT_ERRNO | (errno.unwrap_or(libc::EPERM as u64) as u32 & 0xffff)),
        other => Err(SeccompError::Unsupported {
            kind: "action",
            name: other.to_string(),
        }),
    }
}

/// The audit architecture of an `SCMP_ARCH_*` name.
fn arch(name: &str) -> Result<u32, SeccompError> {
    match name {
        "SCMP_ARCH_X86_64" => Ok(0xC000_003E),
        "SCMP_ARCH_X86" => Ok(0x4000_0003),
        "SCMP_ARCH_X32" => Ok(0x4000_003E),
        "SCMP_ARCH_AARCH64" => Ok(0xC000_00B7),
        "SCMP_ARCH_ARM" => Ok(0x4000_0028),
        other => Err(SeccompError::Unsupported {
            kind: "architecture",
            name: other.to_string(),
        }),
    }
}

fn op(name: &str) -> Result<c_uint, SeccompError> {
    Ok(match name {
        "SCMP_CMP_NE" => 1,
        "SCMP_CMP_LT" => 2,
        "SCMP_CMP_LE" => 3,
        "SCMP_CMP_EQ" => 4,
        "SCMP_CMP_GE" => 5,
        "SCMP_CMP_GT" => 6,
        "SCMP_CMP_MASKED_EQ" => 7,
        other => {
            return Err(SeccompError::Unsupported {
                kind: "comparison",
                name: other.to_string(),
            });
        }
    })
}

/// A libseccomp filter context, released when dropped.
struct Ctx<'a> {
    lib: &'a Lib,
    ctx: *mut c_void,
}

impl Drop for Ctx<'_> {
    fn drop(&mut self) {
        // SAFETY: a context seccomp_init returned, released once.
        unsafe { (self.lib.release)(self.ctx) }
    }
}

/// Compiles the OCI seccomp section `policy` (the subset `oci.rs` writes: a default action,
/// architectures, and rules of names, an action, an errno and argument comparisons) as
/// crun would, into the raw `struct sock_filter` array that `seccomp(2)` loads.
pub fn compile(policy: &Value) -> Result<Vec<u8>, SeccompError> {
    let lib = lib()?;
    let u = |v: &Value| v.as_u64();
    let default = action(
        policy["defaultAction"].as_str().unwrap_or(""),
        u(&policy["defaultErrnoRet"]),
    )?;
    // SAFETY: seccomp_init with an action constant; the context is owned by `ctx`.
    let ctx = unsafe { (lib.init)(default) };
    if ctx.is_null() {
        return Err(SeccompError::Refused {
            step: "seccomp_init".into(),
            rc: -1,
        });
    }
    let ctx = Ctx { lib: &lib, ctx };
    for a in policy["architectures"].as_array().into_iter().flatten() {
        let token = arch(a.as_str().unwrap_or(""))?;
        // SAFETY: a live context and an architecture token.
        let rc = unsafe { (lib.arch_add)(ctx.ctx, token) };
        // The native one is there from the start.
        if rc != 0 && rc != -libc::EEXIST {
            return Err(SeccompError::Refused {
                step: format!("adding architecture {a}"),
                rc,
            });
        }
    }
    for rule in policy["syscalls"].as_array().into_iter().flatten() {
        let act = action(rule["action"].as_str().unwrap_or(""), u(&rule["errnoRet"]))?;
        let mut args = Vec::new();
        for a in rule["args"].as_array().into_iter().flatten() {
            args.push(ArgCmp {
                arg: u(&a["index"]).unwrap_or(0) as c_uint,
                op: op(a["op"].as_str().unwrap_or(""))?,
                datum_a: u(&a["value"]).unwrap_or(0),
                datum_b: u(&a["valueTwo"]).unwrap_or(0),
            });
        }
        for name in rule["names"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or("");
            let c = CString::new(name).map_err(|_| SeccompError::Unsupported {
                kind: "syscall name",
                name: format!("{name:?}"),
            })?;
            // SAFETY: a NUL-terminated name.
            let nr = unsafe { (lib.resolve)(c.as_ptr()) };
            if nr == -1 {
                continue; // unknown to this libseccomp, as crun skips it
            }
            // SAFETY: a live context; `args` outlives the call.
            let rc =
                unsafe { (lib.rule_add)(ctx.ctx, act, nr, args.len() as c_uint, args.as_ptr()) };
            if rc != 0 {
                return Err(SeccompError::Refused {
                    step: format!("adding the rule for {name}"),
                    rc,
                });
            }
        }
    }
    let mut f =
        crate::spawn::memfd(c"seccomp-bpf", libc::MFD_CLOEXEC).ctx(|| "memfd_create".into())?;
    // SAFETY: a live context and an open descriptor.
    let rc = unsafe { (lib.export)(ctx.ctx, f.as_raw_fd()) };
    if rc != 0 {
        return Err(SeccompError::Refused {
            step: "seccomp_export_bpf".into(),
            rc,
        });
    }
    let bpf = crate::spawn::written(&mut f).ctx(|| "reading the program".into())?;
    if bpf.is_empty() || bpf.len() % 8 != 0 {
        return Err(SeccompError::NotAProgram(bpf.len()));
    }
    Ok(bpf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Loads `bpf` in a child process (no_new_privs first, as crun does) and runs `f`
    /// there; returns what `f` returned.
    fn under(bpf: &[u8], f: fn() -> i64) -> i64 {
        let (mut r, w) = std::io::pipe().unwrap();
        // SAFETY: the child only makes system calls and writes to the pipe, then exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                let prog = libc::sock_fprog {
                    len: (bpf.len() / 8) as u16,
                    filter: bpf.as_ptr() as *mut libc::sock_filter,
                };
                let mut out = -1000i64;
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                    && libc::syscall(
                        libc::SYS_seccomp,
                        libc::SECCOMP_SET_MODE_FILTER,
                        0,
                        &prog as *const libc::sock_fprog,
                    ) == 0
                {
                    out = f();
                }
                libc::write(w.as_raw_fd(), (&out as *const i64).cast(), 8);
                libc::_exit(0);
            }
        }
        drop(w);
        let mut b = [0u8; 8];
        r.read_exact(&mut b).unwrap();
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        i64::from_ne_bytes(b)
    }

    fn errno_of(rc: i64) -> i64 {
        if rc < 0 {
            // SAFETY: reading this thread's errno.
            unsafe { *libc::__errno_location() as i64 }
        } else {
            rc.min(0)
        }
    }

    #[test]
    fn the_compiled_policy_allows_and_refuses_as_written() {
        let policy = super::super::oci::seccomp_policy();
        let bpf = match compile(&policy) {
            Ok(b) => b,
            // A host without libseccomp: crun compiles the OCI section instead.
            Err(SeccompError::NoLibrary) => return,
            Err(e) => panic!("{e}"),
        };
        // An allowed call works.
        assert!(under(&bpf, || unsafe { libc::getpid() } as i64) > 0);
        // Refused by default: EPERM.
        assert_eq!(
            under(&bpf, || errno_of(unsafe {
                libc::syscall(libc::SYS_keyctl, 0, 0, 0, 0, 0)
            })),
            libc::EPERM as i64
        );
        // clone3: ENOSYS, so libc falls back to clone.
        assert_eq!(
            under(&bpf, || errno_of(unsafe {
                libc::syscall(libc::SYS_clone3, 0, 0)
            })),
            libc::ENOSYS as i64
        );
        // Arguments are compared: AF_INET sockets yes, AF_ALG no.
        assert_eq!(
            under(&bpf, || {
                let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
                if fd >= 0 { 0 } else { errno_of(-1) }
            }),
            0
        );
        assert_eq!(
            under(&bpf, || errno_of(
                unsafe { libc::socket(libc::AF_ALG, libc::SOCK_SEQPACKET, 0) } as i64
            )),
            libc::EPERM as i64
        );
        // clone with CLONE_NEWUSER: refused; unshare is not on the list at all.
        assert_eq!(
            under(&bpf, || errno_of(unsafe {
                libc::syscall(
                    libc::SYS_clone,
                    libc::CLONE_NEWUSER as i64 | libc::SIGCHLD as i64,
                    0,
                    0,
                    0,
                    0,
                )
            })),
            libc::EPERM as i64
        );
    }

    #[test]
    fn what_it_cannot_compile_is_an_error() {
        let bad = serde_json::json!({
            "defaultAction": "SCMP_ACT_NOTIFY", "architectures": [], "syscalls": []
        });
        match compile(&bad) {
            Err(SeccompError::NoLibrary) => {}
            Err(SeccompError::Unsupported { kind, name }) => {
                assert_eq!((kind, name.as_str()), ("action", "SCMP_ACT_NOTIFY"))
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("compiled an action it does not know"),
        }
    }
}
