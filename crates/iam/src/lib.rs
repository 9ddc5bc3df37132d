//! IAM: principals and API keys. Keys look like `dsk.<32 chars>`; only their sha256 is
//! stored. This is the single-node store that `dsec up` uses; the Raft-replicated store
//! with projects and quotas implements the same [`KeyStore`] interface.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const KEY_PREFIX: &str = "dsk.";
const KEY_ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Admin,
    User,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Short public id, to name a key without showing it.
    pub key_id: String,
    pub principal: String,
    pub role: Role,
    pub sha256: String,
    pub created_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("IAM state {0} is damaged: {1}")]
    Corrupt(PathBuf, String),
}

/// Who made a request, once its key checked out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
    pub key_id: String,
}

pub trait KeyStore: Send + Sync {
    fn authenticate(&self, key: &str) -> Option<Principal>;
}

fn hash_key(key: &str) -> String {
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

/// Keys in one JSON file, written atomically.
pub struct FileKeyStore {
    path: PathBuf,
    by_hash: RwLock<HashMap<String, KeyRecord>>,
}

impl FileKeyStore {
    pub fn open(path: impl Into<PathBuf>) -> Result<FileKeyStore, IamError> {
        let path = path.into();
        let records: Vec<KeyRecord> = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| IamError::Corrupt(path.clone(), e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(IamError::Io {
                    context: format!("reading {}", path.display()),
                    source,
                });
            }
        };
        Ok(FileKeyStore {
            path,
            by_hash: RwLock::new(records.into_iter().map(|r| (r.sha256.clone(), r)).collect()),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.read().map(|m| m.is_empty()).unwrap_or(true)
    }

    /// Creates a key for `principal` and returns it; this is the only time it is visible.
    pub fn create_key(&self, principal: &str, role: Role) -> Result<String, IamError> {
        let key = generate_key();
        let sha256 = hash_key(&key);
        let rec = KeyRecord {
            key_id: sha256[..12].to_string(),
            principal: principal.to_string(),
            role,
            sha256: sha256.clone(),
            created_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        let mut map = self.by_hash.write().unwrap_or_else(|p| p.into_inner());
        map.insert(sha256, rec);
        save(&self.path, &map)?;
        Ok(key)
    }
}

fn save(path: &Path, map: &HashMap<String, KeyRecord>) -> Result<(), IamError> {
    let mut records: Vec<&KeyRecord> = map.values().collect();
    records.sort_by_key(|r| r.created_ms);
    let io = |context: String| move |source| IamError::Io { context, source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec_pretty(&records).unwrap_or_default();
    std::fs::write(&tmp, bytes).map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("writing {}", path.display())))
}

impl KeyStore for FileKeyStore {
    fn authenticate(&self, key: &str) -> Option<Principal> {
        if !key.starts_with(KEY_PREFIX) || key.len() > 256 {
            return None;
        }
        let map = self.by_hash.read().ok()?;
        map.get(&hash_key(key)).map(|r| Principal {
            name: r.principal.clone(),
            role: r.role.clone(),
            key_id: r.key_id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_authenticate_and_only_hashes_are_stored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.json");
        let store = FileKeyStore::open(&p).unwrap();
        assert!(store.is_empty());
        let key = store.create_key("admin", Role::Admin).unwrap();
        assert!(key.starts_with("dsk.") && key.len() == 36);
        let on_disk = std::fs::read_to_string(&p).unwrap();
        assert!(
            !on_disk.contains(&key[4..]),
            "plaintext key written to disk"
        );
        let reopened = FileKeyStore::open(&p).unwrap();
        assert_eq!(reopened.authenticate(&key).unwrap().role, Role::Admin);
        assert!(reopened.authenticate("dsk.wrong").is_none());
        assert!(reopened.authenticate(&key[4..]).is_none());
    }
}
