//! The Raft log in a redb file: entries by index, plus the vote, the committed log id and
//! the last purged log id. Each call is one write transaction, durable when it returns.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{OptionalSend, RaftTypeConfig};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::types::{Entry, LogId, TypeConfig, Vote, io_err};
use crate::IamError;

const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_logs");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const LAST_PURGED: &str = "last_purged";

/// Cheap to clone: the reader openraft asks for is another handle on the same file.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> io::Result<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| io_err(format!("a Raft log record does not parse: {e}")))
}

fn encode<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(io_err)
}

impl LogStore {
    pub fn open(path: &Path) -> Result<LogStore, IamError> {
        let db = crate::store::open_db(path)?;
        let tx = db.begin_write().map_err(crate::store::db_err)?;
        tx.open_table(LOGS).map_err(crate::store::db_err)?;
        tx.open_table(META).map_err(crate::store::db_err)?;
        tx.commit().map_err(crate::store::db_err)?;
        Ok(LogStore { db: Arc::new(db) })
    }

    fn get_meta<T: DeserializeOwned>(&self, key: &str) -> io::Result<Option<T>> {
        let tx = self.db.begin_read().map_err(io_err)?;
        let t = tx.open_table(META).map_err(io_err)?;
        match t.get(key).map_err(io_err)? {
            Some(v) => Ok(Some(decode(v.value())?)),
            None => Ok(None),
        }
    }

    fn put_meta<T: Serialize>(&self, key: &str, v: &T) -> io::Result<()> {
        let bytes = encode(v)?;
        let tx = self.db.begin_write().map_err(io_err)?;
        tx.open_table(META)
            .map_err(io_err)?
            .insert(key, bytes.as_slice())
            .map_err(io_err)?;
        tx.commit().map_err(io_err)
    }

    /// The index of the first entry still in the log, if any (tests check purging with it).
    pub fn first_index(&self) -> io::Result<Option<u64>> {
        let tx = self.db.begin_read().map_err(io_err)?;
        let t = tx.open_table(LOGS).map_err(io_err)?;
        Ok(t.first().map_err(io_err)?.map(|(k, _)| k.value()))
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let start = match range.start_bound() {
            Bound::Included(i) => Bound::Included(*i),
            Bound::Excluded(i) => Bound::Excluded(*i),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(*i),
            Bound::Excluded(i) => Bound::Excluded(*i),
            Bound::Unbounded => Bound::Unbounded,
        };
        let tx = self.db.begin_read().map_err(io_err)?;
        let t = tx.open_table(LOGS).map_err(io_err)?;
        let mut out = Vec::new();
        for item in t.range::<u64>((start, end)).map_err(io_err)? {
            let (_, v) = item.map_err(io_err)?;
            out.push(decode(v.value())?);
        }
        Ok(out)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        self.get_meta(VOTE)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last_purged: Option<LogId> = self.get_meta(LAST_PURGED)?;
        let last = {
            let tx = self.db.begin_read().map_err(io_err)?;
            let t = tx.open_table(LOGS).map_err(io_err)?;
            match t.last().map_err(io_err)? {
                Some((_, v)) => Some(decode::<Entry>(v.value())?.log_id),
                None => None,
            }
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last.or(last_purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        self.put_meta(VOTE, vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        self.put_meta(COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.get_meta::<Option<LogId>>(COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = <TypeConfig as RaftTypeConfig>::Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let res = (|| {
            let tx = self.db.begin_write().map_err(io_err)?;
            {
                let mut t = tx.open_table(LOGS).map_err(io_err)?;
                for e in entries {
                    t.insert(e.log_id.index, encode(&e)?.as_slice())
                        .map_err(io_err)?;
                }
            }
            tx.commit().map_err(io_err)
        })();
        // The commit above is durable (redb syncs on commit), so the flush is done now.
        callback.io_completed(res.as_ref().map(|_| ()).map_err(io_err));
        res
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index + 1).unwrap_or(0);
        tracing::debug!(from, "truncating the Raft log");
        let tx = self.db.begin_write().map_err(io_err)?;
        tx.open_table(LOGS)
            .map_err(io_err)?
            .retain_in(from.., |_, _| false)
            .map_err(io_err)?;
        tx.commit().map_err(io_err)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        tracing::debug!(upto = log_id.index, "purging the Raft log");
        let bytes = encode(&log_id)?;
        let tx = self.db.begin_write().map_err(io_err)?;
        {
            let mut meta = tx.open_table(META).map_err(io_err)?;
            meta.insert(LAST_PURGED, bytes.as_slice()).map_err(io_err)?;
            tx.open_table(LOGS)
                .map_err(io_err)?
                .retain_in(..=log_id.index, |_, _| false)
                .map_err(io_err)?;
        }
        tx.commit().map_err(io_err)
    }
}
