//! An EROFS image of a directory tree: what a store layer becomes so that it can be
//! mounted read-only straight from one file (the kernel's file-backed EROFS) and, when
//! that file is remote, read by range on first access (lazy start).
//!
//! Written here rather than by `mkfs.erofs`: Debian 12's erofs-utils (1.5) cannot read a
//! tar, interleaves metadata with data (a lazy reader then fetches most of the image to
//! list a directory) and fails on large trees in chunk mode. The format written is the
//! kernel's plain one, uncompressed, 4 KiB blocks:
//!
//! ```text
//! block 0 ..   superblock at byte 1024; inodes from byte 1152 (nid 36), breadth-first:
//!              each a 64-byte extended inode, its extended attributes, then the tail
//!              of its data (the last partial block) inline; none straddles a block
//! data blocks  the whole blocks of every file and directory, in the same order
//! ```
//!
//! All metadata (every directory and inode, and every file smaller than a block) sits
//! at the front, so a reader that fetches the first megabytes can list and stat the
//! whole tree. The same tree always gives the same bytes (no build time, UUID or
//! random in it), so a layer converted on two nodes has one digest.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::{ImageError, IoContext};

pub const BLOCK: u64 = 4096;
const BLOCK_BITS: u8 = 12;
const MAGIC: u32 = 0xE0F5_E1E2;
const SUPER_OFFSET: usize = 1024;
/// The first byte after the superblock: where inodes start (nid 36).
const FIRST_INODE: u64 = 1024 + 128;
const INODE_SIZE: u64 = 64;
const DIRENT_SIZE: usize = 12;
const XATTR_HEADER: usize = 12;

const LAYOUT_FLAT_PLAIN: u16 = 0;
const LAYOUT_FLAT_INLINE: u16 = 2;

const FT_REG: u8 = 1;
const FT_DIR: u8 = 2;
const FT_CHR: u8 = 3;
const FT_BLK: u8 = 4;
const FT_FIFO: u8 = 5;
const FT_SOCK: u8 = 6;
const FT_LNK: u8 = 7;

/// What one build wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErofsStats {
    pub inodes: u64,
    /// Size of the image.
    pub bytes: u64,
    /// Bytes of metadata at its front (superblock, inodes, inline data): what a lazy
    /// reader fetches to list the tree.
    pub meta_bytes: u64,
}

fn bad(m: impl Into<String>) -> ImageError {
    ImageError::BadTree(m.into())
}

enum Kind {
    /// Children by name (sorted), each a node index.
    Dir(Vec<(Vec<u8>, usize)>),
    File(PathBuf),
    Symlink(Vec<u8>),
    /// Devices (an overlay whiteout is char 0/0), FIFOs and sockets: the encoded rdev.
    Special(u32),
}

struct Node {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    mtime_nsec: u32,
    nlink: u32,
    size: u64,
    parent: usize,
    xattrs: Vec<u8>,
    kind: Kind,
    // Layout, filled in by `place`.
    pos: u64,
    inline: bool,
    blkaddr: u32,
}

impl Node {
    fn file_type(&self) -> u8 {
        match self.mode & libc::S_IFMT {
            libc::S_IFREG => FT_REG,
            libc::S_IFDIR => FT_DIR,
            libc::S_IFCHR => FT_CHR,
            libc::S_IFBLK => FT_BLK,
            libc::S_IFIFO => FT_FIFO,
            libc::S_IFSOCK => FT_SOCK,
            libc::S_IFLNK => FT_LNK,
            _ => 0,
        }
    }

    fn tail(&self) -> u64 {
        if self.inline { self.size % BLOCK } else { 0 }
    }

    /// Blocks in the data area.
    fn blocks(&self) -> u64 {
        if self.inline {
            self.size / BLOCK
        } else {
            self.size.div_ceil(BLOCK)
        }
    }

    fn nid(&self) -> u64 {
        self.pos / 32
    }
}

/// The kernel's `new_encode_dev`.
fn encode_dev(rdev: u64) -> u32 {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

/// The inode's extended attributes in EROFS's inline form (a 12-byte header, then
/// entries of 4-byte alignment), or nothing. Names EROFS has no prefix index for
/// are left out (a layer keeps none: see [`dsec_common::tree::xattr_rule`]).
fn encode_xattrs(p: &Path, map: &BTreeMap<String, Vec<u8>>) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::new();
    for (name, value) in map {
        let (index, suffix): (u8, &str) = if let Some(s) = name.strip_prefix("user.") {
            (1, s)
        } else if name == "system.posix_acl_access" {
            (2, "")
        } else if name == "system.posix_acl_default" {
            (3, "")
        } else if let Some(s) = name.strip_prefix("trusted.") {
            (4, s)
        } else if let Some(s) = name.strip_prefix("security.") {
            (6, s)
        } else {
            tracing::debug!(path = %p.display(), name, "attribute left out of the EROFS image");
            continue;
        };
        if out.is_empty() {
            out.resize(XATTR_HEADER, 0);
        }
        let (Ok(name_len), Ok(value_len)) =
            (u8::try_from(suffix.len()), u16::try_from(value.len()))
        else {
            return Err(bad(format!(
                "attribute {name} of {} is too long for EROFS",
                p.display()
            )));
        };
        out.push(name_len);
        out.push(index);
        out.extend_from_slice(&value_len.to_le_bytes());
        out.extend_from_slice(suffix.as_bytes());
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
    }
    Ok(out)
}

/// Reads the tree under `src` breadth-first into nodes (index 0 the root); hard links
/// become one node.
fn scan(src: &Path) -> Result<Vec<Node>, ImageError> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut links: HashMap<(u64, u64), usize> = HashMap::new();
    let mut queue: VecDeque<(usize, PathBuf)> = VecDeque::new();
    let root_meta = std::fs::symlink_metadata(src).ctx(|| format!("reading {}", src.display()))?;
    if !root_meta.is_dir() {
        return Err(bad(format!("{} is not a directory", src.display())));
    }
    nodes.push(node_of(src, &root_meta, 0)?);
    queue.push_back((0, src.to_path_buf()));
    while let Some((dir, path)) = queue.pop_front() {
        let mut names: Vec<(Vec<u8>, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(&path).ctx(|| format!("listing {}", path.display()))? {
            let e = e.ctx(|| format!("listing {}", path.display()))?;
            names.push((e.file_name().as_bytes().to_vec(), e.path()));
        }
        names.sort();
        let mut children = Vec::with_capacity(names.len());
        let mut subdirs = 0u32;
        for (name, p) in names {
            let m = std::fs::symlink_metadata(&p).ctx(|| format!("reading {}", p.display()))?;
            if !m.is_dir()
                && m.nlink() > 1
                && let Some(&i) = links.get(&(m.dev(), m.ino()))
            {
                nodes[i].nlink += 1;
                children.push((name, i));
                continue;
            }
            let i = nodes.len();
            nodes.push(node_of(&p, &m, dir)?);
            if m.is_dir() {
                subdirs += 1;
                queue.push_back((i, p));
            } else if m.nlink() > 1 {
                links.insert((m.dev(), m.ino()), i);
            }
            children.push((name, i));
        }
        nodes[dir].nlink = 2 + subdirs;
        nodes[dir].kind = Kind::Dir(children);
    }
    Ok(nodes)
}

fn node_of(p: &Path, m: &std::fs::Metadata, parent: usize) -> Result<Node, ImageError> {
    let ft = m.file_type();
    let (kind, size) = if ft.is_dir() {
        (Kind::Dir(Vec::new()), 0)
    } else if ft.is_file() {
        (Kind::File(p.to_path_buf()), m.len())
    } else if ft.is_symlink() {
        let t = std::fs::read_link(p).ctx(|| format!("reading link {}", p.display()))?;
        let t = t.as_os_str().as_bytes().to_vec();
        let n = t.len() as u64;
        (Kind::Symlink(t), n)
    } else {
        (Kind::Special(encode_dev(m.rdev())), 0)
    };
    let map = dsec_common::tree::read_xattrs(p).map_err(|e| bad(e.to_string()))?;
    Ok(Node {
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        mtime: m.mtime(),
        mtime_nsec: m.mtime_nsec().clamp(0, 999_999_999) as u32,
        nlink: 1,
        size,
        parent,
        xattrs: encode_xattrs(p, &map)?,
        kind,
        pos: 0,
        inline: false,
        blkaddr: 0,
    })
}

/// A directory's entries ("." and ".." among them) grouped into blocks: the indices
/// into `entries` each block holds. Entries are sorted by name across all blocks, as
/// the kernel's lookup (a binary search over blocks, then within one) needs.
fn dir_blocks(entries: &[(Vec<u8>, usize)]) -> Vec<std::ops::Range<usize>> {
    let mut blocks = Vec::new();
    let (mut start, mut used) = (0usize, 0usize);
    for (i, (name, _)) in entries.iter().enumerate() {
        let need = DIRENT_SIZE + name.len();
        if used + need > BLOCK as usize {
            blocks.push(start..i);
            start = i;
            used = 0;
        }
        used += need;
    }
    blocks.push(start..entries.len());
    blocks
}

fn dir_entries(nodes: &[Node], i: usize) -> Vec<(Vec<u8>, usize)> {
    let Kind::Dir(children) = &nodes[i].kind else {
        return Vec::new();
    };
    let mut all = Vec::with_capacity(children.len() + 2);
    all.push((b".".to_vec(), i));
    all.push((b"..".to_vec(), nodes[i].parent));
    all.extend(children.iter().cloned());
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// The bytes of a directory: every block but the last padded with zeros to a whole
/// one, the last as long as its entries and names.
fn dir_bytes(nodes: &[Node], entries: &[(Vec<u8>, usize)]) -> Vec<u8> {
    let mut out = Vec::new();
    let blocks = dir_blocks(entries);
    let last = blocks.len() - 1;
    for (k, range) in blocks.into_iter().enumerate() {
        let base = out.len();
        let block = &entries[range];
        let mut nameoff = DIRENT_SIZE * block.len();
        for (name, i) in block {
            out.extend_from_slice(&nodes[*i].nid().to_le_bytes());
            out.extend_from_slice(&(nameoff as u16).to_le_bytes());
            out.push(nodes[*i].file_type());
            out.push(0);
            nameoff += name.len();
        }
        for (name, _) in block {
            out.extend_from_slice(name);
        }
        if k < last {
            out.resize(base + BLOCK as usize, 0);
        }
    }
    out
}

/// The size a directory's bytes will have (known before any nid is).
fn dir_size(entries: &[(Vec<u8>, usize)]) -> u64 {
    let blocks = dir_blocks(entries);
    let last = blocks.last().map_or(0, |r| {
        entries[r.clone()]
            .iter()
            .map(|e| DIRENT_SIZE + e.0.len())
            .sum::<usize>()
    });
    (blocks.len() as u64 - 1) * BLOCK + last as u64
}

/// Gives every node its place: inodes packed from byte 1152 on, none straddling a
/// block; then data blocks. Returns (metadata end, total blocks).
fn place(nodes: &mut [Node]) -> Result<(u64, u64), ImageError> {
    for i in 0..nodes.len() {
        if matches!(nodes[i].kind, Kind::Dir(_)) {
            let entries = dir_entries(nodes, i);
            nodes[i].size = dir_size(&entries);
        }
    }
    let mut pos = FIRST_INODE;
    for n in nodes.iter_mut() {
        let base = INODE_SIZE + n.xattrs.len() as u64;
        if base > BLOCK {
            return Err(bad("an inode's extended attributes take more than a block"));
        }
        let tail = n.size % BLOCK;
        n.inline = tail > 0 && base + tail <= BLOCK;
        let need = base + n.tail();
        pos = pos.next_multiple_of(32);
        if pos % BLOCK + need > BLOCK {
            pos = pos.next_multiple_of(BLOCK);
        }
        n.pos = pos;
        pos += need;
    }
    let meta_end = pos;
    let mut next = meta_end.div_ceil(BLOCK);
    for n in nodes.iter_mut() {
        let blocks = n.blocks();
        n.blkaddr = if blocks == 0 {
            0
        } else {
            u32::try_from(next).map_err(|_| bad("the tree is too large for one EROFS image"))?
        };
        next += blocks;
    }
    if nodes[0].nid() > u16::MAX as u64 {
        return Err(bad("the root inode is out of reach"));
    }
    u32::try_from(next).map_err(|_| bad("the tree is too large for one EROFS image"))?;
    Ok((meta_end, next))
}

fn put_inode(meta: &mut [u8], n: &Node, ino: u32) {
    let layout = if n.inline {
        LAYOUT_FLAT_INLINE
    } else {
        LAYOUT_FLAT_PLAIN
    };
    let icount: u16 = if n.xattrs.is_empty() {
        0
    } else {
        ((n.xattrs.len() - XATTR_HEADER) / 4 + 1) as u16
    };
    let i_u = match n.kind {
        Kind::Special(rdev) => rdev,
        _ => n.blkaddr,
    };
    let mut b = [0u8; INODE_SIZE as usize];
    b[0..2].copy_from_slice(&(1 | (layout << 1)).to_le_bytes());
    b[2..4].copy_from_slice(&icount.to_le_bytes());
    b[4..6].copy_from_slice(&(n.mode as u16).to_le_bytes());
    b[8..16].copy_from_slice(&n.size.to_le_bytes());
    b[16..20].copy_from_slice(&i_u.to_le_bytes());
    b[20..24].copy_from_slice(&ino.to_le_bytes());
    b[24..28].copy_from_slice(&n.uid.to_le_bytes());
    b[28..32].copy_from_slice(&n.gid.to_le_bytes());
    b[32..40].copy_from_slice(&(n.mtime as u64).to_le_bytes());
    b[40..44].copy_from_slice(&n.mtime_nsec.to_le_bytes());
    b[44..48].copy_from_slice(&n.nlink.to_le_bytes());
    let at = n.pos as usize;
    meta[at..at + b.len()].copy_from_slice(&b);
    let x = at + b.len();
    meta[x..x + n.xattrs.len()].copy_from_slice(&n.xattrs);
}

fn put_super(meta: &mut [u8], root_nid: u16, inos: u64, blocks: u32) {
    let s = &mut meta[SUPER_OFFSET..SUPER_OFFSET + 128];
    s[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    s[12] = BLOCK_BITS;
    s[14..16].copy_from_slice(&root_nid.to_le_bytes());
    s[16..24].copy_from_slice(&inos.to_le_bytes());
    s[36..40].copy_from_slice(&blocks.to_le_bytes());
}

/// Writes a node's data: whole blocks at its block address, the tail into the
/// metadata after its inode and attributes.
fn put_data(out: &File, meta: &mut [u8], n: &Node, data: &[u8]) -> Result<(), ImageError> {
    let whole = (n.blocks() * BLOCK).min(data.len() as u64) as usize;
    if whole > 0 {
        out.write_all_at(&data[..whole], n.blkaddr as u64 * BLOCK)
            .ctx(|| "writing the EROFS image".into())?;
    }
    let tail = &data[whole..];
    if n.inline {
        let at = (n.pos + INODE_SIZE) as usize + n.xattrs.len();
        meta[at..at + tail.len()].copy_from_slice(tail);
    }
    Ok(())
}

fn copy_file(out: &mut File, meta: &mut [u8], n: &Node, src: &Path) -> Result<(), ImageError> {
    let mut f = File::open(src).ctx(|| format!("opening {}", src.display()))?;
    let whole = if n.inline { n.blocks() * BLOCK } else { n.size };
    if whole > 0 {
        out.seek(SeekFrom::Start(n.blkaddr as u64 * BLOCK))
            .ctx(|| "seeking in the EROFS image".into())?;
        let copied = std::io::copy(&mut (&mut f).take(whole), out)
            .ctx(|| format!("copying {}", src.display()))?;
        if copied != whole {
            return Err(bad(format!("{} changed while it was read", src.display())));
        }
    }
    if n.inline {
        let at = (n.pos + INODE_SIZE) as usize + n.xattrs.len();
        let tail = n.tail() as usize;
        f.read_exact(&mut meta[at..at + tail])
            .ctx(|| format!("reading {}", src.display()))?;
    }
    Ok(())
}

/// Writes an EROFS image of the tree under `src` to `out` (created or truncated).
pub fn build(src: &Path, out: &Path) -> Result<ErofsStats, ImageError> {
    let mut nodes = scan(src)?;
    let (meta_end, blocks) = place(&mut nodes)?;
    let meta_len = (meta_end.div_ceil(BLOCK) * BLOCK) as usize;
    let mut meta = vec![0u8; meta_len];
    let mut f = File::create(out).ctx(|| format!("creating {}", out.display()))?;
    f.set_len(blocks * BLOCK)
        .ctx(|| format!("sizing {}", out.display()))?;
    for i in 0..nodes.len() {
        put_inode(&mut meta, &nodes[i], i as u32 + 1);
        match &nodes[i].kind {
            Kind::Dir(_) => {
                let entries = dir_entries(&nodes, i);
                let data = dir_bytes(&nodes, &entries);
                debug_assert_eq!(data.len() as u64, nodes[i].size);
                put_data(&f, &mut meta, &nodes[i], &data)?;
            }
            Kind::Symlink(t) => put_data(&f, &mut meta, &nodes[i], t)?,
            Kind::File(p) => copy_file(&mut f, &mut meta, &nodes[i], p)?,
            Kind::Special(_) => {}
        }
    }
    put_super(
        &mut meta,
        nodes[0].nid() as u16,
        nodes.len() as u64,
        blocks as u32,
    );
    f.write_all_at(&meta, 0)
        .ctx(|| format!("writing {}", out.display()))?;
    f.sync_all().ctx(|| format!("syncing {}", out.display()))?;
    Ok(ErofsStats {
        inodes: nodes.len() as u64,
        bytes: blocks * BLOCK,
        meta_bytes: meta_end,
    })
}

/// Mounts an EROFS image read-only on `target` straight from its file (the kernel's
/// file-backed EROFS, no loop device; `/bin/mount` would make one).
pub fn mount(image: &Path, target: &Path) -> Result<(), ImageError> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| bad(format!("{} has a NUL byte", p.display())))
    };
    let (src, dst) = (c(image)?, c(target)?);
    // SAFETY: NUL-terminated strings that outlive the call; no data argument.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            c"erofs".as_ptr(),
            libc::MS_RDONLY | libc::MS_NODEV,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(ImageError::Io {
            context: format!(
                "mounting the EROFS image {} on {}",
                image.display(),
                target.display()
            ),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
