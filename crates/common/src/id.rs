//! Sandbox ids: `<edge>-<random>`. The edge part lets any apiserver route a request
//! for a sandbox to its edge without a per-sandbox table.

use std::fmt;

/// 32 symbols, lower case, no look-alikes (no i, l, o, u).
const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
const RANDOM_LEN: usize = 12;

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SandboxId {
    edge: String,
    random: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "'{0}' is not a sandbox id: expected <edge>-<12 characters of [0-9a-z]>, as returned by create"
)]
pub struct BadId(pub String);

impl SandboxId {
    /// A new random id on `edge`. `edge` must be a valid edge name (see [`valid_edge_name`]).
    pub fn generate(edge: &str) -> SandboxId {
        let mut bytes = [0u8; RANDOM_LEN];
        fill_random(&mut bytes);
        let random = bytes
            .iter()
            .map(|b| ALPHABET[(*b as usize) % 32] as char)
            .collect();
        SandboxId {
            edge: edge.to_string(),
            random,
        }
    }

    pub fn parse(s: &str) -> Result<SandboxId, BadId> {
        let (edge, random) = s.rsplit_once('-').ok_or_else(|| BadId(s.to_string()))?;
        if !valid_edge_name(edge)
            || random.len() != RANDOM_LEN
            || !random.bytes().all(|b| ALPHABET.contains(&b))
        {
            return Err(BadId(s.to_string()));
        }
        Ok(SandboxId {
            edge: edge.to_string(),
            random: random.to_string(),
        })
    }

    pub fn edge(&self) -> &str {
        &self.edge
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.edge, self.random)
    }
}

/// Edge names: 1–32 characters of `[a-z0-9]`, starting with a letter (no `-`, so the id
/// splits unambiguously).
pub fn valid_edge_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && s.as_bytes()[0].is_ascii_lowercase()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// `n` random bytes from the kernel's CSPRNG, as lower-case hex.
/// Compares secrets (tokens, keys, signatures) without stopping at the first difference,
/// so the time taken does not reveal how much of a guess was right.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    fill_random(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Fills `buf` from the kernel's CSPRNG.
pub fn fill_random(buf: &mut [u8]) {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[off..].as_mut_ptr().cast(), buf.len() - off, 0) };
        if n > 0 {
            off += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_parse_back_and_name_their_edge() {
        let id = SandboxId::generate("node7");
        let s = id.to_string();
        let back = SandboxId::parse(&s).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.edge(), "node7");
        assert_ne!(SandboxId::generate("node7"), id);
    }

    #[test]
    fn malformed_ids_are_rejected() {
        for bad in [
            "",
            "abc",
            "node7-",
            "-0123456789ab",
            "node7-0123456789aB",
            "node7-0123456789a",
            "Node7-0123456789ab",
            "../x-0123456789ab",
            "n-0123456789ai",
        ] {
            assert!(SandboxId::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(SandboxId::parse("n-0123456789ab").is_ok());
    }
}
