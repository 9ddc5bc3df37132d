//! The E2B-compatible gateway: E2B's control-plane REST API and in-sandbox Connect-RPC
//! protocol mapped onto the OpenDsec runtime API. Not built yet: this crate reserves the
//! component's place in the workspace.
