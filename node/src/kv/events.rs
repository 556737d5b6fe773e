//! KV events: every change to a node's prefix cache, numbered 1, 2, 3… without gaps.
//!
//! A router keeps a [`KvReplica`] per node by applying events in order; when it sees a gap (a
//! lagged channel, a reconnect) it asks for a [`KvDump`] and restarts from it. Replaying events
//! `1..=seq` onto an empty replica gives exactly the dump taken at `seq`.

use tokio::sync::broadcast;

pub use strata_engine_api::kv::{KvDump, KvEvent, KvEventKind};

use super::types::{BlockHash, BlockHashMap, Tier};

/// Numbers events and publishes them. Publishing with no subscriber is fine: the dump covers
/// anyone who connects later.
#[derive(Debug)]
pub struct KvEventLog {
    last_seq: u64,
    sender: broadcast::Sender<KvEvent>,
}

impl KvEventLog {
    /// `capacity` is how many events a slow subscriber may fall behind before it sees
    /// `RecvError::Lagged` (and should ask for a dump).
    pub fn new(capacity: usize) -> Self {
        let (sender, _) = broadcast::channel(capacity.max(1));
        Self {
            last_seq: 0,
            sender,
        }
    }

    /// Numbers `kind` with the next sequence number and publishes it; returns that number.
    pub fn publish(&mut self, kind: KvEventKind) -> u64 {
        self.last_seq += 1;
        // An error only means nobody is subscribed right now.
        let _ = self.sender.send(KvEvent {
            seq: self.last_seq,
            kind,
        });
        self.last_seq
    }

    /// Sequence number of the last published event (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    pub fn subscribe(&self) -> broadcast::Receiver<KvEvent> {
        self.sender.subscribe()
    }

    /// A handle that can hand out subscriptions from another thread than the publisher's.
    pub fn sender(&self) -> broadcast::Sender<KvEvent> {
        self.sender.clone()
    }
}

/// A consumer's view of one node's cache, maintained from events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvReplica {
    seq: u64,
    blocks: BlockHashMap<(Option<BlockHash>, Tier)>,
}

/// Why an event could not be applied: the consumer must resynchronise from a dump.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaError {
    #[error("KV event gap: expected seq {expected}, got {got}")]
    Gap { expected: u64, got: u64 },
    #[error("KV event {seq} refers to unknown block {hash:?}")]
    UnknownBlock { seq: u64, hash: BlockHash },
}

impl KvReplica {
    pub fn from_dump(dump: &KvDump) -> Self {
        let blocks = dump.blocks.iter().map(|&(h, p, t)| (h, (p, t))).collect();
        Self {
            seq: dump.seq,
            blocks,
        }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    pub fn tier_of(&self, hash: BlockHash) -> Option<Tier> {
        self.blocks.get(&hash).map(|&(_, t)| t)
    }

    /// Applies the next event. Events at or below `seq` are ignored (already covered by a dump).
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), ReplicaError> {
        if event.seq <= self.seq {
            return Ok(());
        }
        if event.seq != self.seq + 1 {
            return Err(ReplicaError::Gap {
                expected: self.seq + 1,
                got: event.seq,
            });
        }
        let unknown = |hash| ReplicaError::UnknownBlock {
            seq: event.seq,
            hash,
        };
        match event.kind {
            KvEventKind::Stored { hash, parent, tier } => {
                self.blocks.insert(hash, (parent, tier));
            }
            KvEventKind::Removed { hash, .. } => {
                self.blocks.remove(&hash).ok_or_else(|| unknown(hash))?;
            }
            KvEventKind::TierChanged { hash, to, .. } => {
                self.blocks.get_mut(&hash).ok_or_else(|| unknown(hash))?.1 = to;
            }
        }
        self.seq = event.seq;
        Ok(())
    }

    /// The replica as a dump, blocks sorted by hash (the order [`KvDump`]s are produced in).
    pub fn to_dump(&self) -> KvDump {
        let mut blocks: Vec<_> = self.blocks.iter().map(|(&h, &(p, t))| (h, p, t)).collect();
        blocks.sort_unstable_by_key(|&(h, _, _)| h);
        KvDump {
            seq: self.seq,
            blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_numbered_from_one_without_gaps() {
        let mut log = KvEventLog::new(16);
        // No subscriber yet: publishing must still number events.
        assert_eq!(
            log.publish(KvEventKind::Removed {
                hash: BlockHash(1),
                tier: Tier::Host
            }),
            1
        );
        let mut rx = log.subscribe();
        for i in 2..=5u64 {
            let kind = KvEventKind::Stored {
                hash: BlockHash(i as u128),
                parent: None,
                tier: Tier::Device,
            };
            assert_eq!(log.publish(kind), i);
        }
        let seqs: Vec<u64> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|e| e.seq)
            .collect();
        assert_eq!(seqs, vec![2, 3, 4, 5]);
        assert_eq!(log.last_seq(), 5);
    }

    #[test]
    fn replica_detects_gaps_and_unknown_blocks() {
        let mut r = KvReplica::default();
        let stored = |seq, h| KvEvent {
            seq,
            kind: KvEventKind::Stored {
                hash: BlockHash(h),
                parent: None,
                tier: Tier::Device,
            },
        };
        r.apply(&stored(1, 10)).unwrap();
        assert_eq!(
            r.apply(&stored(3, 11)),
            Err(ReplicaError::Gap {
                expected: 2,
                got: 3
            })
        );
        let bad = KvEvent {
            seq: 2,
            kind: KvEventKind::TierChanged {
                hash: BlockHash(99),
                from: Tier::Device,
                to: Tier::Host,
            },
        };
        assert!(matches!(
            r.apply(&bad),
            Err(ReplicaError::UnknownBlock { .. })
        ));
        r.apply(&stored(1, 10)).unwrap(); // a duplicate is ignored
        assert_eq!(
            r.to_dump().blocks,
            vec![(BlockHash(10), None, Tier::Device)]
        );
        let resynced = KvReplica::from_dump(&r.to_dump());
        assert_eq!(resynced, r);
    }
}
