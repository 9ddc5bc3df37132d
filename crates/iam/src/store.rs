//! The IAM state on disk: one redb file with a table per kind of record, written in one
//! transaction per command, so a crash leaves either the whole command or none of it.
//! This is the single-replica store `dsec up` uses; the replicated store applies the same
//! commands from its log to the same tables.

use std::path::Path;
use std::sync::Mutex;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::IamError;
use crate::state::{Command, Effect, IamState, KeyRecord, Project, Reservation};

const PROJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("projects");
const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const RESERVATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("reservations");

pub(crate) fn db_err(e: impl std::fmt::Display) -> IamError {
    IamError::Storage(e.to_string())
}

pub struct LocalStore {
    db: Database,
    state: Mutex<IamState>,
}

fn load_table<T: DeserializeOwned>(
    db: &Database,
    def: TableDefinition<&str, &[u8]>,
) -> Result<Vec<T>, IamError> {
    let tx = db.begin_read().map_err(db_err)?;
    let t = tx.open_table(def).map_err(db_err)?;
    let mut out = Vec::new();
    for item in t.iter().map_err(db_err)? {
        let (_, v) = item.map_err(db_err)?;
        out.push(
            serde_json::from_slice(v.value())
                .map_err(|e| IamError::Storage(format!("a record does not parse: {e}")))?,
        );
    }
    Ok(out)
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// Opens (or creates) a redb file, and its directory.
pub(crate) fn open_db(path: &Path) -> Result<Database, IamError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(db_err)?;
    }
    Database::create(path)
        .map_err(|e| IamError::Storage(format!("opening {}: {e}", path.display())))
}

impl LocalStore {
    pub fn open(path: &Path, now_ms: u64) -> Result<LocalStore, IamError> {
        let db = open_db(path)?;
        let tx = db.begin_write().map_err(db_err)?;
        create_tables(&tx)?;
        tx.commit().map_err(db_err)?;
        let state = load_state(&db)?;
        let store = LocalStore {
            db,
            state: Mutex::new(state),
        };
        if store.read(|s| s.projects.is_empty()) {
            let boot = IamState::bootstrap(now_ms);
            let fx = Effect {
                projects: boot.projects.values().cloned().collect(),
                ..Effect::default()
            };
            store.write(&fx)?;
            *store.state.lock().unwrap_or_else(|p| p.into_inner()) = boot;
        }
        Ok(store)
    }

    fn write(&self, fx: &Effect) -> Result<(), IamError> {
        let tx = self.db.begin_write().map_err(db_err)?;
        write_effect(&tx, fx)?;
        tx.commit().map_err(db_err)
    }

    /// Applies a command and makes it durable before answering.
    pub fn apply(&self, cmd: Command) -> Result<Effect, IamError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let fx = st.apply(cmd).map_err(IamError::Refused)?;
        if let Err(e) = self.write(&fx) {
            // Memory is ahead of the disk: reread the disk, which has the truth.
            drop(st);
            if let Ok(fresh) = load_state(&self.db) {
                *self.state.lock().unwrap_or_else(|p| p.into_inner()) = fresh;
            }
            return Err(e);
        }
        Ok(fx)
    }

    pub fn read<R>(&self, f: impl FnOnce(&IamState) -> R) -> R {
        f(&self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Creates the state's tables if they are missing.
pub(crate) fn create_tables(tx: &WriteTransaction) -> Result<(), IamError> {
    for def in [PROJECTS, KEYS, RESERVATIONS] {
        tx.open_table(def).map_err(db_err)?;
    }
    Ok(())
}

/// Writes what one command changed, inside the caller's transaction (the replicated store
/// adds its own bookkeeping to the same transaction).
pub(crate) fn write_effect(tx: &WriteTransaction, fx: &Effect) -> Result<(), IamError> {
    let mut t = tx.open_table(PROJECTS).map_err(db_err)?;
    for p in &fx.projects {
        t.insert(p.path.as_str(), json(p).as_slice())
            .map_err(db_err)?;
    }
    let mut t = tx.open_table(KEYS).map_err(db_err)?;
    for k in &fx.keys {
        t.insert(k.sha256.as_str(), json(k).as_slice())
            .map_err(db_err)?;
    }
    let mut t = tx.open_table(RESERVATIONS).map_err(db_err)?;
    for r in &fx.reserved {
        t.insert(r.sandbox_id.as_str(), json(r).as_slice())
            .map_err(db_err)?;
    }
    for id in &fx.released {
        t.remove(id.as_str()).map_err(db_err)?;
    }
    Ok(())
}

/// Replaces the whole state on disk with `state` (a snapshot being installed).
pub(crate) fn write_state(tx: &WriteTransaction, state: &IamState) -> Result<(), IamError> {
    for def in [PROJECTS, KEYS, RESERVATIONS] {
        tx.open_table(def)
            .map_err(db_err)?
            .retain(|_, _| false)
            .map_err(db_err)?;
    }
    write_effect(
        tx,
        &Effect {
            projects: state.projects.values().cloned().collect(),
            keys: state.keys.values().cloned().collect(),
            reserved: state.reservations().values().cloned().collect(),
            released: Vec::new(),
        },
    )
}

/// Reads the whole state from its tables.
pub(crate) fn load_state(db: &Database) -> Result<IamState, IamError> {
    let mut state = IamState::default();
    for p in load_table::<Project>(db, PROJECTS)? {
        state.projects.insert(p.path.clone(), p);
    }
    for k in load_table::<KeyRecord>(db, KEYS)? {
        state.keys.insert(k.sha256.clone(), k);
    }
    for r in load_table::<Reservation>(db, RESERVATIONS)? {
        state.put_reservation(r);
    }
    Ok(state)
}
