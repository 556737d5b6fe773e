use std::fmt;
use std::time::Duration;

use crate::CollectiveKind;

/// Everything a collective can fail with.
///
/// The mismatch variants (and `ConcurrentCall`) leave the group usable: a mismatch is found once
/// every rank has arrived, reported identically on every rank, and no buffer is touched. The
/// others (`PeerGone`, `Timeout`, `Panicked`) break the group for good: every later call, on every
/// rank, returns the error that broke it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("ranks out of step: rank {rank} issued {found} where rank 0 issued {expected}")]
    KindMismatch {
        rank: usize,
        expected: CollectiveKind,
        found: CollectiveKind,
    },
    #[error("ranks out of step: rank {rank} issued {found}, rank 0 {expected}")]
    GroupMismatch {
        rank: usize,
        expected: GroupPosition,
        found: GroupPosition,
    },
    #[error("{kind}: rank {rank} passed {len} elements, rank 0 passed {expected}")]
    LengthMismatch {
        kind: CollectiveKind,
        rank: usize,
        len: usize,
        expected: usize,
    },
    #[error(
        "all_gather: rank {rank}'s output holds {output} elements, needs {expected} \
         (world size × input length)"
    )]
    GatherOutputLength {
        rank: usize,
        output: usize,
        expected: usize,
    },
    #[error("broadcast: root {root} is out of range for world size {world_size}")]
    RootOutOfRange { root: usize, world_size: usize },
    #[error("broadcast: rank {rank} names root {root}, rank 0 names root {expected}")]
    RootMismatch {
        rank: usize,
        root: usize,
        expected: usize,
    },
    #[error("rank {rank}'s handle is already inside a collective on another thread")]
    ConcurrentCall { rank: usize },
    #[error("rank {rank} dropped its handle; the group is broken")]
    PeerGone { rank: usize },
    #[error("timed out after {timeout:?} waiting for rank(s) {missing:?}; the group is broken")]
    Timeout {
        timeout: Duration,
        missing: Vec<usize>,
    },
    #[error("a thread panicked inside a collective; the group is broken")]
    Panicked,
}

/// Where a collective stands: a call of its own, or one of the collectives of a group. Ranks must
/// agree on it, which catches a rank whose group has a different length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupPosition {
    Single,
    InGroup { index: usize, len: usize },
}

impl fmt::Display for GroupPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupPosition::Single => f.write_str("a single collective"),
            GroupPosition::InGroup { index, len } => {
                write!(f, "collective {index} of a group of {len}")
            }
        }
    }
}
