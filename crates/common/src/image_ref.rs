//! Image references: `ns/name[:tag]`, lower-case path components, no path tricks. Here in
//! `common` because the cluster front door checks a create's image against the key's
//! project without linking the image store.

use std::fmt;
use std::path::PathBuf;

/// A string that is not an image reference; the message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadImageRef(pub String);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageRef {
    /// Path components, e.g. `["root", "py"]`.
    pub repo: Vec<String>,
    pub tag: String,
}

fn valid_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

fn valid_tag(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<ImageRef, BadImageRef> {
        let bad = |why: &str| {
            BadImageRef(format!(
                "'{s}' is not a valid image reference ({why}); use ns/name[:tag] with lower-case letters, digits, '.', '_' and '-', e.g. root/py:3.11"
            ))
        };
        let (path, tag) = match s.rsplit_once(':') {
            Some((p, t)) => (p, t),
            None => (s, "latest"),
        };
        if !valid_tag(tag) {
            return Err(bad("bad tag"));
        }
        let repo: Vec<String> = path.split('/').map(str::to_string).collect();
        if repo.len() < 2 || repo.len() > 8 {
            return Err(bad("needs a namespace and a name"));
        }
        if !repo.iter().all(|c| valid_component(c)) {
            return Err(bad("bad name component"));
        }
        Ok(ImageRef {
            repo,
            tag: tag.to_string(),
        })
    }

    /// The project namespace the image lives in: every path component but the name
    /// (`root/t1` for `root/t1/myenv:v1`, `root` for `root/py:3.11`).
    pub fn project(&self) -> String {
        self.repo[..self.repo.len() - 1].join("/")
    }

    /// Relative path of the reference file inside `refs/`. Components are validated, so it
    /// cannot leave that directory.
    pub fn rel_path(&self) -> PathBuf {
        let mut p: PathBuf = self.repo.iter().collect();
        p.push(&self.tag);
        p
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.repo.join("/"), self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_defaults_tag() {
        let r = ImageRef::parse("root/py:3.11").unwrap();
        assert_eq!(r.repo, vec!["root", "py"]);
        assert_eq!(r.tag, "3.11");
        assert_eq!(r.to_string(), "root/py:3.11");
        assert_eq!(ImageRef::parse("root/base").unwrap().tag, "latest");
        assert_eq!(r.project(), "root");
        assert_eq!(
            ImageRef::parse("root/t1/env:v1").unwrap().project(),
            "root/t1"
        );
        assert_eq!(
            ImageRef::parse("a/b/c:v1").unwrap().rel_path(),
            PathBuf::from("a/b/c/v1")
        );
    }

    #[test]
    fn rejects_path_tricks_and_bad_names() {
        for bad in [
            "",
            "py",
            "root/../x",
            "../etc/passwd",
            "/root/py",
            "root//py",
            "root/py:",
            "root/py:../x",
            "Root/py",
            "root/.hidden",
            "root/py:a/b",
            "root/p y",
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
