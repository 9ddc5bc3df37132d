//! A sandbox's egress rules, from the API's `network_rules` map (`{"pypi": true,
//! "*.example.com": true, "203.0.113.0/24": true, "198.51.100.7:443": true}`) to what the
//! DNS proxy and nftables enforce: allowed domain patterns and CIDRs (with an optional
//! port). Service names (`pypi`, `npm`, …) expand to the domains the edge configuration
//! gives them. `false` allows nothing; it is accepted so rules read like the seed's.
//!
//! A rule never opens the ranges in [`NEVER`] (other sandboxes, the node's networks,
//! loopback, link-local and cloud metadata, reserved space): a CIDR inside one is refused,
//! and a wider one (`0.0.0.0/0`) still leaves them closed. Only the operator can open a
//! private address, by listing it as a named private service in the node's configuration
//! (`[edge.network.private_services] db = ["10.1.2.3:5432"]`), which a rule then names.

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

/// Addresses no tenant rule opens: the node itself (loopback), other sandboxes and
/// private networks, link-local and cloud metadata, shared and reserved space. A DNS answer
/// pointing into them is not followed; only an operator's private service opens a part.
pub const NEVER: &[(&str, &str)] = &[
    ("0.0.0.0/8", "\"this network\""),
    (
        "10.0.0.0/8",
        "private networks: other sandboxes and the node's own networks",
    ),
    ("100.64.0.0/10", "carrier-grade NAT space"),
    ("127.0.0.0/8", "loopback"),
    (
        "169.254.0.0/16",
        "link-local, where cloud metadata services answer",
    ),
    ("172.16.0.0/12", "private networks"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.168.0.0/16", "private networks"),
    ("198.18.0.0/15", "benchmarking space"),
    ("224.0.0.0/3", "multicast and reserved space"),
];

pub fn never() -> Vec<Cidr> {
    NEVER.iter().filter_map(|(s, _)| Cidr::parse(s)).collect()
}

/// The never-range `c` lies in, and what it is.
pub fn never_range_of(c: &Cidr) -> Option<(Cidr, &'static str)> {
    NEVER
        .iter()
        .filter_map(|(s, why)| Some((Cidr::parse(s)?, *why)))
        .find(|(n, _)| c.within(n))
}

/// The never-range address `ip` lies in, and what it is.
pub fn never_range_of_ip(ip: Ipv4Addr) -> Option<(Cidr, &'static str)> {
    never_range_of(&Cidr {
        addr: ip,
        prefix: 32,
    })
}

/// `203.0.113.0/24` or `198.51.100.7:443`: a network and an optional port.
pub fn parse_cidr_port(k: &str) -> Result<(Cidr, Option<u16>), &'static str> {
    let (net, port) = match k.rsplit_once(':') {
        Some((n, port)) => {
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or("has a port that is not 1-65535")?;
            (n, Some(port))
        }
        None => (k, None),
    };
    let cidr = Cidr::parse(net).ok_or("is not an IPv4 CIDR")?;
    Ok((cidr, port))
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
    /// (network, port); `None` is any port. Never inside a never-range.
    pub cidrs: Vec<(Cidr, Option<u16>)>,
    /// The operator's private services the rules named: opened before the never-ranges
    /// are dropped.
    pub private: Vec<(Cidr, Option<u16>)>,
    /// Headers the node's egress proxy sets on requests to some hosts (`headers.rs`).
    pub headers: Vec<HeaderRule>,
}

/// A host whose requests get headers: names (a domain or a pattern), or one address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderHost {
    Name(DomainPattern),
    Addr(Ipv4Addr),
}

/// Headers set (replacing any the sandbox sent) on requests to `host`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRule {
    pub host: HeaderHost,
    pub headers: Vec<(String, String)>,
}

/// Most hosts with headers, headers per host, and bytes of a header's value.
pub const MAX_HEADER_HOSTS: usize = 64;
pub const MAX_HEADERS: usize = 32;
pub const MAX_HEADER_VALUE: usize = 8192;

/// Headers that frame or route a request: the proxy owns them, a rule may not set them.
const FRAMING: [&str; 10] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "expect",
];

/// Checks a sandbox's egress headers (host → name → value) and compiles them; a 400
/// names what is wrong.
pub fn compile_headers(
    h: &BTreeMap<String, BTreeMap<String, String>>,
) -> Result<Vec<HeaderRule>, ApiError> {
    if h.len() > MAX_HEADER_HOSTS {
        return Err(ApiError::invalid(format!(
            "egress_headers names {} hosts; at most {MAX_HEADER_HOSTS}",
            h.len()
        )));
    }
    let mut out = Vec::new();
    for (host, headers) in h {
        let k = host.trim();
        let target = match k.parse::<Ipv4Addr>() {
            Ok(a) => HeaderHost::Addr(a),
            Err(_) => HeaderHost::Name(DomainPattern::parse(k).ok_or_else(|| {
                ApiError::invalid(format!(
                    "egress_headers: {host:?} is neither a domain (\"api.example.com\", \"*.example.com\") nor an IPv4 address"
                ))
            })?),
        };
        if headers.is_empty() || headers.len() > MAX_HEADERS {
            return Err(ApiError::invalid(format!(
                "egress_headers: {host:?} has {} headers; give 1 to {MAX_HEADERS}",
                headers.len()
            )));
        }
        let mut hs = Vec::new();
        for (name, value) in headers {
            let token = !name.is_empty()
                && name.len() <= 256
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token {
                return Err(ApiError::invalid(format!(
                    "egress_headers: {host:?}: {name:?} is not a header name (letters, digits and !#$%&'*+-.^_`|~, at most 256)"
                )));
            }
            if FRAMING.contains(&name.to_ascii_lowercase().as_str()) {
                return Err(ApiError::invalid(format!(
                    "egress_headers: {host:?}: {name} frames or routes the request and cannot be set"
                )));
            }
            // Visible ASCII, spaces and tabs: nothing that could end the header early.
            let clean = value.len() <= MAX_HEADER_VALUE
                && value
                    .bytes()
                    .all(|b| b == b'\t' || (0x20..0x7f).contains(&b));
            if !clean {
                return Err(ApiError::invalid(format!(
                    "egress_headers: {host:?}: the value of {name} must be at most {MAX_HEADER_VALUE} bytes of printable ASCII"
                )));
            }
            hs.push((name.to_ascii_lowercase(), value.trim().to_string()));
        }
        out.push(HeaderRule {
            host: target,
            headers: hs,
        });
    }
    // The first that matches applies (sets are not merged): exact names and addresses,
    // then the longest wildcard.
    out.sort_by_key(|r| match &r.host {
        HeaderHost::Name(p) if p.wildcard => usize::MAX - p.suffix.len(),
        _ => 0,
    });
    Ok(out)
}

impl Policy {
    pub fn allows_name(&self, name: &str) -> bool {
        self.domains.iter().any(|d| d.matches(name))
    }

    pub fn is_empty(&self) -> bool {
        self.domains.is_empty() && self.cidrs.is_empty() && self.private.is_empty()
    }
}

/// The names a rule may use: public services (domains) and the operator's private
/// services (addresses inside the never-ranges).
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    pub services: BTreeMap<String, Vec<String>>,
    pub private: BTreeMap<String, Vec<(Cidr, Option<u16>)>>,
}

impl Catalog {
    /// The built-in services, with the configuration's added (or replacing them), and its
    /// private services, checked.
    pub fn new(
        services: &BTreeMap<String, Vec<String>>,
        private: &BTreeMap<String, Vec<String>>,
        pool: &Cidr,
    ) -> Result<Catalog, super::NetError> {
        let bad = super::NetError::Config;
        let mut c = Catalog {
            services: default_services(),
            private: BTreeMap::new(),
        };
        for (name, domains) in services {
            for d in domains {
                if DomainPattern::parse(d).is_none() {
                    return Err(bad(format!(
                        "[edge.network.services] {name}: {d:?} is not a domain"
                    )));
                }
            }
            c.services.insert(name.clone(), domains.clone());
        }
        for (name, addrs) in private {
            if c.services.contains_key(name) {
                return Err(bad(format!(
                    "[edge.network.private_services] {name} is also a service name; give it another name"
                )));
            }
            let mut v = Vec::new();
            for a in addrs {
                let (cidr, port) = parse_cidr_port(a).map_err(|why| {
                    bad(format!(
                        "[edge.network.private_services] {name}: {a:?} {why}"
                    ))
                })?;
                if cidr.within(pool) || pool.within(&cidr) {
                    return Err(bad(format!(
                        "[edge.network.private_services] {name}: {a:?} overlaps the sandbox pool {pool}; sandboxes never reach each other"
                    )));
                }
                v.push((cidr, port));
            }
            c.private.insert(name.clone(), v);
        }
        Ok(c)
    }
}

fn rule_error(key: &str, why: &str) -> ApiError {
    ApiError::invalid(format!(
        "network_rules: {key:?} {why}; a rule is a service name (e.g. \"pypi\"), a domain (\"example.com\", \"*.example.com\"), or an IPv4 CIDR with an optional port (\"203.0.113.0/24\", \"198.51.100.7:443\")"
    ))
}

/// Turns the API's rules into a policy, expanding service names with the catalog.
pub fn compile(rules: &BTreeMap<String, bool>, catalog: &Catalog) -> Result<Policy, ApiError> {
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
            let (cidr, port) = parse_cidr_port(k).map_err(|why| rule_error(key, why))?;
            if let Some((range, what)) = never_range_of(&cidr) {
                return Err(ApiError::invalid(format!(
                    "network_rules: {key:?} lies in {range} ({what}); sandboxes never reach private, loopback, link-local or reserved addresses, whatever their rules. An operator can offer a private service by name ([edge.network.private_services] in the node's config){}",
                    private_names(catalog)
                )));
            }
            if *allow {
                p.cidrs.push((cidr, port));
            }
        } else if k.contains('.') {
            let d = DomainPattern::parse(k).ok_or_else(|| rule_error(key, "is not a domain"))?;
            if *allow {
                p.domains.push(d);
            }
        } else if let Some(domains) = catalog.services.get(k) {
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
        } else if let Some(addrs) = catalog.private.get(k) {
            if *allow {
                p.private.extend(addrs.iter().copied());
            }
        } else {
            let known: Vec<&str> = catalog
                .services
                .keys()
                .chain(catalog.private.keys())
                .map(String::as_str)
                .collect();
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
    p.private.sort();
    p.private.dedup();
    Ok(p)
}

fn private_names(c: &Catalog) -> String {
    if c.private.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = c.private.keys().map(String::as_str).collect();
        format!("; this node offers {}", names.join(", "))
    }
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

    fn headers(v: &[(&str, &[(&str, &str)])]) -> BTreeMap<String, BTreeMap<String, String>> {
        v.iter()
            .map(|(h, hs)| {
                let hs = hs
                    .iter()
                    .map(|(n, x)| (n.to_string(), x.to_string()))
                    .collect();
                (h.to_string(), hs)
            })
            .collect()
    }

    #[test]
    fn egress_headers_compile_exact_names_before_the_longest_wildcard() {
        let r = compile_headers(&headers(&[
            ("*.example.com", &[("X-A", "wide")]),
            ("*.api.example.com", &[("X-A", "narrow")]),
            ("api.example.com", &[("Authorization", "Bearer k")]),
            ("203.0.113.7", &[("X-A", "addr")]),
        ]))
        .unwrap();
        let order: Vec<String> = r
            .iter()
            .map(|x| match &x.host {
                HeaderHost::Name(p) => {
                    format!("{}{}", if p.wildcard { "*." } else { "" }, p.suffix)
                }
                HeaderHost::Addr(a) => a.to_string(),
            })
            .collect();
        assert_eq!(
            order,
            [
                "203.0.113.7",
                "api.example.com",
                "*.api.example.com",
                "*.example.com"
            ]
        );
        assert_eq!(r[1].headers, [("authorization".into(), "Bearer k".into())]);
    }

    #[test]
    fn egress_headers_that_could_split_or_reroute_a_request_are_refused() {
        for (h, says) in [
            (headers(&[("a b", &[("X-A", "1")])]), "neither a domain"),
            (
                headers(&[("api.example.com", &[("Host", "evil")])]),
                "cannot be set",
            ),
            (
                headers(&[("api.example.com", &[("transfer-encoding", "chunked")])]),
                "cannot be set",
            ),
            (
                headers(&[("api.example.com", &[("X-A", "1\r\nX-B: 2")])]),
                "printable ASCII",
            ),
            (
                headers(&[("api.example.com", &[("X-A", "\u{e9}")])]),
                "printable ASCII",
            ),
            (
                headers(&[("api.example.com", &[("X A:", "1")])]),
                "not a header name",
            ),
            (headers(&[("api.example.com", &[])]), "give 1 to"),
        ] {
            let e = compile_headers(&h).unwrap_err();
            assert!(e.message.contains(says), "{h:?}: {}", e.message);
        }
    }

    /// Fuzz target: whatever a tenant sends as egress headers, what compiles can be put in
    /// a request as it is: names are tokens, values hold no line break or control byte.
    #[test]
    fn fuzz_egress_headers() {
        bolero::check!()
            .with_iterations(2000)
            .with_type::<Vec<(String, String, String)>>()
            .for_each(|v| {
                let mut h: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
                for (host, n, x) in v {
                    h.entry(host.clone())
                        .or_default()
                        .insert(n.clone(), x.clone());
                }
                if let Ok(rules) = compile_headers(&h) {
                    for r in rules {
                        for (n, x) in r.headers {
                            assert!(hyper_token(&n), "{n:?}");
                            assert!(
                                !x.bytes().any(|b| b < 0x20 && b != b'\t' || b == 0x7f),
                                "{x:?}"
                            );
                        }
                    }
                }
            });
    }

    fn hyper_token(n: &str) -> bool {
        !n.is_empty()
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    }

    fn rules(v: &[(&str, bool)]) -> BTreeMap<String, bool> {
        v.iter().map(|(k, b)| (k.to_string(), *b)).collect()
    }

    fn catalog() -> Catalog {
        let private = BTreeMap::from([(
            "db".to_string(),
            vec!["10.1.2.3:5432".to_string(), "192.168.7.0/24".to_string()],
        )]);
        Catalog::new(
            &BTreeMap::new(),
            &private,
            &Cidr::parse("10.200.0.0/16").unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_tenant_rule_cannot_open_private_ranges() {
        let c = catalog();
        for (bad, range) in [
            ("10.200.0.0/16", "10.0.0.0/8"),
            ("10.200.0.6", "10.0.0.0/8"),
            ("169.254.169.254/32", "169.254.0.0/16"),
            ("169.254.169.254:80", "169.254.0.0/16"),
            ("127.0.0.1:8080", "127.0.0.0/8"),
            ("172.17.0.1", "172.16.0.0/12"),
            ("192.168.1.0/24", "192.168.0.0/16"),
            ("100.100.100.200", "100.64.0.0/10"),
            ("0.0.0.0/8", "0.0.0.0/8"),
        ] {
            let e = compile(&rules(&[(bad, true)]), &c).unwrap_err();
            assert_eq!(e.code, dsec_common::ErrorCode::InvalidArgument);
            assert!(e.message.contains(range), "{bad}: {}", e.message);
            assert!(e.message.contains("this node offers db"), "{}", e.message);
        }
        // A wide rule is fine: the never-ranges inside it stay closed (nftables drops them
        // before the rule's set is looked at).
        let p = compile(&rules(&[("0.0.0.0/0", true)]), &c).unwrap();
        assert_eq!(p.cidrs, vec![(Cidr::parse("0.0.0.0/0").unwrap(), None)]);
        assert!(p.private.is_empty());
    }

    #[test]
    fn the_operators_private_services_open_by_name() {
        let p = compile(&rules(&[("db", true)]), &catalog()).unwrap();
        assert!(p.cidrs.is_empty());
        assert_eq!(
            p.private,
            vec![
                (Cidr::parse("10.1.2.3").unwrap(), Some(5432)),
                (Cidr::parse("192.168.7.0/24").unwrap(), None)
            ]
        );
        let pool = Cidr::parse("10.200.0.0/16").unwrap();
        for bad in [
            ("pypi", vec!["10.1.2.3".to_string()]),
            ("x", vec!["10.200.1.0/24".to_string()]),
            ("x", vec!["10.0.0.0/8".to_string()]),
            ("x", vec!["10.1.2.3:0".to_string()]),
        ] {
            let m = BTreeMap::from([(bad.0.to_string(), bad.1.clone())]);
            assert!(
                Catalog::new(&BTreeMap::new(), &m, &pool).is_err(),
                "{bad:?}"
            );
        }
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
            &catalog(),
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
        let s = catalog();
        for (bad, needle) in [
            ("pipy", "unknown service name"),
            ("10.0.0.0/33", "not an IPv4 CIDR"),
            ("203.0.113.1:0", "port"),
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
