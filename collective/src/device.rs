//! Collectives on device memory: the [`DeviceCommunicator`] trait, the counterpart of
//! [`Communicator`](crate::Communicator) for buffers that live on a GPU.
//!
//! The contract is the host trait's, with two differences that device memory brings:
//!
//! - **Stream order.** A collective is enqueued on the rank's stream ([`DeviceCommunicator::stream`])
//!   and the call returns once it is enqueued; later work on that stream sees the result. Read it
//!   on the host only after synchronizing the stream. [`DeviceCommunicator::barrier`] is the
//!   exception: it returns once every rank has reached it, and this rank's stream is drained.
//! - **Local checks only.** Each call checks what this rank can see (lengths, element types, the
//!   device a buffer lives on, the root) before enqueuing anything, and fails with a
//!   [`CollectiveError`] without touching any buffer. Agreement *between* ranks (the same
//!   collectives, lengths and roots, in the same order) is the caller's: checking it would cost a
//!   collective per call; the `local` communicator runs the same SPMD program on CPU and catches
//!   such bugs there.
//!
//! The all-reduce keeps the crate's determinism contract: rank order, starting from rank 0's
//! value, the same bits on every rank, identity with one rank (see [`crate::ordered`]).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceSlice};
use half::bf16;

use crate::CollectiveError;

/// The element types the device collectives carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}

/// A read-only device buffer of one of the [`Dtype`]s.
#[derive(Debug)]
pub enum DeviceBuf<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, bf16>),
}

/// A writable device buffer of one of the [`Dtype`]s.
#[derive(Debug)]
pub enum DeviceBufMut<'a> {
    F32(CudaViewMut<'a, f32>),
    Bf16(CudaViewMut<'a, bf16>),
}

impl DeviceBuf<'_> {
    pub fn len(&self) -> usize {
        match self {
            DeviceBuf::F32(v) => v.len(),
            DeviceBuf::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            DeviceBuf::F32(_) => Dtype::F32,
            DeviceBuf::Bf16(_) => Dtype::Bf16,
        }
    }

    /// The stream the buffer was allocated on (and so its context and device).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceBuf::F32(v) => v.stream(),
            DeviceBuf::Bf16(v) => v.stream(),
        }
    }
}

impl DeviceBufMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            DeviceBufMut::F32(v) => v.len(),
            DeviceBufMut::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            DeviceBufMut::F32(_) => Dtype::F32,
            DeviceBufMut::Bf16(_) => Dtype::Bf16,
        }
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceBufMut::F32(v) => v.stream(),
            DeviceBufMut::Bf16(v) => v.stream(),
        }
    }
}

macro_rules! buf_from {
    ($t:ty, $variant:ident) => {
        impl<'a> From<CudaView<'a, $t>> for DeviceBuf<'a> {
            fn from(v: CudaView<'a, $t>) -> Self {
                DeviceBuf::$variant(v)
            }
        }
        impl<'a> From<&'a CudaSlice<$t>> for DeviceBuf<'a> {
            fn from(s: &'a CudaSlice<$t>) -> Self {
                DeviceBuf::$variant(s.as_view())
            }
        }
        impl<'a> From<CudaViewMut<'a, $t>> for DeviceBufMut<'a> {
            fn from(v: CudaViewMut<'a, $t>) -> Self {
                DeviceBufMut::$variant(v)
            }
        }
        impl<'a> From<&'a mut CudaSlice<$t>> for DeviceBufMut<'a> {
            fn from(s: &'a mut CudaSlice<$t>) -> Self {
                DeviceBufMut::$variant(s.as_view_mut())
            }
        }
    };
}
buf_from!(f32, F32);
buf_from!(bf16, Bf16);

/// One collective of a group ([`DeviceCommunicator::run_group`]), with the contract of the method
/// of the same name.
#[derive(Debug)]
pub enum DeviceCollective<'a> {
    AllReduceSum {
        buf: DeviceBufMut<'a>,
    },
    AllGather {
        input: DeviceBuf<'a>,
        output: DeviceBufMut<'a>,
    },
    Broadcast {
        buf: DeviceBufMut<'a>,
        root: usize,
    },
}

/// One rank's handle on a group of GPUs, one GPU per rank.
///
/// `Send`, so each handle can move into its rank's thread; methods take `&mut self`, so one
/// handle is never inside two collectives at once.
pub trait DeviceCommunicator: Send {
    /// This handle's rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// The stream every collective of this rank is enqueued on.
    fn stream(&self) -> &Arc<CudaStream>;

    /// Whether the collectives only enqueue work on [`DeviceCommunicator::stream`] (no host
    /// synchronization), so a caller may capture them into a CUDA graph. NCCL's do; the
    /// host-staged communicator's ([`crate::StagedCommunicator`]) do not.
    fn capturable(&self) -> bool {
        true
    }

    /// Replaces `buf` on every rank by the element-wise sum of all ranks' `buf`, in rank order
    /// starting from rank 0's value: in f32 for f32 buffers; for bf16 buffers widened to f32,
    /// added in the same order, and rounded to bf16 once. Bit-identical on every rank; with one
    /// rank, `buf` is left as it is.
    fn all_reduce_sum(&mut self, buf: DeviceBufMut<'_>) -> Result<(), CollectiveError> {
        self.run_group(&mut [DeviceCollective::AllReduceSum { buf }])
    }

    /// Writes every rank's `input` into `output`, rank `r`'s at `output[r * n..(r + 1) * n]` where
    /// `n = input.len()`; `output.len() == world_size() * n`, same element type.
    fn all_gather(
        &mut self,
        input: DeviceBuf<'_>,
        output: DeviceBufMut<'_>,
    ) -> Result<(), CollectiveError> {
        self.run_group(&mut [DeviceCollective::AllGather { input, output }])
    }

    /// Copies rank `root`'s `buf` into every other rank's `buf`.
    fn broadcast(&mut self, buf: DeviceBufMut<'_>, root: usize) -> Result<(), CollectiveError> {
        self.run_group(&mut [DeviceCollective::Broadcast { buf, root }])
    }

    /// Returns once every rank has called `barrier` and this rank's stream has drained.
    fn barrier(&mut self) -> Result<(), CollectiveError>;

    /// Enqueues several collectives as one group: the communication of all of them is issued
    /// together (one `ncclGroupStart` … `ncclGroupEnd`), and each all-reduce's ordered sum follows.
    /// Every op is checked before anything is enqueued: a failed check leaves every buffer as it
    /// was.
    fn run_group(&mut self, ops: &mut [DeviceCollective<'_>]) -> Result<(), CollectiveError>;
}
