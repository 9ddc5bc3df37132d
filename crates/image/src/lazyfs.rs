//! The node's lazy blob file system: one read-only FUSE mount where every lazy blob
//! of the store ([`crate::lazy`]) is a file named by its hex digest. A layer's EROFS is
//! mounted from that file (file-backed EROFS), so the kernel's reads of the layer
//! become reads here, and each fetches the chunks it lacks on first access.
//!
//! Only what the store registered is served; a name that is not a registered blob is
//! not found. Reads run on a Tokio runtime so that one slow fetch does not hold the
//! FUSE loop; a fetch that fails, or bytes that do not match their chunk digest, is an
//! I/O error to the reader, never other data.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};

use crate::lazy::{self, Fetch, LazyBlob, LazyStats, RegistryFetch};
use crate::pull::Credentials;

/// Blobs never change once registered: the kernel may keep what it was told.
const TTL: Duration = Duration::from_secs(3600);

/// How a blob's fetcher is made (the registry, with the login its source names).
pub type MakeFetch = Arc<dyn Fn(&Path, &lazy::LazySource) -> Arc<dyn Fetch> + Send + Sync>;

/// The fetcher of a registry blob, logged in as the source's project's kept login.
pub fn registry_fetcher() -> MakeFetch {
    Arc::new(|store: &Path, src: &lazy::LazySource| {
        let credentials = src
            .login
            .as_deref()
            .and_then(|project| {
                crate::credentials::CredentialBook::new(store)
                    .find(project, &src.registry, false)
                    .ok()
                    .flatten()
            })
            .map_or(Credentials::Anonymous, |(_, c)| c);
        Arc::new(RegistryFetch::new(src, credentials)) as Arc<dyn Fetch>
    })
}

/// When each held chunk was last read, for eviction (least recently read first).
#[derive(Default)]
struct Lru {
    tick: u64,
    /// (blob inode, chunk) -> tick of its last read.
    last: HashMap<(u64, u64), u64>,
}

#[derive(Default)]
struct Table {
    by_name: HashMap<String, u64>,
    /// Inode `i + 2` is `blobs[i]`.
    blobs: Vec<(String, Arc<LazyBlob>)>,
}

/// What the file system serves; clone it to read blobs' statistics while it runs.
#[derive(Clone)]
pub struct LazyFs {
    store: PathBuf,
    rt: tokio::runtime::Handle,
    fetcher: MakeFetch,
    table: Arc<Mutex<Table>>,
    started: SystemTime,
    /// The most bytes of chunks kept on the node, all blobs together; none: no bound.
    cache_limit: Option<u64>,
    lru: Arc<Mutex<Lru>>,
    /// Prefetch a blob this long after its first read (none: never).
    prefetch: Option<Duration>,
}

/// Chunks a prefetch has in flight at once (demand reads do not wait for them).
const PREFETCH_AT_ONCE: usize = 4;

impl LazyFs {
    pub fn new(store: &Path, rt: tokio::runtime::Handle, fetcher: MakeFetch) -> LazyFs {
        LazyFs {
            store: store.to_path_buf(),
            rt,
            fetcher,
            table: Arc::new(Mutex::new(Table::default())),
            started: SystemTime::now(),
            cache_limit: None,
            lru: Arc::new(Mutex::new(Lru::default())),
            prefetch: None,
        }
    }

    /// `after` a blob's first read (a sandbox's start reads first), fetch the rest of it
    /// in the background (below nine tenths of the cache's bound, so that it never
    /// evicts what was read).
    pub fn with_prefetch(mut self, after: Option<Duration>) -> LazyFs {
        self.prefetch = after;
        self
    }

    fn spawn_prefetch(&self, blob: Arc<LazyBlob>, after: Duration) {
        use futures_util::StreamExt;
        let fs = self.clone();
        self.rt.spawn(async move {
            tokio::time::sleep(after).await;
            let t0 = std::time::Instant::now();
            let cs = blob.source().table.chunk_size;
            let missing: Vec<u64> = (0..blob.chunks()).filter(|&i| !blob.has(i)).collect();
            let n = missing.len();
            let mut fetches = futures_util::stream::iter(missing)
                .map(|i| {
                    let (b, fs) = (blob.clone(), fs.clone());
                    async move {
                        if let Some(limit) = fs.cache_limit
                            && fs.held_bytes() + cs > limit - limit / 10
                        {
                            return Err("the cache is full".to_string());
                        }
                        b.prefetch(i).await.map_err(|e| e.to_string())
                    }
                })
                .buffer_unordered(PREFETCH_AT_ONCE);
            while let Some(r) = fetches.next().await {
                if let Err(e) = r {
                    tracing::info!(blob = %blob.source().digest, "prefetch stopped: {e}");
                    return;
                }
            }
            tracing::info!(
                blob = %blob.source().digest,
                "prefetched {n} chunks in {:.1} s",
                t0.elapsed().as_secs_f64()
            );
        });
    }

    /// Keeps at most `bytes` of fetched chunks on the node: past it, the chunks read
    /// least recently are dropped (and fetched again when read again).
    pub fn with_cache_limit(mut self, bytes: Option<u64>) -> LazyFs {
        self.cache_limit = bytes;
        self
    }

    /// Bytes of chunks held on the node, of the blobs this mount has opened.
    pub fn held_bytes(&self) -> u64 {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.blobs.iter().map(|(_, b)| b.held_bytes()).sum()
    }

    /// Notes a read of `len` bytes at `offset` of blob `ino`, then drops the chunks
    /// read least recently while more than the limit is held.
    fn touched(&self, ino: u64, blob: &LazyBlob, offset: u64, len: u64) {
        let Some(limit) = self.cache_limit else {
            return;
        };
        let cs = blob.source().table.chunk_size;
        {
            let mut l = self.lru.lock().unwrap_or_else(|e| e.into_inner());
            l.tick += 1;
            let tick = l.tick;
            for c in offset / cs..=(offset + len.max(1) - 1) / cs {
                l.last.insert((ino, c), tick);
            }
        }
        if self.held_bytes() <= limit {
            return;
        }
        // Down to nine tenths of the limit, so that eviction runs once in a while.
        let goal = limit - limit / 10;
        let blobs: Vec<(u64, Arc<LazyBlob>)> = {
            let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
            t.blobs
                .iter()
                .enumerate()
                .map(|(i, (_, b))| (i as u64 + 2, b.clone()))
                .collect()
        };
        let mut candidates: Vec<(u64, u64, u64)> = Vec::new();
        {
            let l = self.lru.lock().unwrap_or_else(|e| e.into_inner());
            for (ino, b) in &blobs {
                for c in 0..b.chunks() {
                    if b.has(c) {
                        // Chunks held from before this mount was started come first.
                        let tick = l.last.get(&(*ino, c)).copied().unwrap_or(0);
                        candidates.push((tick, *ino, c));
                    }
                }
            }
        }
        candidates.sort_unstable();
        let mut held = self.held_bytes();
        for (_, ino, c) in candidates {
            if held <= goal {
                break;
            }
            let b = &blobs[(ino - 2) as usize].1;
            match b.evict(c) {
                Ok(true) => {
                    held = held.saturating_sub(cs);
                    self.lru
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .last
                        .remove(&(ino, c));
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(blob = %b.source().digest, error = %e, "evicting a chunk");
                    break;
                }
            }
        }
    }

    fn config() -> fuser::Config {
        let mut cfg = fuser::Config::default();
        cfg.mount_options = vec![
            fuser::MountOption::FSName("dsec-lazy".into()),
            fuser::MountOption::RO,
            fuser::MountOption::NoDev,
            fuser::MountOption::NoSuid,
            fuser::MountOption::NoExec,
            fuser::MountOption::DefaultPermissions,
        ];
        // EROFS reads the backing file in the context of whichever task faults a page
        // in (a sandbox's process among them).
        cfg.acl = fuser::SessionACL::All;
        cfg.n_threads = Some(2);
        cfg
    }

    /// Mounts the file system on `mountpoint` and serves it on background threads
    /// until the returned session is dropped (which unmounts it).
    pub fn mount(&self, mountpoint: &Path) -> std::io::Result<fuser::BackgroundSession> {
        fuser::spawn_mount2(self.clone(), mountpoint, &Self::config())
    }

    /// Mounts the file system on `mountpoint` and serves it until it is unmounted.
    pub fn serve(&self, mountpoint: &Path) -> std::io::Result<()> {
        fuser::mount2(self.clone(), mountpoint, &Self::config())
    }

    /// The statistics of a blob this mount has opened.
    pub fn stats(&self, hex: &str) -> Option<LazyStats> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let i = *t.by_name.get(hex)?;
        Some(t.blobs[(i - 2) as usize].1.stats())
    }

    fn blob(&self, ino: INodeNo) -> Option<Arc<LazyBlob>> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let i = ino.0.checked_sub(2)? as usize;
        t.blobs.get(i).map(|(_, b)| b.clone())
    }

    /// The inode of a registered blob, opening it on first use.
    fn open_blob(&self, name: &str) -> Result<(u64, Arc<LazyBlob>), Errno> {
        if !crate::digest::valid_digest(name) {
            return Err(Errno::ENOENT);
        }
        {
            let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(&i) = t.by_name.get(name) {
                return Ok((i, t.blobs[(i - 2) as usize].1.clone()));
            }
        }
        if !lazy::blob_dir(&self.store, name)
            .join("source.json")
            .exists()
        {
            return Err(Errno::ENOENT);
        }
        let src = lazy::source(&self.store, name).map_err(|e| {
            tracing::warn!(blob = name, error = %e, "a lazy blob's source is unreadable");
            Errno::EIO
        })?;
        let fetch = (self.fetcher)(&self.store, &src);
        let blob = LazyBlob::open(&self.store, name, fetch).map_err(|e| {
            tracing::warn!(blob = name, error = %e, "opening a lazy blob");
            Errno::EIO
        })?;
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&i) = t.by_name.get(name) {
            return Ok((i, t.blobs[(i - 2) as usize].1.clone()));
        }
        let blob = Arc::new(blob);
        t.blobs.push((name.to_string(), blob.clone()));
        let ino = t.blobs.len() as u64 + 1;
        t.by_name.insert(name.to_string(), ino);
        Ok((ino, blob))
    }

    fn attr(&self, ino: u64, size: u64, dir: bool) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            // The directory is root's alone, as the store's layers are (EROFS opens a
            // blob as root, at mount). A blob is readable by whoever is handed it: a
            // jailed VMM running as its own user, which sees only the files bound into
            // its jail (a VM's root disks).
            perm: if dir { 0o500 } else { 0o444 },
            nlink: if dir { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }
}

impl Filesystem for LazyFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str().filter(|_| parent == INodeNo::ROOT) else {
            return reply.error(Errno::ENOENT);
        };
        match self.open_blob(name) {
            Ok((ino, blob)) => {
                reply.entry(&TTL, &self.attr(ino, blob.size(), false), Generation(0))
            }
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT {
            return reply.attr(&TTL, &self.attr(1, 0, true));
        }
        match self.blob(ino) {
            Some(b) => reply.attr(&TTL, &self.attr(ino.0, b.size(), false)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.blob(ino).is_none() {
            return reply.error(Errno::ENOENT);
        }
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(blob) = self.blob(ino) else {
            return reply.error(Errno::ENOENT);
        };
        let fs = self.clone();
        self.rt.spawn(async move {
            match blob.read_at(offset, size as u64).await {
                Ok(bytes) => {
                    reply.data(&bytes);
                    fs.touched(ino.0, &blob, offset, bytes.len() as u64);
                    if let Some(after) = fs.prefetch
                        && blob.start_prefetch()
                    {
                        fs.spawn_prefetch(blob.clone(), after);
                    }
                }
                Err(e) => {
                    tracing::warn!(blob = %blob.source().digest, error = %e, "a lazy read failed");
                    reply.error(Errno::EIO)
                }
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut names: Vec<String> = std::fs::read_dir(self.store.join("lazy"))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|n| crate::digest::valid_digest(n))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        let mut entries: Vec<(u64, FileType, String)> = vec![
            (1, FileType::Directory, ".".into()),
            (1, FileType::Directory, "..".into()),
        ];
        for n in names {
            // Inode numbers of blobs not looked up yet: any that is not a served one
            // (the kernel looks a name up before it uses it).
            let ino = self
                .table
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .by_name
                .get(&n)
                .copied()
                .unwrap_or(u64::MAX);
            entries.push((ino, FileType::RegularFile, n));
        }
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}
