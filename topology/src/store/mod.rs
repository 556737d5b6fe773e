//! The durable store: one redb file holding the raft log, the vote, the committed log id and
//! the latest state-machine snapshot.
//!
//! Durability: every write transaction commits with redb's default `Durability::Immediate`
//! (fsync before `commit` returns) and in two phases, so the commit slot redb reads at open
//! always points at fully written pages. That is what lets the open treat any checksum failure
//! as corruption instead of quietly falling back to the previous commit (a one-phase commit
//! would make that fallback legitimate after a torn write, and a damaged file would lose its
//! last transactions without a word). The one exception is the committed log id, which is
//! advisory (see `LogStore::save_committed`).
//!
//! Integrity at open: redb verifies the checksum of every page of the committed trees
//! (`set_check_integrity_on_open`), then `verify` decodes every record and checks that the log
//! is one contiguous run after the purged prefix. A file that fails either is refused with
//! `StoreError::Corrupt`, naming the file; it is never truncated or repaired into a shorter
//! history. A crash is not corruption: after SIGKILL or power loss the last durable commit is
//! whole and the file opens. The check reads the whole file, which stays small because the log
//! is purged behind snapshots.

mod feed;
mod log_store;
mod state_machine;

use std::fs;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::{LogId, RaftLogId, StorageError, StorageIOError};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};

pub use feed::{ChangeFeed, CommittedEvent, FEED_CAPACITY, FeedError};
pub use log_store::LogStore;
pub use state_machine::{
    AppliedState, SnapshotBuilder, StateMachineStore, StateReader, StoredSnapshot,
};

use crate::{NodeId, TypeConfig};

/// The layout version this build writes and reads.
pub const STORE_FORMAT: u32 = 1;

/// Log index → JSON of `openraft::Entry<TypeConfig>`.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
/// Small records: `format`, `vote`, `committed`, `last_purged`.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
/// `meta` (JSON of the snapshot's `SnapshotMeta`) and `data` (the serialized state).
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot");

const KEY_FORMAT: &str = "format";
const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_LAST_PURGED: &str = "last_purged";
const KEY_SNAPSHOT_META: &str = "meta";
const KEY_SNAPSHOT_DATA: &str = "data";

/// Why the store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "{}: the topology store is corrupt: {detail}. Refusing to start on it: without its raft \
         state this member must leave the group and join again as a new member (docs/\
         ARCHITECTURE.md, \"Recovering a member\")",
        path.display()
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error("{}: store format {found}, this build reads format {expected}", path.display())]
    Format {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("{}: {source}", path.display())]
    Database { path: PathBuf, source: redb::Error },
}

/// Opens (or creates) the store at `path` and returns its two halves. Fails with
/// [`StoreError::Corrupt`] on a damaged or truncated file.
pub fn open(path: &Path) -> Result<(LogStore, StateMachineStore), StoreError> {
    let db = Arc::new(open_database(path)?);
    verify(&db).map_err(|detail| StoreError::Corrupt {
        path: path.to_path_buf(),
        detail,
    })?;
    let state_machine =
        StateMachineStore::load(db.clone()).map_err(|detail| StoreError::Corrupt {
            path: path.to_path_buf(),
            detail,
        })?;
    Ok((LogStore::new(db), state_machine))
}

fn open_database(path: &Path) -> Result<Database, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    let database_err = |source: redb::Error| StoreError::Database {
        path: path.to_path_buf(),
        source,
    };
    let exists = path.exists();
    if exists && fs::metadata(path).map(|m| m.len()).unwrap_or(0) == 0 {
        return Err(corrupt("the file is empty".into()));
    }
    let mut builder = Database::builder();
    builder.set_check_integrity_on_open(true);
    // A damaged file must not take the process down; redb reports damage as errors when it
    // verifies at open, and anything it does not foresee is caught here as corruption too.
    let opened = catch_unwind(AssertUnwindSafe(|| {
        if exists {
            builder.open(path)
        } else {
            builder.create(path)
        }
    }))
    .map_err(|_| corrupt("the database reader panicked on the file's contents".into()))?;
    let db = match opened {
        Ok(db) => db,
        Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(detail))) => {
            return Err(corrupt(detail));
        }
        Err(redb::DatabaseError::RepairAborted) => {
            return Err(corrupt(
                "the file needs a repair that would lose data".into(),
            ));
        }
        Err(redb::DatabaseError::UpgradeRequired(version)) => {
            return Err(corrupt(format!("unknown redb file format {version}")));
        }
        // redb reports a wrong magic number or a header it cannot read as invalid data, and a
        // file shorter than its header says as an early end of file.
        Err(redb::DatabaseError::Storage(redb::StorageError::Io(io)))
            if matches!(
                io.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            return Err(corrupt(io.to_string()));
        }
        Err(e) => return Err(database_err(e.into())),
    };
    if !exists {
        init(&db).map_err(database_err)?;
        return Ok(db);
    }
    let found = read_format(&db).map_err(corrupt)?;
    if found != STORE_FORMAT {
        return Err(StoreError::Format {
            path: path.to_path_buf(),
            found,
            expected: STORE_FORMAT,
        });
    }
    Ok(db)
}

/// Writes the format marker and creates the tables of a new store.
fn init(db: &Database) -> Result<(), redb::Error> {
    let txn = begin_write(db)?;
    txn.open_table(META)?
        .insert(KEY_FORMAT, STORE_FORMAT.to_le_bytes().as_slice())?;
    txn.open_table(LOG)?;
    txn.open_table(SNAPSHOT)?;
    txn.commit()?;
    Ok(())
}

fn read_format(db: &Database) -> Result<u32, String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let meta = txn
        .open_table(META)
        .map_err(|e| format!("no metadata table ({e}): not a topology store"))?;
    let raw = meta
        .get(KEY_FORMAT)
        .map_err(|e| e.to_string())?
        .ok_or("no format marker: not a topology store")?;
    let bytes: [u8; 4] = raw
        .value()
        .try_into()
        .map_err(|_| "the format marker is not 4 bytes".to_string())?;
    Ok(u32::from_le_bytes(bytes))
}

/// Decodes every record and checks the log's shape: each entry sits at its own index, indices
/// are contiguous, and all of them follow the purged prefix.
fn verify(db: &Database) -> Result<(), String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let meta = txn.open_table(META).map_err(|e| e.to_string())?;
    let last_purged: Option<LogId<NodeId>> =
        decode_meta(&meta, KEY_LAST_PURGED).map_err(|e| format!("last purged log id: {e}"))?;
    decode_meta::<openraft::Vote<NodeId>>(&meta, KEY_VOTE).map_err(|e| format!("vote: {e}"))?;
    decode_meta::<Option<LogId<NodeId>>>(&meta, KEY_COMMITTED)
        .map_err(|e| format!("committed log id: {e}"))?;

    // Purged entries must be covered by the snapshot, or the state they built is gone.
    let snapshots = txn.open_table(SNAPSHOT).map_err(|e| e.to_string())?;
    let snapshot: Option<openraft::SnapshotMeta<NodeId, openraft::BasicNode>> =
        decode_meta(&snapshots, KEY_SNAPSHOT_META)
            .map_err(|e| format!("snapshot metadata: {e}"))?;
    let covered = snapshot.and_then(|s| s.last_log_id).map(|l| l.index);
    if let Some(purged) = last_purged
        && covered.is_none_or(|covered| covered < purged.index)
    {
        return Err(format!(
            "the log is purged up to index {} but the snapshot covers only {covered:?}",
            purged.index
        ));
    }

    let log = txn.open_table(LOG).map_err(|e| e.to_string())?;
    let mut expected = last_purged.map(|l| l.index + 1);
    for row in log.range::<u64>(..).map_err(|e| e.to_string())? {
        let (key, value) = row.map_err(|e| e.to_string())?;
        let index = key.value();
        let entry: openraft::Entry<TypeConfig> = serde_json::from_slice(value.value())
            .map_err(|e| format!("log entry at index {index} does not decode: {e}"))?;
        if entry.get_log_id().index != index {
            return Err(format!(
                "log entry stored at index {index} claims index {}",
                entry.get_log_id().index
            ));
        }
        match expected {
            Some(want) if index != want => {
                return Err(format!("log gap: expected index {want}, found {index}"));
            }
            _ => expected = Some(index + 1),
        }
    }
    Ok(())
}

/// Every write transaction: immediate durability (redb's default) and two-phase commit.
fn begin_write(db: &Database) -> Result<WriteTransaction, redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_two_phase_commit(true);
    Ok(txn)
}

/// Reads and decodes a JSON record of the meta table; absent is `None`.
fn decode_meta<T: serde::de::DeserializeOwned>(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> Result<Option<T>, String> {
    match table.get(key).map_err(|e| e.to_string())? {
        None => Ok(None),
        Some(raw) => serde_json::from_slice(raw.value())
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

fn read_err(e: impl std::error::Error + 'static) -> StorageError<NodeId> {
    StorageIOError::read(&e).into()
}

fn write_err(e: impl std::error::Error + 'static) -> StorageError<NodeId> {
    StorageIOError::write(&e).into()
}

#[cfg(test)]
mod tests;
