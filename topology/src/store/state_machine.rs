//! The state-machine half of the store.
//!
//! The state machine lives in memory and is made durable by the log plus snapshots: a restart
//! loads the latest snapshot from the file, and openraft re-applies the committed entries after
//! it. Only snapshots are written here, each whole in one durable transaction, before openraft
//! may purge the log entries they cover.
//!
//! Every applied entry and every installed snapshot is also published on the feed (`feed.rs`)
//! while the state's write lock is held, so readers see state and feed in one order.

use std::io::Cursor;
use std::sync::{Arc, PoisonError, RwLock};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, RaftSnapshotBuilder, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership,
};
use redb::{Database, ReadableDatabase, ReadableTable};
use tokio::sync::broadcast;

use super::feed::{ChangeFeed, CommittedEvent, FEED_CAPACITY};
use super::{KEY_SNAPSHOT_DATA, KEY_SNAPSHOT_META, SNAPSHOT, begin_write, read_err, write_err};
use crate::state::{ClusterState, Outcome};
use crate::{NodeId, TypeConfig};

/// What has been applied: the cluster state and the raft bookkeeping that goes with it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppliedState {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, BasicNode>,
    pub cluster: ClusterState,
}

/// A snapshot as kept in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshot {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    /// JSON of the `ClusterState`.
    pub data: Vec<u8>,
}

/// The applied state and the feed of changes to it, shared by the state machine and readers.
struct Shared {
    state: RwLock<AppliedState>,
    /// Sent to only while `state`'s write lock is held (see `feed`).
    events: broadcast::Sender<CommittedEvent>,
}

/// A read handle on the applied state, for the application beside raft.
#[derive(Clone)]
pub struct StateReader {
    shared: Arc<Shared>,
}

impl StateReader {
    /// A copy of the applied state.
    pub fn get(&self) -> AppliedState {
        self.with(AppliedState::clone)
    }

    /// Runs `f` on the applied state without copying it.
    pub fn with<T>(&self, f: impl FnOnce(&AppliedState) -> T) -> T {
        f(&self
            .shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// The applied state and the feed of every change committed after it.
    pub fn subscribe(&self) -> (AppliedState, ChangeFeed) {
        let state = self
            .shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        (
            state.clone(),
            ChangeFeed::new(self.shared.events.subscribe()),
        )
    }
}

/// The raft state machine over [`ClusterState`].
pub struct StateMachineStore {
    db: Arc<Database>,
    shared: Arc<Shared>,
}

impl StateMachineStore {
    /// Loads the latest snapshot from the file, or starts empty.
    pub(super) fn load(db: Arc<Database>) -> Result<Self, String> {
        let state = match read_snapshot(&db)? {
            None => AppliedState::default(),
            Some(snapshot) => AppliedState {
                last_applied: snapshot.meta.last_log_id,
                membership: snapshot.meta.last_membership.clone(),
                cluster: serde_json::from_slice(&snapshot.data)
                    .map_err(|e| format!("snapshot state does not decode: {e}"))?,
            },
        };
        let (events, _) = broadcast::channel(FEED_CAPACITY);
        Ok(Self {
            db,
            shared: Arc::new(Shared {
                state: RwLock::new(state),
                events,
            }),
        })
    }

    pub fn reader(&self) -> StateReader {
        StateReader {
            shared: self.shared.clone(),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, AppliedState> {
        // `apply` never panics while holding the lock (it only runs `ClusterState::apply`,
        // which returns rejections as values), so a poisoned lock still holds a whole state.
        self.shared
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads the stored snapshot, if any.
fn read_snapshot(db: &Database) -> Result<Option<StoredSnapshot>, String> {
    let txn = db.begin_read().map_err(|e| e.to_string())?;
    let table = txn.open_table(SNAPSHOT).map_err(|e| e.to_string())?;
    let meta = table.get(KEY_SNAPSHOT_META).map_err(|e| e.to_string())?;
    let data = table.get(KEY_SNAPSHOT_DATA).map_err(|e| e.to_string())?;
    match (meta, data) {
        (None, None) => Ok(None),
        (Some(meta), Some(data)) => Ok(Some(StoredSnapshot {
            meta: serde_json::from_slice(meta.value())
                .map_err(|e| format!("snapshot metadata does not decode: {e}"))?,
            data: data.value().to_vec(),
        })),
        _ => Err("snapshot metadata and data are not both present".into()),
    }
}

/// Which snapshot wins when the file already holds one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Replace {
    /// A built snapshot never replaces a later one (a snapshot installed from the leader
    /// while this one was being built).
    UnlessOlder,
    /// An installed snapshot is what raft decided this member's state is.
    Always,
}

/// Stores `snapshot`; returns whether it was stored.
fn write_snapshot(
    db: &Database,
    snapshot: &StoredSnapshot,
    replace: Replace,
) -> Result<bool, redb::Error> {
    let meta = serde_json::to_vec(&snapshot.meta).map_err(|e| redb::Error::Io(e.into()))?;
    let txn = begin_write(db)?;
    {
        let mut table = txn.open_table(SNAPSHOT)?;
        if replace == Replace::UnlessOlder
            && let Some(existing) = table.get(KEY_SNAPSHOT_META)?
        {
            let existing: SnapshotMeta<NodeId, BasicNode> =
                serde_json::from_slice(existing.value()).map_err(|e| redb::Error::Io(e.into()))?;
            if existing.last_log_id > snapshot.meta.last_log_id {
                return Ok(false);
            }
        }
        table.insert(KEY_SNAPSHOT_META, meta.as_slice())?;
        table.insert(KEY_SNAPSHOT_DATA, snapshot.data.as_slice())?;
    }
    txn.commit()?;
    Ok(true)
}

fn snapshot_id(last: &Option<LogId<NodeId>>) -> String {
    match last {
        Some(log_id) => format!("{}-{}", log_id.leader_id, log_id.index),
        None => "empty".to_string(),
    }
}

/// Builds a snapshot from a copy of the state taken when openraft asked for a builder, so the
/// state machine keeps applying while the copy is serialized and written.
pub struct SnapshotBuilder {
    db: Arc<Database>,
    state: AppliedState,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let data = serde_json::to_vec(&self.state.cluster)
            .map_err(|e| StorageIOError::write_state_machine(&e))?;
        let meta = SnapshotMeta {
            last_log_id: self.state.last_applied,
            last_membership: self.state.membership.clone(),
            snapshot_id: snapshot_id(&self.state.last_applied),
        };
        let stored = StoredSnapshot { meta, data };
        write_snapshot(&self.db, &stored, Replace::UnlessOlder).map_err(write_err)?;
        Ok(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        let reader = self.reader();
        Ok(reader.with(|state| (state.last_applied, state.membership.clone())))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let mut state = self.write();
        let mut outcomes = Vec::new();
        for entry in entries {
            state.last_applied = Some(entry.log_id);
            let (command, outcome) = match entry.payload {
                EntryPayload::Blank => (None, Ok(state.cluster.unchanged())),
                EntryPayload::Normal(command) => {
                    let outcome = state.cluster.apply(&command);
                    (Some(command), outcome)
                }
                EntryPayload::Membership(membership) => {
                    state.membership = StoredMembership::new(Some(entry.log_id), membership);
                    (None, Ok(state.cluster.unchanged()))
                }
            };
            // Nobody subscribed is not an error: the event is simply not needed.
            let _ = self.shared.events.send(CommittedEvent::Applied {
                log_id: entry.log_id,
                command,
                outcome: outcome.clone(),
            });
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: self.db.clone(),
            state: self.write().clone(),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let cluster: ClusterState = serde_json::from_slice(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        write_snapshot(&self.db, &stored, Replace::Always).map_err(write_err)?;
        let mut state = self.write();
        *state = AppliedState {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            cluster,
        };
        let _ = self.shared.events.send(CommittedEvent::Replaced {
            last_applied: meta.last_log_id,
        });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let stored = read_snapshot(&self.db).map_err(|e| read_err(std::io::Error::other(e)))?;
        Ok(stored.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}
