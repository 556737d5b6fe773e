//! The raft log half of the store: entries, vote, committed id, purge and truncation.

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{Entry, LogId, OptionalSend, RaftLogId, RaftLogReader, StorageError, Vote};
use redb::{Database, Durability, ReadableDatabase, ReadableTable};

use super::{
    KEY_COMMITTED, KEY_LAST_PURGED, KEY_VOTE, LOG, META, begin_write, decode_meta, read_err,
    write_err,
};
use crate::{NodeId, TypeConfig};

/// The raft log, in the store's `raft_log` and `raft_meta` tables. Cloning shares the file.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    pub(super) fn new(db: Arc<Database>) -> Self {
        Self { db }
    }

    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(META)?;
        decode_meta(&table, key).map_err(|e| redb::Error::Io(std::io::Error::other(e)))
    }

    fn write_meta<T: serde::Serialize>(
        &self,
        key: &str,
        value: &T,
        durability: Durability,
    ) -> Result<(), redb::Error> {
        let bytes = serde_json::to_vec(value).map_err(|e| redb::Error::Io(e.into()))?;
        let mut txn = begin_write(&self.db)?;
        txn.set_durability(durability)?;
        txn.open_table(META)?.insert(key, bytes.as_slice())?;
        txn.commit()?;
        Ok(())
    }

    fn append_sync(&self, entries: Vec<Entry<TypeConfig>>) -> Result<(), redb::Error> {
        let txn = begin_write(&self.db)?;
        {
            let mut table = txn.open_table(LOG)?;
            for entry in &entries {
                let bytes = serde_json::to_vec(entry).map_err(|e| redb::Error::Io(e.into()))?;
                table.insert(entry.get_log_id().index, bytes.as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let txn = self.db.begin_read().map_err(read_err)?;
        let table = txn.open_table(LOG).map_err(read_err)?;
        let mut entries = Vec::new();
        for row in table.range::<u64>(range).map_err(read_err)? {
            let (_, value) = row.map_err(read_err)?;
            entries.push(serde_json::from_slice(value.value()).map_err(read_err)?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let last_purged_log_id: Option<LogId<NodeId>> =
            self.read_meta(KEY_LAST_PURGED).map_err(read_err)?;
        let txn = self.db.begin_read().map_err(read_err)?;
        let table = txn.open_table(LOG).map_err(read_err)?;
        let last_in_log = match table.last().map_err(read_err)? {
            Some((_, value)) => {
                let entry: Entry<TypeConfig> =
                    serde_json::from_slice(value.value()).map_err(read_err)?;
                Some(*entry.get_log_id())
            }
            None => None,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id: last_in_log.or(last_purged_log_id),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.write_meta(KEY_VOTE, vote, Durability::Immediate)
            .map_err(write_err)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.read_meta(KEY_VOTE).map_err(read_err)
    }

    /// The committed id is advisory: it only lets a restarted member re-apply its own log
    /// before hearing from the leader. Losing the latest value in a crash leaves an older,
    /// still-true one, so it is written without its own fsync; the next durable commit (the
    /// next append) carries it to disk.
    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        self.write_meta(KEY_COMMITTED, &committed, Durability::None)
            .map_err(write_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self
            .read_meta::<Option<LogId<NodeId>>>(KEY_COMMITTED)
            .map_err(read_err)?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<_> = entries.into_iter().collect();
        match self.append_sync(entries) {
            Ok(()) => {
                // The transaction committed with fsync: the entries are on disk.
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(write_err(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let txn = begin_write(&self.db).map_err(write_err)?;
        txn.open_table(LOG)
            .map_err(write_err)?
            .retain_in(log_id.index.., |_, _| false)
            .map_err(write_err)?;
        txn.commit().map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let bytes = serde_json::to_vec(&log_id).map_err(write_err)?;
        let txn = begin_write(&self.db).map_err(write_err)?;
        {
            let mut meta = txn.open_table(META).map_err(write_err)?;
            let previous: Option<LogId<NodeId>> = decode_meta(&meta, KEY_LAST_PURGED)
                .map_err(|e| write_err(std::io::Error::other(e)))?;
            if previous.is_some_and(|p| p.index >= log_id.index) {
                return Ok(());
            }
            meta.insert(KEY_LAST_PURGED, bytes.as_slice())
                .map_err(write_err)?;
            txn.open_table(LOG)
                .map_err(write_err)?
                .retain_in(..=log_id.index, |_, _| false)
                .map_err(write_err)?;
        }
        txn.commit().map_err(write_err)
    }
}
