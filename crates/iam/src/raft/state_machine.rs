//! The replicated state machine: committed commands applied to an [`IamState`], written to
//! the same tables as [`crate::store::LocalStore`] together with the last applied log id and
//! membership, in one redb transaction per batch. A snapshot is the JSON of the state; the
//! latest one is kept in the file too, so a restarted leader can still send it to a replica
//! whose log it has already purged.

use std::io;
use std::path::Path;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use futures_util::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend};
use redb::{Database, ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};

use super::types::{
    IamResponse, LogId, Snapshot, SnapshotData, SnapshotMeta, StoredMembership, TypeConfig, io_err,
};
use crate::IamError;
use crate::state::IamState;
use crate::store::{create_tables, db_err, load_state, write_effect, write_state};

const SM_META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_sm_meta");
const APPLIED: &str = "applied";
const SNAPSHOT_META: &str = "snapshot_meta";
/// The latest snapshot's bytes, kept as they are (not inside JSON).
const SNAPSHOT_DATA: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_snapshot");
const SNAPSHOT_KEY: &str = "latest";

/// The last applied log id and the membership it brought, kept with the state.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Applied {
    last_applied: Option<LogId>,
    membership: StoredMembership,
}

struct StoredSnapshot {
    meta: SnapshotMeta,
    data: SnapshotData,
}

pub(crate) struct Data {
    pub(crate) state: IamState,
    applied: Applied,
}

struct Inner {
    db: Database,
    data: RwLock<Data>,
}

/// Cheap to clone; the node reads the applied state through it.
#[derive(Clone)]
pub struct StateMachineStore {
    inner: Arc<Inner>,
}

fn get_json<T: for<'de> Deserialize<'de>>(db: &Database, key: &str) -> Result<Option<T>, IamError> {
    let tx = db.begin_read().map_err(db_err)?;
    let t = tx.open_table(SM_META).map_err(db_err)?;
    let Some(v) = redb::ReadableTable::get(&t, key).map_err(db_err)? else {
        return Ok(None);
    };
    serde_json::from_slice(v.value())
        .map(Some)
        .map_err(|e| IamError::Storage(format!("the Raft state record {key} does not parse: {e}")))
}

fn put_json<T: Serialize>(tx: &redb::WriteTransaction, key: &str, v: &T) -> io::Result<()> {
    let bytes = serde_json::to_vec(v).map_err(io_err)?;
    tx.open_table(SM_META)
        .map_err(io_err)?
        .insert(key, bytes.as_slice())
        .map_err(io_err)?;
    Ok(())
}

fn put_snapshot(tx: &redb::WriteTransaction, s: &StoredSnapshot) -> io::Result<()> {
    put_json(tx, SNAPSHOT_META, &s.meta)?;
    tx.open_table(SNAPSHOT_DATA)
        .map_err(io_err)?
        .insert(SNAPSHOT_KEY, s.data.as_slice())
        .map_err(io_err)?;
    Ok(())
}

impl StateMachineStore {
    pub fn open(path: &Path) -> Result<StateMachineStore, IamError> {
        let db = crate::store::open_db(path)?;
        let tx = db.begin_write().map_err(db_err)?;
        create_tables(&tx)?;
        tx.open_table(SM_META).map_err(db_err)?;
        tx.open_table(SNAPSHOT_DATA).map_err(db_err)?;
        tx.commit().map_err(db_err)?;
        let mut state = load_state(&db)?;
        let applied: Applied = get_json(&db, APPLIED)?.unwrap_or_default();
        if state.projects.is_empty() {
            // Every replica starts from the same root project (time 0), so their states agree
            // before the first entry. It goes to disk now: entries only write what they change.
            state = IamState::bootstrap(0);
            let tx = db.begin_write().map_err(db_err)?;
            write_state(&tx, &state)?;
            tx.commit().map_err(db_err)?;
        }
        Ok(StateMachineStore {
            inner: Arc::new(Inner {
                db,
                data: RwLock::new(Data { state, applied }),
            }),
        })
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Data> {
        self.inner.data.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_applied(&self, tx: &redb::WriteTransaction, applied: &Applied) -> io::Result<()> {
        put_json(tx, APPLIED, applied)
    }

    fn reload(&self) {
        let fresh = load_state(&self.inner.db);
        let applied = get_json::<Applied>(&self.inner.db, APPLIED);
        if let (Ok(state), Ok(applied)) = (fresh, applied) {
            let mut d = self.inner.data.write().unwrap_or_else(|p| p.into_inner());
            d.state = state;
            d.applied = applied.unwrap_or_default();
        }
    }

    fn stored_snapshot(&self) -> io::Result<Option<StoredSnapshot>> {
        let Some(meta) = get_json::<SnapshotMeta>(&self.inner.db, SNAPSHOT_META).map_err(io_err)?
        else {
            return Ok(None);
        };
        let tx = self.inner.db.begin_read().map_err(io_err)?;
        let t = tx.open_table(SNAPSHOT_DATA).map_err(io_err)?;
        let data = redb::ReadableTable::get(&t, SNAPSHOT_KEY)
            .map_err(io_err)?
            .map(|v| v.value().to_vec())
            .ok_or_else(|| io_err("the IAM snapshot's data is missing"))?;
        Ok(Some(StoredSnapshot { meta, data }))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        let (data, meta) = {
            let d = self.read();
            let data = serde_json::to_vec(&d.state).map_err(io_err)?;
            let meta = SnapshotMeta {
                last_log_id: d.applied.last_applied,
                last_membership: d.applied.membership.clone(),
            };
            (data, meta)
        };
        let stored = StoredSnapshot { meta, data };
        let tx = self.inner.db.begin_write().map_err(io_err)?;
        put_snapshot(&tx, &stored)?;
        tx.commit().map_err(io_err)?;
        tracing::info!(last = ?stored.meta.last_log_id, bytes = stored.data.len(), "built an IAM snapshot");
        Ok(Snapshot {
            meta: stored.meta,
            snapshot: stored.data,
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotData = SnapshotData;
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let d = self.read();
        Ok((d.applied.last_applied, d.applied.membership.clone()))
    }

    async fn apply<Strm>(&mut self, entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let batch: Vec<EntryResponder<TypeConfig>> = entries.try_collect().await?;
        if batch.is_empty() {
            return Ok(());
        }
        let mut responses = Vec::with_capacity(batch.len());
        let res = {
            let mut d = self.inner.data.write().unwrap_or_else(|p| p.into_inner());
            (|| {
                let tx = self.inner.db.begin_write().map_err(io_err)?;
                for (entry, responder) in batch {
                    d.applied.last_applied = Some(entry.log_id);
                    let mut resp = IamResponse::default();
                    match entry.payload {
                        EntryPayload::Blank => {}
                        EntryPayload::Normal(req) => match d.state.apply(req.0) {
                            Ok(fx) => write_effect(&tx, &fx).map_err(io_err)?,
                            Err(refusal) => resp.refusal = Some(refusal),
                        },
                        EntryPayload::Membership(m) => {
                            d.applied.membership = StoredMembership::new(Some(entry.log_id), m);
                        }
                    }
                    responses.push((responder, resp));
                }
                self.write_applied(&tx, &d.applied)?;
                tx.commit().map_err(io_err)
            })()
        };
        if let Err(e) = res {
            // Memory is ahead of the disk: reread the disk, which has the truth. openraft
            // treats the error as fatal for this replica anyway.
            tracing::error!(error = %e, "applying IAM entries failed");
            self.reload();
            return Err(e);
        }
        for (responder, resp) in responses {
            if let Some(r) = responder {
                r.send(resp);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: SnapshotData,
    ) -> Result<(), io::Error> {
        let state: IamState = serde_json::from_slice(&snapshot)
            .map_err(|e| io_err(format!("an IAM snapshot does not parse: {e}")))?;
        let applied = Applied {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: snapshot,
        };
        let mut d = self.inner.data.write().unwrap_or_else(|p| p.into_inner());
        let tx = self.inner.db.begin_write().map_err(io_err)?;
        write_state(&tx, &state).map_err(io_err)?;
        self.write_applied(&tx, &applied)?;
        put_snapshot(&tx, &stored)?;
        tx.commit().map_err(io_err)?;
        tracing::info!(last = ?meta.last_log_id, "installed an IAM snapshot");
        d.state = state;
        d.applied = applied;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        Ok(self.stored_snapshot()?.map(|s| Snapshot {
            meta: s.meta,
            snapshot: s.data,
        }))
    }
}
