//! IAM's types as the messages of `dsec.v1.Iam` (`proto/dsec/v1/iam.proto`), both ways. As
//! in `dsec_rpc::convert`, every conversion destructures without `..`, so a field added to
//! a type and not to the proto does not compile; unknown enum values are refused, not
//! defaulted. A refusal travels as the API error of its code (`dsec_rpc::to_status`).

use dsec_common::{ApiError, ErrorCode};
use dsec_rpc::Malformed;
use dsec_rpc::pb;
use dsec_rpc::pb::command::Command as Cmd;

use crate::state::{
    Command, KeyRecord, PrincipalKind, Project, Quota, Refusal, Reservation, Usage,
};
use crate::{Principal, ProjectView};

dsec_rpc::same_variants!(PrincipalKind, pb::PrincipalKind, kind, "principal kind", {
    Human, Agent
});

fn required<T>(v: Option<T>, what: &str) -> Result<T, Malformed> {
    v.ok_or_else(|| Malformed(format!("{what} is missing")))
}

impl From<Principal> for pb::Principal {
    fn from(p: Principal) -> Self {
        let Principal {
            name,
            kind,
            key_id,
            project,
        } = p;
        pb::Principal {
            name,
            kind: pb::PrincipalKind::from(kind).into(),
            key_id,
            project,
        }
    }
}

impl TryFrom<pb::Principal> for Principal {
    type Error = Malformed;
    fn try_from(p: pb::Principal) -> Result<Self, Malformed> {
        let pb::Principal {
            name,
            kind: k,
            key_id,
            project,
        } = p;
        Ok(Principal {
            name,
            kind: kind(k)?,
            key_id,
            project,
        })
    }
}

dsec_rpc::same_fields!(Quota, pb::Quota, { sandboxes, cpu_cores, memory_mb, disk_mb });
dsec_rpc::same_fields!(Usage, pb::Usage, { sandboxes, cpu_cores, memory_mb, disk_mb });

impl From<Reservation> for pb::Reservation {
    fn from(r: Reservation) -> Self {
        let Reservation {
            sandbox_id,
            project,
            edge,
            usage,
        } = r;
        pb::Reservation {
            sandbox_id,
            project,
            edge,
            usage: Some(usage.into()),
        }
    }
}

impl TryFrom<pb::Reservation> for Reservation {
    type Error = Malformed;
    fn try_from(r: pb::Reservation) -> Result<Self, Malformed> {
        let pb::Reservation {
            sandbox_id,
            project,
            edge,
            usage,
        } = r;
        Ok(Reservation {
            sandbox_id,
            project,
            edge,
            usage: required(usage, "a reservation's usage")?.into(),
        })
    }
}

impl From<Command> for pb::Command {
    fn from(c: Command) -> Self {
        let cmd = match c {
            Command::CreateProject {
                actor,
                path,
                quota,
                now_ms,
            } => Cmd::CreateProject(pb::CreateProject {
                actor,
                path,
                quota: Some(quota.into()),
                now_ms,
            }),
            Command::SetQuota { actor, path, quota } => Cmd::SetQuota(pb::SetQuota {
                actor,
                path,
                quota: Some(quota.into()),
            }),
            Command::CreateKey {
                actor,
                project,
                principal,
                kind,
                sha256,
                now_ms,
            } => Cmd::CreateKey(pb::CreateKey {
                actor,
                project,
                principal,
                kind: pb::PrincipalKind::from(kind).into(),
                sha256,
                now_ms,
            }),
            Command::RevokeKey { actor, key_id } => Cmd::RevokeKey(pb::RevokeKey { actor, key_id }),
            Command::Reserve(r) => Cmd::Reserve(r.into()),
            Command::Hold(r) => Cmd::Hold(r.into()),
            Command::Release { sandbox_id } => Cmd::Release(pb::Release { sandbox_id }),
            Command::Reconcile { edge, live } => Cmd::Reconcile(pb::Reconcile { edge, live }),
        };
        pb::Command { command: Some(cmd) }
    }
}

impl TryFrom<pb::Command> for Command {
    type Error = Malformed;
    fn try_from(c: pb::Command) -> Result<Self, Malformed> {
        Ok(match required(c.command, "the command")? {
            Cmd::CreateProject(pb::CreateProject {
                actor,
                path,
                quota,
                now_ms,
            }) => Command::CreateProject {
                actor,
                path,
                quota: quota.map(Into::into).unwrap_or_default(),
                now_ms,
            },
            Cmd::SetQuota(pb::SetQuota { actor, path, quota }) => Command::SetQuota {
                actor,
                path,
                quota: quota.map(Into::into).unwrap_or_default(),
            },
            Cmd::CreateKey(pb::CreateKey {
                actor,
                project,
                principal,
                kind: k,
                sha256,
                now_ms,
            }) => Command::CreateKey {
                actor,
                project,
                principal,
                kind: kind(k)?,
                sha256,
                now_ms,
            },
            Cmd::RevokeKey(pb::RevokeKey { actor, key_id }) => Command::RevokeKey { actor, key_id },
            Cmd::Reserve(r) => Command::Reserve(r.try_into()?),
            Cmd::Hold(r) => Command::Hold(r.try_into()?),
            Cmd::Release(pb::Release { sandbox_id }) => Command::Release { sandbox_id },
            Cmd::Reconcile(pb::Reconcile { edge, live }) => Command::Reconcile { edge, live },
        })
    }
}

impl From<ProjectView> for pb::Project {
    fn from(v: ProjectView) -> Self {
        let ProjectView {
            project:
                Project {
                    path,
                    quota,
                    created_ms,
                },
            usage,
        } = v;
        pb::Project {
            path,
            quota: Some(quota.into()),
            created_ms,
            usage: Some(usage.into()),
        }
    }
}

impl From<pb::Project> for ProjectView {
    fn from(p: pb::Project) -> Self {
        let pb::Project {
            path,
            quota,
            created_ms,
            usage,
        } = p;
        ProjectView {
            project: Project {
                path,
                quota: quota.map(Into::into).unwrap_or_default(),
                created_ms,
            },
            usage: usage.map(Into::into).unwrap_or_default(),
        }
    }
}

impl From<KeyRecord> for pb::KeyRecord {
    fn from(k: KeyRecord) -> Self {
        let KeyRecord {
            key_id,
            sha256,
            principal,
            kind,
            project,
            created_ms,
            revoked,
        } = k;
        pb::KeyRecord {
            key_id,
            sha256,
            principal,
            kind: pb::PrincipalKind::from(kind).into(),
            project,
            created_ms,
            revoked,
        }
    }
}

impl TryFrom<pb::KeyRecord> for KeyRecord {
    type Error = Malformed;
    fn try_from(k: pb::KeyRecord) -> Result<Self, Malformed> {
        let pb::KeyRecord {
            key_id,
            sha256,
            principal,
            kind: kd,
            project,
            created_ms,
            revoked,
        } = k;
        Ok(KeyRecord {
            key_id,
            sha256,
            principal,
            kind: kind(kd)?,
            project,
            created_ms,
            revoked,
        })
    }
}

/// A refusal as the API error of its code.
pub fn refusal_to_api(r: &Refusal) -> ApiError {
    let code = match r {
        Refusal::Invalid(_) => ErrorCode::InvalidArgument,
        Refusal::NotFound(_) => ErrorCode::NotFound,
        Refusal::Forbidden(_) => ErrorCode::PermissionDenied,
        Refusal::Exists(_) => ErrorCode::AlreadyExists,
        Refusal::Quota(_) => ErrorCode::ResourceExhausted,
    };
    ApiError::new(code, r.to_string())
}

/// The refusal an API error stands for; `None` for an outage (try another replica).
pub fn refusal_from_api(e: &ApiError) -> Option<Refusal> {
    let m = e.message.clone();
    Some(match e.code {
        ErrorCode::InvalidArgument => Refusal::Invalid(m),
        ErrorCode::NotFound => Refusal::NotFound(m),
        ErrorCode::PermissionDenied => Refusal::Forbidden(m),
        ErrorCode::AlreadyExists => Refusal::Exists(m),
        ErrorCode::ResourceExhausted => Refusal::Quota(m),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn wire<M: Message + Default>(m: M) -> M {
        M::decode(m.encode_to_vec().as_slice()).unwrap()
    }

    fn reservation() -> Reservation {
        Reservation {
            sandbox_id: "e1-abc".into(),
            project: "root/a".into(),
            edge: "e1".into(),
            usage: Usage {
                sandboxes: 1,
                cpu_cores: 0.5,
                memory_mb: 256,
                disk_mb: 1024,
            },
        }
    }

    #[test]
    fn every_command_survives_the_wire() {
        let quota = Quota {
            sandboxes: Some(3),
            cpu_cores: Some(1.5),
            memory_mb: None,
            disk_mb: Some(10),
        };
        let cmds = vec![
            Command::CreateProject {
                actor: "root".into(),
                path: "root/a".into(),
                quota,
                now_ms: 5,
            },
            Command::SetQuota {
                actor: "root".into(),
                path: "root/a".into(),
                quota,
            },
            Command::CreateKey {
                actor: "root".into(),
                project: "root/a".into(),
                principal: "bot".into(),
                kind: PrincipalKind::Agent,
                sha256: "ab".into(),
                now_ms: 6,
            },
            Command::RevokeKey {
                actor: "root".into(),
                key_id: "k1".into(),
            },
            Command::Reserve(reservation()),
            Command::Hold(reservation()),
            Command::Release {
                sandbox_id: "e1-abc".into(),
            },
            Command::Reconcile {
                edge: "e1".into(),
                live: vec!["e1-abc".into(), "e1-def".into()],
            },
        ];
        for c in cmds {
            let back = Command::try_from(wire(pb::Command::from(c.clone()))).unwrap();
            assert_eq!(back, c);
        }
        assert!(Command::try_from(pb::Command { command: None }).is_err());
    }

    #[test]
    fn principals_keys_and_projects_survive_the_wire() {
        let p = Principal {
            name: "n".into(),
            kind: PrincipalKind::Human,
            key_id: "k".into(),
            project: "root/a".into(),
        };
        assert_eq!(
            Principal::try_from(wire(pb::Principal::from(p.clone()))).unwrap(),
            p
        );
        let k = KeyRecord {
            key_id: "k".into(),
            sha256: "s".into(),
            principal: "n".into(),
            kind: PrincipalKind::Agent,
            project: "root".into(),
            created_ms: 3,
            revoked: true,
        };
        assert_eq!(
            KeyRecord::try_from(wire(pb::KeyRecord::from(k.clone()))).unwrap(),
            k
        );
        let v = ProjectView {
            project: Project {
                path: "root/a".into(),
                quota: Quota {
                    sandboxes: Some(1),
                    ..Default::default()
                },
                created_ms: 9,
            },
            usage: reservation().usage,
        };
        let back = ProjectView::from(wire(pb::Project::from(v.clone())));
        assert_eq!((back.project, back.usage), (v.project, v.usage));
        let mut bad = pb::Principal::from(p);
        bad.kind = 0;
        assert!(Principal::try_from(bad).is_err());
    }

    #[test]
    fn a_refusal_keeps_its_kind_through_its_code() {
        for r in [
            Refusal::Invalid("i".into()),
            Refusal::NotFound("n".into()),
            Refusal::Forbidden("f".into()),
            Refusal::Exists("e".into()),
            Refusal::Quota("q".into()),
        ] {
            assert_eq!(refusal_from_api(&refusal_to_api(&r)), Some(r));
        }
        assert_eq!(refusal_from_api(&ApiError::unavailable("x")), None);
    }
}
