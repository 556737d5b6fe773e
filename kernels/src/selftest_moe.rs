//! Checks of the mixture-of-experts kernels (`cuda/moe.cu`): the router's logits against f64,
//! the routing against the CPU reference's rule on the same logits (the same experts, the same
//! weights), the whole sparse MLP against an f64 twin with the kernels' rounding points (with and
//! without Qwen2-MoE's gated shared expert), and each token's output alone equal bit for bit to
//! its row in a batch, and the launches grouped by expert equal to a warp per slot bit for bit —
//! each with a canary that must fail.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::selftest::{
    Rng, TOL_BF16, TOL_F32, compare_with_canary, download, poisoned_bf16, poisoned_f32, round_bf16,
    to_f64, upload,
};
use crate::selftest_gemv::invariance_result;
use crate::{CheckResult, ExpertGroups, ExpertSlots, KernelError, Kernels};

/// One sparse layer's shape.
#[derive(Clone, Copy)]
struct Case {
    experts: usize,
    k: usize,
    hidden: usize,
    inter: usize,
    normalize: bool,
    /// Qwen2-MoE's shared expert's intermediate width.
    shared: Option<usize>,
    /// Routed by a warp a token and the slots grouped by expert (the grouped launches), not a
    /// thread a token and a warp a slot.
    grouped: bool,
}

impl Case {
    fn name(&self, tokens: usize) -> String {
        format!(
            "tokens={tokens} experts={} k={} hidden={} inter={} normalize={} shared={:?} grouped={}",
            self.experts,
            self.k,
            self.hidden,
            self.inter,
            self.normalize,
            self.shared,
            self.grouped
        )
    }
}

/// A layer's weights on the host.
struct Host {
    router: Vec<bf16>,
    gate_up: Vec<bf16>,
    down: Vec<bf16>,
    /// The shared expert's gate/up, down and `[1, hidden]` gate.
    shared: Option<[Vec<bf16>; 3]>,
}

impl Host {
    fn new(rng: &mut Rng, c: &Case) -> Host {
        let (e, h, i) = (c.experts, c.hidden, c.inter);
        Host {
            router: rng.bf16_vec(e * h, 0.5, 0.0),
            gate_up: rng.bf16_vec(e * 2 * i * h, 0.1, 0.0),
            down: rng.bf16_vec(e * h * i, 0.1, 0.0),
            shared: c.shared.map(|si| {
                [
                    rng.bf16_vec(2 * si * h, 0.1, 0.0),
                    rng.bf16_vec(h * si, 0.1, 0.0),
                    rng.bf16_vec(h, 0.2, 0.0),
                ]
            }),
        }
    }
}

/// The layer's weights on the device.
struct Device {
    router: CudaSlice<bf16>,
    gate_up: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
    shared: Option<[CudaSlice<bf16>; 3]>,
}

impl Device {
    fn new(s: &Arc<CudaStream>, h: &Host) -> Result<Device, KernelError> {
        Ok(Device {
            router: upload(s, &h.router)?,
            gate_up: upload(s, &h.gate_up)?,
            down: upload(s, &h.down)?,
            shared: match &h.shared {
                Some([a, b, c]) => Some([upload(s, a)?, upload(s, b)?, upload(s, c)?]),
                None => None,
            },
        })
    }
}

/// What one run of the kernels leaves: the logits, the routing and the layer's output.
struct Run {
    logits: Vec<f32>,
    ids: Vec<i32>,
    weights: Vec<f32>,
    out: Vec<bf16>,
    /// The activations and weighted expert outputs of the grouped launches, and of the launches
    /// with a warp per slot.
    grouped: (Vec<bf16>, Vec<f32>),
    plain: (Vec<bf16>, Vec<f32>),
}

/// The sparse MLP of `x`'s rows through the kernels, as the engine launches it.
fn run(
    k: &Kernels,
    s: &Arc<CudaStream>,
    c: &Case,
    w: &Device,
    x: &[bf16],
) -> Result<Run, KernelError> {
    let (h, e, kk) = (c.hidden, c.experts, c.k);
    let t = x.len() / h;
    let x = upload(s, x)?;
    let mut logits = poisoned_f32(s, t * e)?;
    k.moe_logits(s, &mut logits, &x, &w.router, (t, e, h))?;
    let mut ids = upload(s, &vec![-1i32; t * kk])?;
    let mut rw = poisoned_f32(s, t * kk)?;
    let shape = (t, e, kk);
    match c.grouped {
        true => k.moe_route_warp(s, (&mut ids, &mut rw), &logits, shape, c.normalize)?,
        false => k.moe_route(s, (&mut ids, &mut rw), &logits, shape, c.normalize)?,
    }
    let routed = ExpertSlots {
        slots: t * kk,
        per_token: kk,
        experts: e,
        hidden: h,
        inter: c.inter,
    };
    // Grouped by expert, and a warp per slot (each slot reading its expert's rows itself): the
    // same bits; the case's path feeds the output.
    let mut groups = ExpertGroups::new(s, t * kk, e)?;
    k.moe_sort(s, &mut groups, &ids, (t * kk, e))?;
    let mut act = poisoned_bf16(s, t * kk * c.inter)?;
    k.moe_gate_up_grouped(s, &mut act, &x, &w.gate_up, &groups, routed)?;
    let mut grouped_slots = poisoned_f32(s, t * kk * h)?;
    k.moe_down_grouped(s, &mut grouped_slots, &act, &w.down, (&groups, &rw), routed)?;
    let mut plain_act = poisoned_bf16(s, t * kk * c.inter)?;
    k.moe_gate_up(s, &mut plain_act, &x, &w.gate_up, Some(&ids), routed)?;
    let mut plain_slots = poisoned_f32(s, t * kk * h)?;
    k.moe_down(
        s,
        &mut plain_slots,
        &plain_act,
        &w.down,
        (Some(&ids), Some(&rw)),
        routed,
    )?;
    let mut out = poisoned_bf16(s, t * h)?;
    let slots = if c.grouped {
        &grouped_slots
    } else {
        &plain_slots
    };
    match (&w.shared, c.shared) {
        (Some([gu, down, gate]), Some(si)) => {
            let one = ExpertSlots {
                slots: t,
                per_token: 1,
                experts: 1,
                hidden: h,
                inter: si,
            };
            let mut sact = poisoned_bf16(s, t * si)?;
            k.moe_gate_up(s, &mut sact, &x, gu, None, one)?;
            let mut shared = poisoned_f32(s, t * h)?;
            k.moe_down(s, &mut shared, &sact, down, (None, None), one)?;
            let mut g = poisoned_f32(s, t)?;
            k.moe_logits(s, &mut g, &x, gate, (t, 1, h))?;
            k.moe_combine(s, &mut out, slots, Some((&shared, &g)), (t, kk, h))?;
        }
        _ => k.moe_combine(s, &mut out, slots, None, (t, kk, h))?,
    }
    Ok(Run {
        logits: download(s, &logits)?,
        ids: download(s, &ids)?,
        weights: download(s, &rw)?,
        out: download(s, &out)?,
        grouped: (download(s, &act)?, download(s, &grouped_slots)?),
        plain: (download(s, &plain_act)?, download(s, &plain_slots)?),
    })
}

/// The CPU reference's routing of one token (model/src/cpu/moe.rs): softmax in f32 less the
/// maximum, the k largest (ties to the lower expert), renormalized from the largest, by expert.
fn route(logits: &[f32], k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
    let mut chosen: Vec<(usize, f32)> = order[..k].iter().map(|&e| (e, exps[e] / sum)).collect();
    if normalize {
        let total: f32 = chosen.iter().map(|&(_, p)| p).sum();
        chosen.iter_mut().for_each(|(_, p)| *p /= total);
    }
    chosen.sort_by_key(|&(e, _)| e);
    chosen
}

fn dot(a: &[f64], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(x, w)| x * w.to_f64()).sum()
}

/// One expert's gated MLP of one row in f64 with the kernels' rounding points.
fn expert(x: &[f64], gate_up: &[bf16], down: &[bf16], h: usize, inter: usize) -> Vec<f64> {
    let act: Vec<f64> = (0..inter)
        .map(|i| {
            let g = round_bf16(dot(x, &gate_up[i * h..(i + 1) * h]));
            let u = round_bf16(dot(x, &gate_up[(inter + i) * h..(inter + i + 1) * h]));
            round_bf16(round_bf16(g / (1.0 + (-g).exp())) * u)
        })
        .collect();
    (0..h)
        .map(|n| round_bf16(dot(&act, &down[n * inter..(n + 1) * inter])))
        .collect()
}

/// The layer's output in f64 for the given routing (`shift` moves every chosen expert by one:
/// the canary).
fn twin(c: &Case, w: &Host, x: &[bf16], routing: &[Vec<(usize, f32)>], shift: usize) -> Vec<f64> {
    let (h, i) = (c.hidden, c.inter);
    let x = to_f64(x);
    let mut out = Vec::with_capacity(x.len());
    for (row, chosen) in x.chunks_exact(h).zip(routing) {
        let mut acc = vec![0.0f64; h];
        for &(e, p) in chosen {
            let e = (e + shift) % c.experts;
            let gu = &w.gate_up[e * 2 * i * h..(e + 1) * 2 * i * h];
            let y = expert(row, gu, &w.down[e * h * i..(e + 1) * h * i], h, i);
            acc.iter_mut()
                .zip(y)
                .for_each(|(a, y)| *a += y * f64::from(p));
        }
        if let (Some([gu, down, gate]), Some(si)) = (&w.shared, c.shared) {
            let y = expert(row, gu, down, h, si);
            let scale = 1.0 / (1.0 + (-dot(row, gate)).exp());
            acc.iter_mut().zip(y).for_each(|(a, y)| *a += scale * y);
        }
        out.extend(acc.into_iter().map(round_bf16));
    }
    out
}

pub(crate) fn check_moe(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let cases = [
        Case {
            experts: 16,
            k: 4,
            hidden: 256,
            inter: 96,
            normalize: true,
            shared: None,
            grouped: false,
        },
        Case {
            experts: 60,
            k: 4,
            hidden: 128,
            inter: 64,
            normalize: false,
            shared: Some(160),
            grouped: false,
        },
        Case {
            experts: 128,
            k: 8,
            hidden: 512,
            inter: 64,
            normalize: true,
            shared: None,
            grouped: false,
        },
        Case {
            experts: 8,
            k: 2,
            hidden: 64,
            inter: 224,
            normalize: true,
            shared: None,
            grouped: false,
        },
    ];
    let mut results = Vec::new();
    let paths = cases
        .iter()
        .flat_map(|c| [false, true].map(|grouped| Case { grouped, ..*c }));
    for c in &paths.collect::<Vec<_>>() {
        let tokens = 9;
        let host = Host::new(rng, c);
        let dev = Device::new(s, &host)?;
        let x = rng.bf16_vec(tokens * c.hidden, 1.0, 0.0);
        let r = run(k, s, c, &dev, &x)?;
        let case = c.name(tokens);
        results.extend(check_logits(c, &host, &x, &r, &case));
        results.extend(check_route(c, &r, &case));
        let routing: Vec<Vec<(usize, f32)>> = r
            .logits
            .chunks_exact(c.experts)
            .map(|l| route(l, c.k, c.normalize))
            .collect();
        results.extend(compare_with_canary(
            "moe mlp",
            case.clone(),
            &to_f64(&r.out),
            &twin(c, &host, &x, &routing, 0),
            &twin(c, &host, &x, &routing, 1),
            TOL_BF16,
        ));
        results.extend(check_alone(k, s, c, &dev, &x, &r)?);
        if c.grouped {
            // Many slots an expert (several of each group's batches of slots).
            let many = run(k, s, c, &dev, &rng.bf16_vec(64 * c.hidden, 1.0, 0.0))?;
            results.extend(check_grouped(c, &many));
        }
    }
    results.extend(check_nan_rows(k, s)?);
    Ok(results)
}

/// A row of NaN logits (a padding row's leftovers) still routes to k distinct experts in range
/// (never an address outside the stacks); the canary counts the same on ids left unwritten.
fn check_nan_rows(k: &Kernels, s: &Arc<CudaStream>) -> Result<Vec<CheckResult>, KernelError> {
    let (tokens, experts, kk) = (3, 16, 4);
    let logits = upload(s, &vec![f32::NAN; tokens * experts])?;
    let unwritten = vec![-1i32; tokens * kk];
    let bad = |ids: &[i32]| {
        ids.chunks_exact(kk)
            .map(|row| {
                let mut seen = std::collections::BTreeSet::new();
                row.iter()
                    .filter(|&&e| !(0..experts as i32).contains(&e) || !seen.insert(e))
                    .count()
            })
            .sum::<usize>()
    };
    let mut results = Vec::new();
    for name in ["moe_route", "moe_route_warp"] {
        let mut ids = upload(s, &unwritten)?;
        let mut weights = poisoned_f32(s, tokens * kk)?;
        let out = (&mut ids, &mut weights);
        let shape = (tokens, experts, kk);
        match name {
            "moe_route" => k.moe_route(s, out, &logits, shape, true)?,
            _ => k.moe_route_warp(s, out, &logits, shape, true)?,
        }
        let case = format!(
            "tokens={tokens} experts={experts} k={kk}: NaN logits, ids out of range or repeated"
        );
        results.push(invariance_result(
            name,
            case.clone(),
            false,
            bad(&download(s, &ids)?),
        ));
        results.push(invariance_result(
            name,
            format!("{case} (canary: unwritten ids)"),
            true,
            bad(&unwritten),
        ));
    }
    Ok(results)
}

fn check_logits(c: &Case, w: &Host, x: &[bf16], r: &Run, case: &str) -> Vec<CheckResult> {
    let x = to_f64(x);
    let h = c.hidden;
    let logits = |shift: usize| -> Vec<f64> {
        x.chunks_exact(h)
            .flat_map(|row| {
                (0..c.experts).map(move |e| {
                    let e = (e + shift) % c.experts;
                    dot(row, &w.router[e * h..(e + 1) * h])
                })
            })
            .collect()
    };
    let out: Vec<f64> = r.logits.iter().map(|&v| f64::from(v)).collect();
    compare_with_canary(
        "moe_logits",
        case.to_string(),
        &out,
        &logits(0),
        &logits(1),
        TOL_F32,
    )
}

/// The kernel's experts are the CPU rule's on the same logits, and its weights within f32
/// rounding (expf against the host's exp); the canary: the other normalization.
fn check_route(c: &Case, r: &Run, case: &str) -> Vec<CheckResult> {
    let mut ids_differ = 0;
    let (mut weights, mut right, mut wrong) = (Vec::new(), Vec::new(), Vec::new());
    for (t, logits) in r.logits.chunks_exact(c.experts).enumerate() {
        let chosen = route(logits, c.k, c.normalize);
        let other = route(logits, c.k, !c.normalize);
        for (j, ((e, p), (_, q))) in chosen.into_iter().zip(other).enumerate() {
            ids_differ += usize::from(r.ids[t * c.k + j] != e as i32);
            weights.push(f64::from(r.weights[t * c.k + j]));
            right.push(f64::from(p));
            wrong.push(f64::from(q));
        }
    }
    let mut results = vec![invariance_result(
        "moe_route",
        format!("{case}: experts chosen vs the CPU rule"),
        false,
        ids_differ,
    )];
    results.extend(compare_with_canary(
        "moe_route",
        format!("{case}: weights"),
        &weights,
        &right,
        &wrong,
        TOL_F32,
    ));
    results
}

/// The grouped launches give every activation and expert output the bits of the launches with
/// a warp per slot; the canary sets each slot against the next slot's.
fn check_grouped(c: &Case, r: &Run) -> Vec<CheckResult> {
    let tokens = r.out.len() / c.hidden;
    let case = format!("{}: grouped by expert vs a warp per slot", c.name(tokens));
    let differ = |shift: usize| {
        let (act, slots) = (&r.grouped.0, &r.grouped.1);
        let (pa, ps) = (&r.plain.0, &r.plain.1);
        let rotate = |n: usize, len: usize| (n + shift * len) % act.len().max(1);
        let a = (0..act.len())
            .filter(|&n| act[n].to_bits() != pa[rotate(n, c.inter)].to_bits() || act[n].is_nan())
            .count();
        let rotate = |n: usize| (n + shift * c.hidden) % slots.len().max(1);
        let o = (0..slots.len())
            .filter(|&n| slots[n].to_bits() != ps[rotate(n)].to_bits() || slots[n].is_nan())
            .count();
        a + o
    };
    vec![
        invariance_result("moe grouped", case.clone(), false, differ(0)),
        invariance_result(
            "moe grouped",
            format!("{case} (canary: the next slot)"),
            true,
            differ(1),
        ),
    ]
}

/// Each token alone through the kernels equals its row of the batch bit for bit; the canary
/// sets a token alone against the next token's row.
fn check_alone(
    k: &Kernels,
    s: &Arc<CudaStream>,
    c: &Case,
    dev: &Device,
    x: &[bf16],
    batch: &Run,
) -> Result<Vec<CheckResult>, KernelError> {
    let h = c.hidden;
    let tokens = x.len() / h;
    let (mut differ, mut canary) = (0, 0);
    for t in [0, tokens / 2, tokens - 1] {
        let alone = run(k, s, c, dev, &x[t * h..(t + 1) * h])?;
        let row = |r: usize| &batch.out[r * h..(r + 1) * h];
        let bits = |a: &[bf16], b: &[bf16]| {
            a.iter()
                .zip(b)
                .filter(|(p, q)| p.to_bits() != q.to_bits() || p.is_nan())
                .count()
        };
        differ += bits(&alone.out, row(t));
        canary += bits(&alone.out, row((t + 1) % tokens));
    }
    let case = format!(
        "{}: each token alone vs its row of the batch",
        c.name(tokens)
    );
    Ok(vec![
        invariance_result("moe invariance", case.clone(), false, differ),
        invariance_result(
            "moe invariance",
            format!("{case} (canary: the next row)"),
            true,
            canary,
        ),
    ])
}
