//! The in-process communicator: ranks are threads of one process, sharing memory (DESIGN.md §5).
//!
//! Every collective is one rendezvous in two phases, guarded by one mutex and one condition
//! variable (threads sleep; nothing spins):
//!
//! 1. **Gathering.** Each rank copies its contribution into its own slot (a buffer that only that
//!    rank writes, reused from call to call so steady state allocates nothing) and registers what
//!    it issued. The last rank to arrive checks that all ranks issued the same collective — the
//!    verdict, one for all ranks — and, for an all-reduce, adds the slots into the shared sum in
//!    rank order. That rank alone computes the sum, so every rank copies the same bits.
//! 2. **Draining.** Each rank copies its result out of the slots (or the sum) and departs. The last
//!    to depart reopens gathering. A rank that issues its next collective early waits for that,
//!    because the slots are still being read until then.
//!
//! A handle dropped (or unwound by a panic) marks the group broken and wakes everyone; a rank that
//! waits longer than the group's timeout marks it broken too. Broken is permanent.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{
    Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
use std::time::{Duration, Instant};

use crate::{Collective, CollectiveError, CollectiveKind, Communicator, GroupPosition};

/// How long a rank waits for the others in one collective before the group is declared broken.
/// Generous: between two collectives the ranks do the same work, and a dropped handle is detected
/// at once, without waiting for this.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates the handles of an in-process group.
#[derive(Debug)]
pub struct LocalGroup;

impl LocalGroup {
    /// `world_size` handles, rank `r` at index `r`, with [`DEFAULT_TIMEOUT`]. Hand one to each rank
    /// thread. An empty group (`world_size == 0`) has no handles.
    #[expect(
        clippy::new_ret_no_self,
        reason = "a group exists only as its handles; there is no group value to return"
    )]
    pub fn new(world_size: usize) -> Vec<LocalCommunicator> {
        Self::with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// As [`LocalGroup::new`], with the time a rank waits for the others before the collective
    /// fails with [`CollectiveError::Timeout`].
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Vec<LocalCommunicator> {
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            control: Mutex::new(Control {
                phase: Phase::Gathering,
                arrived: vec![false; world_size],
                descs: vec![Desc::NONE; world_size],
                departed: vec![false; world_size],
                verdict: Ok(()),
                broken: None,
            }),
            changed: Condvar::new(),
            slots: (0..world_size).map(|_| RwLock::new(Vec::new())).collect(),
            sum: RwLock::new(Vec::new()),
        });
        (0..world_size)
            .map(|rank| LocalCommunicator {
                shared: Arc::clone(&shared),
                rank,
                in_call: AtomicBool::new(false),
            })
            .collect()
    }
}

/// One rank's handle on a [`LocalGroup`]. Dropping it breaks the group: the other ranks' pending
/// and later collectives fail with [`CollectiveError::PeerGone`].
#[derive(Debug)]
pub struct LocalCommunicator {
    shared: Arc<Shared>,
    rank: usize,
    /// Set while this handle is inside a collective, to refuse a second, concurrent one.
    in_call: AtomicBool,
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    timeout: Duration,
    control: Mutex<Control>,
    /// Notified on every phase change and when the group breaks.
    changed: Condvar,
    /// Rank `r`'s contribution to the current collective: written only by rank `r` while
    /// gathering, read by any rank while draining.
    slots: Vec<RwLock<Vec<f32>>>,
    /// The all-reduce result: written by the last rank to arrive, read while draining.
    sum: RwLock<Vec<f32>>,
}

#[derive(Debug)]
struct Control {
    phase: Phase,
    /// Per rank, while gathering: has it registered its collective in `descs`?
    arrived: Vec<bool>,
    descs: Vec<Desc>,
    /// Per rank, while draining: has it copied its result out?
    departed: Vec<bool>,
    /// The outcome of the collective being drained, the same for every rank.
    verdict: Result<(), CollectiveError>,
    /// Why the group is unusable, once it is.
    broken: Option<CollectiveError>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Gathering,
    Draining,
}

/// What one rank issued: enough to check that all ranks issued the same collective.
#[derive(Debug, Clone, Copy)]
struct Desc {
    kind: CollectiveKind,
    position: GroupPosition,
    /// Input length (the buffer's, for all-reduce and broadcast).
    len: usize,
    /// All-gather only.
    output_len: usize,
    /// Broadcast only.
    root: usize,
}

impl Desc {
    const NONE: Desc = Desc {
        kind: CollectiveKind::Barrier,
        position: GroupPosition::Single,
        len: 0,
        output_len: 0,
        root: 0,
    };
}

/// A collective with this rank's buffers: [`Collective`] plus the barrier.
enum Op<'a> {
    AllReduceSum(&'a mut [f32]),
    AllGather(&'a [f32], &'a mut [f32]),
    Broadcast(&'a mut [f32], usize),
    Barrier,
}

impl<'a> Op<'a> {
    fn from_collective(op: &'a mut Collective<'_>) -> Self {
        match op {
            Collective::AllReduceSum { buf } => Op::AllReduceSum(buf),
            Collective::AllGather { input, output } => Op::AllGather(input, output),
            Collective::Broadcast { buf, root } => Op::Broadcast(buf, *root),
        }
    }

    fn desc(&self, position: GroupPosition) -> Desc {
        let (kind, len, output_len, root) = match self {
            Op::AllReduceSum(buf) => (CollectiveKind::AllReduceSum, buf.len(), 0, 0),
            Op::AllGather(input, output) => {
                (CollectiveKind::AllGather, input.len(), output.len(), 0)
            }
            Op::Broadcast(buf, root) => (CollectiveKind::Broadcast, buf.len(), 0, *root),
            Op::Barrier => (CollectiveKind::Barrier, 0, 0, 0),
        };
        Desc {
            kind,
            position,
            len,
            output_len,
            root,
        }
    }

    /// What `rank` puts in its slot.
    fn contribution(&self, rank: usize) -> Option<&[f32]> {
        match self {
            Op::AllReduceSum(buf) => Some(buf),
            Op::AllGather(input, _) => Some(input),
            Op::Broadcast(buf, root) if *root == rank => Some(buf),
            Op::Broadcast(..) | Op::Barrier => None,
        }
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let _call = InCall::enter(self)?;
        self.rendezvous(Op::AllReduceSum(buf), GroupPosition::Single)
    }

    fn all_gather_f32(&self, input: &[f32], output: &mut [f32]) -> Result<(), CollectiveError> {
        let _call = InCall::enter(self)?;
        self.rendezvous(Op::AllGather(input, output), GroupPosition::Single)
    }

    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let _call = InCall::enter(self)?;
        self.rendezvous(Op::Broadcast(buf, root), GroupPosition::Single)
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        let _call = InCall::enter(self)?;
        self.rendezvous(Op::Barrier, GroupPosition::Single)
    }

    /// Runs the collectives one after the other, each its own rendezvous.
    fn run_group(&self, ops: &mut [Collective<'_>]) -> Result<(), CollectiveError> {
        let _call = InCall::enter(self)?;
        let len = ops.len();
        for (index, op) in ops.iter_mut().enumerate() {
            let position = GroupPosition::InGroup { index, len };
            self.rendezvous(Op::from_collective(op), position)?;
        }
        Ok(())
    }
}

impl LocalCommunicator {
    fn rendezvous(&self, mut op: Op<'_>, position: GroupPosition) -> Result<(), CollectiveError> {
        let shared = &*self.shared;
        // A timeout too large to add to now is no timeout at all.
        let deadline = Instant::now().checked_add(shared.timeout);

        // Until the previous collective has drained, its readers may still read our slot.
        let control = shared.lock()?;
        let control = shared.wait_until(control, deadline, |c| c.phase == Phase::Gathering)?;
        if let Some(err) = &control.broken {
            return Err(err.clone());
        }
        // Gathering cannot end without us, so the lock can go while we fill our slot.
        drop(control);
        if let Some(data) = op.contribution(self.rank) {
            let mut slot = shared.write(&shared.slots[self.rank])?;
            slot.clear();
            slot.extend_from_slice(data);
        }

        let mut control = shared.lock()?;
        if let Some(err) = &control.broken {
            return Err(err.clone());
        }
        control.descs[self.rank] = op.desc(position);
        control.arrived[self.rank] = true;
        if control.arrived.iter().all(|&a| a) {
            // Last to arrive: judge and reduce for everyone, under the lock, so no rank can see
            // the draining phase before the sum is complete.
            let verdict = check(&control.descs, shared.world_size);
            if verdict.is_ok()
                && matches!(op, Op::AllReduceSum(_))
                && shared.reduce_in_rank_order().is_err()
            {
                return Err(shared.poisoned(control));
            }
            control.verdict = verdict;
            control.phase = Phase::Draining;
            shared.changed.notify_all();
        } else {
            control = shared.wait_until(control, deadline, |c| c.phase == Phase::Draining)?;
        }
        let verdict = control.verdict.clone();
        drop(control);

        if verdict.is_ok() {
            shared.receive(&mut op, self.rank)?;
        }

        let mut control = shared.lock()?;
        control.departed[self.rank] = true;
        if control.departed.iter().all(|&d| d) {
            control.phase = Phase::Gathering;
            control.arrived.fill(false);
            control.departed.fill(false);
            shared.changed.notify_all();
        }
        verdict
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        let mut control = self
            .shared
            .control
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        control
            .broken
            .get_or_insert(CollectiveError::PeerGone { rank: self.rank });
        drop(control);
        self.shared.changed.notify_all();
    }
}

/// Marks a handle as inside a collective for the guard's lifetime.
struct InCall<'a>(&'a AtomicBool);

impl<'a> InCall<'a> {
    fn enter(comm: &'a LocalCommunicator) -> Result<Self, CollectiveError> {
        if comm.in_call.swap(true, Ordering::Acquire) {
            return Err(CollectiveError::ConcurrentCall { rank: comm.rank });
        }
        Ok(InCall(&comm.in_call))
    }
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The verdict on one collective, from what every rank issued; the first disagreement in rank
/// order wins, so every rank reports the same error.
fn check(descs: &[Desc], world_size: usize) -> Result<(), CollectiveError> {
    let Some(first) = descs.first() else {
        return Ok(());
    };
    for (rank, desc) in descs.iter().enumerate().skip(1) {
        if desc.position != first.position {
            return Err(CollectiveError::GroupMismatch {
                rank,
                expected: first.position,
                found: desc.position,
            });
        }
        if desc.kind != first.kind {
            return Err(CollectiveError::KindMismatch {
                rank,
                expected: first.kind,
                found: desc.kind,
            });
        }
        if desc.len != first.len {
            return Err(CollectiveError::LengthMismatch {
                kind: first.kind,
                rank,
                len: desc.len,
                expected: first.len,
            });
        }
        if first.kind == CollectiveKind::Broadcast && desc.root != first.root {
            return Err(CollectiveError::RootMismatch {
                rank,
                root: desc.root,
                expected: first.root,
            });
        }
    }
    if first.kind == CollectiveKind::Broadcast && first.root >= world_size {
        return Err(CollectiveError::RootOutOfRange {
            root: first.root,
            world_size,
        });
    }
    if first.kind == CollectiveKind::AllGather {
        let expected = first.len.checked_mul(world_size);
        for (rank, desc) in descs.iter().enumerate() {
            if expected != Some(desc.output_len) {
                return Err(CollectiveError::GatherOutputLength {
                    rank,
                    output: desc.output_len,
                    expected: expected.unwrap_or(usize::MAX),
                });
            }
        }
    }
    Ok(())
}

impl Shared {
    /// `sum[i] = ((slot₀[i] + slot₁[i]) + …) + slotₙ₋₁[i]` in f32: the order the crate promises.
    /// Element-wise, so vectorizing across `i` keeps every element's order. Called with the
    /// control lock held, so a poisoned buffer lock is only reported, for the caller to break the
    /// group with the guard it holds.
    fn reduce_in_rank_order(&self) -> Result<(), ()> {
        let mut sum = self.sum.write().map_err(drop)?;
        sum.clear();
        for (rank, slot) in self.slots.iter().enumerate() {
            let slot = slot.read().map_err(drop)?;
            if rank == 0 {
                sum.extend_from_slice(&slot);
            } else {
                for (acc, x) in sum.iter_mut().zip(slot.iter()) {
                    *acc += *x;
                }
            }
        }
        Ok(())
    }

    /// Copies `rank`'s result out, once the verdict is `Ok`: every length below was checked by
    /// [`check`], so the copies cannot panic.
    fn receive(&self, op: &mut Op<'_>, rank: usize) -> Result<(), CollectiveError> {
        match op {
            Op::AllReduceSum(buf) => buf.copy_from_slice(&self.read(&self.sum)?),
            Op::AllGather(input, output) => {
                let n = input.len();
                for (r, slot) in self.slots.iter().enumerate() {
                    output[r * n..(r + 1) * n].copy_from_slice(&self.read(slot)?);
                }
            }
            Op::Broadcast(buf, root) if *root != rank => {
                buf.copy_from_slice(&self.read(&self.slots[*root])?);
            }
            Op::Broadcast(..) | Op::Barrier => {}
        }
        Ok(())
    }

    /// Waits until `done` holds, the group breaks, or `deadline` passes (which breaks the group;
    /// `None` waits without limit).
    /// `done` is checked first: a collective that completed is not failed by a later break.
    fn wait_until<'g>(
        &self,
        mut control: MutexGuard<'g, Control>,
        deadline: Option<Instant>,
        done: impl Fn(&Control) -> bool,
    ) -> Result<MutexGuard<'g, Control>, CollectiveError> {
        loop {
            if done(&control) {
                return Ok(control);
            }
            if let Some(err) = &control.broken {
                return Err(err.clone());
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                let err = CollectiveError::Timeout {
                    timeout: self.timeout,
                    missing: control.missing(),
                };
                control.broken = Some(err.clone());
                self.changed.notify_all();
                return Err(err);
            }
            let woken = match left {
                Some(left) => self
                    .changed
                    .wait_timeout(control, left)
                    .map(|(c, _)| c)
                    .map_err(|poisoned| poisoned.into_inner().0),
                None => self.changed.wait(control).map_err(PoisonError::into_inner),
            };
            control = woken.map_err(|control| self.poisoned(control))?;
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Control>, CollectiveError> {
        self.control
            .lock()
            .map_err(|poisoned| self.poisoned(poisoned.into_inner()))
    }

    fn read<'s>(
        &'s self,
        lock: &'s RwLock<Vec<f32>>,
    ) -> Result<RwLockReadGuard<'s, Vec<f32>>, CollectiveError> {
        lock.read().map_err(|_| self.break_after_panic())
    }

    fn write<'s>(
        &'s self,
        lock: &'s RwLock<Vec<f32>>,
    ) -> Result<RwLockWriteGuard<'s, Vec<f32>>, CollectiveError> {
        lock.write().map_err(|_| self.break_after_panic())
    }

    /// A poisoned lock means a thread panicked mid-collective: the rendezvous state can no longer
    /// be trusted, so the group breaks.
    fn poisoned(&self, mut control: MutexGuard<'_, Control>) -> CollectiveError {
        control.broken.get_or_insert(CollectiveError::Panicked);
        self.changed.notify_all();
        CollectiveError::Panicked
    }

    fn break_after_panic(&self) -> CollectiveError {
        let control = self.control.lock().unwrap_or_else(PoisonError::into_inner);
        self.poisoned(control)
    }
}

impl Control {
    /// The ranks the current phase is waiting for.
    fn missing(&self) -> Vec<usize> {
        let pending = match self.phase {
            Phase::Gathering => &self.arrived,
            Phase::Draining => &self.departed,
        };
        (0..pending.len()).filter(|&r| !pending[r]).collect()
    }
}

#[cfg(test)]
mod tests;
