//! The one ELF header reader of the project: whether a 64-bit little-endian executable
//! needs a program interpreter (a dynamic loader). The agent and the guest's busybox must
//! not: they run where no loader is.

/// What is wrong with a file read as an executable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    #[error("not an ELF executable")]
    NotElf,
    #[error("not a 64-bit little-endian ELF executable")]
    NotElf64,
    #[error("truncated ELF program headers")]
    Truncated,
}

/// Whether the ELF image `bytes` has a `PT_INTERP` program header.
pub fn has_interpreter(bytes: &[u8]) -> Result<bool, ElfError> {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err(ElfError::NotElf);
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err(ElfError::NotElf64);
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let mut phoff = [0u8; 8];
    phoff.copy_from_slice(&bytes[0x20..0x28]);
    let phoff = u64::from_le_bytes(phoff);
    let (phentsize, phnum) = (u16_at(0x36) as u64, u16_at(0x38) as u64);
    for i in 0..phnum {
        let o = i
            .checked_mul(phentsize)
            .and_then(|x| x.checked_add(phoff))
            .and_then(|o| usize::try_from(o).ok())
            .filter(|o| o.checked_add(4).is_some_and(|end| end <= bytes.len()))
            .ok_or(ElfError::Truncated)?;
        let p_type = u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        if p_type == 3 {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf(phoff: u64, headers: &[u32]) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&(headers.len() as u16).to_le_bytes());
        for t in headers {
            let mut h = vec![0u8; 56];
            h[..4].copy_from_slice(&t.to_le_bytes());
            b.extend(h);
        }
        b
    }

    #[test]
    fn finds_the_interpreter_and_refuses_what_is_not_elf64() {
        assert_eq!(has_interpreter(&elf(64, &[1, 1])), Ok(false));
        assert_eq!(has_interpreter(&elf(64, &[6, 3, 1])), Ok(true));
        assert_eq!(has_interpreter(b"#!/bin/sh\n"), Err(ElfError::NotElf));
        let mut e32 = elf(64, &[]);
        e32[4] = 1;
        assert_eq!(has_interpreter(&e32), Err(ElfError::NotElf64));
        assert_eq!(
            has_interpreter(&elf(u64::MAX - 8, &[1])),
            Err(ElfError::Truncated)
        );
    }

    /// Fuzz target: any bytes are judged without a panic (offsets near `u64::MAX` too).
    #[test]
    fn fuzz_headers() {
        bolero::check!()
            .with_iterations(crate::FUZZ_CASES)
            .for_each(|input: &[u8]| {
                let _ = has_interpreter(input);
            });
    }
}
