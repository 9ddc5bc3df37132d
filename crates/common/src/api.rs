//! Public API models (REST/JSON). The OpenAPI document's schemas are generated from
//! these types and their doc comments (feature `openapi`; `crates/edge-api/tests/openapi.rs`),
//! so a field's comment is what the API's users read.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// `POST /v1/sandboxes`. Numbers are JSON numbers; the edge checks each is a whole
/// number in range and names the field when it is not.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// `container` (always), `vm` or `microvm` where the node can run them.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// An image reference from the image store, e.g. `root/py:3.11`.
    #[cfg_attr(feature = "openapi", schema(example = "root/py:3.11"))]
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0.01))]
    pub cpu_cores_limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 16))]
    pub memory_limit_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 16))]
    pub disk_limit_mb: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 16))]
    pub pids_limit: Option<f64>,
    /// Total lifetime from now; extended by `set_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub ttl_seconds: Option<f64>,
    /// Stop after this long without an API call for the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub idle_timeout_seconds: Option<f64>,
    /// What happens when the TTL runs out: `"stop"` (the default), `"pause"` (frozen in
    /// place, as `pause` does; resumed, it has as long again as it was created with) or
    /// `"pause_to_disk"` (paused to disk instead: its processes end, its memory is freed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<String>,
    /// A paused sandbox resumes on the next request to one of its ports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Environment given to every command run in the sandbox.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The project the sandbox counts against (default: the API key's project).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// `"none"`: no network at all (loopback only). Default: the node's network with
    /// egress denied except what `network_rules` allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// What the sandbox may reach: service names (`"pypi": true`), domains
    /// (`"*.example.com": true`), IPv4 CIDRs with an optional port (`"203.0.113.0/24:443"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub network_rules: BTreeMap<String, bool>,
    /// Headers added to the sandbox's outbound HTTP and HTTPS requests, per host (a domain,
    /// `*.example.com`, or an IPv4 address): the node's egress proxy sets them on requests
    /// to that host on ports 80 and 443 (HTTPS through a node CA the sandbox trusts), so a
    /// credential reaches the service without the sandbox seeing it. The host must also
    /// be allowed by `network_rules`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, BTreeMap<String, String>>))]
    pub egress_headers: EgressHeaders,
    /// Volumes mounted into the sandbox (container backend).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// A volume in a sandbox: `volume` (its id, or its name in the sandbox's project or a
/// parent of it) at `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VolumeMount {
    pub volume: String,
    /// Absolute path in the sandbox, e.g. `/mnt/data`.
    pub path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// Unique in its project: `[a-z0-9][a-z0-9._-]*`, at most 63 characters.
    pub name: String,
    /// Its project (default: the API key's project).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// What it may hold (default 1024); counts against the project's disk quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mb: Option<f64>,
}

/// A volume: a file system kept on an edge, apart from any sandbox, that sandboxes of its
/// project mount (many at once) and the volume file API reads and writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Volume))]
pub struct VolumeInfo {
    /// `<edge>-<12 characters>`: the edge that keeps it.
    pub id: String,
    pub edge: String,
    pub name: String,
    pub project: String,
    pub size_mb: u64,
    /// Bytes its files take now.
    #[serde(default)]
    pub used_bytes: u64,
    pub created_at_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListVolumesResponse {
    pub volumes: Vec<VolumeInfo>,
}

/// A file, directory or link in a volume (`GET /v1/volumes/{id}/stat`, listings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeEntry {
    pub name: String,
    /// Absolute within the volume, e.g. `/data/a.txt`.
    pub path: String,
    /// `file`, `directory`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Permission bits and the type's, as `st_mode`.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime_ms: i64,
    pub mtime_ms: i64,
    pub ctime_ms: i64,
    /// Where a link points (as written; resolved inside the volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// `PATCH /v1/volumes/{id}/stat?path=`: the owner or permission bits to set.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VolumeEntryUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

/// `GET /v1/sandboxes/{id}/metrics`: what a running sandbox uses now. CPU time is a
/// running total (a rate needs two readings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxMetrics {
    pub timestamp_ms: u64,
    pub cpu_cores: f64,
    pub cpu_used_ns: u64,
    /// Memory in use, without page cache the kernel can drop.
    pub memory_used_bytes: u64,
    pub memory_cache_bytes: u64,
    pub memory_limit_bytes: u64,
    /// The writable filesystem (`disk_limit_mb`).
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

/// What one sandbox uses, from the node's last kept readings (`GET /v1/usage`): no
/// cgroup is read to answer, so a node with thousands of sandboxes answers at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxUsage {
    pub id: String,
    pub project: String,
    pub state: SandboxState,
    pub backend: String,
    pub image: String,
    pub cpu_cores: f64,
    /// CPU used between the last two readings, in percent of one core (none: fewer than
    /// two readings yet, or paused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_percent: Option<f64>,
    /// Memory in use at the last reading, without page cache the kernel can drop.
    pub memory_used_bytes: u64,
    pub memory_limit_bytes: u64,
    /// When the last reading was taken (0: none yet).
    pub sampled_at_ms: u64,
}

/// `GET /v1/usage`: the caller's sandboxes' resource use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageResponse {
    pub sandboxes: Vec<SandboxUsage>,
    /// How far apart the node's readings are (0: it keeps none).
    pub interval_ms: u64,
}

/// One kept reading of a sandbox's resource use (the node takes one every
/// `metrics_interval_ms` while the sandbox runs). CPU time is a running total.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MetricsSample {
    pub timestamp_ms: u64,
    pub cpu_used_ns: u64,
    pub memory_used_bytes: u64,
    pub memory_cache_bytes: u64,
}

/// `GET /v1/sandboxes/{id}/metrics/history[?start_ms=&end_ms=]`: the kept readings in
/// that range, oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MetricsHistory {
    /// How far apart readings are taken (0: the node keeps none).
    pub interval_ms: u64,
    pub cpu_cores: f64,
    pub memory_limit_bytes: u64,
    pub samples: Vec<MetricsSample>,
}

/// A sandbox's network as the API shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkInfo {
    /// `"rules"` (egress per `rules`) or `"none"` (loopback only).
    pub mode: String,
    /// The sandbox's IPv4 address on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(default)]
    pub rules: BTreeMap<String, bool>,
    /// Headers set on outbound requests per host (see `CreateSandboxRequest`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, BTreeMap<String, String>>))]
    pub egress_headers: EgressHeaders,
}

/// Host → header name → value, set on a sandbox's outbound requests to that host.
pub type EgressHeaders = BTreeMap<String, BTreeMap<String, String>>;

/// Names and values: labels, a file's metadata, a query's parameters.
pub type StringMap = BTreeMap<String, String>;

/// `PUT /v1/sandboxes/{id}/network`: replaces the rules of a running sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetNetworkRequest {
    pub network_rules: BTreeMap<String, bool>,
    /// Replaces the sandbox's egress headers (none: it has none after).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = BTreeMap<String, BTreeMap<String, String>>))]
    pub egress_headers: EgressHeaders,
}

/// `POST /v1/sandboxes/{id}/commit`: the sandbox's filesystem changes become one more
/// layer on top of its image, tagged as `image`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CommitRequest {
    /// The new image's reference, e.g. `root/myenv:v1`.
    pub image: String,
    /// Replace `image` if it exists (otherwise that is a 409 `already_exists`).
    #[serde(default)]
    pub overwrite: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommitResponse {
    /// The new image's reference, normalised (`root/myenv` → `root/myenv:latest`).
    pub image: String,
    /// Its manifest digest.
    pub digest: String,
    /// Its layer digests, bottom first; the last is the sandbox's changes.
    pub layers: Vec<String>,
    /// The image's size (its layers' tar sizes added up).
    pub size_bytes: u64,
    /// How long the sandbox was frozen while its changes were copied (0 for a `vm`
    /// sandbox: its agent reads them while it runs).
    pub paused_ms: u64,
}

pub fn root_project() -> String {
    "root".to_string()
}

pub fn default_backend() -> String {
    "container".to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    Paused,
    Stopping,
    Stopped,
}

impl SandboxState {
    /// The state's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Limits {
    pub cpu_cores: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Sandbox))]
pub struct SandboxInfo {
    pub id: String,
    pub edge: String,
    pub backend: String,
    pub image: String,
    pub state: SandboxState,
    pub limits: Limits,
    /// Unix milliseconds.
    pub created_at_ms: u64,
    /// Unix milliseconds at which the TTL stops the sandbox.
    pub expires_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Processes the kernel killed for exceeding `memory_limit_mb`.
    #[serde(default)]
    pub oom_kills: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// The project whose quota the sandbox counts against.
    #[serde(default = "root_project")]
    pub project: String,
    /// Opens `/v1/sandboxes/{id}/ports/{port}/…` without an API key (`?dsec_token=` or the
    /// `X-Dsec-Token` header), for browsers.
    #[serde(default)]
    pub port_token: String,
    #[serde(default)]
    pub network: NetworkInfo,
    /// Paused with its memory written to disk and no processes on the host.
    #[serde(default)]
    pub paused_to_disk: bool,
    /// The id it had on the edge it was resumed away from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_from: Option<String>,
    /// The warm pool (`[[edge.pools]]`) it was taken from, made before the create asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_pool: Option<String>,
    /// Its volumes (by id).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// `POST /v1/sandboxes/{id}/pause`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// End the sandbox's processes, freeing the host's memory until it is resumed: a VM's
    /// memory is written to disk and restored on resume; a container keeps its files and
    /// starts afresh on resume (its image's start command runs again). False: freeze it
    /// in place.
    #[serde(default)]
    pub to_disk: bool,
}

/// `POST /v1/groups/pause` and `/v1/groups/resume`: every sandbox with these labels.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GroupRequest {
    /// `key: value` pairs a sandbox must all have (at least one).
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub to_disk: bool,
}

/// What a group pause or resume did, sandbox by sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GroupResponse {
    /// Sandboxes now in the asked-for state.
    pub done: Vec<String>,
    /// Sandboxes that could not be changed, with the reason.
    #[serde(default)]
    pub failed: Vec<GroupFailure>,
    /// Milliseconds the whole call took.
    pub took_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GroupFailure {
    pub id: String,
    pub code: crate::ErrorCode,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListSandboxesResponse {
    pub sandboxes: Vec<SandboxInfo>,
}

/// `POST /v1/sandboxes/{id}/exec`. Exactly one of `cmd` (run by `/bin/sh -c`) and `argv`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// Bytes written to the command's stdin, which is then closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// A user name from the sandbox's /etc/passwd or a numeric uid (default root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Answer with NDJSON events as the process runs (see docs/RUNTIME_API.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Answer at once with the process id; the process keeps running.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
    /// Give the process a terminal of this size (with `stream` or `background`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<crate::channel::PtySize>,
    /// A free string shown in the process list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResult {
    pub stdout: String,
    pub stderr: String,
    /// The exit status, or 128 + signal number when a signal ended the command.
    pub exit_code: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    /// The kernel's OOM killer ended a process of this command's sandbox while it ran.
    #[serde(default)]
    pub oom_killed: bool,
    #[serde(default)]
    pub stdout_truncated: bool,
    #[serde(default)]
    pub stderr_truncated: bool,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[serde(default = "one")]
    pub count: f64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Make the copies on this edge (cluster): it pulls the source's saved state from
    /// the source's edge. Default: the source's edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<String>,
}

/// A sandbox's state kept under an id (`POST /v1/sandboxes/{id}/snapshot`), to start new
/// sandboxes from (`POST /v1/snapshots/{id}/restore`) until it is deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Snapshot))]
pub struct SnapshotInfo {
    /// `<edge>-<12 characters>`, like a sandbox id: the edge that keeps it.
    pub id: String,
    pub edge: String,
    /// The sandbox it was taken of.
    pub source: String,
    pub backend: String,
    pub image: String,
    pub project: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub created_at_ms: u64,
    /// Whether sandboxes restored from it carry its process memory (VM backends).
    pub memory_preserved: bool,
    /// Bytes it takes on disk.
    pub size_bytes: u64,
    /// How long the source was paused while it was taken.
    pub source_paused_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListSnapshotsResponse {
    pub snapshots: Vec<SnapshotInfo>,
}

/// `POST /v1/sandboxes/{id}/resume`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Resume on this edge instead (cluster, VM backends): it pulls the sandbox's saved
    /// state from its edge and the sandbox continues there under a new id (the answer's
    /// `id`; `moved_from` names the old one). The sandbox is paused to disk first if it
    /// was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<String>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkResponse {
    pub sandboxes: Vec<SandboxInfo>,
    /// Whether the copies carry the source's process memory (VM backends) or only its
    /// filesystem (containers).
    pub memory_preserved: bool,
    pub note: String,
    /// How long the source was frozen while its writable layer was copied.
    pub source_paused_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    pub ttl_seconds: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BackendStatus {
    pub name: String,
    pub available: bool,
    /// What the backend runs on (e.g. `crun 1.8.1`), or why it is unavailable.
    pub detail: String,
    /// What the backend can do beyond create, exec, files, sessions, limits, pause in
    /// place, snapshots, forks, commits and stop, which every backend does.
    #[serde(default)]
    pub capabilities: Vec<Capability>,
}

/// A capability some backends have and others lack. A request for one its backend lacks
/// is refused before anything is done, naming the capability (501).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Capability {
    /// A fork's copies (and a snapshot's restores) keep the processes and their memory,
    /// not only the files.
    ForkMemory,
    /// Pause to disk: the processes end and the memory is freed, files kept (a VM's
    /// memory is written out and restored).
    PauseToDisk,
    /// A sandbox's saved state goes to another edge: forks onto, restores on and moves
    /// to another node.
    Move,
    /// Volumes mounted into the sandbox.
    Volumes,
}

impl Capability {
    pub const ALL: [Capability; 4] = [
        Capability::ForkMemory,
        Capability::PauseToDisk,
        Capability::Move,
        Capability::Volumes,
    ];

    /// Its name in the API (as serialised).
    pub fn name(self) -> &'static str {
        match self {
            Capability::ForkMemory => "fork_memory",
            Capability::PauseToDisk => "pause_to_disk",
            Capability::Move => "move",
            Capability::Volumes => "volumes",
        }
    }

    /// What the capability lets a caller do, for the refusal's sentence.
    pub fn describe(self) -> &'static str {
        match self {
            Capability::ForkMemory => "keep processes and memory across a fork or snapshot",
            Capability::PauseToDisk => "pause to disk",
            Capability::Move => "move a sandbox's state to another edge",
            Capability::Volumes => "mount volumes",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeStatus {
    pub name: String,
    pub healthy: bool,
    pub backends: Vec<BackendStatus>,
    /// `v1`, `v2` or `hybrid`.
    pub cgroup_mode: String,
    pub cpus: u32,
    pub memory_total_mb: u64,
    pub memory_available_mb: u64,
    pub disk_free_mb: u64,
    pub sandboxes: u64,
    /// Resources promised to running sandboxes.
    pub committed_cpu_cores: f64,
    pub committed_memory_mb: u64,
    /// The node refuses creates beyond this many sandboxes.
    #[serde(default)]
    pub max_sandboxes: u64,
    /// Sandboxes per project.
    #[serde(default)]
    pub projects: BTreeMap<String, u64>,
    /// Warm pools: how many members wait in each, of how many.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolStatus>,
}

/// A warm pool's state in [`NodeStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolStatus {
    pub name: String,
    pub image: String,
    pub backend: String,
    pub size: u32,
    /// Made and waiting to be handed out.
    pub ready: u32,
}

impl NodeStatus {
    /// A node known by name only: unhealthy, no capacity (e.g. one that does not answer).
    pub fn unreachable(name: &str) -> NodeStatus {
        NodeStatus {
            name: name.to_string(),
            healthy: false,
            backends: vec![],
            cgroup_mode: String::new(),
            cpus: 0,
            memory_total_mb: 0,
            memory_available_mb: 0,
            disk_free_mb: 0,
            sandboxes: 0,
            committed_cpu_cores: 0.0,
            committed_memory_mb: 0,
            max_sandboxes: 0,
            projects: BTreeMap::new(),
            pools: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterStatus {
    pub version: String,
    pub nodes: Vec<NodeStatus>,
}

/// A process aether manages (started with `stream` or `background`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub pid: u32,
    pub argv: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    pub pty: bool,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub started_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileStat {
    pub path: String,
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Permission bits (e.g. 420 = 0o644).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ms: i64,
    /// A symlink's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The file's metadata: its extended attributes named [`METADATA_XATTR_PREFIX`]`<key>`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// Where a file's metadata is kept: extended attributes of this prefix and the key.
/// The prefix is E2B envd's, so metadata set by either is seen by both (a template's
/// files keep theirs).
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";
/// The most metadata keys one file may be given.
pub const METADATA_MAX_KEYS: usize = 64;
/// The most bytes of keys and values together (one filesystem block holds them).
pub const METADATA_MAX_BYTES: usize = 2048;

/// Checks metadata a caller gives a file: keys of HTTP token characters (they travel as
/// header names, so they are lower case), values of printable US-ASCII, within the
/// limits above.
pub fn check_metadata(m: &StringMap) -> Result<(), ApiError> {
    if m.len() > METADATA_MAX_KEYS {
        return Err(ApiError::invalid(format!(
            "a file may have at most {METADATA_MAX_KEYS} metadata keys ({} given)",
            m.len()
        )));
    }
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let mut bytes = 0;
    for (k, v) in m {
        if k.is_empty() || !k.chars().all(token) || k.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(ApiError::invalid(format!(
                "metadata key {k:?} must be non-empty lower-case letters, digits and !#$%&'*+-.^_`|~"
            )));
        }
        if !v.chars().all(|c| (' '..='~').contains(&c)) {
            return Err(ApiError::invalid(format!(
                "the value of metadata key {k:?} must be printable US-ASCII"
            )));
        }
        bytes += k.len() + v.len();
    }
    if bytes > METADATA_MAX_BYTES {
        return Err(ApiError::invalid(format!(
            "metadata keys and values may hold at most {METADATA_MAX_BYTES} bytes together ({bytes} given)"
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionInfo {
    pub session_id: String,
    pub pid: u32,
    pub shell: String,
    pub busy: bool,
    pub commands: u64,
}

/// A session command's result; `state` is `running` (output so far) or `done`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionResult {
    pub command_id: u64,
    pub state: String,
    pub stdout: String,
    pub stderr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    #[serde(default)]
    pub session_restarted: bool,
    #[serde(default)]
    pub stdout_truncated: bool,
    #[serde(default)]
    pub stderr_truncated: bool,
    pub duration_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionCreateRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionRunRequest {
    pub cmd: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub background: bool,
}

/// `POST /v1/functions/{name}:call`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FunctionCallRequest {
    /// Given to the function as JSON on its stdin (`null` when left out).
    #[serde(default)]
    pub input: serde_json::Value,
    /// At most the function's own limit (its `timeout_seconds`), which is the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
    /// The project the call's sandbox counts against (default: the key's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
}

/// What a function call returned. A function that exits non-zero still answers 200 with
/// its exit code and stderr: the call worked, the function failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionCallResult {
    pub function: String,
    /// The function's stdout parsed as JSON; its text as a string when it is not JSON.
    pub output: serde_json::Value,
    pub stderr: String,
    pub exit_code: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// From the request reaching the node to the answer, sandbox included.
    pub duration_ms: u64,
    /// The entry point's own run time, as the sandbox's agent measured it.
    pub run_ms: u64,
    /// The sandbox the call ran in (stopped once it answered).
    pub sandbox_id: String,
    /// The warm pool that sandbox came from, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_pool: Option<String>,
}

/// An entry of `GET /v1/functions`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionInfo {
    pub name: String,
    pub image: String,
    pub backend: String,
    pub entry: Vec<String>,
    pub timeout_seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// The types an [`Event`] has.
pub const EVENT_TYPES: &[&str] = &[
    "created",
    "paused",
    "resumed",
    "updated",
    "forked",
    "snapshotted",
    "stopped",
    "expired",
    "oom_killed",
];

/// What a `GET /v1/events` asks for (its query string: `event_query`).
#[derive(Debug, Clone, PartialEq)]
pub struct EventQuery {
    /// Only events numbered above this.
    pub after: u64,
    pub limit: usize,
    pub sandbox: Option<String>,
    /// Any of these types (none: all).
    pub types: Vec<String>,
    /// Newest first instead of oldest first.
    pub newest_first: bool,
    /// Matching events passed over before the page starts.
    pub offset: usize,
    /// How long to wait for an event when there is none yet.
    pub wait: std::time::Duration,
}

impl Default for EventQuery {
    fn default() -> Self {
        EventQuery {
            after: 0,
            limit: 100,
            sandbox: None,
            types: Vec::new(),
            newest_first: false,
            offset: 0,
            wait: std::time::Duration::ZERO,
        }
    }
}

/// One thing that happened to a sandbox (`GET /v1/events`, webhooks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Unique: the edge's name and `seq`.
    pub id: String,
    /// Its place in the edge's order of events (ascending; `after=` pages by it).
    pub seq: u64,
    /// `created`, `paused`, `resumed`, `updated` (its lifetime or network rules were
    /// changed), `forked`, `snapshotted`, `stopped`, `expired` (stopped by its TTL) or
    /// `oom_killed`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Unix milliseconds.
    pub at_ms: u64,
    pub sandbox: String,
    pub project: String,
    pub edge: String,
    pub backend: String,
    /// Why: for `stopped`, `requested`, `idle`, `died` or `shutdown`; for `paused`,
    /// `requested`, `ttl` or `group`; for `created`, `create`, `pool`, `fork` or `restore`;
    /// for `updated`, `timeout` or `network`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// What else the event names: `forked_from`, `snapshot`, `copies` (a fork's new
    /// sandboxes), `oom_kills`, `to_disk`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub detail: BTreeMap<String, serde_json::Value>,
}

/// `GET /v1/events`: events after `after`, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListEventsResponse {
    pub events: Vec<Event>,
    /// Pass as `after=` for the next page (the last event's `seq`, or `after` when there
    /// was none).
    pub next: u64,
}

/// `POST /v1/webhooks`: send a project's events to `url`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WebhookRequest {
    /// `http://` or `https://`; its host must resolve to a public address (or one the
    /// node's `[edge.events] webhook_allow` lets through).
    pub url: String,
    /// Event types to send (none: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub types: Vec<String>,
    /// Whose events (its sub-projects' too); default the key's project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// A name to know it by (at most 128 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether events are sent (default true); a disabled webhook is sent none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// The signing secret (16 to 256 bytes); default a new random one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// `dsec` (the default: [`Event`] bodies signed with `X-Dsec-Signature`) or `e2b`
    /// (E2B's lifecycle event bodies and `e2b-signature`, for programs written for E2B).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<WebhookFormat>,
}

/// How a webhook's deliveries are written and signed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    /// The [`Event`] as JSON; `X-Dsec-Signature: t=<unix>,v1=<hex HMAC-SHA256(secret,
    /// "<t>.<body>")>`.
    #[default]
    Dsec,
    /// E2B's lifecycle event (`sandbox.lifecycle.*`); `e2b-signature`: unpadded
    /// URL-safe base64 of SHA-256(secret ‖ body), as E2B signs.
    E2b,
}

impl WebhookFormat {
    pub fn is_dsec(self) -> bool {
        self == WebhookFormat::Dsec
    }
}

/// `PATCH /v1/webhooks/{id}`: what to change (a field left out stays).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WebhookUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Event types to send (empty: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub types: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

fn yes() -> bool {
    true
}

/// A webhook. `secret` (its signing key) is in the create's answer only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WebhookInfo {
    pub id: String,
    pub url: String,
    pub project: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub types: Vec<String>,
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether events are sent to it.
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub format: WebhookFormat,
}

/// One try to deliver an event to a webhook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Delivery {
    pub event: String,
    #[serde(rename = "type")]
    pub kind: String,
    /// 1 for the first try.
    pub attempt: u32,
    pub at_ms: u64,
    pub took_ms: u64,
    /// The receiver's HTTP status (none: no answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Delivered (a 2xx answer).
    pub ok: bool,
    /// Why it failed, or `dropped` when the queue overflowed, `given up` after the last try.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod metadata_tests {
    use super::*;

    #[test]
    fn capability_names_are_their_json_names() {
        for c in Capability::ALL {
            assert_eq!(serde_json::to_value(c).unwrap(), c.name());
        }
    }

    fn m(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn metadata_keys_values_and_sizes_are_checked() {
        assert!(check_metadata(&m(&[("owner", "team a"), ("x-1.b~", "~!")])).is_ok());
        for bad in [
            m(&[("", "v")]),
            m(&[("Upper", "v")]),
            m(&[("a/b", "v")]),
            m(&[("a b", "v")]),
            m(&[("a\0", "v")]),
            m(&[("k", "line\nbreak")]),
            m(&[("k", "caf\u{e9}")]),
            m(&[("k", &"v".repeat(METADATA_MAX_BYTES))]),
        ] {
            assert!(check_metadata(&bad).is_err(), "{bad:?}");
        }
        let many: BTreeMap<String, String> = (0..=METADATA_MAX_KEYS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert!(check_metadata(&many).is_err());
    }
}
