//! IAM: principals (humans and agents alike) with API keys, nested projects with delegated
//! quotas, and the usage of every sandbox. Keys look like `dsk.<32 chars>`; only their
//! sha256 is stored. [`state`] is the deterministic state machine, [`store`] keeps it in a
//! redb file; callers use the [`Iam`] trait, which a replicated store implements too.

pub mod http;
pub mod raft;
pub mod remote;
pub mod rpc;
pub mod service;
pub mod state;
pub mod store;

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use state::IamState;

pub use raft::{RaftConfig, RaftIam};
pub use remote::RemoteIam;
pub use state::{
    Command, KeyRecord, PrincipalKind, Project, Quota, ROOT, Refusal, Reservation, Usage, within,
};
pub use store::LocalStore;

pub const KEY_PREFIX: &str = "dsk.";
/// Keys in E2B's format (`e2b_` and 40 hex digits), for programs and wrappers around the
/// E2B SDK that check a key's shape before they send it; otherwise keys like any other.
pub const E2B_KEY_PREFIX: &str = "e2b_";
const KEY_ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("IAM storage: {0}")]
    Storage(String),
}

// The replicated store reports "no leader" and "no quorum" as `Storage` errors, which the
// apiserver already answers with 503; separate variants would need a new arm there.
pub(crate) fn unavailable(why: impl std::fmt::Display) -> IamError {
    IamError::Storage(format!("the replicated IAM store is unavailable: {why}"))
}

pub(crate) fn not_leader(leader: Option<String>) -> IamError {
    IamError::Storage(format!(
        "no IAM leader answered{}; retry shortly",
        leader
            .map(|l| format!(" (the last known leader is {l})"))
            .unwrap_or_default()
    ))
}

/// Who made a request, once its key checked out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    pub name: String,
    pub kind: PrincipalKind,
    pub key_id: String,
    /// The project the key belongs to; it may act on this project and everything inside.
    pub project: String,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.project == ROOT
    }

    /// Whether the key may see and start images of `project` (see
    /// [`dsec_common::project::may_read_images`]).
    pub fn may_read_images(&self, project: &str) -> bool {
        dsec_common::project::may_read_images(&self.project, project)
    }

    /// Whether the key may create, overwrite or delete images of `project` (see
    /// [`dsec_common::project::may_write_images`]).
    pub fn may_write_images(&self, project: &str) -> bool {
        dsec_common::project::may_write_images(&self.project, project)
    }
}

/// A project as its viewers see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProjectView {
    #[serde(flatten)]
    pub project: Project,
    pub usage: Usage,
}

/// A command being applied ([`Iam::apply_async`]).
pub type Applying =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), IamError>> + Send>>;

pub trait Iam: Send + Sync + 'static {
    fn authenticate(&self, key: &str) -> Option<Principal>;
    /// Applies a command once it is durable (on a replicated store: committed).
    fn apply(&self, cmd: Command) -> Result<(), IamError>;
    /// [`Iam::apply`] for async callers. A replicated store awaits the commit without
    /// holding a thread, so that the writes of many creates at once reach its log
    /// together (one append and one apply for all of them); the default runs
    /// [`Iam::apply`] on a blocking thread.
    fn apply_async(self: std::sync::Arc<Self>, cmd: Command) -> Applying {
        Box::pin(async move {
            tokio::task::spawn_blocking(move || self.apply(cmd))
                .await
                .unwrap_or_else(|e| Err(unavailable(format!("an IAM write failed: {e}"))))
        })
    }
    /// Projects the actor can see (its own and those inside), with usage.
    fn projects(&self, actor: &str) -> Result<Vec<ProjectView>, IamError>;
    /// Keys of the projects the actor can see.
    fn keys(&self, actor: &str) -> Result<Vec<KeyRecord>, IamError>;
}

pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub fn generate_key() -> String {
    let mut bytes = [0u8; 32];
    dsec_common::id::fill_random(&mut bytes);
    let body: String = bytes
        .iter()
        .map(|b| KEY_ALPHABET[(*b as usize) % 32] as char)
        .collect();
    format!("{KEY_PREFIX}{body}")
}

/// A key in E2B's format: `e2b_` and 40 lowercase hex digits (160 random bits).
pub fn generate_e2b_key() -> String {
    let mut bytes = [0u8; 20];
    dsec_common::id::fill_random(&mut bytes);
    format!("{E2B_KEY_PREFIX}{}", hex::encode(bytes))
}

/// Whether `key` has the shape of a key this deployment makes (either format).
pub fn well_formed_key(key: &str) -> bool {
    if let Some(hexd) = key.strip_prefix(E2B_KEY_PREFIX) {
        return hexd.len() == 40 && hexd.bytes().all(|b| b.is_ascii_hexdigit());
    }
    key.starts_with(KEY_PREFIX) && key.len() <= 256
}

/// The format of a key [`create_key_as`] makes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyFormat {
    /// `dsk.` and 32 letters and digits.
    #[default]
    Dsec,
    /// E2B's: `e2b_` and 40 hex digits.
    E2b,
}

pub use dsec_common::now_ms;

/// Makes a key for `principal` in `project`; the returned key is the only copy.
pub fn create_key(
    iam: &dyn Iam,
    actor: &str,
    project: &str,
    principal: &str,
    kind: PrincipalKind,
) -> Result<(String, String), IamError> {
    create_key_as(iam, actor, project, principal, kind, KeyFormat::Dsec)
}

/// [`create_key`] in the given format.
pub fn create_key_as(
    iam: &dyn Iam,
    actor: &str,
    project: &str,
    principal: &str,
    kind: PrincipalKind,
    format: KeyFormat,
) -> Result<(String, String), IamError> {
    let key = match format {
        KeyFormat::Dsec => generate_key(),
        KeyFormat::E2b => generate_e2b_key(),
    };
    let sha256 = hash_key(&key);
    iam.apply(Command::CreateKey {
        actor: actor.to_string(),
        project: project.to_string(),
        principal: principal.to_string(),
        kind,
        sha256: sha256.clone(),
        now_ms: now_ms(),
    })?;
    Ok((key, sha256[..12].to_string()))
}

/// The principal a key belongs to, if the key is known and not revoked.
pub(crate) fn authenticate_in(s: &IamState, key: &str) -> Option<Principal> {
    if !well_formed_key(key) {
        return None;
    }
    let h = hash_key(key);
    s.keys.get(&h).filter(|k| !k.revoked).map(|k| Principal {
        name: k.principal.clone(),
        kind: k.kind,
        key_id: k.key_id.clone(),
        project: k.project.clone(),
    })
}

pub(crate) fn projects_in(s: &IamState, actor: &str) -> Vec<ProjectView> {
    s.projects
        .values()
        .filter(|p| within(&p.path, actor))
        .map(|p| ProjectView {
            project: p.clone(),
            usage: s.usage(&p.path),
        })
        .collect()
}

pub(crate) fn keys_in(s: &IamState, actor: &str) -> Vec<KeyRecord> {
    s.keys
        .values()
        .filter(|k| within(&k.project, actor))
        .cloned()
        .collect()
}

impl Iam for LocalStore {
    fn authenticate(&self, key: &str) -> Option<Principal> {
        self.read(|s| authenticate_in(s, key))
    }

    fn apply(&self, cmd: Command) -> Result<(), IamError> {
        LocalStore::apply(self, cmd).map(|_| ())
    }

    fn projects(&self, actor: &str) -> Result<Vec<ProjectView>, IamError> {
        Ok(self.read(|s| projects_in(s, actor)))
    }

    fn keys(&self, actor: &str) -> Result<Vec<KeyRecord>, IamError> {
        Ok(self.read(|s| keys_in(s, actor)))
    }
}

/// Keys of the earlier single-file store (`iam/keys.json`) become root keys, once.
pub fn import_key_file(store: &dyn Iam, path: &Path) -> Result<usize, IamError> {
    #[derive(Deserialize)]
    struct Old {
        principal: String,
        sha256: String,
        created_ms: u64,
    }
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(0);
    };
    let old: Vec<Old> = serde_json::from_slice(&bytes)
        .map_err(|e| IamError::Storage(format!("{} does not parse: {e}", path.display())))?;
    let mut n = 0;
    for k in old {
        if store.keys(ROOT)?.iter().any(|r| r.sha256 == k.sha256) {
            continue;
        }
        store.apply(Command::CreateKey {
            actor: ROOT.into(),
            project: ROOT.into(),
            principal: k.principal,
            kind: PrincipalKind::Human,
            sha256: k.sha256,
            now_ms: k.created_ms,
        })?;
        n += 1;
    }
    let _ = std::fs::rename(path, path.with_extension("json.imported"));
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_read_down_and_up_the_tree_and_written_only_in_the_subtree() {
        let p = |project: &str| Principal {
            name: "eve".into(),
            kind: PrincipalKind::Agent,
            key_id: "k".into(),
            project: project.into(),
        };
        let t1 = p("root/t1");
        assert!(t1.may_read_images("root"), "shared base images");
        assert!(t1.may_read_images("root/t1"));
        assert!(t1.may_read_images("root/t1/sub"));
        assert!(!t1.may_read_images("root/t2"), "a sibling's images");
        assert!(!t1.may_read_images("root/t10"), "a prefix is not a parent");
        assert!(!t1.may_read_images("other"));
        assert!(t1.may_write_images("root/t1") && t1.may_write_images("root/t1/sub"));
        for theirs in ["root", "root/t2", "root/t10", "other"] {
            assert!(!t1.may_write_images(theirs), "{theirs}");
        }
        let admin = p("root");
        assert!(admin.may_write_images("root/t2") && admin.may_read_images("other"));
        assert!(!admin.may_write_images("other"), "outside every project");
    }

    #[test]
    fn e2b_format_keys_are_keys_like_any_other_and_only_well_formed_ones_are_looked_up() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(&dir.path().join("iam.redb"), 1).unwrap();
        let (key, key_id) = create_key_as(
            &store,
            ROOT,
            ROOT,
            "e2b",
            PrincipalKind::Human,
            KeyFormat::E2b,
        )
        .unwrap();
        let hexd = key.strip_prefix("e2b_").unwrap();
        assert!(
            hexd.len() == 40 && hexd.bytes().all(|b| b.is_ascii_hexdigit()),
            "{key}"
        );
        let p = store.authenticate(&key).unwrap();
        assert_eq!(
            (p.project.as_str(), p.key_id.as_str()),
            (ROOT, key_id.as_str())
        );
        // Another key of the same shape, a cut or padded one: nobody.
        assert!(store.authenticate(&generate_e2b_key()).is_none());
        assert!(store.authenticate(&key[..key.len() - 1]).is_none());
        assert!(store.authenticate(&format!("{key}0")).is_none());
        assert!(!well_formed_key("e2b_zz") && !well_formed_key("xyz"));
    }

    #[test]
    fn keys_authenticate_by_hash_survive_a_reopen_and_can_be_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("iam.redb");
        let store = LocalStore::open(&p, 1).unwrap();
        let (key, key_id) = create_key(&store, ROOT, ROOT, "admin", PrincipalKind::Human).unwrap();
        assert!(key.starts_with("dsk.") && key.len() == 36);
        store
            .apply(Command::CreateProject {
                actor: ROOT.into(),
                path: "root/a".into(),
                quota: Quota {
                    sandboxes: Some(2),
                    ..Quota::default()
                },
                now_ms: 2,
            })
            .unwrap();
        let (agent, _) = create_key(&store, ROOT, "root/a", "bot", PrincipalKind::Agent).unwrap();
        drop(store);
        let bytes = std::fs::read(&p).unwrap();
        assert!(
            !bytes.windows(32).any(|w| w == &key.as_bytes()[4..]),
            "plaintext key written to disk"
        );
        let store = LocalStore::open(&p, 3).unwrap();
        let admin = store.authenticate(&key).unwrap();
        assert!(admin.is_admin());
        let bot = store.authenticate(&agent).unwrap();
        assert_eq!(
            (bot.project.as_str(), bot.kind),
            ("root/a", PrincipalKind::Agent)
        );
        assert_eq!(store.projects("root/a").unwrap().len(), 1);
        assert_eq!(store.projects(ROOT).unwrap().len(), 2);
        assert_eq!(store.keys("root/a").unwrap().len(), 1);
        assert!(store.authenticate("dsk.wrong").is_none());
        // An agent cannot revoke the admin's key (it cannot see it); the admin can revoke.
        assert!(
            store
                .apply(Command::RevokeKey {
                    actor: "root/a".into(),
                    key_id: key_id.clone()
                })
                .is_err()
        );
        store
            .apply(Command::RevokeKey {
                actor: ROOT.into(),
                key_id,
            })
            .unwrap();
        assert!(store.authenticate(&key).is_none());
    }
}
