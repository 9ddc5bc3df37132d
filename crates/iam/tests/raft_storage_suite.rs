//! openraft's own conformance suite for log and state machine storage, run on the redb stores.

use std::time::Duration;

use dsec_iam::raft::TypeConfig;
use dsec_iam::raft::log_store::LogStore;
use dsec_iam::raft::state_machine::StateMachineStore;
use openraft::StorageError;
use openraft::testing::log::{StoreBuilder, Suite};
use tempfile::TempDir;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().unwrap();
        let log = LogStore::open(&dir.path().join("raft-log.redb")).unwrap();
        let sm = StateMachineStore::open(&dir.path().join("iam.redb")).unwrap();
        Ok((dir, log, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redb_stores_pass_the_openraft_storage_suite() {
    tokio::time::timeout(Duration::from_secs(120), Suite::test_all(Builder))
        .await
        .expect("the storage suite ran past its time limit")
        .unwrap();
}
