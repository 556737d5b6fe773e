use std::fmt;
use std::time::Duration;

use crate::CollectiveKind;

/// Everything a collective can fail with.
///
/// In the `local` communicator, the mismatch variants (and `ConcurrentCall`) leave the group
/// usable: a mismatch is found once every rank has arrived, reported identically on every rank,
/// and no buffer is touched. The others (`PeerGone`, `Timeout`, `Panicked`) break the group for
/// good: every later call, on every rank, returns the error that broke it.
///
/// In the NCCL communicator, the checks a rank makes alone (`GatherOutputLength`,
/// `RootOutOfRange`, `DtypeMismatch`, `WrongDevice`) fail before anything is enqueued and leave it
/// usable; a failed NCCL or CUDA call breaks it.
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
    /// A shared library the GPU communicator needs (libcuda, libnccl, libnvrtc) could not be
    /// loaded; `looked` says where it was searched.
    #[error("{library} not found; looked in: {}", looked.join(", "))]
    LibraryMissing {
        library: String,
        looked: Vec<String>,
    },
    /// The device list given to a GPU group is unusable (empty, repeated or absent devices).
    #[error("invalid device list: {0}")]
    InvalidDevices(String),
    /// A CUDA driver, NVRTC or kernel-loading step failed.
    #[error("CUDA: {context}: {message}")]
    Cuda { context: String, message: String },
    /// An NCCL call failed. After one fails the communicator is broken: every later call returns
    /// this error.
    #[error("NCCL {call} failed: {result}")]
    Nccl { call: &'static str, result: String },
    #[error("{kind}: rank {rank} passed {found} buffers where {expected} were needed")]
    DtypeMismatch {
        kind: CollectiveKind,
        rank: usize,
        expected: crate::Dtype,
        found: crate::Dtype,
    },
    #[error(
        "{kind}: a buffer of rank {rank} lives on device {found}, its communicator on device \
         {expected}"
    )]
    WrongDevice {
        kind: CollectiveKind,
        rank: usize,
        expected: usize,
        found: usize,
    },
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
