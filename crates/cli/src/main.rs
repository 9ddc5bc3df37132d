//! `dsec`: the OpenDsec CLI and every server role as a subcommand.

mod client;
mod cmd;
mod output;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub const DEFAULT_DATA_DIR: &str = "/var/lib/dsec";

#[derive(Parser)]
#[command(
    name = "dsec",
    version,
    max_term_width = 80,
    about = "OpenDsec: sandboxes for agents and RL rollouts",
    after_help = "Example:\n  dsec up && dsec run root/py:3.11 -- python3 -c 'print(6*7)'"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Print tables as wide as their cells (by default they fit the terminal, or 80
    /// columns when the output is not one)
    #[arg(long, global = true)]
    wide: bool,
}

/// Flags every API client command takes.
#[derive(clap::Args, Clone)]
pub struct ApiArgs {
    /// API URL (default: from client.toml)
    #[arg(long, env = "DSEC_API_URL", global = true)]
    pub api_url: Option<String>,
    /// API key, dsk.… (default: from client.toml)
    #[arg(long, env = "DSEC_API_KEY", global = true, hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print JSON instead of tables
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(clap::Args, Clone)]
pub struct DataDirArg {
    /// Where all state lives
    #[arg(long, env = "DSEC_DATA_DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Start every role on this machine in the background and print the API URL and key
    #[command(after_help = "Example:\n  dsec up --data-dir /var/lib/dsec")]
    Up(cmd::up::UpArgs),
    /// Run in the foreground: every role (what `dsec up` starts), or one cluster role
    #[command(
        after_help = "Example:\n  dsec serve --config /etc/dsec/edge.toml\n\nConfig files for each role and a multi-node bring-up: deploy/cluster/README.md"
    )]
    Serve(cmd::up::ServeArgs),
    /// Run the E2B-compatible gateway on its own, in front of an OpenDsec API (a cluster's
    /// apiserver); `dsec up` runs one by itself
    #[command(
        after_help = "Example:\n  dsec gateway --api-url http://apiserver:7600 --api-key dsk.… --listen 0.0.0.0:17600 --domain sbx.example.com\n\nThen, for E2B programs: E2B_API_URL=http://<host>:17600 E2B_SANDBOX_URL=http://<host>:17600 E2B_API_KEY=dsk.…"
    )]
    Gateway(cmd::gateway::GatewayArgs),
    /// Stop the server started by `dsec up` (and, unless --keep-sandboxes, its sandboxes)
    #[command(after_help = "Example:\n  dsec down --data-dir /var/lib/dsec")]
    Down(cmd::up::DownArgs),
    /// Print a shell's completion script for dsec
    #[command(
        after_help = "Example:\n  source <(dsec completion bash)\n  dsec completion zsh > \"${fpath[1]}/_dsec\"\n  dsec completion fish > ~/.config/fish/completions/dsec.fish"
    )]
    Completion {
        /// bash, zsh, fish, elvish or powershell
        shell: clap_complete::Shell,
    },
    /// Show nodes, backends, capacity and sandboxes
    #[command(after_help = "Example:\n  dsec status --json")]
    Status(cmd::up::StatusArgs),
    /// Create a sandbox from an image; with a command, run it and print its output
    #[command(
        after_help = "Example:\n  dsec run root/py:3.11 --memory 1024 -- python3 -c 'print(6*7)'\n  dsec run --rm root/base -- uname -a\n  dsec run --allow pypi --allow 203.0.113.0/24:443 root/py:3.11 -- pip download requests\n  dsec run -v data:/mnt/data root/base -- ls /mnt/data\n  dsec run --allow api.example.com --header 'api.example.com:Authorization=Bearer sk-1' root/base -- curl https://api.example.com/"
    )]
    Run(Box<cmd::sandbox::RunArgs>),
    /// Run a command in a sandbox
    #[command(after_help = "Example:\n  dsec exec local-0123456789ab -- ls -l /")]
    Exec(cmd::sandbox::ExecArgs),
    /// List sandboxes
    #[command(after_help = "Example:\n  dsec ls --label task=demo")]
    Ls(cmd::sandbox::LsArgs),
    /// Stop and remove sandboxes
    #[command(after_help = "Example:\n  dsec rm local-0123456789ab")]
    Rm(cmd::sandbox::RmArgs),
    /// Fork a running sandbox into copies (vm: with its memory; containers: filesystem only)
    #[command(
        after_help = "Example:\n  dsec fork local-0123456789ab --count 4 --label job=7\n\nThe source pauses briefly while its state is saved, then runs on; every copy starts\nwhere the source was (a vm copy with its processes and memory) and diverges from there."
    )]
    Fork(cmd::sandbox::ForkArgs),
    /// Pause a sandbox: frozen in place, or with --to-disk its processes ended, freeing the
    /// host's memory (a vm's memory is saved to disk; a container keeps its files and
    /// starts afresh on resume)
    #[command(
        after_help = "Example:\n  dsec pause local-0123456789ab\n  dsec pause --to-disk local-0123456789ab && dsec resume local-0123456789ab\n\nA paused sandbox's lifetime is extended by the time it stays paused."
    )]
    Pause(cmd::pause::PauseArgs),
    /// Resume a paused sandbox where it stopped (from disk too), here or on another edge
    #[command(
        after_help = "Example:\n  dsec resume local-0123456789ab\n  dsec resume edge1-0123456789ab --edge edge2    # moves it: a new id on edge2"
    )]
    Resume(cmd::pause::ResumeArgs),
    /// Pause every sandbox with the given labels (a preempted job) in one call
    #[command(
        name = "pause-group",
        after_help = "Example:\n  dsec pause-group --label job=7 --to-disk\n  dsec resume-group --label job=7\n\nExits 1 when any sandbox could not be paused (each one is listed with the reason)."
    )]
    PauseGroup(cmd::pause::GroupArgs),
    /// Resume every paused sandbox with the given labels
    #[command(
        name = "resume-group",
        after_help = "Example:\n  dsec resume-group --label job=7 --json"
    )]
    ResumeGroup(cmd::pause::GroupArgs),
    /// Replace a running sandbox's egress rules (they hold for new connections at once)
    #[command(
        after_help = "Example:\n  dsec network local-0123456789ab --allow pypi --allow 203.0.113.0/24:443\n  dsec network local-0123456789ab --allow api.example.com --header 'api.example.com:X-Key=k1'\n  dsec network local-0123456789ab          # close egress"
    )]
    Network(cmd::sandbox::NetworkArgs),
    /// Extend a sandbox's lifetime
    #[command(
        name = "set-timeout",
        after_help = "Example:\n  dsec set-timeout local-0123456789ab 3600"
    )]
    SetTimeout(cmd::sandbox::TimeoutArgs),
    /// Open an interactive shell in a sandbox (piped input runs as a script)
    #[command(
        after_help = "Example:\n  dsec shell local-0123456789ab\n  dsec shell local-0123456789ab --cmd /usr/bin/python3\n  echo 'echo hi; exit' | dsec shell local-0123456789ab"
    )]
    Shell(cmd::runtime::ShellArgs),
    /// Copy a file into or out of a sandbox (ID:/path on one side; - for stdin/stdout)
    #[command(
        after_help = "Example:\n  dsec cp data.csv local-0123456789ab:/root/data.csv\n  dsec cp local-0123456789ab:/root/out.log ./\n  tar c src | dsec cp - local-0123456789ab:/root/src.tar"
    )]
    Cp(cmd::runtime::CpArgs),
    /// Print a process's output, kept and live, until it exits; exits with its exit code
    #[command(
        after_help = "Example:\n  dsec logs local-0123456789ab 42\n\nAlways follows: it returns when the process exits (Ctrl-C stops watching, not the process)."
    )]
    Logs(cmd::runtime::LogsArgs),
    /// List a sandbox's managed processes (streamed and background ones)
    #[command(after_help = "Example:\n  dsec ps local-0123456789ab --json")]
    Ps(cmd::runtime::PsArgs),
    /// List a sandbox's trajectories, or show the steps of one
    #[command(
        after_help = "Example:\n  dsec trajectory local-0123456789ab\n  dsec trajectory local-0123456789ab episode-7 --json"
    )]
    Trajectory(cmd::runtime::TrajectoryArgs),
    /// Turn a running sandbox's filesystem changes into a new image (one more layer on its
    /// image; env and workdir kept) that any later sandbox, container or vm, can use
    #[command(
        after_help = "Example:\n  dsec commit local-0123456789ab root/myenv:v1\n  dsec run root/myenv:v1 -- ls /root\n\nAn existing IMAGE_REF is replaced only with --overwrite. A container sandbox is frozen\nwhile its changes are copied; a vm sandbox keeps running (write nothing during it)."
    )]
    Commit(cmd::commit::CommitArgs),
    /// Keep a sandbox's state under an id and start sandboxes from it later
    #[command(subcommand)]
    Snapshot(cmd::snapshot::SnapshotCommand),
    /// Show what happened to your sandboxes (created, paused, stopped, expired, ...), or
    /// follow it as it happens
    #[command(
        after_help = "Example:\n  dsec events --sandbox local-0123456789ab\n  dsec events --follow --type expired --json\n\nWebhooks (POST /v1/webhooks) get the same events, signed: docs/RUNTIME_API.md"
    )]
    Events(cmd::events::EventsArgs),
    /// Show the sandboxes by what they use (CPU, memory), refreshed until interrupted
    #[command(
        after_help = "Example:\n  dsec top\n  dsec top --sort memory --label job=7\n  dsec top --once --json\n\nCPU is over the node's last reading interval ([edge] metrics_interval_ms), in\npercent of one core."
    )]
    Top(cmd::top::TopArgs),
    /// Volumes: file systems kept apart from sandboxes, mounted by many (`dsec run -v`)
    #[command(subcommand)]
    Volume(cmd::volume::VolumeCommand),
    /// Build, list, inspect and remove images
    #[command(subcommand)]
    Image(cmd::image::ImageCommand),
    /// Projects, quotas and API keys
    #[command(subcommand)]
    Iam(cmd::iam::IamCommand),
    /// The cluster CA and component certificates (mutual TLS between components)
    #[command(subcommand)]
    Certs(cmd::certs::CertsCommand),
    /// Serve an image store's lazy layers to the kernel (FUSE) until unmounted; the
    /// node starts it on the first lazy pull
    #[command(
        after_help = "Example:\n  dsec lazyfs --store /var/lib/dsec/images\n\nIt mounts <store>/lazyfs and returns when that is unmounted; a second one for the\nsame store exits at once."
    )]
    Lazyfs(LazyfsArgs),
}

#[derive(clap::Args)]
struct LazyfsArgs {
    /// The image store
    #[arg(long)]
    store: PathBuf,
    /// The most MiB of fetched chunks to keep; past it, those read least recently go
    /// (0: no bound)
    #[arg(long, default_value_t = 32768)]
    cache_mb: u64,
    /// Fetch the rest of a blob in the background once something reads it
    #[arg(long)]
    prefetch: bool,
}

fn main() {
    let cli = Cli::parse();
    output::set_wide(cli.wide);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Up(a) => cmd::up::up(a).await,
            Command::Serve(a) => cmd::up::serve_command(a).await,
            Command::Down(a) => cmd::up::down(a).await,
            Command::Gateway(a) => cmd::gateway::run(a).await,
            Command::Status(a) => cmd::up::status(a).await,
            Command::Completion { shell } => {
                use clap::CommandFactory;
                use std::io::Write;
                let mut script = Vec::new();
                clap_complete::generate(shell, &mut Cli::command(), "dsec", &mut script);
                // A closed pipe (`| head`) is the reader's choice, not an error.
                let _ = std::io::stdout().write_all(&script);
                Ok(0)
            }
            Command::Run(a) => cmd::sandbox::run(*a).await,
            Command::Exec(a) => cmd::sandbox::exec(a).await,
            Command::Ls(a) => cmd::sandbox::ls(a).await,
            Command::Rm(a) => cmd::sandbox::rm(a).await,
            Command::Fork(a) => cmd::sandbox::fork(a).await,
            Command::Pause(a) => cmd::pause::pause(a).await,
            Command::Resume(a) => cmd::pause::resume(a).await,
            Command::PauseGroup(a) => cmd::pause::group(a, false).await,
            Command::ResumeGroup(a) => cmd::pause::group(a, true).await,
            Command::SetTimeout(a) => cmd::sandbox::set_timeout(a).await,
            Command::Network(a) => cmd::sandbox::network(a).await,
            Command::Shell(a) => cmd::runtime::shell(a).await,
            Command::Cp(a) => cmd::runtime::cp(a).await,
            Command::Logs(a) => cmd::runtime::logs(a).await,
            Command::Ps(a) => cmd::runtime::ps(a).await,
            Command::Trajectory(a) => cmd::runtime::trajectory(a).await,
            Command::Commit(a) => cmd::commit::commit(a).await,
            Command::Snapshot(c) => cmd::snapshot::run(c).await,
            Command::Events(a) => cmd::events::run(a).await,
            Command::Top(a) => cmd::top::run(a).await,
            Command::Volume(c) => cmd::volume::run(c).await,
            Command::Image(c) => cmd::image::run(c).await,
            Command::Iam(c) => cmd::iam::run(c).await,
            Command::Certs(c) => cmd::certs::run(c),
            Command::Lazyfs(a) => {
                cmd::up::init_tracing();
                let rt = tokio::runtime::Handle::current();
                // A cluster's edge names its peers in the store; they are asked first.
                let peers: std::sync::Arc<dyn dsec_image::lazy::PeerChunks> =
                    std::sync::Arc::new(dsec_edge_api::transfer::LazyPeers::new(&a.store));
                tokio::task::spawn_blocking(move || {
                    dsec_image::lazy::serve(&a.store, rt, a.cache_mb, a.prefetch, Some(peers))
                })
                .await?
                .map(|_| 0)
                .map_err(anyhow::Error::from)
            }
        }
    });
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
