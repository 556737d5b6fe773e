//! The feed of committed changes: every applied entry, in log order, for the routers and nodes
//! that follow the group.
//!
//! A follower subscribes with [`StateReader::subscribe`](super::StateReader::subscribe) and
//! gets the applied state plus a feed that continues exactly after it: events are sent while
//! the state's write lock is held, and the subscription is taken under its read lock, so no
//! entry is missed or seen twice. Two events ask the follower to start over from a whole
//! state: a snapshot installed in place of the log (`Replaced`), and falling more than
//! [`FEED_CAPACITY`] events behind (`FeedError::Lagged`).

use openraft::LogId;
use tokio::sync::broadcast;

use crate::NodeId;
use crate::state::{Command, Outcome};

/// Events a subscriber may fall behind by before it must resubscribe.
pub const FEED_CAPACITY: usize = 4096;

/// One committed change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommittedEvent {
    /// An entry was applied; `command` is `None` for raft's own blank and membership entries.
    Applied {
        log_id: LogId<NodeId>,
        command: Option<Command>,
        outcome: Outcome,
    },
    /// A snapshot from the leader replaced the state: read it whole.
    Replaced { last_applied: Option<LogId<NodeId>> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    #[error("the subscriber fell {0} events behind; resubscribe to read the state whole")]
    Lagged(u64),
    #[error("the state machine is gone")]
    Closed,
}

/// A subscriber's view of the feed.
pub struct ChangeFeed {
    rx: broadcast::Receiver<CommittedEvent>,
}

impl ChangeFeed {
    pub(super) fn new(rx: broadcast::Receiver<CommittedEvent>) -> Self {
        Self { rx }
    }

    /// The next committed change. After `Lagged` the feed is no longer gap-free: resubscribe.
    pub async fn recv(&mut self) -> Result<CommittedEvent, FeedError> {
        self.rx.recv().await.map_err(|e| match e {
            broadcast::error::RecvError::Lagged(n) => FeedError::Lagged(n),
            broadcast::error::RecvError::Closed => FeedError::Closed,
        })
    }

    /// The next change if one is waiting.
    pub fn try_recv(&mut self) -> Option<Result<CommittedEvent, FeedError>> {
        match self.rx.try_recv() {
            Ok(event) => Some(Ok(event)),
            Err(broadcast::error::TryRecvError::Empty) => None,
            Err(broadcast::error::TryRecvError::Lagged(n)) => Some(Err(FeedError::Lagged(n))),
            Err(broadcast::error::TryRecvError::Closed) => Some(Err(FeedError::Closed)),
        }
    }
}
