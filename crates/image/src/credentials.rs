//! Registry credentials a project keeps on the node, so that its pulls, pushes and builds
//! `FROM` a private registry need none in each request.
//!
//! The book is one file in the image store (which a cluster's edges share),
//! `registry-credentials.sealed`: the JSON of every project's entries sealed with
//! AES-256-GCM (a fresh nonce per write) under the node's key `registry-credentials.key`,
//! 32 random bytes made at first use; both are root's alone (0600). A copy of the sealed
//! file alone (a backup, a support bundle, a listing) gives nothing away; whoever can read
//! the key file is root on the node already. Writers take an exclusive lock on
//! `registry-credentials.lock`, so two edges never lose each other's change.
//!
//! An entry is found for the project an image goes into and, for pulls, that project's
//! parents (a parent's registry login serves its subtree, as its images do); a push uses
//! the pushing project's own entry only, so a tenant never writes to a registry with a
//! parent's login. No answer of the API carries a password or a token back.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

use crate::pull::{Credentials, PullFailure};
use crate::{ImageError, IoContext};

const SEALED: &str = "registry-credentials.sealed";
const KEY: &str = "registry-credentials.key";
const LOCK: &str = "registry-credentials.lock";
/// Bound to every sealed book: a file sealed for anything else does not open as one.
const AAD: &[u8] = b"opendsec registry credentials v1";
/// Longest username, password or token kept (a registry token is a few KiB at most).
const MAX_SECRET: usize = 16 << 10;
/// Most registries one project keeps logins for.
const MAX_PER_PROJECT: usize = 64;

#[derive(Serialize, Deserialize, Clone)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Stored {
    Basic { username: String, password: String },
    Token { token: String },
}

#[derive(Serialize, Deserialize, Default)]
struct Book {
    /// project -> registry -> login
    projects: BTreeMap<String, BTreeMap<String, Entry>>,
}

#[derive(Serialize, Deserialize, Clone)]
struct Entry {
    #[serde(flatten)]
    login: Stored,
    updated_ms: u64,
}

/// A kept login as the API shows it: never its secret.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = RegistryLogin))]
pub struct Login {
    pub project: String,
    pub registry: String,
    /// `basic` (a username and a password) or `token`.
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    pub updated_ms: u64,
}

fn invalid(registry: &str, m: impl Into<String>) -> ImageError {
    ImageError::Pull {
        reference: registry.to_string(),
        kind: PullFailure::Invalid,
        message: m.into(),
    }
}

/// A registry's name as logins are kept under it: `host[:port]`, lower case, Docker
/// Hub's other names as `docker.io` (the name a reference like `python:3.11` resolves to).
pub fn registry_name(registry: &str) -> Result<String, ImageError> {
    let r = registry
        .trim()
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_ascii_lowercase();
    let ok = !r.is_empty()
        && r.len() <= 253
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
        && !r.starts_with(['.', '-', ':']);
    if !ok {
        return Err(invalid(
            registry,
            format!(
                "{registry:?} is not a registry name: give host[:port], e.g. registry.example.com or 127.0.0.1:5000"
            ),
        ));
    }
    Ok(match r.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".to_string()
        }
        _ => r,
    })
}

use dsec_common::now_ms;

/// The node's book of registry logins (see the module's description).
pub struct CredentialBook {
    dir: PathBuf,
}

impl CredentialBook {
    /// The book kept in directory `dir` (the image store's root).
    pub fn new(dir: &Path) -> CredentialBook {
        CredentialBook {
            dir: dir.to_path_buf(),
        }
    }

    /// The sealing key; made (root's alone) when there is none and `create`.
    fn key(&self, create: bool) -> Result<Option<LessSafeKey>, ImageError> {
        let path = self.dir.join(KEY);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                let mut k = [0u8; 32];
                SystemRandom::new()
                    .fill(&mut k)
                    .map_err(|_| ImageError::Corrupt("no randomness for a key".into()))?;
                let tmp = self.dir.join(format!("{KEY}.{}", std::process::id()));
                let mut f = dsec_common::private::open(&tmp, false)
                    .ctx(|| format!("making {}", tmp.display()))?;
                f.write_all(&k)
                    .and_then(|_| f.sync_all())
                    .ctx(|| format!("writing {}", tmp.display()))?;
                // Another edge may have made one meanwhile: the first one named wins.
                std::fs::hard_link(&tmp, &path)
                    .or_else(|e| match e.kind() {
                        std::io::ErrorKind::AlreadyExists => Ok(()),
                        _ => Err(e),
                    })
                    .ctx(|| format!("naming {}", path.display()))?;
                let _ = std::fs::remove_file(&tmp);
                std::fs::read(&path).ctx(|| format!("reading {}", path.display()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).ctx(|| format!("reading {}", path.display())),
        };
        let key = UnboundKey::new(&AES_256_GCM, &bytes)
            .map_err(|_| ImageError::Corrupt(format!("{} is not a 32-byte key", path.display())))?;
        Ok(Some(LessSafeKey::new(key)))
    }

    fn load(&self, key: Option<&LessSafeKey>) -> Result<Book, ImageError> {
        let path = self.dir.join(SEALED);
        let mut sealed = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Book::default()),
            Err(e) => return Err(e).ctx(|| format!("reading {}", path.display())),
        };
        let key = key.ok_or_else(|| {
            ImageError::Corrupt(format!(
                "{} is there but its key {KEY} is not",
                path.display()
            ))
        })?;
        if sealed.len() < NONCE_LEN {
            return Err(ImageError::Corrupt(format!(
                "{} is cut short",
                path.display()
            )));
        }
        let mut body = sealed.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&sealed)
            .map_err(|_| ImageError::Corrupt(format!("{}: bad nonce", path.display())))?;
        let plain = key
            .open_in_place(nonce, Aad::from(AAD), &mut body)
            .map_err(|_| {
                ImageError::Corrupt(format!(
                    "{} does not open with the node's key (changed or damaged)",
                    path.display()
                ))
            })?;
        serde_json::from_slice(plain)
            .map_err(|e| ImageError::Corrupt(format!("{}: {e}", path.display())))
    }

    fn save(&self, key: &LessSafeKey, book: &Book) -> Result<(), ImageError> {
        let mut body = serde_json::to_vec(book)
            .map_err(|e| ImageError::Corrupt(format!("the credentials book: {e}")))?;
        let mut n = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut n)
            .map_err(|_| ImageError::Corrupt("no randomness for a nonce".into()))?;
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(n), Aad::from(AAD), &mut body)
            .map_err(|_| ImageError::Corrupt("sealing the credentials book failed".into()))?;
        let path = self.dir.join(SEALED);
        let tmp = self.dir.join(format!("{SEALED}.tmp"));
        let mut f =
            dsec_common::private::open(&tmp, false).ctx(|| format!("writing {}", tmp.display()))?;
        f.write_all(&n)
            .and_then(|_| f.write_all(&body))
            .and_then(|_| f.sync_all())
            .ctx(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).ctx(|| format!("naming {}", path.display()))
    }

    /// Runs `f` on the book under the writers' lock and keeps what it changed.
    fn change<T>(
        &self,
        f: impl FnOnce(&mut Book) -> Result<T, ImageError>,
    ) -> Result<T, ImageError> {
        std::fs::create_dir_all(&self.dir).ctx(|| format!("making {}", self.dir.display()))?;
        let lock = dsec_common::private::open(&self.dir.join(LOCK), true)
            .ctx(|| "opening the credentials lock".to_string())?;
        lock.lock()
            .ctx(|| "locking the credentials book".to_string())?;
        let key = self
            .key(true)?
            .ok_or_else(|| ImageError::Corrupt("no key".into()))?;
        let mut book = self.load(Some(&key))?;
        let out = f(&mut book)?;
        self.save(&key, &book)?;
        Ok(out)
    }

    fn read(&self) -> Result<Book, ImageError> {
        let key = self.key(false)?;
        self.load(key.as_ref())
    }

    /// Keeps `login` for `project` at `registry` (replacing an earlier one).
    pub fn set(
        &self,
        project: &str,
        registry: &str,
        login: &Credentials,
    ) -> Result<Login, ImageError> {
        let registry = registry_name(registry)?;
        let stored = match login {
            Credentials::Basic { username, password } => Stored::Basic {
                username: username.clone(),
                password: password.clone(),
            },
            Credentials::Token(t) => Stored::Token { token: t.clone() },
            Credentials::Anonymous => {
                return Err(invalid(
                    &registry,
                    "give a username and a password, or a token",
                ));
            }
        };
        let too_long = match &stored {
            Stored::Basic { username, password } => {
                username.is_empty()
                    || password.is_empty()
                    || username.len() > MAX_SECRET
                    || password.len() > MAX_SECRET
            }
            Stored::Token { token } => token.is_empty() || token.len() > MAX_SECRET,
        };
        if too_long {
            return Err(invalid(
                &registry,
                format!(
                    "a username, password or token is empty or over {} KiB",
                    MAX_SECRET >> 10
                ),
            ));
        }
        let entry = Entry {
            login: stored,
            updated_ms: now_ms(),
        };
        let shown = show(project, &registry, &entry);
        self.change(|book| {
            let mine = book.projects.entry(project.to_string()).or_default();
            if !mine.contains_key(&registry) && mine.len() >= MAX_PER_PROJECT {
                return Err(invalid(
                    &registry,
                    format!(
                        "project {project} keeps logins for {MAX_PER_PROJECT} registries already; remove one first"
                    ),
                ));
            }
            mine.insert(registry.clone(), entry);
            Ok(())
        })?;
        Ok(shown)
    }

    /// Forgets `project`'s login at `registry`; whether there was one.
    pub fn remove(&self, project: &str, registry: &str) -> Result<bool, ImageError> {
        let registry = registry_name(registry)?;
        if !self
            .read()?
            .projects
            .get(project)
            .is_some_and(|m| m.contains_key(&registry))
        {
            return Ok(false);
        }
        self.change(|book| {
            let gone = book
                .projects
                .get_mut(project)
                .is_some_and(|m| m.remove(&registry).is_some());
            book.projects.retain(|_, m| !m.is_empty());
            Ok(gone)
        })
    }

    /// The logins of the projects `visible` says yes to, without their secrets.
    pub fn list(&self, visible: impl Fn(&str) -> bool) -> Result<Vec<Login>, ImageError> {
        let book = self.read()?;
        Ok(book
            .projects
            .iter()
            .filter(|(p, _)| visible(p))
            .flat_map(|(p, m)| m.iter().map(move |(r, e)| show(p, r, e)))
            .collect())
    }

    /// The login to use at `registry` for an image of `project`: its own, else (when
    /// `inherit`) its nearest parent's; with the project it is kept for.
    pub fn find(
        &self,
        project: &str,
        registry: &str,
        inherit: bool,
    ) -> Result<Option<(String, Credentials)>, ImageError> {
        let registry = registry_name(registry)?;
        let book = self.read()?;
        let mut p = Some(project);
        while let Some(at) = p {
            if let Some(e) = book.projects.get(at).and_then(|m| m.get(&registry)) {
                let c = match &e.login {
                    Stored::Basic { username, password } => Credentials::Basic {
                        username: username.clone(),
                        password: password.clone(),
                    },
                    Stored::Token { token } => Credentials::Token(token.clone()),
                };
                return Ok(Some((at.to_string(), c)));
            }
            if !inherit {
                break;
            }
            p = at.rsplit_once('/').map(|(parent, _)| parent);
        }
        Ok(None)
    }
}

fn show(project: &str, registry: &str, e: &Entry) -> Login {
    let (kind, username) = match &e.login {
        Stored::Basic { username, .. } => ("basic", Some(username.clone())),
        Stored::Token { .. } => ("token", None),
    };
    Login {
        project: project.to_string(),
        registry: registry.to_string(),
        kind: kind.to_string(),
        username,
        updated_ms: e.updated_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(u: &str, p: &str) -> Credentials {
        Credentials::Basic {
            username: u.into(),
            password: p.into(),
        }
    }

    #[test]
    fn logins_are_sealed_found_up_the_tree_and_never_shown() {
        let d = tempfile::tempdir().unwrap();
        let book = CredentialBook::new(d.path());
        assert!(book.find("root/t1", "r.example", true).unwrap().is_none());
        book.set(
            "root/t1",
            "R.example:5000",
            &basic("alice", "hunter2-secret"),
        )
        .unwrap();
        book.set(
            "root",
            "docker.io",
            &Credentials::Token("tok-123456".into()),
        )
        .unwrap();

        // On disk: neither secret nor name in the clear; the files are root's alone.
        let sealed = std::fs::read(d.path().join(SEALED)).unwrap();
        for needle in ["hunter2-secret", "alice", "tok-123456", "r.example"] {
            assert!(
                !sealed.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{needle} in the clear"
            );
        }
        for f in [SEALED, KEY] {
            let mode = std::fs::metadata(d.path().join(f)).unwrap().permissions();
            assert_eq!(
                std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
                0o600,
                "{f}"
            );
        }

        // Found for the project and (pulls) its subtree; a push finds its own only.
        let (at, c) = book
            .find("root/t1/a", "r.example:5000", true)
            .unwrap()
            .unwrap();
        assert_eq!(at, "root/t1");
        assert!(
            matches!(c, Credentials::Basic { ref password, .. } if password == "hunter2-secret")
        );
        assert!(
            book.find("root/t1/a", "r.example:5000", false)
                .unwrap()
                .is_none()
        );
        assert!(
            book.find("root/t2", "r.example:5000", true)
                .unwrap()
                .is_none()
        );
        let (at, _) = book
            .find("root/t2", "registry-1.docker.io", true)
            .unwrap()
            .unwrap();
        assert_eq!(at, "root");

        // A listing shows who and where, never the secret.
        let shown = serde_json::to_string(&book.list(|p| p == "root/t1").unwrap()).unwrap();
        assert!(
            shown.contains("alice") && shown.contains("r.example:5000"),
            "{shown}"
        );
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok-"),
            "{shown}"
        );

        assert!(book.remove("root/t1", "r.example:5000").unwrap());
        assert!(!book.remove("root/t1", "r.example:5000").unwrap());
        assert!(
            book.find("root/t1", "r.example:5000", true)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_damaged_or_foreign_book_is_refused_not_read() {
        let d = tempfile::tempdir().unwrap();
        let book = CredentialBook::new(d.path());
        book.set("root", "r.example", &basic("u", "p")).unwrap();
        let path = d.path().join(SEALED);
        let mut b = std::fs::read(&path).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&path, &b).unwrap();
        assert!(matches!(
            book.find("root", "r.example", true),
            Err(ImageError::Corrupt(_))
        ));
        // Another node's key does not open it either.
        std::fs::write(d.path().join(KEY), [7u8; 32]).unwrap();
        assert!(book.list(|_| true).is_err());
    }

    #[test]
    fn bad_registry_names_and_empty_logins_are_refused() {
        for bad in ["", "a b", "../x", "-x", "r.example/path"] {
            assert!(registry_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            registry_name("https://Index.Docker.io/").unwrap(),
            "docker.io"
        );
        let d = tempfile::tempdir().unwrap();
        let book = CredentialBook::new(d.path());
        assert!(
            book.set("root", "r.example", &Credentials::Anonymous)
                .is_err()
        );
        assert!(book.set("root", "r.example", &basic("", "p")).is_err());
        assert!(
            book.set(
                "root",
                "r.example",
                &Credentials::Token("x".repeat(MAX_SECRET + 1))
            )
            .is_err()
        );
    }
}
