//! strata-collective: the collective-communication layer of tensor parallelism (DESIGN.md §5).
//!
//! A [`Communicator`] is one rank's handle on a group of `world_size` ranks. The ranks run the
//! same program (SPMD): every rank issues the same collectives, in the same order, with the same
//! lengths. Each call returns when this rank's part of the collective is complete; the result is
//! then in the rank's own buffer.
//!
//! # Determinism
//!
//! Greedy output must be byte-identical between TP = N and TP = 1 (DESIGN.md §3, §5), so the one
//! reduction here has a fixed order that depends on nothing but the rank count:
//! [`Communicator::all_reduce_sum_f32`] computes, for every element `i`,
//! `((x₀[i] + x₁[i]) + x₂[i]) + … + x₍ₙ₋₁₎[i]` in f32, where `xᵣ` is rank `r`'s buffer — rank order,
//! starting from rank 0's value (not from `0.0`, which would turn `-0.0` into `0.0`). The result
//! is bit-identical on every rank and independent of which rank arrives first or how threads are
//! scheduled. With one rank it is the input, bit for bit. The device all-reduce
//! ([`DeviceCommunicator::all_reduce_sum`]) keeps the same order; bf16 buffers are widened to f32,
//! added in that order and rounded to bf16 once ([`ordered`] is the host reference).
//!
//! # Errors
//!
//! Every call returns `Result<(), CollectiveError>`. In the `local` communicator, disagreements
//! between ranks (different collectives, lengths, roots, group shapes) are detected once every
//! rank has arrived and are reported as the same error on every rank; buffers are left untouched
//! and the group stays usable. A rank that drops its handle (including by panicking) or never
//! arrives breaks the group: the others get an error instead of hanging, and every later call
//! fails the same way. The NCCL communicator checks what one rank can see before enqueuing
//! anything; agreement between ranks is the program's (see [`DeviceCommunicator`]).
//!
//! # Implementations
//!
//! - [`local`]: ranks are threads of one process sharing memory. It runs the sharded math of the
//!   CPU backend, so tensor-parallel correctness is tested without GPUs.
//! - [`nccl`]: ranks are threads of one process, one GPU each, with device buffers
//!   ([`DeviceCommunicator`]). Rank 0 creates the `ncclUniqueId` and hands it to the other ranks
//!   in-process; each rank has its own context and stream; groups map onto
//!   `ncclGroupStart`/`ncclGroupEnd`. NCCL's own `ncclAllReduce` sums in an order chosen by its
//!   algorithm (ring or tree, channel count), which is not rank order, so the all-reduce here
//!   keeps the contract above another way: an NCCL all-gather of every rank's buffer, then a
//!   small kernel that adds the gathered rows in rank order — checked bit for bit on a GPU against
//!   [`ordered`], the host reference that the `local` communicator also matches
//!   (`strata gpu nccl`).
//!
//! [`inventory`] lists the machine's GPUs and the links between them, for placing TP ranks.

mod device;
mod error;
pub mod inventory;
pub mod local;
pub mod nccl;
pub mod ordered;
pub mod staged;

use std::fmt;

pub use device::{DeviceBuf, DeviceBufMut, DeviceCollective, DeviceCommunicator, Dtype};
pub use error::{CollectiveError, GroupPosition};
pub use local::{DEFAULT_TIMEOUT, LocalCommunicator, LocalGroup};
pub use nccl::{NcclCommunicator, NcclGroup};
pub use staged::{StagedCommunicator, StagedGroup};

/// One rank's handle on a communicator group.
///
/// `Send + Sync` so that a handle can live in an `Arc<dyn Communicator>` shared by the rank's
/// threads; but the ranks of a group each issue their collectives in program order, so one handle
/// must not be inside two collectives at once.
pub trait Communicator: Send + Sync {
    /// This handle's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Replaces `buf` on every rank by the element-wise sum of all ranks' `buf`, added in rank
    /// order in f32 (see the crate documentation): bit-identical on every rank. Every rank passes
    /// the same length.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;

    /// Writes every rank's `input` into `output`, rank `r`'s at `output[r * n..(r + 1) * n]` where
    /// `n = input.len()`. Every rank passes the same `n`, and `output.len() == world_size() * n`.
    fn all_gather_f32(&self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError>;

    /// Copies rank `root`'s `buf` into every other rank's `buf`. Every rank passes the same `root`
    /// (in `0..world_size()`) and the same length.
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<(), CollectiveError>;

    /// Runs several collectives as one group: they complete together, when this call returns.
    ///
    /// The buffers stay borrowed for the whole group, so no output can be read before the group
    /// is complete — the contract of an NCCL group (`ncclGroupStart` … `ncclGroupEnd`), which may
    /// launch the collectives together, expressed in the types. Every rank passes the same
    /// sequence of collectives. The slice can live on the stack: a group allocates nothing.
    ///
    /// An implementation may run the collectives one after the other (the `local` one does); if
    /// one fails, the ones before it have completed and the buffers of the ones after it are
    /// untouched, identically on every rank.
    fn run_group(&self, ops: &mut [Collective<'_>]) -> Result<(), CollectiveError>;
}

/// One collective of a group ([`Communicator::run_group`]), with the same contract as the method
/// of the same name.
#[derive(Debug)]
pub enum Collective<'a> {
    AllReduceSum {
        buf: &'a mut [f32],
    },
    AllGather {
        input: &'a [f32],
        output: &'a mut [f32],
    },
    Broadcast {
        buf: &'a mut [f32],
        root: usize,
    },
}

/// The kinds of collective, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveKind {
    AllReduceSum,
    AllGather,
    Broadcast,
    Barrier,
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollectiveKind::AllReduceSum => "all_reduce_sum",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        })
    }
}
