//! Launchers for `cuda/moe.cu`: a mixture of experts' router logits, top-k routing, the chosen
//! experts' gated MLPs gathered by expert id from stacked weights, and the per-token sum. Each
//! output element is one warp's fixed-order reduction over its own token's row, so a token's
//! result does not depend on which tokens share the launch (prompt rows equal decode rows).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop};
use half::bf16;

use crate::launch::{aligned16, grid, need_len, product, stride_blocks, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const MODULE: &str = "moe";
const THREADS: u32 = 256;
/// A block of the routing kernels: 128 tokens of `moe_route`, 4 of `moe_route_warp`
/// (`ROUTE_WARPS` in cuda/moe.cu).
const ROUTE_THREADS: u32 = 128;
/// `moe_sort`'s one block (one thread per expert at most).
const SORT_THREADS: u32 = 1024;
/// The most experts and experts per token `moe_route` takes.
pub const MOE_MAX_EXPERTS: usize = 1024;
pub const MOE_MAX_TOP_K: usize = 32;

/// The slots of one expert launch: `slots` rows, slot `s` reading token `s / per_token` and
/// expert `ids[s]` (expert 0 without ids) of `experts` stacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertSlots {
    pub slots: usize,
    pub per_token: usize,
    pub experts: usize,
    pub hidden: usize,
    /// The expert's intermediate width (a multiple of 8).
    pub inter: usize,
}

/// A step's expert slots grouped by expert (`moe_sort`), for the grouped launches that read each
/// chosen expert's weights once however many of the step's tokens chose it.
pub struct ExpertGroups {
    /// Slot numbers, group by group.
    order: CudaSlice<i32>,
    /// Each group's expert (-1 past the last group).
    experts: CudaSlice<i32>,
    /// Each group's first position in `order`, then the end.
    starts: CudaSlice<i32>,
}

impl ExpertGroups {
    /// Room for `slots` slots over `experts` experts.
    pub fn new(
        stream: &Arc<CudaStream>,
        slots: usize,
        experts: usize,
    ) -> Result<Self, KernelError> {
        let groups = groups(slots, experts);
        Ok(Self {
            order: stream.alloc_zeros(slots.max(1))?,
            experts: stream.alloc_zeros(groups.max(1))?,
            starts: stream.alloc_zeros(groups + 1)?,
        })
    }

    /// The groups a launch of `slots` over `experts` uses, checked against the room.
    fn fit(&self, name: &'static str, slots: usize, experts: usize) -> Result<u32, KernelError> {
        let g = groups(slots, experts);
        need_len(name, "order", self.order.len(), slots)?;
        need_len(name, "group experts", self.experts.len(), g)?;
        need_len(name, "group starts", self.starts.len(), g + 1)?;
        to_u32(name, "groups", g)
    }
}

/// Groups of a step: at most one per expert and one per slot.
fn groups(slots: usize, experts: usize) -> usize {
    slots.min(experts)
}

/// Blocks of [`THREADS`] giving one warp to each of `items`.
fn warp_blocks(kernel: &'static str, items: usize) -> Result<u32, KernelError> {
    let warps_per_block = (THREADS / 32) as usize;
    to_u32(kernel, "blocks", items.div_ceil(warps_per_block))
}

impl Kernels {
    /// `logits[t, e] = x[t] · w[e]` in f32 (`x` `[tokens, hidden]` bf16, `w` `[experts, hidden]`
    /// bf16, `hidden % 8 == 0`, both 16-byte aligned).
    pub fn moe_logits(
        &self,
        stream: &Arc<CudaStream>,
        logits: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (tokens, experts, hidden): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        let name = "moe_logits";
        ensure_shape!(
            hidden.is_multiple_of(8),
            name,
            "hidden = {hidden} is not a multiple of 8"
        );
        let items = product(name, &[tokens, experts])?;
        need_len(name, "logits", logits.len(), items)?;
        need_len(name, "x", x.len(), product(name, &[tokens, hidden])?)?;
        need_len(name, "w", w.len(), product(name, &[experts, hidden])?)?;
        if items == 0 {
            return Ok(());
        }
        let blocks = warp_blocks(name, items)?;
        let (t32, e32, h32) = (
            to_u32(name, "tokens", tokens)?,
            to_u32(name, "experts", experts)?,
            to_u32(name, "hidden", hidden)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = logits.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        aligned16(name, "x", xp)?;
        aligned16(name, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&xp).arg(&wp).arg(&t32).arg(&e32).arg(&h32);
        // SAFETY: the lengths and alignment the kernel reads and writes are checked above.
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// Each token's `k` experts (`ids`, ascending) and weights from its `logits` row: softmax,
    /// top-k (ties to the lower expert), divided by their sum when `normalize`. One thread per
    /// token.
    pub fn moe_route(
        &self,
        stream: &Arc<CudaStream>,
        (ids, weights): (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k): (usize, usize, usize),
        normalize: bool,
    ) -> Result<(), KernelError> {
        let shape = (tokens, experts, k, normalize);
        self.route(stream, ("moe_route", 1), (ids, weights), logits, shape)
    }

    /// [`Kernels::moe_route`]'s results, one warp per token.
    pub fn moe_route_warp(
        &self,
        stream: &Arc<CudaStream>,
        (ids, weights): (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k): (usize, usize, usize),
        normalize: bool,
    ) -> Result<(), KernelError> {
        let shape = (tokens, experts, k, normalize);
        self.route(
            stream,
            ("moe_route_warp", 32),
            (ids, weights),
            logits,
            shape,
        )
    }

    /// A routing kernel `name` giving `lanes` threads to each token.
    fn route(
        &self,
        stream: &Arc<CudaStream>,
        (name, lanes): (&'static str, usize),
        (ids, weights): (&mut impl DevicePtrMut<i32>, &mut impl DevicePtrMut<f32>),
        logits: &impl DevicePtr<f32>,
        (tokens, experts, k, normalize): (usize, usize, usize, bool),
    ) -> Result<(), KernelError> {
        ensure_shape!(
            (1..=MOE_MAX_EXPERTS).contains(&experts)
                && (1..=MOE_MAX_TOP_K.min(experts)).contains(&k),
            name,
            "{k} of {experts} experts: at most {MOE_MAX_TOP_K} of at most {MOE_MAX_EXPERTS}"
        );
        let chosen = product(name, &[tokens, k])?;
        need_len(name, "ids", ids.len(), chosen)?;
        need_len(name, "weights", weights.len(), chosen)?;
        need_len(
            name,
            "logits",
            logits.len(),
            product(name, &[tokens, experts])?,
        )?;
        if tokens == 0 {
            return Ok(());
        }
        let (t32, e32, k32, n32) = (
            to_u32(name, "tokens", tokens)?,
            experts as u32,
            k as u32,
            u32::from(normalize),
        );
        let f = self.function(MODULE, name)?;
        let (i, _i) = ids.device_ptr_mut(stream);
        let (wp, _w) = weights.device_ptr_mut(stream);
        let (l, _l) = logits.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&i)
            .arg(&wp)
            .arg(&l)
            .arg(&t32)
            .arg(&e32)
            .arg(&k32)
            .arg(&n32);
        let per_block = ROUTE_THREADS as usize / lanes;
        let blocks = to_u32(name, "blocks", tokens.div_ceil(per_block))?;
        // SAFETY: as in `moe_logits`.
        unsafe { b.launch(grid(blocks, ROUTE_THREADS)) }?;
        Ok(())
    }

    /// Groups the `slots` expert ids of a step by expert into `groups` (`ids` below `experts`,
    /// as `moe_route` writes them).
    pub fn moe_sort(
        &self,
        stream: &Arc<CudaStream>,
        groups: &mut ExpertGroups,
        ids: &impl DevicePtr<i32>,
        (slots, experts): (usize, usize),
    ) -> Result<(), KernelError> {
        let name = "moe_sort";
        ensure_shape!(
            (1..=MOE_MAX_EXPERTS).contains(&experts),
            name,
            "{experts} experts: at most {MOE_MAX_EXPERTS}"
        );
        need_len(name, "ids", ids.len(), slots)?;
        let g = groups.fit(name, slots, experts)?;
        if slots == 0 {
            return Ok(());
        }
        let (s32, e32) = (to_u32(name, "slots", slots)?, experts as u32);
        let f = self.function(MODULE, name)?;
        let (o, _o) = groups.order.device_ptr_mut(stream);
        let (ge, _ge) = groups.experts.device_ptr_mut(stream);
        let (gs, _gs) = groups.starts.device_ptr_mut(stream);
        let (ip, _i) = ids.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&ge)
            .arg(&gs)
            .arg(&ip)
            .arg(&s32)
            .arg(&e32)
            .arg(&g);
        // SAFETY: the lengths are checked above; the kernel skips an id outside the experts.
        unsafe { b.launch(grid(1, SORT_THREADS)) }?;
        Ok(())
    }

    /// [`Kernels::moe_gate_up`] over the slots grouped by `moe_sort`: the same bits, each chosen
    /// expert's rows read once a step.
    pub fn moe_gate_up_grouped(
        &self,
        stream: &Arc<CudaStream>,
        act: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        groups: &ExpertGroups,
        shape: ExpertSlots,
    ) -> Result<(), KernelError> {
        let name = "moe_gate_up_grouped";
        let ExpertSlots {
            slots,
            per_token,
            experts,
            hidden,
            inter,
        } = shape;
        check_slots(name, shape, None)?;
        let g = groups.fit(name, slots, experts)?;
        need_len(name, "act", act.len(), product(name, &[slots, inter])?)?;
        need_len(
            name,
            "x",
            x.len(),
            product(name, &[slots / per_token, hidden])?,
        )?;
        need_len(
            name,
            "w",
            w.len(),
            product(name, &[experts, 2 * inter, hidden])?,
        )?;
        let items = product(name, &[g as usize, inter])?;
        if items == 0 {
            return Ok(());
        }
        let blocks = warp_blocks(name, items)?;
        let (p32, i32_, h32) = (
            to_u32(name, "per_token", per_token)?,
            to_u32(name, "inter", inter)?,
            to_u32(name, "hidden", hidden)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = act.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (op, _op) = groups.order.device_ptr(stream);
        let (ge, _ge) = groups.experts.device_ptr(stream);
        let (gs, _gs) = groups.starts.device_ptr(stream);
        aligned16(name, "x", xp)?;
        aligned16(name, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&xp)
            .arg(&wp)
            .arg(&op)
            .arg(&ge)
            .arg(&gs)
            .arg(&g)
            .arg(&p32)
            .arg(&i32_)
            .arg(&h32);
        // SAFETY: as in `moe_logits`; the groups hold slots below `slots` and experts below
        // `experts` (moe_sort writes them from the router's ids).
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// [`Kernels::moe_down`] over the slots grouped by `moe_sort`, each slot scaled by its
    /// routing weight: the same bits, each chosen expert's rows read once a step.
    pub fn moe_down_grouped(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<f32>,
        act: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (groups, weights): (&ExpertGroups, &CudaSlice<f32>),
        shape: ExpertSlots,
    ) -> Result<(), KernelError> {
        let name = "moe_down_grouped";
        let ExpertSlots {
            slots,
            experts,
            hidden,
            inter,
            ..
        } = shape;
        check_slots(name, shape, None)?;
        let g = groups.fit(name, slots, experts)?;
        need_len(name, "weights", weights.len(), slots)?;
        need_len(name, "out", out.len(), product(name, &[slots, hidden])?)?;
        need_len(name, "act", act.len(), product(name, &[slots, inter])?)?;
        need_len(
            name,
            "w",
            w.len(),
            product(name, &[experts, hidden, inter])?,
        )?;
        let items = product(name, &[g as usize, hidden])?;
        if items == 0 {
            return Ok(());
        }
        let blocks = warp_blocks(name, items)?;
        let (h32, i32_) = (
            to_u32(name, "hidden", hidden)?,
            to_u32(name, "inter", inter)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (ap, _a) = act.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (op, _op) = groups.order.device_ptr(stream);
        let (ge, _ge) = groups.experts.device_ptr(stream);
        let (gs, _gs) = groups.starts.device_ptr(stream);
        let (rp, _r) = weights.device_ptr(stream);
        aligned16(name, "act", ap)?;
        aligned16(name, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&ap)
            .arg(&wp)
            .arg(&op)
            .arg(&ge)
            .arg(&gs)
            .arg(&rp)
            .arg(&g)
            .arg(&h32)
            .arg(&i32_);
        // SAFETY: as in `moe_gate_up_grouped`.
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// `act[s] = bf16(silu(gate) · up)` of slot `s`'s expert (`w` `[experts][2·inter][hidden]`,
    /// gate rows then up rows), on its token's row of `x`.
    pub fn moe_gate_up(
        &self,
        stream: &Arc<CudaStream>,
        act: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        ids: Option<&CudaSlice<i32>>,
        shape: ExpertSlots,
    ) -> Result<(), KernelError> {
        let name = "moe_gate_up";
        let ExpertSlots {
            slots,
            per_token,
            experts,
            hidden,
            inter,
        } = shape;
        check_slots(name, shape, ids.map(|i| i.len()))?;
        let items = product(name, &[slots, inter])?;
        need_len(name, "act", act.len(), items)?;
        need_len(
            name,
            "x",
            x.len(),
            product(name, &[slots / per_token, hidden])?,
        )?;
        need_len(
            name,
            "w",
            w.len(),
            product(name, &[experts, 2 * inter, hidden])?,
        )?;
        if items == 0 {
            return Ok(());
        }
        let blocks = warp_blocks(name, items)?;
        let (s32, p32, i32_, h32) = (
            to_u32(name, "slots", slots)?,
            to_u32(name, "per_token", per_token)?,
            to_u32(name, "inter", inter)?,
            to_u32(name, "hidden", hidden)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = act.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (ip, _i) = optional(ids, stream);
        aligned16(name, "x", xp)?;
        aligned16(name, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&xp)
            .arg(&wp)
            .arg(&ip)
            .arg(&s32)
            .arg(&p32)
            .arg(&i32_)
            .arg(&h32);
        // SAFETY: as in `moe_logits`; ids hold an expert below `experts` for every slot (the
        // router writes them).
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// `out[s, n] = bf16(act[s] · w[e][n]) · weights[s]` in f32 (`w` `[experts][hidden][inter]`;
    /// weight 1 without `weights`).
    pub fn moe_down(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<f32>,
        act: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (ids, weights): (Option<&CudaSlice<i32>>, Option<&CudaSlice<f32>>),
        shape: ExpertSlots,
    ) -> Result<(), KernelError> {
        let name = "moe_down";
        let ExpertSlots {
            slots,
            experts,
            hidden,
            inter,
            ..
        } = shape;
        check_slots(name, shape, ids.map(|i| i.len()))?;
        if let Some(weights) = weights {
            need_len(name, "weights", weights.len(), slots)?;
        }
        let items = product(name, &[slots, hidden])?;
        need_len(name, "out", out.len(), items)?;
        need_len(name, "act", act.len(), product(name, &[slots, inter])?)?;
        need_len(
            name,
            "w",
            w.len(),
            product(name, &[experts, hidden, inter])?,
        )?;
        if items == 0 {
            return Ok(());
        }
        let blocks = warp_blocks(name, items)?;
        let (s32, h32, i32_) = (
            to_u32(name, "slots", slots)?,
            to_u32(name, "hidden", hidden)?,
            to_u32(name, "inter", inter)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (ap, _a) = act.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (ip, _i) = optional(ids, stream);
        let (rp, _r) = optional(weights, stream);
        aligned16(name, "act", ap)?;
        aligned16(name, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&ap)
            .arg(&wp)
            .arg(&ip)
            .arg(&rp)
            .arg(&s32)
            .arg(&h32)
            .arg(&i32_);
        // SAFETY: as in `moe_gate_up`.
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// `out[t] = bf16(Σ_j slots[t, j] + sigmoid(gate[t]) · shared[t])`, the slots added in order
    /// from zero, the shared term only with `shared = Some((shared, gate))`.
    pub fn moe_combine(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        slots: &impl DevicePtr<f32>,
        shared: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        (tokens, k, hidden): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        let name = "moe_combine";
        let total = product(name, &[tokens, hidden])?;
        need_len(name, "out", out.len(), total)?;
        need_len(name, "slots", slots.len(), product(name, &[total, k])?)?;
        if let Some((values, gate)) = shared {
            need_len(name, "shared", values.len(), total)?;
            need_len(name, "gate", gate.len(), tokens)?;
        }
        if total == 0 {
            return Ok(());
        }
        let (t32, k32, h32) = (
            to_u32(name, "tokens", tokens)?,
            to_u32(name, "k", k)?,
            to_u32(name, "hidden", hidden)?,
        );
        let f = self.function(MODULE, name)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (sp, _s) = slots.device_ptr(stream);
        let (vp, _v) = optional(shared.map(|s| s.0), stream);
        let (gp, _g) = optional(shared.map(|s| s.1), stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&sp)
            .arg(&vp)
            .arg(&gp)
            .arg(&t32)
            .arg(&k32)
            .arg(&h32);
        // SAFETY: as in `moe_logits`.
        unsafe { b.launch(grid(stride_blocks(total, THREADS), THREADS)) }?;
        Ok(())
    }
}

/// The slots' shape checks shared by the expert launches.
fn check_slots(name: &'static str, s: ExpertSlots, ids: Option<usize>) -> Result<(), KernelError> {
    ensure_shape!(
        s.hidden.is_multiple_of(8) && s.inter.is_multiple_of(8),
        name,
        "hidden = {} and inter = {} must be multiples of 8",
        s.hidden,
        s.inter
    );
    ensure_shape!(
        s.per_token > 0 && s.slots.is_multiple_of(s.per_token) && s.experts > 0,
        name,
        "{} slots of {} per token over {} experts",
        s.slots,
        s.per_token,
        s.experts
    );
    match ids {
        Some(len) => need_len(name, "ids", len, s.slots),
        None => Ok(()),
    }
}

/// A device pointer, or null, with the guard that keeps it ordered on `stream`.
fn optional<'a, T>(
    p: Option<&'a CudaSlice<T>>,
    stream: &'a Arc<CudaStream>,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match p {
        Some(p) => {
            let (ptr, guard) = p.device_ptr(stream);
            (ptr, Some(guard))
        }
        None => (0, None),
    }
}
