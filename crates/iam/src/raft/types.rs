//! The openraft type configuration of the IAM store.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::state::{Command, Refusal};

pub type NodeId = u64;

/// A log entry's payload: one IAM command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IamRequest(pub Command);

impl fmt::Display for IamRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only the kind of command: log lines should not carry key hashes or names.
        let kind = match &self.0 {
            Command::CreateProject { .. } => "create_project",
            Command::SetQuota { .. } => "set_quota",
            Command::CreateKey { .. } => "create_key",
            Command::RevokeKey { .. } => "revoke_key",
            Command::Reserve(_) => "reserve",
            Command::Hold(_) => "hold",
            Command::Release { .. } => "release",
            Command::Reconcile { .. } => "reconcile",
        };
        write!(f, "iam:{kind}")
    }
}

/// What applying a command gave. A refusal is a normal outcome: the command is in the log
/// and every replica refuses it the same way.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IamResponse {
    pub refusal: Option<Refusal>,
}

openraft::declare_raft_types!(
    /// The Raft types of the IAM store.
    pub TypeConfig:
        D = IamRequest,
        R = IamResponse,
        NodeId = NodeId,
        Node = openraft::BasicNode,
);

pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
pub type Vote = openraft::alias::VoteOf<TypeConfig>;
pub type Entry = openraft::alias::EntryOf<TypeConfig>;
pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
/// A snapshot's data: the JSON of the [`crate::state::IamState`] at its last log id.
pub type SnapshotData = Vec<u8>;
pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, SnapshotData>;

pub(crate) fn io_err(e: impl fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}
