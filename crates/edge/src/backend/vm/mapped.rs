//! A `mapped-ram` save file (QEMU >= 9): a migration stream in which each RAM block's
//! pages sit at fixed offsets instead of in the stream, so a copy of the VM can map the
//! guest's memory straight from the file (`memory-backend-file,offset=…,share=off`) and
//! pages stay shared between copies until written.
//!
//! Layout (QEMU's `docs/devel/migration/mapped-ram.rst`): the RAM section's setup lists
//! each block as `u8 len, idstr, be64 used_length`, then a packed header `be32 version
//! (1), be64 page_size, be64 bitmap_offset, be64 pages_offset`; one bit per page at
//! `bitmap_offset` (`unsigned long` words, little-endian here) says whether the page was
//! written, and page `i` is at `pages_offset + i * page_size`, where `pages_offset` is the
//! end of the bitmap rounded up to 1 MiB. Device state follows as a normal stream.
//!
//! A live save writes a page each time it was dirty; a page that was written in an early
//! pass and zero at the end has its bit cleared but keeps its old bytes. [`seal`] punches
//! those pages (every clear bit) out of the file and then clears the guest memory's
//! bitmap, so a loading QEMU reads no page of it into memory: the mapping is the memory.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use dsec_common::IoContext;

use crate::backend::StateError;

/// Where the header of the guest's memory block is looked for (it follows the stream's
/// header and configuration section: about 100 bytes in practice).
const HEAD: usize = 64 << 10;
/// The `id` of the guest memory's backend on every VM's command line.
const MEM_ID: &[u8] = b"mem";
const PAGE: u64 = 4096;
const ALIGN: u64 = 1 << 20;

/// The guest memory block of a mapped-ram file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemBlock {
    pub bitmap_offset: u64,
    pub bitmap_len: u64,
    /// Where page 0 is: the `offset` a copy maps the file at.
    pub pages_offset: u64,
    pub pages: u64,
}

/// Finds the guest memory block (`mem`, `mem_bytes` long) in the first bytes of a
/// mapped-ram file, checking that its header is self-consistent.
pub fn find_mem(head: &[u8], mem_bytes: u64) -> Result<MemBlock, StateError> {
    if !head.starts_with(b"QEVM") {
        return Err(StateError::Invalid("not a QEMU migration stream".into()));
    }
    if mem_bytes == 0 || !mem_bytes.is_multiple_of(PAGE) {
        return Err(StateError::Invalid(format!(
            "{mem_bytes} bytes is not a guest memory size"
        )));
    }
    let mut needle = vec![MEM_ID.len() as u8];
    needle.extend_from_slice(MEM_ID);
    needle.extend_from_slice(&mem_bytes.to_be_bytes());
    let head = &head[..head.len().min(HEAD)];
    let mut from = 0;
    while let Some(at) = find(&head[from..], &needle) {
        let h = from + at + needle.len();
        from += at + 1;
        let Some(b) = head.get(h..h + 28) else {
            break;
        };
        let be32 = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let be64 = |o: usize| u64::from_be_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let (version, page_size) = (be32(0), be64(4));
        let (bitmap_offset, pages_offset) = (be64(12), be64(20));
        let pages = mem_bytes / PAGE;
        let bitmap_len = pages.div_ceil(64) * 8;
        let end = bitmap_offset
            .checked_add(bitmap_len)
            .and_then(|e| e.checked_next_multiple_of(ALIGN));
        if version == 1
            && page_size == PAGE
            && bitmap_offset >= (h + 28) as u64
            && end == Some(pages_offset)
        {
            return Ok(MemBlock {
                bitmap_offset,
                bitmap_len,
                pages_offset,
                pages,
            });
        }
    }
    Err(StateError::Invalid(format!(
        "no mapped-ram header for a {} MiB guest memory block",
        mem_bytes >> 20
    )))
}

/// Where the pages of a guest memory of `mem_bytes` will be in a save not yet written:
/// the header before the bitmap is about 130 bytes, so the end of the bitmap rounds up to
/// the same MiB as from 256 unless the bitmap ends within those bytes of a MiB (guests
/// near a multiple of 32 GiB). A save that comes out otherwise is found by [`read_mem`].
pub fn planned_pages_offset(mem_bytes: u64) -> u64 {
    (256 + (mem_bytes / PAGE).div_ceil(64) * 8).next_multiple_of(ALIGN)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads the guest memory block of the mapped-ram file `f`, checking that the file
/// holds all of its pages.
pub fn read_mem(f: &File, mem_bytes: u64) -> Result<MemBlock, StateError> {
    let mut head = vec![0u8; HEAD];
    let n = read_fully(f, &mut head, 0).ctx(|| "reading the saved VM".into())?;
    let b = find_mem(&head[..n], mem_bytes)?;
    let len = f.metadata().ctx(|| "the saved VM".into())?.len();
    if b.pages_offset + mem_bytes > len {
        return Err(StateError::Invalid(format!(
            "the saved VM is {len} bytes, short of its memory's pages ({} bytes from {})",
            mem_bytes, b.pages_offset
        )));
    }
    Ok(b)
}

/// [`read_mem`] of the file at `path`.
pub fn read_mem_of(path: &std::path::Path, mem_bytes: u64) -> Result<MemBlock, StateError> {
    let f = File::open(path).ctx(|| format!("opening {}", path.display()))?;
    read_mem(&f, mem_bytes)
}

fn read_fully(f: &File, buf: &mut [u8], at: u64) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], at + n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Makes a just-written live save of a VM with `mem_bytes` of memory ready to be mapped:
/// every page whose bit is clear is punched out of the file (it may hold bytes of an
/// earlier pass), then the memory's bitmap is cleared. Returns the block.
pub fn seal(f: &File, mem_bytes: u64) -> Result<MemBlock, StateError> {
    let b = read_mem(f, mem_bytes)?;
    let mut bitmap = vec![0u8; b.bitmap_len as usize];
    if read_fully(f, &mut bitmap, b.bitmap_offset).ctx(|| "the bitmap".into())? != bitmap.len() {
        return Err(StateError::Invalid(
            "the saved VM ends inside its page bitmap".into(),
        ));
    }
    for (first, n) in clear_runs(&bitmap, b.pages) {
        punch(f, b.pages_offset + first * PAGE, n * PAGE)
            .ctx(|| "giving back unused pages".into())?;
    }
    f.write_all_at(&vec![0u8; bitmap.len()], b.bitmap_offset)
        .ctx(|| "clearing the bitmap".into())?;
    Ok(b)
}

/// The runs `(first page, pages)` whose bits are clear among the first `pages` bits of
/// `bitmap` (64-bit little-endian words).
fn clear_runs(bitmap: &[u8], pages: u64) -> Vec<(u64, u64)> {
    let bit = |i: u64| {
        let word = (i / 64) as usize * 8;
        let w = u64::from_le_bytes(
            bitmap
                .get(word..word + 8)
                .and_then(|s| s.try_into().ok())
                .unwrap_or([0; 8]),
        );
        w >> (i % 64) & 1 == 1
    };
    let mut out = Vec::new();
    let mut run: Option<u64> = None;
    let mut i = 0;
    while i < pages {
        // A whole word at once where it is all clear or all set.
        let word = (i / 64) as usize * 8;
        if i % 64 == 0 && i + 64 <= pages {
            let w = &bitmap[word..word + 8];
            if w.iter().all(|&x| x == 0) {
                run.get_or_insert(i);
                i += 64;
                continue;
            }
            if w.iter().all(|&x| x == 0xff) {
                if let Some(r) = run.take() {
                    out.push((r, i - r));
                }
                i += 64;
                continue;
            }
        }
        match (bit(i), run) {
            (false, None) => run = Some(i),
            (true, Some(r)) => {
                out.push((r, i - r));
                run = None;
            }
            _ => {}
        }
        i += 1;
    }
    if let Some(r) = run {
        out.push((r, pages - r));
    }
    out
}

fn punch(f: &File, off: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: fallocate on an open descriptor with plain integer arguments.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The start of a mapped-ram file as QEMU writes it, for a guest of `mem` bytes.
    fn head(mem: u64) -> (Vec<u8>, MemBlock) {
        let mut h = b"QEVM\0\0\0\x03\x07\0\0\0\x07microvm".to_vec();
        h.extend_from_slice(&[1, 0, 0, 0, 2, 3, b'r', b'a', b'm', 0, 0, 0, 0]);
        h.extend_from_slice(&(mem | 4).to_be_bytes());
        h.extend_from_slice(&[3]);
        h.extend_from_slice(b"mem");
        h.extend_from_slice(&mem.to_be_bytes());
        let bitmap_offset = (h.len() + 28) as u64;
        let bitmap_len = (mem / 4096).div_ceil(64) * 8;
        let pages_offset = (bitmap_offset + bitmap_len).next_multiple_of(1 << 20);
        h.extend_from_slice(&1u32.to_be_bytes());
        h.extend_from_slice(&4096u64.to_be_bytes());
        h.extend_from_slice(&bitmap_offset.to_be_bytes());
        h.extend_from_slice(&pages_offset.to_be_bytes());
        let b = MemBlock {
            bitmap_offset,
            bitmap_len,
            pages_offset,
            pages: mem / 4096,
        };
        (h, b)
    }

    #[test]
    fn the_memory_block_is_found_and_checked() {
        let (h, want) = head(768 << 20);
        assert_eq!(find_mem(&h, 768 << 20).unwrap(), want);
        // Another size, a broken header, another stream: refused.
        assert!(find_mem(&h, 512 << 20).is_err());
        let mut bad = h.clone();
        let at = bad.len() - 1;
        bad[at] ^= 1;
        assert!(find_mem(&bad, 768 << 20).is_err());
        assert!(find_mem(&h[4..], 768 << 20).is_err());
        assert!(find_mem(&h[..h.len() - 3], 768 << 20).is_err());
        assert!(find_mem(&h, 0).is_err());
        for mem in [128u64 << 20, 768 << 20, 4 << 30] {
            assert_eq!(planned_pages_offset(mem), head(mem).1.pages_offset);
        }
    }

    #[test]
    fn clear_runs_cover_every_clear_bit_and_no_set_one() {
        let pages = 200u64;
        let mut bm = vec![0u8; pages.div_ceil(64) as usize * 8];
        let set: Vec<u64> = (0..pages)
            .filter(|i| i % 7 == 3 || (64..128).contains(i))
            .collect();
        for &i in &set {
            bm[(i / 8) as usize] |= 1 << (i % 8);
        }
        let runs = clear_runs(&bm, pages);
        let mut clear = vec![false; pages as usize];
        for (f, n) in runs {
            for i in f..f + n {
                assert!(!clear[i as usize], "page {i} twice");
                clear[i as usize] = true;
            }
        }
        for i in 0..pages {
            assert_eq!(clear[i as usize], !set.contains(&i), "page {i}");
        }
        assert_eq!(clear_runs(&[0xff; 8], 64), vec![]);
        assert_eq!(clear_runs(&[0; 16], 100), vec![(0, 100)]);
    }

    #[test]
    fn sealing_punches_stale_pages_and_clears_the_bitmap() {
        use std::io::Write;
        let mem = 4u64 << 20;
        let (h, b) = head(mem);
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&h).unwrap();
        // Pages 0..1024 all hold bytes; only the even ones are current.
        f.set_len(b.pages_offset + mem + 100).unwrap();
        f.write_all_at(&vec![0xaa; mem as usize], b.pages_offset)
            .unwrap();
        let mut bm = vec![0u8; b.bitmap_len as usize];
        for i in (0..b.pages).step_by(2) {
            bm[(i / 8) as usize] |= 1 << (i % 8);
        }
        f.write_all_at(&bm, b.bitmap_offset).unwrap();
        assert_eq!(seal(&f, mem).unwrap(), b);
        let mut page = vec![0u8; 4096];
        for i in [0u64, 1, 2, 3, 1022, 1023] {
            f.read_exact_at(&mut page, b.pages_offset + i * 4096)
                .unwrap();
            let want = if i % 2 == 0 { 0xaa } else { 0 };
            assert!(page.iter().all(|&x| x == want), "page {i}");
        }
        let mut left = vec![1u8; b.bitmap_len as usize];
        f.read_exact_at(&mut left, b.bitmap_offset).unwrap();
        assert!(left.iter().all(|&x| x == 0));
        // A file cut short of its pages is refused, not mapped.
        f.set_len(b.pages_offset + mem / 2).unwrap();
        assert!(seal(&f, mem).is_err());
    }

    /// Fuzz target (`cargo bolero test backend::vm::mapped::tests::fuzz_mapped_head`);
    /// under `cargo test` a bounded property test: the start of a saved VM sent by another
    /// edge reads as a memory block or an error, never a panic, and a block found always
    /// fits the rules a mapping relies on.
    #[test]
    fn fuzz_mapped_head() {
        bolero::check!()
            .with_iterations(2000)
            .for_each(|input: &[u8]| {
                let mut h = b"QEVM".to_vec();
                h.extend_from_slice(input);
                for mem in [4096u64, 1 << 20, 768 << 20] {
                    if let Ok(b) = find_mem(&h, mem) {
                        assert_eq!(b.pages_offset % (1 << 20), 0);
                        assert!(b.bitmap_offset + b.bitmap_len <= b.pages_offset);
                    }
                }
                let _ = clear_runs(input, (input.len() * 8) as u64);
            });
    }
}
