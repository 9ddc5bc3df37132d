//! The IAM state replicated with Raft (openraft): every replica keeps the same redb tables
//! as [`crate::store::LocalStore`], fed from a replicated log instead of direct writes.
//!
//! - [`types`]: the openraft type configuration (log payload = an IAM [`crate::Command`]).
//! - [`log_store`]: the Raft log, vote and commit pointer in a redb file.
//! - [`state_machine`]: applies committed commands to an [`crate::state::IamState`] and its
//!   tables; snapshots are the serialized state.
//! - [`network`]: replica-to-replica RPC, JSON over HTTP/1.1.
//! - [`node`]: [`RaftIam`], a replica that implements [`crate::Iam`].

pub mod log_store;
pub mod network;
pub mod node;
pub mod state_machine;
pub mod types;

pub use node::{RaftConfig, RaftIam};
pub use types::{IamRequest, IamResponse, NodeId, TypeConfig};
