//! A sandbox's egress rules, from the API's `network_rules` map (`{"pypi": true,
//! "*.example.com": true, "203.0.113.0/24": true, "198.51.100.7:443": true}`) to what the
//! DNS proxy and nftables enforce: allowed domain patterns and CIDRs (with an optional
//! port). Service names (`pypi`, `npm`, …) expand to the domains the edge configuration
//! gives them. `false` allows nothing; it is accepted so rules read like the seed's.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use dsec_common::ApiError;

/// Most rules one sandbox may have.
pub const MAX_RULES: usize = 256;

/// An IPv4 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, p.parse::<u8>().ok()?),
            None => (s, 32),
        };
        let addr: Ipv4Addr = a.parse().ok()?;
        if p > 32 {
            return None;
        }
        Some(Cidr {
            addr: Ipv4Addr::from(u32::from(addr) & Self::mask(p)),
            prefix: p,
        })
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        }
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix) == u32::from(self.addr)
    }

    /// Whether all of `self` lies inside `other`.
    pub fn within(&self, other: &Cidr) -> bool {
        self.prefix >= other.prefix && other.contains(self.addr)
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Addresses no rule opens implicitly: the node itself (loopback), other sandboxes and
/// private networks, link-local and cloud metadata, shared and reserved space. A DNS answer
/// pointing into them is not followed; only a CIDR rule that lies inside one of them (it
/// names it explicitly) opens it.
pub const NEVER: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/3",
];

pub fn never() -> Vec<Cidr> {
    NEVER.iter().filter_map(|s| Cidr::parse(s)).collect()
}

/// A domain rule: `pypi.org` (that name) or `*.pythonhosted.org` (names under it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DomainPattern {
    pub suffix: String,
    pub wildcard: bool,
}

impl DomainPattern {
    pub fn parse(s: &str) -> Option<DomainPattern> {
        let s = s.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, s),
        };
        let ok = name.len() <= 253
            && name.contains('.')
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        ok.then_some(DomainPattern {
            suffix: name,
            wildcard,
        })
    }

    pub fn matches(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.wildcard {
            name.len() > self.suffix.len()
                && name.ends_with(&self.suffix)
                && name.as_bytes()[name.len() - self.suffix.len() - 1] == b'.'
        } else {
            name == self.suffix
        }
    }
}

/// What a sandbox may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    pub domains: Vec<DomainPattern>,
    /// (network, port); `None` is any port.
    pub cidrs: Vec<(Cidr, Option<u16>)>,
}

impl Policy {
    pub fn allows_name(&self, name: &str) -> bool {
        self.domains.iter().any(|d| d.matches(name))
    }

    pub fn is_empty(&self) -> bool {
        self.domains.is_empty() && self.cidrs.is_empty()
    }
}

fn rule_error(key: &str, why: &str) -> ApiError {
    ApiError::invalid(format!(
        "network_rules: {key:?} {why}; a rule is a service name (e.g. \"pypi\"), a domain (\"example.com\", \"*.example.com\"), or an IPv4 CIDR with an optional port (\"203.0.113.0/24\", \"198.51.100.7:443\")"
    ))
}

/// Turns the API's rules into a policy, expanding service names with `services`.
pub fn compile(
    rules: &BTreeMap<String, bool>,
    services: &BTreeMap<String, Vec<String>>,
) -> Result<Policy, ApiError> {
    if rules.len() > MAX_RULES {
        return Err(ApiError::invalid(format!(
            "network_rules has {} rules; at most {MAX_RULES}",
            rules.len()
        )));
    }
    let mut p = Policy::default();
    for (key, allow) in rules {
        let k = key.trim();
        let first = k.chars().next().unwrap_or(' ');
        let looks_ip = first.is_ascii_digit() && !k.contains(|c: char| c.is_ascii_alphabetic());
        if looks_ip {
            let (net, port) = match k.rsplit_once(':') {
                Some((n, port)) => {
                    let port: u16 = port
                        .parse()
                        .ok()
                        .filter(|p| *p > 0)
                        .ok_or_else(|| rule_error(key, "has a port that is not 1-65535"))?;
                    (n, Some(port))
                }
                None => (k, None),
            };
            let cidr = Cidr::parse(net).ok_or_else(|| rule_error(key, "is not an IPv4 CIDR"))?;
            if *allow {
                p.cidrs.push((cidr, port));
            }
        } else if k.contains('.') {
            let d = DomainPattern::parse(k).ok_or_else(|| rule_error(key, "is not a domain"))?;
            if *allow {
                p.domains.push(d);
            }
        } else if let Some(domains) = services.get(k) {
            if *allow {
                for d in domains {
                    let d = DomainPattern::parse(d).ok_or_else(|| {
                        ApiError::internal(format!(
                            "the edge's service {k} lists {d:?}, which is not a domain"
                        ))
                    })?;
                    p.domains.push(d);
                }
            }
        } else {
            let known: Vec<&str> = services.keys().map(String::as_str).collect();
            return Err(ApiError::invalid(format!(
                "network_rules: unknown service name {key:?}; this node knows {} (or give a domain or a CIDR)",
                known.join(", ")
            )));
        }
    }
    p.domains.sort();
    p.domains.dedup();
    p.cidrs.sort();
    p.cidrs.dedup();
    Ok(p)
}

/// The services every edge knows unless its configuration says otherwise.
pub fn default_services() -> BTreeMap<String, Vec<String>> {
    let s = |v: &[&str]| v.iter().map(|d| d.to_string()).collect::<Vec<_>>();
    BTreeMap::from([
        (
            "pypi".to_string(),
            s(&["pypi.org", "files.pythonhosted.org", "*.pythonhosted.org"]),
        ),
        (
            "npm".to_string(),
            s(&["registry.npmjs.org", "*.npmjs.org", "registry.yarnpkg.com"]),
        ),
        (
            "github".to_string(),
            s(&[
                "github.com",
                "*.github.com",
                "*.githubusercontent.com",
                "codeload.github.com",
            ]),
        ),
        (
            "debian".to_string(),
            s(&["deb.debian.org", "security.debian.org", "*.debian.org"]),
        ),
        (
            "huggingface".to_string(),
            s(&["huggingface.co", "*.huggingface.co", "*.hf.co"]),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(v: &[(&str, bool)]) -> BTreeMap<String, bool> {
        v.iter().map(|(k, b)| (k.to_string(), *b)).collect()
    }

    #[test]
    fn services_domains_and_cidrs_compile() {
        let p = compile(
            &rules(&[
                ("pypi", true),
                ("npm", false),
                ("*.example.com", true),
                ("203.0.113.0/24", true),
                ("198.51.100.7:443", true),
            ]),
            &default_services(),
        )
        .unwrap();
        assert!(p.allows_name("pypi.org"));
        assert!(p.allows_name("files.pythonhosted.org."));
        assert!(p.allows_name("a.b.example.com"));
        assert!(
            !p.allows_name("example.com"),
            "*. covers names under it only"
        );
        assert!(!p.allows_name("registry.npmjs.org"), "false allows nothing");
        assert!(!p.allows_name("evilpypi.org"));
        assert!(!p.allows_name("pypi.org.evil.test"));
        assert_eq!(p.cidrs.len(), 2);
        assert_eq!(
            p.cidrs[0],
            (Cidr::parse("198.51.100.7").unwrap(), Some(443))
        );
    }

    #[test]
    fn bad_rules_say_what_is_wrong() {
        let s = default_services();
        for (bad, needle) in [
            ("pipy", "unknown service name"),
            ("10.0.0.0/33", "not an IPv4 CIDR"),
            ("10.0.0.1:0", "port"),
            ("a..b.com", "not a domain"),
            ("1.2.3.4:99999", "port"),
        ] {
            let e = compile(&rules(&[(bad, true)]), &s).unwrap_err();
            assert!(e.message.contains(needle), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn cidrs_normalise_and_nest() {
        let c = Cidr::parse("10.1.2.3/8").unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(Cidr::parse("10.9.0.0/16").unwrap().within(&c));
        assert!(!Cidr::parse("0.0.0.0/0").unwrap().within(&c));
        assert!(
            never()
                .iter()
                .any(|n| n.contains("169.254.169.254".parse().unwrap()))
        );
    }
}
