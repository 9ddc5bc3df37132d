//! The uncompressed ELF `vmlinux` inside an x86 `bzImage`, for Firecracker (whose released
//! versions load only ELF kernels). The bzImage's setup header says where the compressed
//! payload is; its first bytes say how it is compressed. LZ4 (what Debian's cloud kernel
//! uses) is decoded here; gzip, xz, zstd, bzip2 and lzma go through the usual tools.

use std::io::Write;
use std::process::{Command, Stdio};

/// Offsets in the bzImage setup header (Documentation/arch/x86/boot.rst).
const SETUP_SECTS: usize = 0x1f1;
const HEADER_MAGIC: usize = 0x202;
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;

/// The LZ4 "legacy" frame the kernel build writes (`lz4 -l`).
const LZ4_LEGACY_MAGIC: [u8; 4] = [0x02, 0x21, 0x4c, 0x18];
/// Largest uncompressed block of a legacy frame.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;

/// Why a vmlinux could not be taken out of a bzImage.
#[derive(Debug, thiserror::Error)]
pub enum VmlinuxError {
    /// The image is not what its headers say: how.
    #[error("{0}")]
    Malformed(&'static str),
    #[error("the bzImage payload has an unknown compression (starts {0:02x?})")]
    UnknownCompression(Vec<u8>),
    #[error("running {tool} ({source}); install it with `apt-get install {package}`")]
    NoTool {
        tool: &'static str,
        package: &'static str,
        source: std::io::Error,
    },
    #[error("waiting for {tool}: {source}")]
    Wait {
        tool: &'static str,
        source: std::io::Error,
    },
    #[error("{tool} could not decompress the kernel: {said}")]
    Decompress { tool: &'static str, said: String },
}

fn u32_at(b: &[u8], o: usize) -> Result<u32, VmlinuxError> {
    b.get(o..o + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(VmlinuxError::Malformed("the bzImage is truncated"))
}

/// The compressed payload of a bzImage (the kernel build appends the uncompressed size
/// as 4 bytes; they are left off).
pub fn payload(bz: &[u8]) -> Result<&[u8], VmlinuxError> {
    if bz.get(HEADER_MAGIC..HEADER_MAGIC + 4) != Some(b"HdrS") {
        return Err(VmlinuxError::Malformed(
            "not an x86 bzImage (no HdrS setup header)",
        ));
    }
    let sects = match bz[SETUP_SECTS] {
        0 => 4,
        n => n as usize,
    };
    let start = (sects + 1) * 512 + u32_at(bz, PAYLOAD_OFFSET)? as usize;
    let len = u32_at(bz, PAYLOAD_LENGTH)? as usize;
    let p = bz
        .get(start..start.saturating_add(len))
        .ok_or(VmlinuxError::Malformed(
            "the bzImage payload lies outside the file (truncated?)",
        ))?;
    if p.len() < 8 {
        return Err(VmlinuxError::Malformed("the bzImage payload is empty"));
    }
    Ok(&p[..p.len() - 4])
}

/// Decodes one LZ4 block into `out`.
fn lz4_block(mut src: &[u8], out: &mut Vec<u8>, limit: usize) -> Result<(), VmlinuxError> {
    let bad = || VmlinuxError::Malformed("corrupt LZ4 block");
    let start = out.len();
    let read_len = |src: &mut &[u8], mut n: usize| -> Result<usize, VmlinuxError> {
        if n == 15 {
            loop {
                let (&b, rest) = src.split_first().ok_or_else(bad)?;
                *src = rest;
                n += b as usize;
                if b != 255 {
                    break;
                }
            }
        }
        Ok(n)
    };
    while let Some((&token, rest)) = src.split_first() {
        src = rest;
        let lit = read_len(&mut src, (token >> 4) as usize)?;
        let (l, rest) = (src.get(..lit).ok_or_else(bad)?, &src[lit..]);
        out.extend_from_slice(l);
        src = rest;
        if src.is_empty() {
            break; // the last sequence has literals only
        }
        let off = u16::from_le_bytes([src[0], *src.get(1).ok_or_else(bad)?]) as usize;
        src = &src[2..];
        let mlen = read_len(&mut src, (token & 15) as usize)? + 4;
        if off == 0 || off > out.len() - start || out.len() - start + mlen > limit {
            return Err(bad());
        }
        let from = out.len() - off;
        // Overlapping copies repeat the last `off` bytes: copy byte by byte.
        for i in 0..mlen {
            let b = out[from + i];
            out.push(b);
        }
    }
    if out.len() - start > limit {
        return Err(bad());
    }
    Ok(())
}

/// Decodes an LZ4 legacy frame: the magic, then blocks of `[compressed len u32 LE][data]`.
pub fn lz4_legacy(src: &[u8]) -> Result<Vec<u8>, VmlinuxError> {
    let mut rest = src
        .strip_prefix(&LZ4_LEGACY_MAGIC[..])
        .ok_or(VmlinuxError::Malformed("not an LZ4 legacy frame"))?;
    let mut out = Vec::with_capacity(src.len() * 3);
    while rest.len() >= 4 {
        let n = u32_at(rest, 0)? as usize;
        // A legacy frame has no end mark; another frame's magic would also end it.
        if n == u32::from_le_bytes(LZ4_LEGACY_MAGIC) as usize {
            break;
        }
        let block = rest.get(4..4 + n).ok_or(VmlinuxError::Malformed(
            "truncated LZ4 block in the kernel payload",
        ))?;
        lz4_block(block, &mut out, LZ4_LEGACY_BLOCK)?;
        rest = &rest[4 + n..];
    }
    Ok(out)
}

/// Runs `tool -dc` over `data`; what it writes is the result.
fn through(
    tool: &'static str,
    package: &'static str,
    data: &[u8],
) -> Result<Vec<u8>, VmlinuxError> {
    let mut child = Command::new(tool)
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| VmlinuxError::NoTool {
            tool,
            package,
            source,
        })?;
    let mut stdin = child
        .stdin
        .take()
        .ok_or(VmlinuxError::Malformed("no stdin for the decompressor"))?;
    let data = data.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&data));
    let out = child
        .wait_with_output()
        .map_err(|source| VmlinuxError::Wait { tool, source })?;
    let _ = feeder.join();
    // Trailing bytes after the stream make some tools exit non-zero with the data intact;
    // the ELF check below is what decides.
    if out.stdout.is_empty() {
        return Err(VmlinuxError::Decompress {
            tool,
            said: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out.stdout)
}

/// The ELF vmlinux of a bzImage.
pub fn extract(bz: &[u8]) -> Result<Vec<u8>, VmlinuxError> {
    let p = payload(bz)?;
    let elf = if p.starts_with(&LZ4_LEGACY_MAGIC) {
        lz4_legacy(p)?
    } else if p.starts_with(&[0x1f, 0x8b]) {
        through("gzip", "gzip", p)?
    } else if p.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        through("xz", "xz-utils", p)?
    } else if p.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        through("zstd", "zstd", p)?
    } else if p.starts_with(b"BZh") {
        through("bzip2", "bzip2", p)?
    } else if p.starts_with(&[0x5d, 0, 0]) {
        through("lzma", "xz-utils", p)?
    } else {
        return Err(VmlinuxError::UnknownCompression(p[..4].to_vec()));
    };
    if !elf.starts_with(b"\x7fELF") {
        return Err(VmlinuxError::Malformed(
            "the decompressed kernel is not an ELF file",
        ));
    }
    Ok(elf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bzImage-shaped buffer around `payload` (plus the 4 size bytes the build adds).
    fn bzimage(payload: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; 5 * 512];
        b[SETUP_SECTS] = 4;
        b[HEADER_MAGIC..HEADER_MAGIC + 4].copy_from_slice(b"HdrS");
        b[PAYLOAD_OFFSET..PAYLOAD_OFFSET + 4].copy_from_slice(&16u32.to_le_bytes());
        b[PAYLOAD_LENGTH..PAYLOAD_LENGTH + 4]
            .copy_from_slice(&(payload.len() as u32 + 4).to_le_bytes());
        b.extend_from_slice(&[0xaa; 16]);
        b.extend_from_slice(payload);
        b.extend_from_slice(&1234u32.to_le_bytes());
        b
    }

    /// `\x7fELF` + "abcabcabcabc" + "!" as one legacy frame: literals, a back-reference
    /// that overlaps itself, and a literal-only last sequence.
    fn lz4_frame() -> Vec<u8> {
        let mut block = vec![0x70]; // 7 literals, match length 0+4
        block.extend_from_slice(b"\x7fELFabc");
        block.extend_from_slice(&3u16.to_le_bytes()); // offset 3
        block.push(0x10); // 1 literal, no match (last sequence)
        block.push(b'!');
        // The matched part must be 4 + 0 = 4 bytes: "abca"; write the expectation below.
        let mut f = LZ4_LEGACY_MAGIC.to_vec();
        f.extend_from_slice(&(block.len() as u32).to_le_bytes());
        f.extend_from_slice(&block);
        f
    }

    #[test]
    fn lz4_legacy_frames_decode() {
        assert_eq!(lz4_legacy(&lz4_frame()).unwrap(), b"\x7fELFabcabca!");
        let mut bad = lz4_frame();
        let n = bad.len();
        bad[n - 4] = 0x0f; // a back-reference before the start
        assert!(lz4_legacy(&bad).is_err());
        assert!(lz4_legacy(b"nope").is_err());
    }

    #[test]
    fn the_payload_is_found_through_the_setup_header() {
        let frame = lz4_frame();
        let bz = bzimage(&frame);
        assert_eq!(payload(&bz).unwrap(), &frame[..]);
        assert_eq!(extract(&bz).unwrap(), b"\x7fELFabcabca!");
        assert!(payload(&bz[..600]).is_err());
        assert!(payload(b"MZ not a kernel").is_err());
    }

    #[test]
    fn gzip_payloads_go_through_gzip() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"\x7fELF rest of the kernel").unwrap();
        let bz = bzimage(&gz.finish().unwrap());
        assert_eq!(extract(&bz).unwrap(), b"\x7fELF rest of the kernel");
    }

    /// Against a real Debian kernel when one is named (`DSEC_TEST_BZIMAGE=path`).
    #[test]
    fn a_real_bzimage_gives_an_elf_kernel() {
        let Ok(p) = std::env::var("DSEC_TEST_BZIMAGE") else {
            return;
        };
        let bz = std::fs::read(&p).unwrap();
        let elf = extract(&bz).unwrap();
        eprintln!(
            "{p}: {} bytes of bzImage -> {} bytes of ELF",
            bz.len(),
            elf.len()
        );
        assert!(elf.len() > bz.len());
    }
}
