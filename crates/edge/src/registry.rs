//! The edge's registry of sandboxes, one `state.json` per sandbox directory, written
//! atomically on every change, so a restarted edge knows what it owns and can re-adopt
//! live sandboxes and clean up half-created ones.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dsec_common::ApiError;
use dsec_common::api::{Limits, SandboxInfo, SandboxState, VolumeMount};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub edge: String,
    pub backend: String,
    pub image: String,
    pub image_digest: String,
    /// Layer digests bottom first, resolved at create time.
    pub layers: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    /// The image's start command, run after every fresh start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<dsec_image::store::StartCmd>,
    pub limits: Limits,
    pub labels: BTreeMap<String, String>,
    pub state: SandboxState,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub idle_timeout_seconds: Option<u64>,
    pub last_activity_ms: u64,
    pub forked_from: Option<String>,
    pub oom_kills: u64,
    /// Opens the sandbox's forwarded ports without an API key (e.g. from a browser).
    #[serde(default)]
    pub port_token: String,
    /// The project whose quota the sandbox counts against.
    #[serde(default = "dsec_common::api::root_project")]
    pub project: String,
    /// Its network; `None`: loopback only.
    #[serde(default)]
    pub network: Option<NetRecord>,
    /// When it was paused (unix ms); its TTL and idle time do not run while paused.
    #[serde(default)]
    pub paused_at_ms: Option<u64>,
    /// Paused to disk: its memory is saved and its processes are gone.
    #[serde(default)]
    pub paused_to_disk: bool,
    /// The id it had on the edge it was resumed away from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_from: Option<String>,
    /// The warm pool it waits in, unlisted, until a create takes it (`pools.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_waiting: Option<String>,
    /// The warm pool a create took it from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_pool: Option<String>,
    /// Paused, not stopped, when its TTL runs out (`on_timeout = "pause"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_on_timeout: bool,
    /// That pause is to disk (`on_timeout = "pause_to_disk"`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_to_disk_on_timeout: bool,
    /// The TTL it was created with: what it has again once resumed from such a pause.
    #[serde(default)]
    pub ttl_ms: u64,
    /// Resumed, when paused, by the next request to one of its ports (`auto_resume`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resume_on_request: bool,
    /// Volumes mounted into it, each by its id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// A sandbox's place in the node's network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetRecord {
    /// Its /30 of the node's pool (`None` until one is taken).
    pub slot: Option<u32>,
    pub ip: Option<String>,
    pub gateway: Option<String>,
    pub rules: BTreeMap<String, bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub egress_headers: dsec_common::api::EgressHeaders,
}

impl SandboxRecord {
    pub fn info(&self) -> SandboxInfo {
        SandboxInfo {
            id: self.id.clone(),
            edge: self.edge.clone(),
            backend: self.backend.clone(),
            image: self.image.clone(),
            state: self.state,
            limits: self.limits.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
            idle_timeout_seconds: self.idle_timeout_seconds,
            labels: self.labels.clone(),
            oom_kills: self.oom_kills,
            forked_from: self.forked_from.clone(),
            port_token: self.port_token.clone(),
            project: self.project.clone(),
            paused_to_disk: self.paused_to_disk,
            moved_from: self.moved_from.clone(),
            from_pool: self.from_pool.clone(),
            volumes: self.volumes.clone(),
            network: match &self.network {
                Some(n) => dsec_common::api::NetworkInfo {
                    mode: "rules".into(),
                    address: n.ip.clone(),
                    rules: n.rules.clone(),
                    egress_headers: n.egress_headers.clone(),
                },
                None => dsec_common::api::NetworkInfo {
                    mode: "none".into(),
                    address: None,
                    rules: BTreeMap::new(),
                    egress_headers: BTreeMap::new(),
                },
            },
        }
    }
}

pub use dsec_common::now_ms;

pub struct Registry {
    root: PathBuf,
}

impl Registry {
    pub fn open(root: &Path) -> Result<Registry, ApiError> {
        // Records hold port tokens and environments: root's alone.
        dsec_common::private::dir(root)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", root.display())))?;
        Ok(Registry {
            root: root.to_path_buf(),
        })
    }

    /// The sandbox's own directory; ids are validated before they get here.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    pub fn save(&self, rec: &SandboxRecord) -> Result<(), ApiError> {
        let dir = self.dir(&rec.id);
        dsec_common::private::dir(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let bytes = serde_json::to_vec_pretty(rec).unwrap_or_default();
        dsec_common::private::write(&dir.join("state.json"), &bytes)
            .map_err(|e| ApiError::internal(format!("saving state of {}: {e}", rec.id)))
    }

    /// Every record on disk (unreadable ones are reported with their directory).
    pub fn load_all(&self) -> Vec<Result<SandboxRecord, PathBuf>> {
        let Ok(rd) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| {
                let p = e.path();
                std::fs::read(p.join("state.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .ok_or(p)
            })
            .collect()
    }
}
