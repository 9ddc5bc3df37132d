//! Function calls (`[[edge.functions]]`): a function is an image and an entry point. A
//! call runs the entry point in a sandbox of its own, made for the call or, when the
//! function names a warm pool with a member ready, taken from it, so that a call costs
//! an exec rather than a create. The input goes to the entry point's stdin as JSON; its
//! stdout is the output. The sandbox belongs to the caller's project (quotas apply as to
//! any create) and is stopped once the call has answered: no call sees another's state.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use dsec_common::api::{
    CreateSandboxRequest, ExecRequest, FunctionCallRequest, FunctionCallResult, FunctionInfo,
};
use dsec_common::project::within;
use dsec_common::{ApiError, ErrorCode};

use crate::config::{EdgeConfig, FunctionConfig};
use crate::{Edge, pools, validate};

/// Label on a call's sandbox naming its function.
pub const FUNCTION_LABEL: &str = "dsec-function";

/// Extra lifetime of a call's sandbox past the call's timeout: it is stopped when the
/// call answers; the TTL only bounds one the edge lost track of (a crash mid-call).
const TTL_MARGIN_S: f64 = 60.0;

/// The node's functions, checked at start.
pub(crate) struct Functions {
    by_name: HashMap<String, (FunctionConfig, CreateSandboxRequest)>,
}

impl Functions {
    /// The configured functions, each checked (an error names the function).
    pub(crate) fn new(cfg: &EdgeConfig) -> Result<Functions, ApiError> {
        let mut by_name = HashMap::new();
        for f in &cfg.functions {
            let bad =
                |m: String| ApiError::invalid(format!("[[edge.functions]] {:?}: {m}", f.name));
            if !pools::valid_name(&f.name) {
                return Err(bad("name: use 1-32 of a-z, 0-9 and -".into()));
            }
            if f.entry.is_empty() || f.entry.iter().any(|a| a.contains('\0')) {
                return Err(bad(
                    "entry must name a program (and its arguments), without NUL bytes".into(),
                ));
            }
            if !(f.timeout_seconds.is_finite() && f.timeout_seconds > 0.0) {
                return Err(bad("timeout_seconds must be above 0".into()));
            }
            if f.projects.iter().any(|p| p.is_empty()) {
                return Err(bad("projects: an empty project name".into()));
            }
            let mut req = match (&f.pool, &f.image) {
                (Some(p), None) => {
                    let Some(pool) = cfg.pools.iter().find(|x| &x.name == p) else {
                        return Err(bad(format!("pool {p:?} is not one of [[edge.pools]]")));
                    };
                    pools::request(pool, cfg)
                }
                (None, Some(image)) => CreateSandboxRequest {
                    backend: "container".into(),
                    image: image.clone(),
                    ..CreateSandboxRequest::default()
                },
                _ => return Err(bad("give exactly one of pool or image".into())),
            };
            req.ttl_seconds = Some((f.timeout_seconds + TTL_MARGIN_S).ceil());
            req.labels = BTreeMap::from([(FUNCTION_LABEL.to_string(), f.name.clone())]);
            validate::create(cfg, &req).map_err(|e| bad(e.message))?;
            if by_name.insert(f.name.clone(), (f.clone(), req)).is_some() {
                return Err(bad("named twice".into()));
            }
        }
        Ok(Functions { by_name })
    }

    /// A function the key's project may call; others are as unknown as missing ones.
    fn get(
        &self,
        name: &str,
        project: &str,
    ) -> Result<&(FunctionConfig, CreateSandboxRequest), ApiError> {
        self.by_name
            .get(name)
            .filter(|(f, _)| callable(f, project))
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "function {name:?} does not exist (GET /v1/functions lists those this key can call)"
                ))
            })
    }
}

fn callable(f: &FunctionConfig, project: &str) -> bool {
    f.projects.is_empty() || f.projects.iter().any(|p| within(project, p))
}

/// The function's output: its stdout as JSON, or as text when it is not JSON.
fn output_of(stdout: &str) -> serde_json::Value {
    if stdout.trim().is_empty() {
        return serde_json::Value::Null;
    }
    serde_json::from_str(stdout).unwrap_or_else(|_| serde_json::Value::String(stdout.into()))
}

impl Edge {
    /// The functions a key of `project` may call.
    pub fn functions(&self, project: &str) -> Vec<FunctionInfo> {
        let mut out: Vec<FunctionInfo> = self
            .functions
            .by_name
            .values()
            .filter(|(f, _)| callable(f, project))
            .map(|(f, req)| FunctionInfo {
                name: f.name.clone(),
                image: req.image.clone(),
                backend: req.backend.clone(),
                entry: f.entry.clone(),
                timeout_seconds: f.timeout_seconds,
                pool: f.pool.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Runs function `name` for a key of project `key_project`; `call.project` (already
    /// checked to be within it) is the project the sandbox counts against.
    pub async fn call_function(
        self: &Arc<Self>,
        name: &str,
        key_project: &str,
        call: FunctionCallRequest,
    ) -> Result<FunctionCallResult, ApiError> {
        let t0 = Instant::now();
        let (f, req) = self.functions.get(name, key_project)?;
        let timeout = match call.timeout_seconds {
            None => f.timeout_seconds,
            Some(t) if t.is_finite() && t > 0.0 && t <= f.timeout_seconds => t,
            Some(t) => {
                return Err(ApiError::invalid(format!(
                    "timeout_seconds {t} is not allowed: give a number above 0 and at most {} (function {name:?}'s limit)",
                    f.timeout_seconds
                )));
            }
        };
        let input = serde_json::to_string(&call.input)
            .map_err(|e| ApiError::invalid(format!("input: {e}")))?;
        let mut create = req.clone();
        create.project = call.project.or_else(|| Some(key_project.to_string()));
        let entry = f.entry.clone();
        let sb = self.create(create).await?;
        let id = sb.id.clone();
        let ran = self
            .exec(
                &id,
                ExecRequest {
                    argv: Some(entry),
                    stdin: Some(input),
                    timeout_seconds: Some(timeout),
                    ..ExecRequest::default()
                },
            )
            .await;
        // Its sandbox goes whatever happened; the caller does not wait for that.
        let edge = self.clone();
        let stop_id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = edge.stop(&stop_id).await {
                tracing::warn!(sandbox = %stop_id, "stopping a function call's sandbox: {}", e.message);
            }
        });
        let r = ran?;
        if r.timed_out {
            return Err(ApiError::new(
                ErrorCode::DeadlineExceeded,
                format!("function {name:?} did not finish within {timeout} s; it was stopped"),
            ));
        }
        if r.stdout_truncated {
            return Err(ApiError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "function {name:?} wrote more output than the node's limit of {} bytes",
                    self.cfg.max_output_bytes
                ),
            ));
        }
        Ok(FunctionCallResult {
            function: name.to_string(),
            output: output_of(&r.stdout),
            stderr: r.stderr,
            exit_code: r.exit_code,
            signal: r.signal,
            duration_ms: t0.elapsed().as_millis() as u64,
            run_ms: r.duration_ms,
            sandbox_id: id,
            from_pool: sb.from_pool,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PoolConfig;

    fn function(name: &str) -> FunctionConfig {
        FunctionConfig {
            name: name.into(),
            entry: vec!["cat".into()],
            pool: None,
            image: Some("root/base".into()),
            timeout_seconds: 5.0,
            projects: vec![],
        }
    }

    #[test]
    fn a_bad_function_is_refused_at_start_with_its_name() {
        let mut cfg = EdgeConfig::default();
        for (f, want) in [
            (function("Bad Name"), "name"),
            (
                FunctionConfig {
                    entry: vec![],
                    ..function("a")
                },
                "entry",
            ),
            (
                FunctionConfig {
                    image: None,
                    ..function("a")
                },
                "exactly one",
            ),
            (
                FunctionConfig {
                    pool: Some("p".into()),
                    ..function("a")
                },
                "exactly one",
            ),
            (
                FunctionConfig {
                    image: None,
                    pool: Some("nope".into()),
                    ..function("a")
                },
                "not one of",
            ),
            (
                FunctionConfig {
                    timeout_seconds: f64::NAN,
                    ..function("a")
                },
                "timeout",
            ),
        ] {
            cfg.functions = vec![f];
            let e = Functions::new(&cfg).err().unwrap();
            assert_eq!(e.code, dsec_common::ErrorCode::InvalidArgument);
            assert!(e.message.contains(want), "{e:?}");
        }
        cfg.functions = vec![function("a"), function("a")];
        assert!(
            Functions::new(&cfg)
                .err()
                .unwrap()
                .message
                .contains("twice")
        );
    }

    #[test]
    fn a_function_on_a_pool_asks_for_what_its_members_are() {
        let cfg = EdgeConfig {
            pools: vec![PoolConfig {
                name: "p".into(),
                image: "root/base".into(),
                backend: "container".into(),
                cpu_cores: None,
                memory_mb: Some(80),
                disk_mb: None,
                pids: None,
                size: 1,
                refill_per_second: 1.0,
            }],
            functions: vec![FunctionConfig {
                image: None,
                pool: Some("p".into()),
                ..function("f")
            }],
            ..EdgeConfig::default()
        };
        let fns = Functions::new(&cfg).unwrap();
        let (_, req) = fns.get("f", "root").unwrap();
        assert_eq!(
            (req.image.as_str(), req.memory_limit_mb),
            ("root/base", Some(80.0))
        );
    }

    #[test]
    fn only_the_named_projects_see_a_function() {
        let cfg = EdgeConfig {
            functions: vec![FunctionConfig {
                projects: vec!["root/a".into()],
                ..function("f")
            }],
            ..EdgeConfig::default()
        };
        let fns = Functions::new(&cfg).unwrap();
        assert!(fns.get("f", "root/a").is_ok() && fns.get("f", "root/a/x").is_ok());
        for p in ["root/b", "root", "root/ab"] {
            let e = fns.get("f", p).unwrap_err();
            assert_eq!(e.code, ErrorCode::NotFound, "{p}");
        }
    }

    #[test]
    fn output_is_json_when_it_parses_and_text_otherwise() {
        assert_eq!(output_of("{\"a\": 1}\n"), serde_json::json!({"a": 1}));
        assert_eq!(output_of("hello\n"), serde_json::json!("hello\n"));
        assert_eq!(output_of(""), serde_json::Value::Null);
    }
}
