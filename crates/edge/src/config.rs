//! Edge configuration: where state lives, which OCI runtime to drive, default and maximum
//! sandbox limits.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EdgeConfig {
    /// Node name; part of every sandbox id (`[a-z][a-z0-9]*`).
    pub name: String,
    /// Sandbox state, bundles and channel sockets.
    pub state_dir: PathBuf,
    /// The image store directory (shared filesystem in a cluster).
    pub image_store: PathBuf,
    /// `auto` (crun if installed, else runc), `crun`, `runc`, or a path to any OCI runtime.
    pub oci_runtime: String,
    /// The statically linked `dsec-aether` binary; empty means look next to `dsec`.
    pub aether_binary: Option<PathBuf>,
    pub defaults: SandboxDefaults,
    pub max: SandboxMaxima,
    /// Refuse creates once this many sandboxes run on the node.
    pub max_sandboxes: u64,
    /// Refuse creates when the host has less memory available than this.
    pub reserved_memory_mb: u64,
    /// Refuse creates when the state directory's filesystem has less free than this.
    pub reserved_disk_mb: u64,
    /// Refuse creates while the 1-minute load average per core is above this (0, the
    /// default: never; bursts of creates raise the load themselves, so set it per cluster).
    pub max_load_per_core: f64,
    /// Per-stream cap on captured command output (at most 64 MiB, `MAX_STREAM_OUTPUT`).
    pub max_output_bytes: u64,
    /// Exec timeout when the request gives none.
    pub default_exec_timeout_seconds: f64,
    /// Sandbox networking and egress policy.
    pub network: NetworkConfig,
    /// Where VM memory files live: a tmpfs, so a VM's memory is RAM and fork copies can
    /// map a snapshot of it copy-on-write.
    pub vm_ram_dir: PathBuf,
    /// Full-VM options of the `vm` backend (`[edge.vm]`).
    pub vm: VmOptions,
    /// The Firecracker binary for the `microvm` backend (v1.16 or a later v1 release);
    /// empty: `firecracker` on PATH, in /usr/local/bin or /usr/bin. Its version is probed
    /// at start; without it (or without hardware KVM) the backend reports unavailable.
    pub firecracker_binary: Option<PathBuf>,
    /// `microvm` fork snapshots: false (default) writes all guest memory each time (Full);
    /// true tracks dirty pages and writes only those changed since the VM's last snapshot
    /// or load (Diff, laid over a copy of that memory). Firecracker calls Diff snapshots a
    /// developer preview.
    pub firecracker_diff_snapshots: bool,
    /// The user Firecracker runs as, jailed (see `backend/microvm/jail.rs`): an escape
    /// from the VMM lands there. Empty keeps it root, which can leave the jail's chroot:
    /// for debugging only.
    pub firecracker_run_as: String,
    /// Lifecycle events and webhooks (`[edge.events]`, see `events/`).
    pub events: EventsConfig,
    /// Warm pools (`[[edge.pools]]`): sandboxes made ahead, each handed to one create that
    /// asks for what they are (see `pools.rs`).
    pub pools: Vec<PoolConfig>,
    /// Functions (`[[edge.functions]]`): an image and an entry point that
    /// `POST /v1/functions/{name}:call` runs in a sandbox of its own (see `functions.rs`).
    pub functions: Vec<FunctionConfig>,
    /// How many creates (and forks) start sandboxes at once; the rest wait their turn in
    /// arrival order. 0 (the default): twice the node's CPUs. A burst of a thousand then
    /// runs a few at a time, so the first is ready about as soon as a lone create would
    /// be, instead of all of them sharing the CPUs until the end.
    pub create_parallelism: u32,
    /// Turn on cgroup2's `favordynmods` at start (on the cgroup2 mount of a v2 or hybrid
    /// host; see `cgroup::favor_dynmods`). Moving a process into a cgroup, which each
    /// create does, otherwise waits for an RCU grace period: about half of a lone create
    /// here. The setting is the kernel's, for the whole host, and stays on after `dsec
    /// down`; `false` leaves the host as it is.
    pub cgroup_favor_dynmods: bool,
    /// How often each running sandbox's CPU time and memory are read and kept, for its
    /// metrics over a time range (`samples.rs`); 0 keeps none. A pass over 3,000
    /// sandboxes took 0.2-0.3 s of one core here: raise it on a dense node.
    pub metrics_interval_ms: u64,
    /// Registries (`host[:port]`, as in an image reference) that keys of projects other
    /// than `root` may pull from. A pull makes the node fetch from the network, so a
    /// tenant must not be able to point it at the node's own services or the local
    /// network; keys of `root` may pull from any registry.
    pub pull_registries: Vec<String>,
    /// Registries (`host[:port]`) the node talks plain HTTP to (one on loopback, say), for
    /// every pull and every build `FROM` one of their images.
    pub insecure_registries: Vec<String>,
    /// Start images whose registry has their lazy layers (EROFS images pushed by `dsec
    /// image push`) before they have arrived: each layer is mounted at once and fetched
    /// by chunk as it is read. Needs EROFS and FUSE in the kernel; without them, or with
    /// `false`, pulls fetch whole images.
    pub lazy_images: bool,
    /// The most MiB of lazy layers' chunks the node keeps; past it, the chunks read least
    /// recently are dropped and fetched again when read again (0: no bound).
    pub lazy_cache_mb: u64,
    /// From a second after a lazy layer is first read, fetch the rest of it in the
    /// background (below nine tenths of `lazy_cache_mb`), so that later reads find it on
    /// the node. Off by default: most of a large image is often never read.
    pub lazy_prefetch: bool,
    /// Registries (`host[:port]`) whose lazy layers pulls by projects other than `root`
    /// may mount. A lazy layer is an EROFS image made by whoever pushed it, which the
    /// node's kernel parses: list only registries whose pushers the node trusts. Pulls
    /// from others fetch whole images, unpacked in user space.
    pub lazy_registries: Vec<String>,
}

/// Public registries tenants may pull from unless the node's config says otherwise.
pub fn default_pull_registries() -> Vec<String> {
    [
        "docker.io",
        "ghcr.io",
        "quay.io",
        "registry.k8s.io",
        "public.ecr.aws",
        "mcr.microsoft.com",
        "gcr.io",
    ]
    .map(String::from)
    .to_vec()
}

/// `[[edge.pools]]`: `size` sandboxes of `image` with these limits, kept made. A create of
/// the same image (same digest), backend and limits, with a network, gets one of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// `[a-z0-9-]`, 1-32 characters; shown as `from_pool` on the sandboxes it hands out.
    pub name: String,
    pub image: String,
    #[serde(default = "container_backend")]
    pub backend: String,
    /// Limits as a create gives them; left out: the node's defaults.
    #[serde(default)]
    pub cpu_cores: Option<f64>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub disk_mb: Option<u64>,
    #[serde(default)]
    pub pids: Option<u64>,
    pub size: u32,
    /// Members made per second at most while refilling (also only while no other create is
    /// under way on the node, so a pool never starves them).
    #[serde(default = "default_refill_per_second")]
    pub refill_per_second: f64,
}

/// `[[edge.functions]]`: a function callable by name. Each call runs `entry` in a new
/// sandbox (a member of `pool` when one is ready, so a call costs no create), with the
/// call's input as JSON on stdin; its stdout is the result. The sandbox is stopped after.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    /// `[a-z0-9-]`, 1-32 characters.
    pub name: String,
    /// The program and its arguments, run in the sandbox.
    pub entry: Vec<String>,
    /// A `[[edge.pools]]` whose members run the calls (its image, backend and limits).
    #[serde(default)]
    pub pool: Option<String>,
    /// Without a pool: the image the calls' sandboxes are made of (the node's default
    /// limits).
    #[serde(default)]
    pub image: Option<String>,
    /// Longest a call may run when it asks for no limit, and the most it may ask for.
    #[serde(default = "default_function_timeout")]
    pub timeout_seconds: f64,
    /// Projects whose keys may call it (each with the projects inside it); empty: all.
    #[serde(default)]
    pub projects: Vec<String>,
}

fn default_function_timeout() -> f64 {
    60.0
}

fn container_backend() -> String {
    "container".into()
}

fn default_refill_per_second() -> f64 {
    20.0
}

/// `[edge.vm]`: how the `vm` backend builds its VMs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VmOptions {
    /// `microvm` (default: QEMU's minimal machine, virtio-mmio, fastest to boot) or `q35`
    /// (a full PC: PCI Express, ACPI, firmware; what PCI passthrough needs).
    pub machine: String,
    /// More `-device` arguments for every VM, e.g. `vfio-pci,host=0000:65:00.0` to pass a
    /// host PCI device through (`q35` only; the device must be bound to vfio-pci, and a
    /// device can be in one VM at a time, so give it to an edge that runs one VM). Not
    /// tested by the project: its test hosts have no IOMMU. A VM with a passed-through
    /// device cannot be forked, snapshotted or paused to disk (QEMU cannot save it).
    pub devices: Vec<String>,
    /// The user QEMU runs as once it has opened what it needs (`-runas`): an escape from
    /// the emulator lands there, not as root. Empty keeps it root (for passthrough devices
    /// that a user cannot open).
    pub run_as: String,
    /// How a running VM's memory is captured for a fork or snapshot. `auto` (default):
    /// `mapped` with QEMU 10 or newer, else `pause`. `mapped`: a live `mapped-ram`
    /// migration into one file while the VM runs, which stops it only for the last dirty
    /// pages and its device state (2-4 ms measured under TCG); the copies map the file's
    /// pages copy-on-write, and every VM's own memory is anonymous (nothing fills a file
    /// the size of its memory). `pause`: the VM stands still while its memory file is
    /// copied (about 0.1 s per 200 MiB of touched memory under TCG), and the copies start
    /// right after. `live`: migrated into a template QEMU while the VM runs (1-5 ms
    /// stopped), but the copies start only once the migration is done (0.6-1.6 s more
    /// under TCG), and the migration reads every page of the VM's memory file, so the
    /// source's file is then allocated in full. A `mapped` or `live` capture that fails
    /// or does not converge within [`LIVE_FORK_WITHIN`] falls back to `pause`.
    pub fork_capture: ForkCapture,
}

/// See [`VmOptions::fork_capture`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForkCapture {
    Auto,
    Mapped,
    Live,
    Pause,
}

/// How long a live capture may run before it is given up for a paused one.
pub const LIVE_FORK_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

impl Default for VmOptions {
    fn default() -> Self {
        VmOptions {
            machine: "microvm".into(),
            devices: Vec::new(),
            run_as: "nobody".into(),
            fork_capture: ForkCapture::Auto,
        }
    }
}

/// Each sandbox gets a network namespace with a veth to the node, an address from `pool`,
/// NAT to the node's uplink and egress denied unless its rules allow it; the node's DNS
/// proxy is its only resolver.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// false: sandboxes get a network namespace with loopback only (no network at all), as
    /// with `network: "none"`.
    pub enabled: bool,
    /// IPv4 network the sandboxes' addresses come from, a /30 each.
    pub pool: String,
    /// The port the DNS proxy listens on (sandboxes' DNS to any server on port 53 is
    /// redirected to it).
    pub dns_port: u16,
    /// Resolvers the DNS proxy asks (`ip:port`); empty: the node's /etc/resolv.conf.
    pub dns_upstream: Vec<String>,
    /// Service names for rules (`pypi = ["pypi.org", "*.pythonhosted.org"]`); these add to
    /// and override the built-in ones (pypi, npm, github, debian, huggingface).
    pub services: BTreeMap<String, Vec<String>>,
    /// Private addresses a rule may open by name (`db = ["10.1.2.3:5432"]`): the only way
    /// into the private, loopback, link-local and reserved ranges, which no tenant rule
    /// can name. Never inside the pool.
    pub private_services: BTreeMap<String, Vec<String>>,
    /// The port of the egress header proxy (on the sandboxes' gateway address), which
    /// sets a sandbox's `egress_headers` on its HTTP and HTTPS requests.
    pub header_port: u16,
    /// PEM files of CAs the header proxy trusts, besides the system's, when it connects
    /// on to a server over HTTPS.
    pub header_roots: Vec<String>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            enabled: true,
            pool: "10.200.0.0/16".into(),
            dns_port: 10053,
            dns_upstream: Vec::new(),
            services: BTreeMap::new(),
            private_services: BTreeMap::new(),
            header_port: 10080,
            header_roots: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxDefaults {
    pub cpu_cores: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u64,
    pub ttl_seconds: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxMaxima {
    /// 0 means the node's core count.
    pub cpu_cores: f64,
    /// 0 means the node's memory.
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u64,
    pub ttl_seconds: u64,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        EdgeConfig {
            name: "local".into(),
            state_dir: PathBuf::from("/var/lib/dsec/edge"),
            image_store: PathBuf::from("/var/lib/dsec/images"),
            oci_runtime: "auto".into(),
            aether_binary: None,
            defaults: SandboxDefaults::default(),
            max: SandboxMaxima::default(),
            max_sandboxes: 4096,
            reserved_memory_mb: 256,
            reserved_disk_mb: 512,
            max_load_per_core: 0.0,
            max_output_bytes: 16 << 20,
            default_exec_timeout_seconds: 600.0,
            network: NetworkConfig::default(),
            vm_ram_dir: PathBuf::from("/dev/shm/dsec-vm"),
            vm: VmOptions::default(),
            firecracker_binary: None,
            firecracker_diff_snapshots: false,
            firecracker_run_as: "nobody".into(),
            events: EventsConfig::default(),
            pools: Vec::new(),
            functions: Vec::new(),
            create_parallelism: 0,
            cgroup_favor_dynmods: true,
            metrics_interval_ms: 5000,
            pull_registries: default_pull_registries(),
            insecure_registries: Vec::new(),
            lazy_images: true,
            lazy_cache_mb: 32768,
            lazy_prefetch: false,
            lazy_registries: Vec::new(),
        }
    }
}

impl Default for SandboxDefaults {
    fn default() -> Self {
        SandboxDefaults {
            cpu_cores: 1.0,
            memory_mb: 512,
            disk_mb: 1024,
            pids: 1024,
            ttl_seconds: 3600,
        }
    }
}

impl Default for SandboxMaxima {
    fn default() -> Self {
        SandboxMaxima {
            cpu_cores: 0.0,
            memory_mb: 0,
            disk_mb: 65536,
            pids: 65536,
            ttl_seconds: 7 * 24 * 3600,
        }
    }
}

/// `[edge.events]`: how long lifecycle events are kept and how webhooks are sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Events older than this are dropped (from memory and from `<state_dir>/events/`).
    pub keep_seconds: u64,
    /// At most this many events are kept (the oldest go first).
    pub max_events: usize,
    /// Tries per webhook delivery before it is given up (the first included); waits
    /// between tries double from one second, to at most a minute.
    pub webhook_attempts: u32,
    /// How long one try may take.
    pub webhook_timeout_seconds: u64,
    /// Webhooks a node keeps, all projects together.
    pub max_webhooks: usize,
    /// Events waiting to be sent to one webhook; past it the oldest are dropped (and
    /// the delivery log says so).
    pub webhook_queue: usize,
    /// Addresses webhooks may be sent to besides public ones, as CIDRs (e.g.
    /// `"127.0.0.0/8"`). Loopback, private, link-local and other special addresses are
    /// refused otherwise, so a key cannot make the node call its own services.
    pub webhook_allow: Vec<String>,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            keep_seconds: 7 * 86_400,
            max_events: 200_000,
            webhook_attempts: 8,
            webhook_timeout_seconds: 10,
            max_webhooks: 1024,
            webhook_queue: 10_000,
            webhook_allow: Vec::new(),
        }
    }
}
