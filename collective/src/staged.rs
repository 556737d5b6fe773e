//! A [`DeviceCommunicator`] that stages through host memory: each collective waits for the
//! rank's stream, copies the device buffers to the host, runs the `local` communicator's
//! collective there, and copies the results back.
//!
//! It exists for ranks that NCCL cannot join: several ranks on one GPU (NCCL refuses a device
//! twice in a communicator), which is how the sharded CUDA path is tested on a one-GPU machine,
//! and machines without libnccl. It keeps the crate's determinism contract exactly — bf16
//! buffers are widened to f32, summed by the host in rank order and rounded once, the same bits
//! as the NCCL communicator's ordered all-reduce ([`crate::ordered`]) — but it synchronizes the
//! stream inside every collective, so it is slow and cannot be captured into a CUDA graph
//! ([`DeviceCommunicator::capturable`] is false).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use half::bf16;

use crate::device::{DeviceBuf, DeviceBufMut, DeviceCollective, DeviceCommunicator};
use crate::ordered::round_to_bf16;
use crate::{CollectiveError, CollectiveKind, Communicator, LocalCommunicator, LocalGroup};

/// Makes the ranks of a host-staged group.
pub struct StagedGroup;

impl StagedGroup {
    /// One communicator per stream, rank `r` on `streams[r]` (streams may share a device).
    pub fn on_streams(streams: Vec<Arc<CudaStream>>) -> Vec<StagedCommunicator> {
        let world_size = streams.len();
        LocalGroup::new(world_size)
            .into_iter()
            .zip(streams)
            .map(|(host, stream)| StagedCommunicator {
                host,
                stream,
                world_size,
            })
            .collect()
    }
}

/// One rank of a [`StagedGroup`].
pub struct StagedCommunicator {
    host: LocalCommunicator,
    stream: Arc<CudaStream>,
    world_size: usize,
}

fn cuda(context: &str, e: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Cuda {
        context: context.into(),
        message: e.to_string(),
    }
}

/// A staged copy of one device buffer, widened to f32.
fn download(stream: &Arc<CudaStream>, buf: &DeviceBuf<'_>) -> Result<Vec<f32>, CollectiveError> {
    fn copy<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
        stream: &Arc<CudaStream>,
        view: &CudaView<'_, T>,
    ) -> Result<Vec<T>, CollectiveError> {
        let mut host = vec![T::default(); view.len()];
        stream
            .memcpy_dtoh(view, &mut host)
            .map_err(|e| cuda("copying a collective's input to the host", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda("waiting for the copy to the host", e))?;
        Ok(host)
    }
    Ok(match buf {
        DeviceBuf::F32(v) => copy(stream, v)?,
        DeviceBuf::Bf16(v) => copy(stream, v)?.iter().map(|x| x.to_f32()).collect(),
    })
}

/// Writes `host` into `buf`, rounding to bf16 once for bf16 buffers.
fn upload(
    stream: &Arc<CudaStream>,
    host: &[f32],
    buf: &mut DeviceBufMut<'_>,
) -> Result<(), CollectiveError> {
    fn copy<T: DeviceRepr>(
        stream: &Arc<CudaStream>,
        host: &[T],
        view: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CollectiveError> {
        stream
            .memcpy_htod(host, view)
            .map_err(|e| cuda("copying a collective's result to the device", e))
    }
    match buf {
        DeviceBufMut::F32(v) => copy(stream, host, v),
        DeviceBufMut::Bf16(v) => {
            let rounded: Vec<bf16> = host.iter().map(|&x| round_to_bf16(x)).collect();
            copy(stream, &rounded, v)
        }
    }
}

fn readable<'a>(buf: &'a DeviceBufMut<'_>) -> DeviceBuf<'a> {
    match buf {
        DeviceBufMut::F32(v) => DeviceBuf::F32(v.as_view()),
        DeviceBufMut::Bf16(v) => DeviceBuf::Bf16(v.as_view()),
    }
}

impl StagedCommunicator {
    /// The checks a rank can make alone, before anything is copied.
    fn check(&self, ops: &[DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        let rank = self.host.rank();
        for op in ops {
            match op {
                DeviceCollective::AllReduceSum { .. } => {}
                DeviceCollective::AllGather { input, output } => {
                    let kind = CollectiveKind::AllGather;
                    if input.dtype() != output.dtype() {
                        return Err(CollectiveError::DtypeMismatch {
                            kind,
                            rank,
                            expected: input.dtype(),
                            found: output.dtype(),
                        });
                    }
                    let expected = input.len().checked_mul(self.world_size);
                    if expected != Some(output.len()) {
                        return Err(CollectiveError::GatherOutputLength {
                            rank,
                            output: output.len(),
                            expected: expected.unwrap_or(usize::MAX),
                        });
                    }
                }
                DeviceCollective::Broadcast { root, .. } => {
                    if *root >= self.world_size {
                        return Err(CollectiveError::RootOutOfRange {
                            root: *root,
                            world_size: self.world_size,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

impl DeviceCommunicator for StagedCommunicator {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn capturable(&self) -> bool {
        false
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda("draining the stream for the barrier", e))?;
        self.host.barrier()
    }

    /// Runs the collectives one after the other through the host.
    fn run_group(&mut self, ops: &mut [DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        self.check(ops)?;
        let stream = self.stream.clone();
        for op in ops.iter_mut() {
            match op {
                DeviceCollective::AllReduceSum { buf } => {
                    let mut host = download(&stream, &readable(buf))?;
                    self.host.all_reduce_sum_f32(&mut host)?;
                    upload(&stream, &host, buf)?;
                }
                DeviceCollective::AllGather { input, output } => {
                    let host = download(&stream, input)?;
                    let mut gathered = vec![0.0f32; output.len()];
                    self.host.all_gather_f32(&host, &mut gathered)?;
                    upload(&stream, &gathered, output)?;
                }
                DeviceCollective::Broadcast { buf, root } => {
                    let mut host = download(&stream, &readable(buf))?;
                    self.host.broadcast_f32(&mut host, *root)?;
                    upload(&stream, &host, buf)?;
                }
            }
        }
        Ok(())
    }
}
