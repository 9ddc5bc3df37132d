//! `GET /v1/events`'s query string, read the same way by an edge (which answers it) and
//! by a cluster's apiserver (which asks every edge and merges the answers).

use std::time::Duration;

use crate::ApiError;
pub use crate::api::EventQuery;
use crate::http::query_pairs;

pub use crate::api::EVENT_TYPES as TYPES;

/// Most events one call returns.
pub const MAX_LIMIT: usize = 1000;
/// The most matching events a call may pass over (`offset`).
pub const MAX_OFFSET: usize = 100_000;
/// The longest a query waits for a new event (`wait_seconds`).
pub const MAX_WAIT: Duration = Duration::from_secs(60);

fn number(k: &str, v: &str) -> Result<f64, ApiError> {
    v.parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0)
        .ok_or_else(|| ApiError::invalid(format!("{k}={v:?} is not a number of at least 0")))
}

impl EventQuery {
    /// The query of a raw query string; an unknown parameter or type is refused.
    pub fn parse(q: &str) -> Result<EventQuery, ApiError> {
        let mut query = EventQuery::default();
        for (k, v) in query_pairs(q) {
            match k.as_str() {
                "after" => {
                    query.after = v.parse().map_err(|_| {
                        ApiError::invalid(format!("after={v:?} is not a sequence number"))
                    })?
                }
                "limit" => query.limit = (number(&k, &v)? as usize).clamp(1, MAX_LIMIT),
                "sandbox" => query.sandbox = Some(v),
                "type" => {
                    if !TYPES.contains(&v.as_str()) {
                        return Err(ApiError::invalid(format!(
                            "unknown event type {v:?}; the types are {}",
                            TYPES.join(", ")
                        )));
                    }
                    if !query.types.contains(&v) {
                        query.types.push(v)
                    }
                }
                "order" => {
                    query.newest_first = match v.as_str() {
                        "asc" => false,
                        "desc" => true,
                        _ => {
                            return Err(ApiError::invalid(format!(
                                "order={v:?}: asc (oldest first) or desc (newest first)"
                            )));
                        }
                    }
                }
                "offset" => query.offset = number(&k, &v)?.min(MAX_OFFSET as f64) as usize,
                "wait_seconds" => {
                    query.wait =
                        Duration::from_secs_f64(number(&k, &v)?.min(MAX_WAIT.as_secs_f64()))
                }
                _ => {
                    return Err(ApiError::invalid(format!(
                        "unknown parameter {k:?}; /v1/events takes after, limit, sandbox, type, order, offset and wait_seconds"
                    )));
                }
            }
        }
        Ok(query)
    }

    /// The query string that asks for this (`wait_seconds` left out).
    pub fn to_query(&self) -> String {
        let mut q = format!("after={}&limit={}", self.after, self.limit);
        if let Some(s) = &self.sandbox {
            q.push_str(&format!("&sandbox={}", crate::http::percent_encode(s)));
        }
        for t in &self.types {
            q.push_str(&format!("&type={t}"));
        }
        if self.newest_first {
            q.push_str("&order=desc");
        }
        if self.offset > 0 {
            q.push_str(&format!("&offset={}", self.offset));
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_reads_back_from_its_string() {
        let q = EventQuery::parse(
            "after=7&limit=5000&type=stopped&type=expired&type=stopped&order=desc&offset=3&sandbox=a%20b&wait_seconds=90",
        )
        .unwrap();
        assert_eq!(q.limit, MAX_LIMIT);
        assert_eq!(q.types, ["stopped", "expired"]);
        assert_eq!(q.wait, MAX_WAIT);
        let again = EventQuery::parse(&q.to_query()).unwrap();
        assert_eq!(
            again,
            EventQuery {
                wait: Duration::ZERO,
                ..q
            }
        );
        for bad in ["type=exploded", "order=up", "after=-1", "limit=x", "nope=1"] {
            assert!(EventQuery::parse(bad).is_err(), "{bad} was taken");
        }
    }
}
