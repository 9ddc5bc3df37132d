//! Conversions between the API's types (`dsec_common::api`) and the messages generated from
//! `proto/`. Every conversion destructures its source without `..`, so a field added to an
//! API type and not carried here (and in the `.proto`) fails to compile: the proto cannot
//! fall behind the API again. Messages to API types are checked: an unknown enum value or
//! a missing required message is [`Malformed`], never a default.

use dsec_common::api::{
    BackendStatus, Capability, ClusterStatus, CreateSandboxRequest, EgressHeaders, ForkRequest,
    ForkResponse, GroupFailure, GroupRequest, GroupResponse, Limits, ListSandboxesResponse,
    ListSnapshotsResponse, NetworkInfo, NodeStatus, PauseRequest, PoolStatus, ResumeRequest,
    SandboxInfo, SandboxState, SnapshotInfo, VolumeMount,
};
use dsec_common::{ApiError, ErrorCode};
use std::collections::BTreeMap;

use crate::pb;

/// A message that does not make a value of the API's type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

fn missing(what: &str) -> Malformed {
    Malformed(format!("{what} is missing"))
}

fn headers_to_pb(h: EgressHeaders) -> BTreeMap<String, pb::Headers> {
    h.into_iter()
        .map(|(host, headers)| (host, pb::Headers { headers }))
        .collect()
}

fn headers_from_pb(h: BTreeMap<String, pb::Headers>) -> EgressHeaders {
    h.into_iter().map(|(host, v)| (host, v.headers)).collect()
}

/// `From` both ways between an API type and its message when every field carries across as
/// it is. Both sides are destructured without `..`, so a field missing on either side does
/// not compile.
/// An API enum and its proto enum, whose variants have the same names (the proto's
/// `UNSPECIFIED` aside): `From` the API's to the message's, and `$back(i32)` the other
/// way, refusing `UNSPECIFIED` and values this side does not know (`$what` names it).
#[macro_export]
macro_rules! same_variants {
    ($api:ident, $msg:path, $back:ident, $what:literal, { $($v:ident),* $(,)? }) => {
        impl From<$api> for $msg {
            fn from(v: $api) -> Self {
                match v {
                    $($api::$v => <$msg>::$v,)*
                }
            }
        }

        pub fn $back(v: i32) -> Result<$api, $crate::Malformed> {
            match <$msg>::try_from(v) {
                $(Ok(<$msg>::$v) => Ok($api::$v),)*
                Ok(<$msg>::Unspecified) | Err(_) => Err($crate::Malformed(format!(
                    concat!($what, " {} is not one this side knows"),
                    v
                ))),
            }
        }
    };
}

#[macro_export]
macro_rules! same_fields {
    ($api:path, $msg:path, { $($f:ident),* $(,)? }) => {
        impl From<$api> for $msg {
            fn from(v: $api) -> Self {
                let $api { $($f),* } = v;
                Self { $($f),* }
            }
        }

        impl From<$msg> for $api {
            fn from(v: $msg) -> Self {
                let $msg { $($f),* } = v;
                Self { $($f),* }
            }
        }
    };
}

same_fields!(VolumeMount, pb::VolumeMount, { volume, path, read_only });
same_fields!(Limits, pb::Limits, { cpu_cores, memory_mb, disk_mb, pids });
same_fields!(ForkRequest, pb::ForkRequest, { count, labels, edge });
same_fields!(PauseRequest, pb::PauseRequest, { to_disk });
same_fields!(ResumeRequest, pb::ResumeRequest, { edge });
same_fields!(GroupRequest, pb::GroupRequest, { labels, to_disk });
same_fields!(PoolStatus, pb::PoolStatus, { name, image, backend, size, ready });
same_fields!(SnapshotInfo, pb::Snapshot, { id, edge, source, backend, image, project, labels, created_at_ms, memory_preserved, size_bytes, source_paused_ms });

impl From<CreateSandboxRequest> for pb::CreateSandboxRequest {
    fn from(r: CreateSandboxRequest) -> Self {
        let CreateSandboxRequest {
            backend,
            image,
            cpu_cores_limit,
            memory_limit_mb,
            disk_limit_mb,
            pids_limit,
            ttl_seconds,
            idle_timeout_seconds,
            on_timeout,
            auto_resume,
            labels,
            env,
            project,
            network,
            network_rules,
            egress_headers,
            volumes,
        } = r;
        pb::CreateSandboxRequest {
            backend,
            image,
            cpu_cores_limit,
            memory_limit_mb,
            disk_limit_mb,
            pids_limit,
            ttl_seconds,
            idle_timeout_seconds,
            labels,
            env,
            on_timeout,
            auto_resume,
            project,
            network,
            network_rules,
            egress_headers: headers_to_pb(egress_headers),
            volumes: volumes.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<pb::CreateSandboxRequest> for CreateSandboxRequest {
    fn from(r: pb::CreateSandboxRequest) -> Self {
        let pb::CreateSandboxRequest {
            backend,
            image,
            cpu_cores_limit,
            memory_limit_mb,
            disk_limit_mb,
            pids_limit,
            ttl_seconds,
            idle_timeout_seconds,
            labels,
            env,
            on_timeout,
            auto_resume,
            project,
            network,
            network_rules,
            egress_headers,
            volumes,
        } = r;
        CreateSandboxRequest {
            backend,
            image,
            cpu_cores_limit,
            memory_limit_mb,
            disk_limit_mb,
            pids_limit,
            ttl_seconds,
            idle_timeout_seconds,
            on_timeout,
            auto_resume,
            labels,
            env,
            project,
            network,
            network_rules,
            egress_headers: headers_from_pb(egress_headers),
            volumes: volumes.into_iter().map(Into::into).collect(),
        }
    }
}

same_variants!(SandboxState, pb::SandboxState, state_from_pb, "sandbox state", {
    Creating, Running, Paused, Stopping, Stopped
});

impl From<NetworkInfo> for pb::NetworkInfo {
    fn from(n: NetworkInfo) -> Self {
        let NetworkInfo {
            mode,
            address,
            rules,
            egress_headers,
        } = n;
        pb::NetworkInfo {
            mode,
            address,
            rules,
            egress_headers: headers_to_pb(egress_headers),
        }
    }
}

impl From<pb::NetworkInfo> for NetworkInfo {
    fn from(n: pb::NetworkInfo) -> Self {
        let pb::NetworkInfo {
            mode,
            address,
            rules,
            egress_headers,
        } = n;
        NetworkInfo {
            mode,
            address,
            rules,
            egress_headers: headers_from_pb(egress_headers),
        }
    }
}

impl From<SandboxInfo> for pb::Sandbox {
    fn from(s: SandboxInfo) -> Self {
        let SandboxInfo {
            id,
            edge,
            backend,
            image,
            state,
            limits,
            created_at_ms,
            expires_at_ms,
            idle_timeout_seconds,
            labels,
            oom_kills,
            forked_from,
            project,
            port_token,
            network,
            paused_to_disk,
            moved_from,
            from_pool,
            volumes,
        } = s;
        pb::Sandbox {
            id,
            edge,
            backend,
            image,
            state: pb::SandboxState::from(state).into(),
            limits: Some(limits.into()),
            created_at_ms,
            expires_at_ms,
            idle_timeout_seconds,
            labels,
            oom_kills,
            forked_from,
            project,
            port_token,
            network: Some(network.into()),
            paused_to_disk,
            moved_from,
            from_pool,
            volumes: volumes.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::Sandbox> for SandboxInfo {
    type Error = Malformed;
    fn try_from(s: pb::Sandbox) -> Result<Self, Malformed> {
        let pb::Sandbox {
            id,
            edge,
            backend,
            image,
            state,
            limits,
            created_at_ms,
            expires_at_ms,
            idle_timeout_seconds,
            labels,
            oom_kills,
            forked_from,
            project,
            port_token,
            network,
            paused_to_disk,
            moved_from,
            from_pool,
            volumes,
        } = s;
        Ok(SandboxInfo {
            id,
            edge,
            backend,
            image,
            state: state_from_pb(state)?,
            limits: limits.ok_or_else(|| missing("a sandbox's limits"))?.into(),
            created_at_ms,
            expires_at_ms,
            idle_timeout_seconds,
            labels,
            oom_kills,
            forked_from,
            project,
            port_token,
            network: network
                .ok_or_else(|| missing("a sandbox's network"))?
                .into(),
            paused_to_disk,
            moved_from,
            from_pool,
            volumes: volumes.into_iter().map(Into::into).collect(),
        })
    }
}

fn sandboxes_from_pb(v: Vec<pb::Sandbox>) -> Result<Vec<SandboxInfo>, Malformed> {
    v.into_iter().map(SandboxInfo::try_from).collect()
}

impl From<ListSandboxesResponse> for pb::ListSandboxesResponse {
    fn from(l: ListSandboxesResponse) -> Self {
        let ListSandboxesResponse { sandboxes } = l;
        pb::ListSandboxesResponse {
            sandboxes: sandboxes.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::ListSandboxesResponse> for ListSandboxesResponse {
    type Error = Malformed;
    fn try_from(l: pb::ListSandboxesResponse) -> Result<Self, Malformed> {
        Ok(ListSandboxesResponse {
            sandboxes: sandboxes_from_pb(l.sandboxes)?,
        })
    }
}

impl From<ForkResponse> for pb::ForkResponse {
    fn from(r: ForkResponse) -> Self {
        let ForkResponse {
            sandboxes,
            memory_preserved,
            note,
            source_paused_ms,
        } = r;
        pb::ForkResponse {
            sandboxes: sandboxes.into_iter().map(Into::into).collect(),
            memory_preserved,
            note,
            source_paused_ms,
        }
    }
}

impl TryFrom<pb::ForkResponse> for ForkResponse {
    type Error = Malformed;
    fn try_from(r: pb::ForkResponse) -> Result<Self, Malformed> {
        let pb::ForkResponse {
            sandboxes,
            memory_preserved,
            note,
            source_paused_ms,
        } = r;
        Ok(ForkResponse {
            sandboxes: sandboxes_from_pb(sandboxes)?,
            memory_preserved,
            note,
            source_paused_ms,
        })
    }
}

impl From<GroupResponse> for pb::GroupResponse {
    fn from(r: GroupResponse) -> Self {
        let GroupResponse {
            done,
            failed,
            took_ms,
        } = r;
        pb::GroupResponse {
            done,
            failed: failed
                .into_iter()
                .map(|f| {
                    let GroupFailure { id, code, message } = f;
                    pb::GroupFailure {
                        id,
                        code: pb::ErrorCode::from(code).into(),
                        message,
                    }
                })
                .collect(),
            took_ms,
        }
    }
}

impl TryFrom<pb::GroupResponse> for GroupResponse {
    type Error = Malformed;
    fn try_from(r: pb::GroupResponse) -> Result<Self, Malformed> {
        let pb::GroupResponse {
            done,
            failed,
            took_ms,
        } = r;
        Ok(GroupResponse {
            done,
            failed: failed
                .into_iter()
                .map(|f| {
                    let pb::GroupFailure { id, code, message } = f;
                    Ok(GroupFailure {
                        id,
                        code: code_from_pb(code)?,
                        message,
                    })
                })
                .collect::<Result<_, Malformed>>()?,
            took_ms,
        })
    }
}

impl From<ListSnapshotsResponse> for pb::ListSnapshotsResponse {
    fn from(l: ListSnapshotsResponse) -> Self {
        let ListSnapshotsResponse { snapshots } = l;
        pb::ListSnapshotsResponse {
            snapshots: snapshots.into_iter().map(Into::into).collect(),
        }
    }
}

impl From<pb::ListSnapshotsResponse> for ListSnapshotsResponse {
    fn from(l: pb::ListSnapshotsResponse) -> Self {
        ListSnapshotsResponse {
            snapshots: l.snapshots.into_iter().map(Into::into).collect(),
        }
    }
}

same_variants!(Capability, pb::Capability, capability_from_pb, "capability", {
    ForkMemory, PauseToDisk, Move, Volumes
});

impl From<NodeStatus> for pb::NodeStatus {
    fn from(n: NodeStatus) -> Self {
        let NodeStatus {
            name,
            healthy,
            backends,
            cgroup_mode,
            cpus,
            memory_total_mb,
            memory_available_mb,
            disk_free_mb,
            sandboxes,
            committed_cpu_cores,
            committed_memory_mb,
            max_sandboxes,
            projects,
            pools,
        } = n;
        pb::NodeStatus {
            name,
            healthy,
            backends: backends
                .into_iter()
                .map(|b| {
                    let BackendStatus {
                        name,
                        available,
                        detail,
                        capabilities,
                    } = b;
                    pb::BackendStatus {
                        name,
                        available,
                        detail,
                        capabilities: capabilities
                            .into_iter()
                            .map(|c| pb::Capability::from(c).into())
                            .collect(),
                    }
                })
                .collect(),
            cgroup_mode,
            cpus,
            memory_total_mb,
            memory_available_mb,
            disk_free_mb,
            sandboxes,
            committed_cpu_cores,
            committed_memory_mb,
            max_sandboxes,
            projects,
            pools: pools.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::NodeStatus> for NodeStatus {
    type Error = Malformed;
    fn try_from(n: pb::NodeStatus) -> Result<Self, Malformed> {
        let pb::NodeStatus {
            name,
            healthy,
            backends,
            cgroup_mode,
            cpus,
            memory_total_mb,
            memory_available_mb,
            disk_free_mb,
            sandboxes,
            committed_cpu_cores,
            committed_memory_mb,
            max_sandboxes,
            projects,
            pools,
        } = n;
        let backends = backends
            .into_iter()
            .map(|b| {
                let pb::BackendStatus {
                    name,
                    available,
                    detail,
                    capabilities,
                } = b;
                Ok(BackendStatus {
                    name,
                    available,
                    detail,
                    capabilities: capabilities
                        .into_iter()
                        .map(capability_from_pb)
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect::<Result<_, Malformed>>()?;
        Ok(NodeStatus {
            name,
            healthy,
            backends,
            cgroup_mode,
            cpus,
            memory_total_mb,
            memory_available_mb,
            disk_free_mb,
            sandboxes,
            committed_cpu_cores,
            committed_memory_mb,
            max_sandboxes,
            projects,
            pools: pools.into_iter().map(Into::into).collect(),
        })
    }
}

impl From<ClusterStatus> for pb::ClusterStatus {
    fn from(s: ClusterStatus) -> Self {
        let ClusterStatus { version, nodes } = s;
        pb::ClusterStatus {
            version,
            nodes: nodes.into_iter().map(Into::into).collect(),
        }
    }
}

impl TryFrom<pb::ClusterStatus> for ClusterStatus {
    type Error = Malformed;
    fn try_from(s: pb::ClusterStatus) -> Result<Self, Malformed> {
        let pb::ClusterStatus { version, nodes } = s;
        Ok(ClusterStatus {
            version,
            nodes: nodes
                .into_iter()
                .map(NodeStatus::try_from)
                .collect::<Result<_, _>>()?,
        })
    }
}

same_variants!(ErrorCode, pb::ErrorCode, code_from_pb, "error code", {
    InvalidArgument, Unauthenticated, PermissionDenied, NotFound, AlreadyExists,
    FailedPrecondition, ResourceExhausted, Unimplemented, Unavailable, DeadlineExceeded,
    Internal,
});

impl From<ApiError> for pb::Error {
    fn from(e: ApiError) -> Self {
        let ApiError {
            code,
            message,
            node_refused,
        } = e;
        pb::Error {
            code: pb::ErrorCode::from(code).into(),
            message,
            node_refused,
        }
    }
}

impl TryFrom<pb::Error> for ApiError {
    type Error = Malformed;
    fn try_from(e: pb::Error) -> Result<Self, Malformed> {
        let pb::Error {
            code,
            message,
            node_refused,
        } = e;
        Ok(ApiError {
            code: code_from_pb(code)?,
            message,
            node_refused,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn labels() -> BTreeMap<String, String> {
        BTreeMap::from([("team".into(), "rl".into()), ("run".into(), "7".into())])
    }

    fn headers() -> EgressHeaders {
        BTreeMap::from([(
            "api.example.com".into(),
            BTreeMap::from([("authorization".into(), "Bearer x".into())]),
        )])
    }

    /// Through the message's bytes and back, so the wire encoding is in the round trip.
    fn wire<M: Message + Default>(m: M) -> M {
        M::decode(m.encode_to_vec().as_slice()).unwrap()
    }

    fn sandbox() -> SandboxInfo {
        SandboxInfo {
            id: "edge1-abcdefabcdef".into(),
            edge: "edge1".into(),
            backend: "vm".into(),
            image: "root/py:3.11".into(),
            state: SandboxState::Paused,
            limits: Limits {
                cpu_cores: 1.5,
                memory_mb: 512,
                disk_mb: 2048,
                pids: 64,
            },
            created_at_ms: 1,
            expires_at_ms: 2,
            idle_timeout_seconds: Some(30),
            labels: labels(),
            oom_kills: 3,
            forked_from: Some("edge1-000000000000".into()),
            project: "root/a".into(),
            port_token: "tok".into(),
            network: NetworkInfo {
                mode: "rules".into(),
                address: Some("10.200.0.2".into()),
                rules: BTreeMap::from([("pypi".into(), true), ("10.0.0.0/8".into(), false)]),
                egress_headers: headers(),
            },
            paused_to_disk: true,
            moved_from: Some("edge2-111111111111".into()),
            from_pool: Some("warm".into()),
            volumes: vec![VolumeMount {
                volume: "edge1-222222222222".into(),
                path: "/mnt/d".into(),
                read_only: true,
            }],
        }
    }

    #[test]
    fn a_create_request_with_every_field_set_survives_the_wire() {
        let r = CreateSandboxRequest {
            backend: "microvm".into(),
            image: "root/py:3.11".into(),
            cpu_cores_limit: Some(0.5),
            memory_limit_mb: Some(256.0),
            disk_limit_mb: Some(1024.0),
            pids_limit: Some(64.0),
            ttl_seconds: Some(60.0),
            idle_timeout_seconds: Some(10.0),
            on_timeout: Some("pause_to_disk".into()),
            auto_resume: Some(false),
            labels: labels(),
            env: BTreeMap::from([("A".into(), "1".into())]),
            project: Some("root/a".into()),
            network: Some("none".into()),
            network_rules: BTreeMap::from([("*.example.com".into(), true)]),
            egress_headers: headers(),
            volumes: vec![VolumeMount {
                volume: "data".into(),
                path: "/mnt/data".into(),
                read_only: false,
            }],
        };
        let back = CreateSandboxRequest::from(wire(pb::CreateSandboxRequest::from(r.clone())));
        assert_eq!(back, r);
        // Unset optionals stay unset (not zero).
        let empty = CreateSandboxRequest::default();
        assert_eq!(
            CreateSandboxRequest::from(wire(pb::CreateSandboxRequest::from(empty.clone()))),
            empty
        );
    }

    #[test]
    fn a_sandbox_and_a_fork_answer_survive_the_wire() {
        let s = sandbox();
        assert_eq!(
            SandboxInfo::try_from(wire(pb::Sandbox::from(s.clone()))).unwrap(),
            s
        );
        let f = ForkResponse {
            sandboxes: vec![s.clone(), s.clone()],
            memory_preserved: true,
            note: "n".into(),
            source_paused_ms: 9,
        };
        let back = ForkResponse::try_from(wire(pb::ForkResponse::from(f.clone()))).unwrap();
        assert_eq!(back.sandboxes, f.sandboxes);
        assert_eq!(
            (back.memory_preserved, back.note, back.source_paused_ms),
            (true, "n".to_string(), 9)
        );
    }

    #[test]
    fn a_node_status_with_capabilities_and_pools_survives_the_wire() {
        let n = NodeStatus {
            name: "edge1".into(),
            healthy: true,
            backends: vec![BackendStatus {
                name: "vm".into(),
                available: true,
                detail: "qemu".into(),
                capabilities: Capability::ALL.to_vec(),
            }],
            cgroup_mode: "hybrid".into(),
            cpus: 2,
            memory_total_mb: 24000,
            memory_available_mb: 20000,
            disk_free_mb: 5,
            sandboxes: 7,
            committed_cpu_cores: 3.5,
            committed_memory_mb: 4096,
            max_sandboxes: 10000,
            projects: BTreeMap::from([("root".into(), 7)]),
            pools: vec![PoolStatus {
                name: "warm".into(),
                image: "root/base".into(),
                backend: "container".into(),
                size: 4,
                ready: 3,
            }],
        };
        let s = ClusterStatus {
            version: "0.1.0".into(),
            nodes: vec![n.clone(), NodeStatus::unreachable("edge2")],
        };
        let back = ClusterStatus::try_from(wire(pb::ClusterStatus::from(s))).unwrap();
        assert_eq!(back.nodes, vec![n, NodeStatus::unreachable("edge2")]);
    }

    #[test]
    fn group_answers_and_errors_keep_their_codes() {
        let g = GroupResponse {
            done: vec!["a".into()],
            failed: vec![GroupFailure {
                id: "b".into(),
                code: ErrorCode::FailedPrecondition,
                message: "m".into(),
            }],
            took_ms: 4,
        };
        let back = GroupResponse::try_from(wire(pb::GroupResponse::from(g))).unwrap();
        assert_eq!(back.failed[0].code, ErrorCode::FailedPrecondition);
        assert_eq!((back.done, back.took_ms), (vec!["a".to_string()], 4));
    }

    #[test]
    fn unknown_enum_values_and_missing_messages_are_malformed_not_defaults() {
        let mut s = pb::Sandbox::from(sandbox());
        s.state = 99;
        assert!(SandboxInfo::try_from(s).is_err());
        let mut s = pb::Sandbox::from(sandbox());
        s.state = pb::SandboxState::Unspecified.into();
        assert!(SandboxInfo::try_from(s).is_err());
        let mut s = pb::Sandbox::from(sandbox());
        s.limits = None;
        let e = SandboxInfo::try_from(s).unwrap_err();
        assert!(e.0.contains("limits"), "{e}");
        let e = pb::Error {
            code: 0,
            message: "x".into(),
            node_refused: false,
        };
        assert!(ApiError::try_from(e).is_err());
    }
}
