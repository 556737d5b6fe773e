//! The NCCL communicator: ranks are threads of one process, one GPU each (DESIGN.md §5).
//!
//! [`NcclGroup::new`] opens a context and a stream per device, creates the `ncclUniqueId` (rank
//! 0's job) and initializes every rank's communicator from the calling thread inside one
//! `ncclGroupStart` … `ncclGroupEnd`, which NCCL allows and which cannot deadlock on a rank that
//! fails to start: the group reports the failure once. The handles then move to their rank
//! threads.
//!
//! **All-reduce.** NCCL's own `ncclAllReduce` adds in an order its algorithm picks (ring or tree,
//! channel count), not rank order. So the all-reduce here is an NCCL all-gather of every rank's
//! buffer into a workspace (rank-major), followed by a small kernel
//! (`collective/cuda/ordered_sum.cu`) that adds the rows in rank order starting from rank 0's
//! value — the same additions on the same bits on every rank, so the same result everywhere, equal
//! to [`crate::ordered`] on the host. The workspace grows to the largest group seen and is reused,
//! so steady state allocates nothing. With one rank the all-reduce is skipped: the identity.
//!
//! The ordered-sum kernel is compiled by NVRTC through `strata_kernels::compile` (disk-cached,
//! same fixed exact-math options as the model kernels).

mod library;

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nccl::{Comm, Id, NcclType, group_end, group_start, result::NcclError};
use half::bf16;
use strata_kernels::KernelError;
use strata_kernels::compile::Compiler;

pub use library::{ensure_nccl, nccl_version};

use crate::device::{DeviceBuf, DeviceBufMut, DeviceCollective, DeviceCommunicator, Dtype};
use crate::{CollectiveError, CollectiveKind};

/// The ordered-sum kernels' source, compiled per device architecture.
pub const ORDERED_SUM: strata_kernels::Source = strata_kernels::Source {
    module: "collective_ordered_sum",
    text: include_str!("../cuda/ordered_sum.cu"),
};

const SUM_THREADS: u32 = 256;

/// Creates the communicators of an NCCL group.
#[derive(Debug)]
pub struct NcclGroup;

impl NcclGroup {
    /// One communicator per device, rank `r` on `devices[r]`, each with a new stream of its own.
    /// Fails with a clear error where there is no driver, no libnccl, no NVRTC, or a device is
    /// absent or repeated.
    #[expect(
        clippy::new_ret_no_self,
        reason = "a group exists only as its handles; there is no group value to return"
    )]
    pub fn new(devices: &[usize]) -> Result<Vec<NcclCommunicator>, CollectiveError> {
        check_devices(devices, None)?;
        strata_kernels::libs::ensure_driver().map_err(|e| kernel_error("finding libcuda", e))?;
        ensure_nccl()?;
        let count = CudaContext::device_count().map_err(|e| cuda("cuDeviceGetCount", e))?;
        check_devices(devices, Some(count.max(0) as usize))?;
        let streams = devices
            .iter()
            .map(|&d| {
                let ctx =
                    CudaContext::new(d).map_err(|e| cuda(format!("opening device {d}"), e))?;
                ctx.new_stream()
                    .map_err(|e| cuda(format!("creating a stream on device {d}"), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::on_streams(streams)
    }

    /// One communicator per stream, rank `r` on `streams[r]`'s device: for callers that already
    /// have a stream per GPU (the CUDA backend's), so collectives need no cross-stream waits.
    pub fn on_streams(
        streams: Vec<Arc<CudaStream>>,
    ) -> Result<Vec<NcclCommunicator>, CollectiveError> {
        let devices: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
        check_devices(&devices, None)?;
        ensure_nccl()?;
        let compiler = Compiler::new(None).map_err(|e| kernel_error("setting up NVRTC", e))?;
        let sums = streams
            .iter()
            .map(|s| OrderedSum::load(s.context(), &compiler))
            .collect::<Result<Vec<_>, _>>()?;
        let comms = init_ranks(&streams)?;
        let world_size = streams.len();
        let mut handles = Vec::with_capacity(world_size);
        for (rank, ((comm, stream), sum)) in comms.into_iter().zip(streams).zip(sums).enumerate() {
            let barrier_send = alloc::<f32>(&stream, 1)?;
            let barrier_recv = alloc::<f32>(&stream, world_size)?;
            handles.push(NcclCommunicator {
                comm: RankComm(comm),
                rank,
                world_size,
                device: stream.context().ordinal(),
                sum,
                gather_f32: None,
                gather_bf16: None,
                barrier_send,
                barrier_recv,
                broken: None,
                stream,
            });
        }
        Ok(handles)
    }
}

/// Checks a device list: not empty, no device twice, and (once known) every ordinal below the
/// device count.
fn check_devices(devices: &[usize], count: Option<usize>) -> Result<(), CollectiveError> {
    if devices.is_empty() {
        return Err(CollectiveError::InvalidDevices(
            "no devices: a group needs at least one".into(),
        ));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(CollectiveError::InvalidDevices(format!(
                "device {d} is listed twice in {devices:?}: one rank per GPU"
            )));
        }
        if let Some(count) = count
            && *d >= count
        {
            return Err(CollectiveError::InvalidDevices(format!(
                "device {d} does not exist: this machine has {count} GPU(s)"
            )));
        }
    }
    Ok(())
}

/// Rank 0's unique id, then every rank's `ncclCommInitRank` inside one group, from this thread.
fn init_ranks(streams: &[Arc<CudaStream>]) -> Result<Vec<Comm>, CollectiveError> {
    let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", &e))?;
    let world_size = streams.len();
    group_start().map_err(|e| nccl_error("ncclGroupStart", &e))?;
    let mut comms = Vec::with_capacity(world_size);
    let mut failed = None;
    for (rank, stream) in streams.iter().enumerate() {
        // ncclCommInitRank takes its device from the thread's current context.
        if let Err(e) = stream.context().bind_to_thread() {
            failed = Some(cuda("binding a rank's context", e));
            break;
        }
        match Comm::from_rank(stream.clone(), rank, world_size, id) {
            Ok(comm) => comms.push(comm),
            Err(e) => {
                failed = Some(nccl_error("ncclCommInitRank", &e));
                break;
            }
        }
    }
    let ended = group_end().map_err(|e| nccl_error("ncclGroupEnd (communicator init)", &e));
    match (failed, ended) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(_)) => Ok(comms),
    }
}

/// The ordered-sum kernels loaded into one context.
#[derive(Debug)]
struct OrderedSum {
    _module: Arc<CudaModule>,
    f32: CudaFunction,
    bf16: CudaFunction,
}

impl OrderedSum {
    fn load(ctx: &Arc<CudaContext>, compiler: &Compiler) -> Result<Self, CollectiveError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda("reading the compute capability", e))?;
        let arch = strata_kernels::arch_for(major, minor);
        if arch == "unsupported" {
            return Err(kernel_error(
                "choosing an architecture",
                KernelError::UnsupportedArch { major, minor },
            ));
        }
        let ptx = compiler
            .compile(&ORDERED_SUM, arch)
            .map_err(|e| kernel_error("compiling ordered_sum.cu", e))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| cuda("loading ordered_sum.cu", e))?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda(format!("loading kernel {name}"), e))
        };
        Ok(OrderedSum {
            f32: function("ordered_sum_f32")?,
            bf16: function("ordered_sum_bf16")?,
            _module: module,
        })
    }
}

/// cudarc's NCCL communicator, made `Send`.
#[derive(Debug)]
struct RankComm(Comm);

// SAFETY: NCCL lets a communicator be used from any thread, one call at a time. `Comm` is `!Send`
// only because it holds a raw pointer. It is reachable only through `NcclCommunicator`, whose
// methods take `&mut self`, so no two threads use it at once.
unsafe impl Send for RankComm {}

/// One rank's NCCL communicator. Dropping it aborts the NCCL communicator; the other ranks'
/// pending collectives then fail or hang, so drop a group's handles together.
#[derive(Debug)]
pub struct NcclCommunicator {
    // Declared first: dropped (aborted) before the buffers and the stream it uses.
    comm: RankComm,
    rank: usize,
    world_size: usize,
    device: usize,
    sum: OrderedSum,
    /// All-reduce workspaces: every rank's contributions, rank-major; grown, never shrunk.
    gather_f32: Option<CudaSlice<f32>>,
    gather_bf16: Option<CudaSlice<bf16>>,
    barrier_send: CudaSlice<f32>,
    barrier_recv: CudaSlice<f32>,
    /// The error of a failed NCCL or CUDA call, returned by every later call.
    broken: Option<CollectiveError>,
    stream: Arc<CudaStream>,
}

impl NcclCommunicator {
    /// The CUDA device ordinal of this rank.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Fails with the error that broke the communicator, if one did.
    fn usable(&self) -> Result<(), CollectiveError> {
        self.broken.clone().map_or(Ok(()), Err)
    }

    /// Records `err` as the reason the communicator is broken and returns it.
    fn breaks(&mut self, err: CollectiveError) -> CollectiveError {
        self.broken.get_or_insert(err).clone()
    }

    /// What this rank alone can check about `ops`, before anything is enqueued.
    fn check(&self, ops: &[DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        let on_device = |kind, stream: &Arc<CudaStream>| {
            let found = stream.context().ordinal();
            if found == self.device {
                Ok(())
            } else {
                Err(CollectiveError::WrongDevice {
                    kind,
                    rank: self.rank,
                    expected: self.device,
                    found,
                })
            }
        };
        for op in ops {
            match op {
                DeviceCollective::AllReduceSum { buf } => {
                    on_device(CollectiveKind::AllReduceSum, buf.stream())?;
                }
                DeviceCollective::AllGather { input, output } => {
                    let kind = CollectiveKind::AllGather;
                    on_device(kind, input.stream())?;
                    on_device(kind, output.stream())?;
                    if input.dtype() != output.dtype() {
                        return Err(CollectiveError::DtypeMismatch {
                            kind,
                            rank: self.rank,
                            expected: input.dtype(),
                            found: output.dtype(),
                        });
                    }
                    let expected = input.len().checked_mul(self.world_size);
                    if expected != Some(output.len()) {
                        return Err(CollectiveError::GatherOutputLength {
                            rank: self.rank,
                            output: output.len(),
                            expected: expected.unwrap_or(usize::MAX),
                        });
                    }
                }
                DeviceCollective::Broadcast { buf, root } => {
                    on_device(CollectiveKind::Broadcast, buf.stream())?;
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

    /// Elements of each workspace the all-reduces of `ops` need together.
    fn workspace_needs(&self, ops: &[DeviceCollective<'_>]) -> (usize, usize) {
        if self.world_size == 1 {
            return (0, 0);
        }
        ops.iter().fold((0, 0), |(f, b), op| match op {
            DeviceCollective::AllReduceSum { buf } => match buf.dtype() {
                Dtype::F32 => (f + buf.len() * self.world_size, b),
                Dtype::Bf16 => (f, b + buf.len() * self.world_size),
            },
            _ => (f, b),
        })
    }

    /// Grows the workspaces to `need` elements (allocates only when they grow).
    fn reserve(&mut self, (need_f32, need_bf16): (usize, usize)) -> Result<(), CollectiveError> {
        if need_f32 > self.gather_f32.as_ref().map_or(0, |s| s.len()) {
            self.gather_f32 = None;
            self.gather_f32 = Some(alloc(&self.stream, need_f32)?);
        }
        if need_bf16 > self.gather_bf16.as_ref().map_or(0, |s| s.len()) {
            self.gather_bf16 = None;
            self.gather_bf16 = Some(alloc(&self.stream, need_bf16)?);
        }
        Ok(())
    }

    /// Issues the communication of every op inside one NCCL group: an all-reduce's all-gather
    /// into its stretch of the workspace, an all-gather, a broadcast in place.
    fn communicate(&mut self, ops: &mut [DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        group_start().map_err(|e| nccl_error("ncclGroupStart", &e))?;
        let (mut at_f32, mut at_bf16) = (0, 0);
        let mut issued = Ok(());
        for op in ops.iter_mut() {
            issued = self.issue(op, &mut at_f32, &mut at_bf16);
            if issued.is_err() {
                break;
            }
        }
        // The group must be closed whatever happened inside it.
        let ended = group_end().map_err(|e| nccl_error("ncclGroupEnd", &e));
        issued.and(ended.map(drop))
    }

    /// Issues one op's NCCL call; `at_*` are the next free elements of the workspaces.
    fn issue(
        &mut self,
        op: &mut DeviceCollective<'_>,
        at_f32: &mut usize,
        at_bf16: &mut usize,
    ) -> Result<(), CollectiveError> {
        let world = self.world_size;
        let comm = &self.comm.0;
        match op {
            DeviceCollective::AllReduceSum { buf } if world > 1 && !buf.is_empty() => match buf {
                DeviceBufMut::F32(v) => {
                    let mut ws = workspace(&mut self.gather_f32, at_f32, v.len() * world)?;
                    comm.all_gather(v, &mut ws)
                }
                DeviceBufMut::Bf16(v) => {
                    let mut ws = workspace(&mut self.gather_bf16, at_bf16, v.len() * world)?;
                    comm.all_gather(v, &mut ws)
                }
            }
            .map_err(|e| nccl_error("ncclAllGather (all-reduce)", &e))?,
            DeviceCollective::AllGather { input, output } if !input.is_empty() => {
                match (input, output) {
                    (DeviceBuf::F32(i), DeviceBufMut::F32(o)) => comm.all_gather(i, o),
                    (DeviceBuf::Bf16(i), DeviceBufMut::Bf16(o)) => comm.all_gather(i, o),
                    // Ruled out by `check`.
                    _ => return Ok(()),
                }
                .map_err(|e| nccl_error("ncclAllGather", &e))?
            }
            DeviceCollective::Broadcast { buf, root } if !buf.is_empty() => {
                let root = *root as i32; // < world_size, checked
                match buf {
                    DeviceBufMut::F32(v) => comm.broadcast_in_place(v, root),
                    DeviceBufMut::Bf16(v) => comm.broadcast_in_place(v, root),
                }
                .map_err(|e| nccl_error("ncclBroadcast", &e))?
            }
            _ => return Ok(()),
        };
        Ok(())
    }

    /// After the group: each all-reduce's rows added in rank order into its buffer; and every
    /// buffer's read/write events recorded again, now that the NCCL kernels are enqueued (cudarc
    /// recorded them when each call returned, which inside a group is before the launch).
    fn finish(&mut self, ops: &mut [DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        let world = self.world_size;
        let stream = &self.stream;
        let (mut at_f32, mut at_bf16) = (0, 0);
        for op in ops.iter_mut() {
            match op {
                DeviceCollective::AllReduceSum { buf } if world > 1 && !buf.is_empty() => match buf
                {
                    DeviceBufMut::F32(v) => {
                        let n = v.len();
                        let ws = gathered(&self.gather_f32, &mut at_f32, n * world)?;
                        launch_sum(stream, &self.sum.f32, &ws, v, world)?;
                    }
                    DeviceBufMut::Bf16(v) => {
                        let n = v.len();
                        let ws = gathered(&self.gather_bf16, &mut at_bf16, n * world)?;
                        launch_sum(stream, &self.sum.bf16, &ws, v, world)?;
                    }
                },
                DeviceCollective::AllReduceSum { .. } => {}
                DeviceCollective::AllGather { input, output } => {
                    touch(stream, input);
                    touch_mut(stream, output);
                }
                DeviceCollective::Broadcast { buf, .. } => touch_mut(stream, buf),
            }
        }
        Ok(())
    }
}

impl DeviceCommunicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.usable()?;
        let done = (|| {
            bind(&self.stream)?;
            self.comm
                .0
                .all_gather(&self.barrier_send, &mut self.barrier_recv)
                .map_err(|e| nccl_error("ncclAllGather (barrier)", &e))?;
            self.stream
                .synchronize()
                .map_err(|e| cuda("synchronizing after the barrier", e))
        })();
        done.map_err(|e| self.breaks(e))
    }

    fn run_group(&mut self, ops: &mut [DeviceCollective<'_>]) -> Result<(), CollectiveError> {
        self.usable()?;
        self.check(ops)?;
        let needs = self.workspace_needs(ops);
        let done = bind(&self.stream)
            .and_then(|()| self.reserve(needs))
            .and_then(|()| self.communicate(ops))
            .and_then(|()| self.finish(ops));
        done.map_err(|e| self.breaks(e))
    }
}

/// The next `len` elements of a workspace, as the all-gather's output.
fn workspace<'w, T>(
    slot: &'w mut Option<CudaSlice<T>>,
    at: &mut usize,
    len: usize,
) -> Result<CudaViewMut<'w, T>, CollectiveError> {
    let start = *at;
    *at += len;
    match slot {
        Some(ws) if ws.len() >= *at => Ok(ws.slice_mut(start..*at)),
        _ => Err(CollectiveError::Cuda {
            context: "all-reduce workspace".into(),
            message: "smaller than reserved (a bug)".into(),
        }),
    }
}

/// The same stretch [`workspace`] handed out, now as the ordered sum's input.
fn gathered<'w, T>(
    slot: &'w Option<CudaSlice<T>>,
    at: &mut usize,
    len: usize,
) -> Result<CudaView<'w, T>, CollectiveError> {
    let start = *at;
    *at += len;
    match slot {
        Some(ws) if ws.len() >= *at => Ok(ws.slice(start..*at)),
        _ => Err(CollectiveError::Cuda {
            context: "all-reduce workspace".into(),
            message: "smaller than reserved (a bug)".into(),
        }),
    }
}

/// `out[i] = ((g[0][i] + g[1][i]) + …)`: one thread per element, grid-stride.
fn launch_sum<T>(
    stream: &Arc<CudaStream>,
    function: &CudaFunction,
    gathered: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    world: usize,
) -> Result<(), CollectiveError> {
    let n = out.len();
    let blocks = n.div_ceil(SUM_THREADS as usize).clamp(1, 1 << 16) as u32;
    let (n64, world32) = (n as u64, world as i32);
    let (g, _g) = gathered.device_ptr(stream);
    let (o, _o) = out.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(function);
    launch.arg(&g).arg(&o).arg(&n64).arg(&world32);
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (SUM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gathered` holds `world * n` elements of the kernel's type (the workspace stretch
    // reserved for this op), `out` holds `n`; the arguments match the kernel's signature.
    unsafe { launch.launch(config) }
        .map(drop)
        .map_err(|e| cuda("launching ordered_sum", e))
}

/// Records the read event of `buf` on `stream` again (see [`NcclCommunicator::finish`]).
fn touch(stream: &CudaStream, buf: &DeviceBuf<'_>) {
    match buf {
        DeviceBuf::F32(v) => drop(v.device_ptr(stream)),
        DeviceBuf::Bf16(v) => drop(v.device_ptr(stream)),
    }
}

/// Records the write event of `buf` on `stream` again.
fn touch_mut(stream: &CudaStream, buf: &mut DeviceBufMut<'_>) {
    match buf {
        DeviceBufMut::F32(v) => drop(v.device_ptr_mut(stream)),
        DeviceBufMut::Bf16(v) => drop(v.device_ptr_mut(stream)),
    }
}

fn bind(stream: &CudaStream) -> Result<(), CollectiveError> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| cuda("binding the rank's context to this thread", e))
}

fn alloc<T: DeviceRepr + NcclType + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, CollectiveError> {
    stream
        .alloc_zeros::<T>(len)
        .map_err(|e| cuda(format!("allocating {len} elements"), e))
}

fn cuda(context: impl Into<String>, e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Cuda {
        context: context.into(),
        message: format!("{e:?}"),
    }
}

fn kernel_error(context: &str, e: KernelError) -> CollectiveError {
    match e {
        KernelError::LibraryMissing { library, looked } => CollectiveError::LibraryMissing {
            library: library.to_string(),
            looked,
        },
        other => CollectiveError::Cuda {
            context: context.to_string(),
            message: other.to_string(),
        },
    }
}

/// An NCCL error with NCCL's own description of its result code.
pub(crate) fn nccl_error(call: &'static str, e: &NcclError) -> CollectiveError {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe {
        let ptr = cudarc::nccl::sys::ncclGetErrorString(e.0);
        (!ptr.is_null()).then(|| std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned())
    };
    CollectiveError::Nccl {
        call,
        result: match text {
            Some(text) => format!("{:?} ({text})", e.0),
            None => format!("{:?}", e.0),
        },
    }
}

#[cfg(test)]
mod tests;
