//! Device self-test: every kernel against a CPU reference on fresh random inputs.
//!
//! Each check draws its inputs from a seeded RNG (never zeros), fills every output with NaN
//! before the launch, and compares against a reference computed on the host in f64 with bf16
//! rounding at the same points as the kernel. It reports the relative error
//! ‖out − ref‖₂ / ‖ref‖₂ (`rel_err`) against a stated tolerance and whether every output
//! element was written. Each category has a canary arm: the same output against a deliberately
//! wrong reference, which must fail. The numbers only mean something on a GPU; without one,
//! the caller never gets a [`Kernels`] to test.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;

use crate::selftest_gemv as gemv_checks;
use crate::{
    CheckResult, KernelError, Kernels, RopeKvShape, selftest_attention, selftest_gemma,
    selftest_runs, selftest_tp,
};

/// Tolerance for bf16 outputs whose reference rounds at the kernel's rounding points: only an
/// f32-vs-f64 difference flipping a rounding remains, far under one bf16 ulp (2⁻⁸) overall.
pub(crate) const TOL_BF16: f64 = 2e-3;
/// Tolerance for f32 outputs of f32-accumulated sums.
pub(crate) const TOL_F32: f64 = 1e-5;

/// Runs every check (attention's included) with a seed drawn from the clock.
pub fn selftest(kernels: &Kernels, stream: &Arc<CudaStream>) -> Vec<CheckResult> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed);
    selftest_with_seed(kernels, stream, seed)
}

/// Runs every check with inputs drawn from `seed` (recorded in each result's detail).
pub fn selftest_with_seed(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    seed: u64,
) -> Vec<CheckResult> {
    let mut rng = Rng::new(seed);
    let mut results = Vec::new();
    type Check = fn(&Kernels, &Arc<CudaStream>, &mut Rng) -> Result<Vec<CheckResult>, KernelError>;
    let checks: &[(&str, Check)] = &[
        ("embed", check_embed),
        ("rmsnorm", check_rmsnorm),
        ("add_rmsnorm", check_add_rmsnorm),
        ("head_rmsnorm", check_head_rmsnorm),
        ("add_bias", check_add_bias),
        ("rope_kv_write", check_rope_kv_write),
        ("silu_mul", check_silu_mul),
        ("gemv", gemv_checks::check_gemv),
        ("gemv batch invariance", gemv_checks::check_gemv_invariance),
        ("gemv3 fused q/k/v", gemv_checks::check_gemv3),
        ("argmax", gemv_checks::check_argmax),
        ("gemm", gemv_checks::check_gemm),
        ("gemm runs", selftest_runs::check_gemm_runs),
        ("run order invariance", selftest_runs::check_runs_invariance),
        ("gemv tiles", crate::selftest_tiles::check_tiles),
        ("gemv shards", selftest_tp::check_gemv_shards),
        ("gemm slices", selftest_tp::check_gemm_slices),
        ("embed rows", selftest_tp::check_embed_rows),
        ("kv_scatter/kv_gather", crate::kv_copy::check),
        ("moe", crate::selftest_moe::check_moe),
    ];
    for (name, check) in checks {
        match check(kernels, stream, &mut rng) {
            Ok(mut r) => results.append(&mut r),
            Err(e) => results.push(CheckResult::error(
                name,
                format!("seed {seed:#x}"),
                false,
                e,
            )),
        }
    }
    results.extend(selftest_gemma::checks(kernels, stream, &mut rng));
    results.extend(selftest_attention::checks(kernels, stream));
    results
}

/// A small deterministic generator (SplitMix64): the same seed gives the same inputs.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A bf16 uniform in ±[0.01, 1) · scale + offset: never zero when offset is 0.
    pub(crate) fn bf16(&mut self, scale: f64, offset: f64) -> bf16 {
        let magnitude = 0.01 + 0.99 * self.unit();
        let sign = if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        bf16::from_f64(sign * magnitude * scale + offset)
    }

    pub(crate) fn bf16_vec(&mut self, n: usize, scale: f64, offset: f64) -> Vec<bf16> {
        (0..n).map(|_| self.bf16(scale, offset)).collect()
    }
}

/// The f64 value of the bf16 nearest `v`: a bf16 store in the reference.
pub(crate) fn round_bf16(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

pub(crate) fn to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// ‖out − ref‖₂ / ‖ref‖₂; infinite when any output is not finite.
pub(crate) fn rel_err(out: &[f64], reference: &[f64]) -> f64 {
    if out.len() != reference.len() || out.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = out
        .iter()
        .zip(reference)
        .map(|(o, r)| (o - r).powi(2))
        .sum();
    let norm: f64 = reference.iter().map(|r| r * r).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Copies a host vector to a new device buffer.
pub(crate) fn upload<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    host: &[T],
) -> Result<CudaSlice<T>, KernelError> {
    Ok(stream.clone_htod(host)?)
}

/// A device buffer of `n` NaNs (the poison every output starts as).
pub(crate) fn poisoned_bf16(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<bf16>, KernelError> {
    upload(stream, &vec![bf16::NAN; n])
}

pub(crate) fn poisoned_f32(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<f32>, KernelError> {
    upload(stream, &vec![f32::NAN; n])
}

/// Waits for the stream and copies a device buffer back.
pub(crate) fn download<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
) -> Result<Vec<T>, KernelError> {
    let host = stream.clone_dtoh(buf)?;
    stream.synchronize()?;
    Ok(host)
}

/// The check of `out` against `reference`, then its canary against `wrong` (which must fail).
pub(crate) fn compare_with_canary(
    kernel: &str,
    case: String,
    out: &[f64],
    reference: &[f64],
    wrong: &[f64],
    tolerance: f64,
) -> Vec<CheckResult> {
    let written = out.iter().all(|v| !v.is_nan());
    let err = rel_err(out, reference);
    let canary_err = rel_err(out, wrong);
    vec![
        CheckResult::compare(
            kernel,
            case.clone(),
            false,
            err,
            tolerance,
            written,
            String::new(),
        ),
        CheckResult::compare(
            kernel,
            case,
            true,
            canary_err,
            tolerance,
            written,
            "against a deliberately wrong reference".to_string(),
        ),
    ]
}

/// HF RMSNorm of one row in f64 with the kernel's rounding points.
fn rmsnorm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (mean + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| round_bf16(round_bf16(v * inv) * g))
        .collect()
}

fn rmsnorm_rows(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    x.chunks(w.len())
        .flat_map(|row| rmsnorm_ref(row, w, eps))
        .collect()
}

fn check_embed(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (vocab, hidden, tokens) = (1000, 1024, 9);
    let table = rng.bf16_vec(vocab * hidden, 1.0, 0.0);
    let mut ids: Vec<u32> = (0..tokens).map(|_| rng.below(vocab) as u32).collect();
    ids[tokens - 1] = vocab as u32 + 7; // out of range: a zero row
    let (d_table, d_ids) = (upload(s, &table)?, upload(s, &ids)?);
    let mut out = poisoned_bf16(s, tokens * hidden)?;
    k.embed(s, &mut out, &d_table, &d_ids, tokens, hidden, vocab)?;
    let out = to_f64(&download(s, &out)?);
    let gather = |shift: usize| -> Vec<f64> {
        ids.iter()
            .flat_map(|&id| {
                let id = id as usize;
                if id >= vocab {
                    vec![0.0; hidden]
                } else {
                    to_f64(&table[((id + shift) % vocab) * hidden..][..hidden])
                }
            })
            .collect()
    };
    let case = format!("tokens={tokens} hidden={hidden} (one id out of range)");
    Ok(compare_with_canary(
        "embed",
        case,
        &out,
        &gather(0),
        &gather(1),
        0.0,
    ))
}

fn check_rmsnorm(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    for (rows, hidden) in [(5, 4096), (3, 1032)] {
        let eps = 1e-6f32;
        let x = rng.bf16_vec(rows * hidden, 2.0, 0.0);
        let w = rng.bf16_vec(hidden, 0.5, 1.0);
        let mut out = poisoned_bf16(s, rows * hidden)?;
        k.rmsnorm(
            s,
            &mut out,
            &upload(s, &x)?,
            &upload(s, &w)?,
            rows,
            hidden,
            eps,
        )?;
        let out = to_f64(&download(s, &out)?);
        let (xf, wf) = (to_f64(&x), to_f64(&w));
        results.extend(compare_with_canary(
            "rmsnorm",
            format!("rows={rows} hidden={hidden}"),
            &out,
            &rmsnorm_rows(&xf, &wf, eps as f64),
            &rmsnorm_rows(&xf, &wf, 1e-1),
            TOL_BF16,
        ));
    }
    Ok(results)
}

fn check_add_rmsnorm(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (rows, hidden, eps) = (6, 2048, 1e-5f32);
    let x = rng.bf16_vec(rows * hidden, 1.0, 0.0);
    let residual = rng.bf16_vec(rows * hidden, 4.0, 0.0);
    let w = rng.bf16_vec(hidden, 0.5, 1.0);
    let mut out = poisoned_bf16(s, rows * hidden)?;
    let mut d_res = upload(s, &residual)?;
    let (d_x, d_w) = (upload(s, &x)?, upload(s, &w)?);
    k.add_rmsnorm(s, &mut out, &mut d_res, &d_x, &d_w, rows, hidden, eps)?;
    let (out, new_res) = (to_f64(&download(s, &out)?), to_f64(&download(s, &d_res)?));
    let (xf, rf, wf) = (to_f64(&x), to_f64(&residual), to_f64(&w));
    let sum: Vec<f64> = xf.iter().zip(&rf).map(|(a, b)| round_bf16(a + b)).collect();
    let case = format!("rows={rows} hidden={hidden}");
    let mut results = compare_with_canary(
        "add_rmsnorm",
        format!("{case} out"),
        &out,
        &rmsnorm_rows(&sum, &wf, eps as f64),
        &rmsnorm_rows(&xf, &wf, eps as f64), // forgets the residual
        TOL_BF16,
    );
    results.extend(compare_with_canary(
        "add_rmsnorm",
        format!("{case} residual"),
        &new_res,
        &sum,
        &rf, // residual left unchanged
        TOL_BF16,
    ));
    Ok(results)
}

fn check_head_rmsnorm(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    for (vectors, head_dim) in [(7 * 8, 128), (5 * 4, 64), (3, 256)] {
        let eps = 1e-6f32;
        let x = rng.bf16_vec(vectors * head_dim, 3.0, 0.0);
        let w = rng.bf16_vec(head_dim, 0.5, 1.0);
        let mut d_x = upload(s, &x)?;
        k.head_rmsnorm(s, &mut d_x, &upload(s, &w)?, vectors, head_dim, eps)?;
        let out = to_f64(&download(s, &d_x)?);
        let (xf, wf) = (to_f64(&x), to_f64(&w));
        let reversed: Vec<f64> = wf.iter().rev().copied().collect();
        results.extend(compare_with_canary(
            "head_rmsnorm",
            format!("vectors={vectors} head_dim={head_dim} (in place)"),
            &out,
            &rmsnorm_rows(&xf, &wf, eps as f64),
            &rmsnorm_rows(&xf, &reversed, eps as f64),
            TOL_BF16,
        ));
    }
    Ok(results)
}

fn check_add_bias(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (rows, cols) = (3, 1032);
    let x = rng.bf16_vec(rows * cols, 1.0, 0.0);
    let bias = rng.bf16_vec(cols, 1.0, 0.0);
    let mut d_x = upload(s, &x)?;
    k.add_bias(s, &mut d_x, &upload(s, &bias)?, rows, cols)?;
    let out = to_f64(&download(s, &d_x)?);
    let with = |b: &dyn Fn(usize) -> f64| -> Vec<f64> {
        x.iter()
            .enumerate()
            .map(|(i, v)| round_bf16(v.to_f64() + b(i % cols)))
            .collect()
    };
    let right = with(&|c| bias[c].to_f64());
    let wrong = with(&|c| bias[cols - 1 - c].to_f64());
    Ok(compare_with_canary(
        "add_bias",
        format!("rows={rows} cols={cols} (in place)"),
        &out,
        &right,
        &wrong,
        TOL_BF16,
    ))
}

/// Rotates every head of `x` (rows of `d`) with the f32 table row of each token; `pair` maps
/// index i < d/2 to its partner (rotate-half: i + d/2; the canary pairs neighbours instead).
fn rope_ref(x: &[f64], heads: usize, d: usize, rows: &[&[f32]], interleaved: bool) -> Vec<f64> {
    let mut out = x.to_vec();
    let half = d / 2;
    for (t, cs) in rows.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * d;
            for i in 0..half {
                let (a, b) = if interleaved {
                    (base + 2 * i, base + 2 * i + 1)
                } else {
                    (base + i, base + i + half)
                };
                let (c, s) = (cs[i] as f64, cs[half + i] as f64);
                out[a] = round_bf16(x[a] * c - x[b] * s);
                out[b] = round_bf16(x[b] * c + x[a] * s);
            }
        }
    }
    out
}

fn check_rope_kv_write(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let shape = RopeKvShape {
        tokens: 6,
        q_heads: 8,
        kv_heads: 2,
        head_dim: 128,
        max_positions: 64,
        num_blocks: 4,
        block_size: 16,
    };
    let (t, d, nq, nkv) = (shape.tokens, shape.head_dim, shape.q_heads, shape.kv_heads);
    let slots = shape.num_blocks * shape.block_size;
    let table: Vec<f32> = (0..shape.max_positions)
        .flat_map(|p| {
            let angles: Vec<f64> = (0..d / 2)
                .map(|i| p as f64 / 10000f64.powf(2.0 * i as f64 / d as f64))
                .collect();
            let cos = angles.iter().map(|a| a.cos() as f32);
            let sin = angles.iter().map(|a| a.sin() as f32);
            cos.chain(sin).collect::<Vec<_>>()
        })
        .collect();
    let positions: Vec<u32> = (0..t)
        .map(|_| rng.below(shape.max_positions) as u32)
        .collect();
    // Distinct slots, the last token padding (not written).
    let mut free: Vec<u32> = (0..slots as u32).collect();
    let mut slot_mapping: Vec<u32> = (0..t)
        .map(|_| free.swap_remove(rng.below(free.len())))
        .collect();
    slot_mapping[t - 1] = u32::MAX;
    let q = rng.bf16_vec(t * nq * d, 1.0, 0.0);
    let kx = rng.bf16_vec(t * nkv * d, 1.0, 0.0);
    let v = rng.bf16_vec(t * nkv * d, 1.0, 0.0);
    let (mut d_q, mut d_k) = (upload(s, &q)?, upload(s, &kx)?);
    let mut k_cache = poisoned_bf16(s, slots * nkv * d)?;
    let mut v_cache = poisoned_bf16(s, slots * nkv * d)?;
    k.rope_kv_write(
        s,
        &mut d_q,
        &mut d_k,
        &upload(s, &v)?,
        &mut k_cache,
        &mut v_cache,
        &upload(s, &table)?,
        &upload(s, &positions)?,
        &upload(s, &slot_mapping)?,
        shape,
    )?;
    let (q_out, k_out) = (to_f64(&download(s, &d_q)?), to_f64(&download(s, &d_k)?));
    let (kc, vc) = (download(s, &k_cache)?, download(s, &v_cache)?);
    let rows: Vec<&[f32]> = positions
        .iter()
        .map(|&p| &table[p as usize * d..][..d])
        .collect();
    let case = format!("tokens={t} q_heads={nq} kv_heads={nkv} d={d}");
    let mut results = compare_with_canary(
        "rope_kv_write",
        format!("{case} q"),
        &q_out,
        &rope_ref(&to_f64(&q), nq, d, &rows, false),
        &rope_ref(&to_f64(&q), nq, d, &rows, true),
        TOL_BF16,
    );
    let k_ref = rope_ref(&to_f64(&kx), nkv, d, &rows, false);
    results.extend(compare_with_canary(
        "rope_kv_write",
        format!("{case} k"),
        &k_out,
        &k_ref,
        &rope_ref(&to_f64(&kx), nkv, d, &rows, true),
        TOL_BF16,
    ));
    // The cache: written slots hold k/v exactly; every other slot still holds the poison.
    let row = nkv * d;
    let (mut wrong_bits, mut unwritten, mut stray) = (0usize, 0usize, 0usize);
    for slot in 0..slots {
        let token = slot_mapping.iter().position(|&m| m as usize == slot);
        let (kc_row, vc_row) = (&kc[slot * row..][..row], &vc[slot * row..][..row]);
        match token {
            Some(tok) => {
                let k_expect = k_out[tok * row..][..row].iter();
                let v_expect = v[tok * row..][..row].iter();
                unwritten += kc_row.iter().chain(vc_row).filter(|x| x.is_nan()).count();
                wrong_bits += kc_row
                    .iter()
                    .zip(k_expect)
                    .filter(|(a, b)| a.to_f64() != **b)
                    .count();
                wrong_bits += vc_row
                    .iter()
                    .zip(v_expect)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
            }
            None => stray += kc_row.iter().chain(vc_row).filter(|x| !x.is_nan()).count(),
        }
    }
    results.push(CheckResult::compare(
        "rope_kv_write",
        format!("{case} paged cache (1 padding slot)"),
        false,
        (wrong_bits + stray) as f64,
        0.0,
        unwritten == 0,
        format!(
            "{wrong_bits} wrong, {unwritten} unwritten, {stray} written outside the mapped slots"
        ),
    ));
    Ok(results)
}

fn check_silu_mul(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (tokens, inter) = (4, 2056);
    let gate_up = rng.bf16_vec(tokens * 2 * inter, 4.0, 0.0);
    let mut out = poisoned_bf16(s, tokens * inter)?;
    let act = crate::GateActivation::Silu;
    k.gated_mul(s, act, &mut out, &upload(s, &gate_up)?, tokens, inter)?;
    let out = to_f64(&download(s, &out)?);
    let gu = to_f64(&gate_up);
    let reference = |swap: bool| -> Vec<f64> {
        (0..tokens * inter)
            .map(|i| {
                let (t, j) = (i / inter, i % inter);
                let (mut g, mut u) = (gu[t * 2 * inter + j], gu[t * 2 * inter + inter + j]);
                if swap {
                    std::mem::swap(&mut g, &mut u);
                }
                round_bf16(round_bf16(g / (1.0 + (-g).exp())) * u)
            })
            .collect()
    };
    Ok(compare_with_canary(
        "silu_mul",
        format!("tokens={tokens} inter={inter}"),
        &out,
        &reference(false),
        &reference(true),
        TOL_BF16,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_inputs_are_never_zero_and_repeat_by_seed() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let va = a.bf16_vec(10_000, 1.0, 0.0);
        assert!(
            va.iter()
                .all(|v| v.to_f64() != 0.0 && v.to_f64().abs() <= 1.0)
        );
        assert_eq!(va, b.bf16_vec(10_000, 1.0, 0.0));
    }

    #[test]
    fn rel_err_is_zero_for_equal_and_infinite_for_nan() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[1.1, 2.0], &[1.0, 2.0]) - 0.1 / 5f64.sqrt()).abs() < 1e-12);
        assert_eq!(rel_err(&[f64::NAN, 2.0], &[1.0, 2.0]), f64::INFINITY);
    }

    #[test]
    fn the_rmsnorm_reference_normalises_to_unit_rms() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let out = rmsnorm_ref(&x, &[1.0; 4], 0.0);
        // rms = sqrt(25 / 4) = 2.5
        assert_eq!(out, vec![round_bf16(1.2), round_bf16(1.6), 0.0, 0.0]);
    }

    #[test]
    fn the_rope_reference_rotates_pairs_half_a_head_apart() {
        // One head of d = 4, angle 90° for pair 0 and 0° for pair 1.
        let cs = [0.0f32, 1.0, 1.0, 0.0];
        let out = rope_ref(&[1.0, 2.0, 3.0, 4.0], 1, 4, &[&cs], false);
        assert_eq!(out, vec![-3.0, 2.0, 1.0, 4.0]);
    }
}
