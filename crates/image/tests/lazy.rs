//! Lazy layers end to end on one node: a layer's EROFS image is pushed to Debian's
//! `docker-registry` on loopback, registered in a store as a lazy blob, served by the
//! lazy FUSE file system and mounted as EROFS from it. Reading a file fetches only the
//! chunks it needs; the whole tree reads back identical; a registry that serves other
//! bytes than the chunk table says gives read errors, never those bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Mounted, pseudo_random};
use dsec_image::lazy::{self, ChunkTable, LazySource};
use dsec_image::{erofs, lazyfs};
use sha2::{Digest, Sha256};

fn ready() -> bool {
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting needs root");
        return false;
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let has = |n: &str| fs.lines().any(|l| l.split_whitespace().last() == Some(n));
    if !has("erofs") || !has("fuse") || !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: this kernel lacks EROFS or FUSE");
        return false;
    }
    if !Path::new("/usr/bin/docker-registry").exists() {
        eprintln!("skipped: needs Debian's docker-registry (deploy/deps.sh installs it)");
        return false;
    }
    true
}

struct Registry {
    child: Child,
    addr: String,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_registry(dir: &Path) -> Registry {
    let addr = format!("127.0.0.1:{}", free_port());
    std::fs::create_dir_all(dir.join("storage")).unwrap();
    let cfg = dir.join("config.yml");
    std::fs::write(
        &cfg,
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {addr}\n",
            dir.join("storage").display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("registry.log")).unwrap();
    let child = Command::new("docker-registry")
        .args(["serve"])
        .arg(&cfg)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let r = Registry { child, addr };
    let t0 = Instant::now();
    while std::net::TcpStream::connect(&r.addr).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the registry did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    r
}

/// Pushes `bytes` as a blob of `repo`; returns its digest.
fn push(rt: &tokio::runtime::Runtime, registry: &str, repo: &str, bytes: Vec<u8>) -> String {
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    let client = dsec_image::pull::client(true, None);
    let r = oci_client::Reference::with_tag(registry.into(), repo.into(), "x".into());
    rt.block_on(client.push_blob(&r, bytes, &digest)).unwrap();
    digest
}

#[test]
fn a_lazy_layer_fetches_what_is_read_and_reads_back_whole() {
    if !ready() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let registry = start_registry(&t.path().join("registry"));

    // A layer of 24 files of 1.5 MiB and 500 small ones: a 36+ MiB image.
    let src = t.path().join("src");
    std::fs::create_dir_all(src.join("big")).unwrap();
    std::fs::create_dir_all(src.join("small")).unwrap();
    for i in 0..24 {
        std::fs::write(
            src.join(format!("big/{i}.bin")),
            pseudo_random(3 << 19, i + 1),
        )
        .unwrap();
    }
    for i in 0..500 {
        std::fs::write(src.join(format!("small/{i}.txt")), format!("file {i}\n")).unwrap();
    }
    let img = t.path().join("layer.erofs");
    let stats = erofs::build(&src, &img).unwrap();
    let bytes = std::fs::read(&img).unwrap();
    let table = ChunkTable::of_file(&img, lazy::CHUNK_SIZE).unwrap();
    let digest = push(&rt, &registry.addr, "lazy/test", bytes.clone());

    let store = t.path().join("store");
    std::fs::create_dir_all(store.join("tmp")).unwrap();
    let source = LazySource {
        registry: registry.addr.clone(),
        repository: "lazy/test".into(),
        digest: digest.clone(),
        plain_http: true,
        ca_pem: None,
        login: None,
        table: table.clone(),
    };
    lazy::register(&store, &source).unwrap();

    // The same image's bytes, but the table says chunk 20 is other bytes: a registry
    // (or a man in the middle) serving what the publisher did not publish.
    let mut forged_table = table.clone();
    forged_table.chunks[20] = hex::encode(Sha256::digest(b"something else"));
    let other = {
        // Another blob (one byte more) so that it has its own name.
        let mut b = bytes.clone();
        b.extend_from_slice(&[0u8; 4096]);
        b
    };
    let mut other_table = ChunkTable {
        size: other.len() as u64,
        ..forged_table.clone()
    };
    other_table
        .chunks
        .truncate(other.len().div_ceil(lazy::CHUNK_SIZE as usize));
    let last = other_table.chunks.len() - 1;
    other_table.chunks[last] =
        hex::encode(Sha256::digest(&other[last * lazy::CHUNK_SIZE as usize..]));
    let forged_digest = push(&rt, &registry.addr, "lazy/test", other);
    lazy::register(
        &store,
        &LazySource {
            digest: forged_digest.clone(),
            table: other_table,
            ..source.clone()
        },
    )
    .unwrap();

    let fs = lazyfs::LazyFs::new(&store, rt.handle().clone(), lazyfs::registry_fetcher());
    let fuse_dir = t.path().join("lazyfs");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let session = fs.mount(&fuse_dir).unwrap();

    let hex = digest.trim_start_matches("sha256:");
    let mnt = t.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    erofs::mount(&fuse_dir.join(hex), &mnt).unwrap();
    let _m = Mounted(mnt.clone());
    let after_mount = fs.stats(hex).unwrap();

    // One small file and one big one: a few chunks, not the image.
    assert_eq!(
        std::fs::read_to_string(mnt.join("small/250.txt")).unwrap(),
        "file 250\n"
    );
    assert_eq!(
        std::fs::read(mnt.join("big/7.bin")).unwrap(),
        pseudo_random(3 << 19, 8)
    );
    let first = fs.stats(hex).unwrap();
    eprintln!(
        "image {} bytes ({} of metadata); fetched {} at mount, {} after reading two files",
        stats.bytes, stats.meta_bytes, after_mount.fetched_bytes, first.fetched_bytes
    );
    assert!(first.fetched_bytes > 0);
    assert!(
        first.fetched_bytes <= 4 * lazy::CHUNK_SIZE,
        "reading 1.5 MiB and a line fetched {} bytes",
        first.fetched_bytes
    );

    // Everything reads back as it was; every chunk then came once.
    for i in 0..24 {
        assert_eq!(
            std::fs::read(mnt.join(format!("big/{i}.bin"))).unwrap(),
            pseudo_random(3 << 19, i + 1),
            "big/{i}.bin"
        );
    }
    for i in 0..500 {
        assert_eq!(
            std::fs::read_to_string(mnt.join(format!("small/{i}.txt"))).unwrap(),
            format!("file {i}\n")
        );
    }
    let all = fs.stats(hex).unwrap();
    assert!(
        all.fetched_bytes <= bytes.len() as u64,
        "a chunk was fetched twice"
    );
    assert_eq!(
        std::fs::read(store.join("lazy").join(hex).join("data"))
            .unwrap()
            .len(),
        bytes.len()
    );

    // The forged blob: the chunks that match read, the one that does not is an error.
    let fhex = forged_digest.trim_start_matches("sha256:");
    let fmnt = t.path().join("forged");
    std::fs::create_dir_all(&fmnt).unwrap();
    erofs::mount(&fuse_dir.join(fhex), &fmnt).unwrap();
    let _f = Mounted(fmnt.clone());
    let mut bad = 0;
    for i in 0..24 {
        match std::fs::read(fmnt.join(format!("big/{i}.bin"))) {
            Ok(b) => assert_eq!(b, pseudo_random(3 << 19, i + 1), "big/{i}.bin"),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                bad += 1;
            }
        }
    }
    assert!(bad >= 1, "the forged chunk was read without an error");
    // The chunk was never kept.
    let have = std::fs::read(store.join("lazy").join(fhex).join("have")).unwrap();
    assert_eq!(have[20 / 8] & (1 << (20 % 8)), 0);

    drop(_f);
    drop(_m);
    drop(session);
}

/// 16 files of 1.5 MiB as one lazy blob in a fresh store, served by `fs` (made by
/// `make`) and mounted; the store, the mount and the blob's hex digest.
struct Served {
    _t: tempfile::TempDir,
    _registry: Registry,
    store: PathBuf,
    mnt: PathBuf,
    hex: String,
    blob_len: u64,
    fs: lazyfs::LazyFs,
    // Dropped first: the EROFS mount, then the FUSE session.
    _m: Option<Mounted>,
    _session: Option<fuser::BackgroundSession>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self._m.take();
        self._session.take();
    }
}

fn serve_files(rt: &tokio::runtime::Runtime, make: impl FnOnce(&Path) -> lazyfs::LazyFs) -> Served {
    let t = tempfile::tempdir().unwrap();
    let registry = start_registry(&t.path().join("registry"));
    let src = t.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..16 {
        std::fs::write(src.join(format!("{i}.bin")), pseudo_random(3 << 19, i + 1)).unwrap();
    }
    let img = t.path().join("layer.erofs");
    erofs::build(&src, &img).unwrap();
    let bytes = std::fs::read(&img).unwrap();
    let table = ChunkTable::of_file(&img, lazy::CHUNK_SIZE).unwrap();
    let digest = push(rt, &registry.addr, "lazy/files", bytes.clone());
    let store = t.path().join("store");
    std::fs::create_dir_all(store.join("tmp")).unwrap();
    lazy::register(
        &store,
        &LazySource {
            registry: registry.addr.clone(),
            repository: "lazy/files".into(),
            digest: digest.clone(),
            plain_http: true,
            ca_pem: None,
            login: None,
            table,
        },
    )
    .unwrap();
    let fs = make(&store);
    let fuse_dir = t.path().join("lazyfs");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let session = fs.mount(&fuse_dir).unwrap();
    let hex = digest.trim_start_matches("sha256:").to_string();
    let mnt = t.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    erofs::mount(&fuse_dir.join(&hex), &mnt).unwrap();
    Served {
        _m: Some(Mounted(mnt.clone())),
        _session: Some(session),
        _t: t,
        _registry: registry,
        store,
        mnt,
        hex,
        blob_len: bytes.len() as u64,
        fs,
    }
}

#[test]
fn a_bounded_cache_drops_the_chunks_read_least_recently() {
    if !ready() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let limit = 6 * lazy::CHUNK_SIZE;
    let s = serve_files(&rt, |store| {
        lazyfs::LazyFs::new(store, rt.handle().clone(), lazyfs::registry_fetcher())
            .with_cache_limit(Some(limit))
    });
    // Twice through 24 MiB of files with room for 6 MiB: right every time, never more
    // than the bound kept, and so chunks fetched again.
    for round in 0..2 {
        for i in 0..16 {
            assert_eq!(
                std::fs::read(s.mnt.join(format!("{i}.bin"))).unwrap(),
                pseudo_random(3 << 19, i + 1),
                "round {round}, {i}.bin"
            );
            assert!(s.fs.held_bytes() <= limit, "{} held", s.fs.held_bytes());
        }
        // The kernel's own cache of the files would hide the second round's reads.
        drop_caches();
    }
    let data = std::fs::metadata(s.store.join("lazy").join(&s.hex).join("data")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert!(
        data.blocks() * 512 <= limit + lazy::CHUNK_SIZE,
        "{} bytes on disk",
        data.blocks() * 512
    );
    let stats = s.fs.stats(&s.hex).unwrap();
    assert!(
        stats.fetched_bytes > s.blob_len,
        "evicted chunks were read again: fetched {} of a {}-byte blob",
        stats.fetched_bytes,
        s.blob_len
    );
}

#[test]
fn a_first_read_starts_a_prefetch_of_the_rest() {
    if !ready() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let s = serve_files(&rt, |store| {
        lazyfs::LazyFs::new(store, rt.handle().clone(), lazyfs::registry_fetcher())
            .with_prefetch(Some(Duration::ZERO))
    });
    // The mount read the superblock: the rest comes without another read.
    let t0 = Instant::now();
    while s.fs.held_bytes() < s.blob_len.div_ceil(lazy::CHUNK_SIZE) * lazy::CHUNK_SIZE {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the prefetch did not finish"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let fetched = s.fs.stats(&s.hex).unwrap().fetched_bytes;
    assert_eq!(fetched, s.blob_len, "every chunk fetched once");
    for i in 0..16 {
        assert_eq!(
            std::fs::read(s.mnt.join(format!("{i}.bin"))).unwrap(),
            pseudo_random(3 << 19, i + 1)
        );
    }
    assert_eq!(
        s.fs.stats(&s.hex).unwrap().fetched_bytes,
        fetched,
        "reads fetched nothing"
    );
}

fn drop_caches() {
    // SAFETY: no arguments.
    unsafe { libc::sync() };
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1\n");
}
