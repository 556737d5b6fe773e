//! Checks of the kernels Gemma 3 adds: RMSNorm with f32 weights (whole rows and per head), the
//! sandwich norm fused with the residual add and the next norm, the GELU-tanh-gated product and
//! the embedding scale — each against an f64 reference with the kernel's rounding points, each
//! with a canary that must fail.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::selftest::{
    Rng, TOL_BF16, TOL_F32, compare_with_canary, download, poisoned_bf16, poisoned_f32, round_bf16,
    to_f64, upload,
};
use crate::selftest_gemv::matmul_ref;
use crate::{CheckResult, GateActivation, GemmOut, KernelError, Kernels, LtGemm};

/// Gemma 3's RMSNorm of one row in f64: the normalised value times the f32 weight, rounded once.
fn norm_f32w(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (mean + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| round_bf16(v * inv * f64::from(*g)))
        .collect()
}

fn norm_rows(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    x.chunks(w.len())
        .flat_map(|row| norm_f32w(row, w, eps))
        .collect()
}

/// `1 + w` weights as a converter stores them: near 1, in f32.
fn weights_f32(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| 1.0 + (rng.unit() as f32 - 0.5) * 0.3 + 1e-4)
        .collect()
}

pub(crate) fn checks(k: &Kernels, s: &Arc<CudaStream>, rng: &mut Rng) -> Vec<CheckResult> {
    type Check = fn(&Kernels, &Arc<CudaStream>, &mut Rng) -> Result<Vec<CheckResult>, KernelError>;
    let checks: &[(&str, Check)] = &[
        ("rmsnorm_f32w", check_rmsnorm_f32w),
        ("head_rmsnorm_f32w", check_head_rmsnorm_f32w),
        ("sandwich_add_rmsnorm", check_sandwich),
        ("gelu_tanh_mul", check_gelu_tanh_mul),
        ("scale_bf16", check_scale),
        ("gemma 3 shapes", check_shapes),
    ];
    let mut results = Vec::new();
    for (name, check) in checks {
        match check(k, s, rng) {
            Ok(mut r) => results.append(&mut r),
            Err(e) => results.push(CheckResult::error(name, String::new(), false, e)),
        }
    }
    results
}

fn check_rmsnorm_f32w(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (rows, hidden, eps) = (5, 640, 1e-6f32);
    let x = rng.bf16_vec(rows * hidden, 2.0, 0.0);
    let w = weights_f32(rng, hidden);
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
    let xf = to_f64(&x);
    // The canary forgets the `1 +` the weights hold.
    let bare: Vec<f32> = w.iter().map(|v| v - 1.0).collect();
    Ok(compare_with_canary(
        "rmsnorm_f32w",
        format!("rows={rows} hidden={hidden}"),
        &out,
        &norm_rows(&xf, &w, eps.into()),
        &norm_rows(&xf, &bare, eps.into()),
        TOL_BF16,
    ))
}

fn check_head_rmsnorm_f32w(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (vectors, head_dim, eps) = (4 * 5, 256, 1e-6f32);
    let x = rng.bf16_vec(vectors * head_dim, 3.0, 0.0);
    let w = weights_f32(rng, head_dim);
    let mut d_x = upload(s, &x)?;
    k.head_rmsnorm(s, &mut d_x, &upload(s, &w)?, vectors, head_dim, eps)?;
    let out = to_f64(&download(s, &d_x)?);
    let xf = to_f64(&x);
    let reversed: Vec<f32> = w.iter().rev().copied().collect();
    Ok(compare_with_canary(
        "head_rmsnorm_f32w",
        format!("vectors={vectors} head_dim={head_dim} (in place)"),
        &out,
        &norm_rows(&xf, &w, eps.into()),
        &norm_rows(&xf, &reversed, eps.into()),
        TOL_BF16,
    ))
}

fn check_sandwich(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (rows, hidden, eps) = (6, 640, 1e-6f32);
    let x = rng.bf16_vec(rows * hidden, 30.0, 0.0);
    let residual = rng.bf16_vec(rows * hidden, 4.0, 0.0);
    let (wx, w) = (weights_f32(rng, hidden), weights_f32(rng, hidden));
    let mut out = poisoned_bf16(s, rows * hidden)?;
    let mut d_res = upload(s, &residual)?;
    k.sandwich_add_rmsnorm(
        s,
        &mut out,
        &mut d_res,
        &upload(s, &x)?,
        &upload(s, &wx)?,
        &upload(s, &w)?,
        rows,
        hidden,
        eps,
    )?;
    let (out, new_res) = (to_f64(&download(s, &out)?), to_f64(&download(s, &d_res)?));
    let (xf, rf) = (to_f64(&x), to_f64(&residual));
    let add =
        |y: &[f64]| -> Vec<f64> { rf.iter().zip(y).map(|(a, b)| round_bf16(a + b)).collect() };
    let sum = add(&norm_rows(&xf, &wx, eps.into()));
    let plain = add(&xf); // the block output added without its norm
    let case = format!("rows={rows} hidden={hidden}");
    let mut results = compare_with_canary(
        "sandwich_add_rmsnorm",
        format!("{case} residual"),
        &new_res,
        &sum,
        &plain,
        TOL_BF16,
    );
    results.extend(compare_with_canary(
        "sandwich_add_rmsnorm",
        format!("{case} out"),
        &out,
        &norm_rows(&sum, &w, eps.into()),
        &norm_rows(&sum, &wx, eps.into()), // the wrong weight
        TOL_BF16,
    ));
    Ok(results)
}

fn check_gelu_tanh_mul(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (tokens, inter) = (3, 2048);
    let gate_up = rng.bf16_vec(tokens * 2 * inter, 4.0, 0.0);
    let mut out = poisoned_bf16(s, tokens * inter)?;
    k.gated_mul(
        s,
        GateActivation::GeluTanh,
        &mut out,
        &upload(s, &gate_up)?,
        tokens,
        inter,
    )?;
    let out = to_f64(&download(s, &out)?);
    let gu = to_f64(&gate_up);
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    let silu = |x: f64| x / (1.0 + (-x).exp());
    let reference = |act: &dyn Fn(f64) -> f64| -> Vec<f64> {
        (0..tokens * inter)
            .map(|i| {
                let (t, j) = (i / inter, i % inter);
                let (g, u) = (gu[t * 2 * inter + j], gu[t * 2 * inter + inter + j]);
                round_bf16(round_bf16(act(g)) * u)
            })
            .collect()
    };
    Ok(compare_with_canary(
        "gelu_tanh_mul",
        format!("tokens={tokens} inter={inter}"),
        &out,
        &reference(&gelu),
        &reference(&silu), // the other activation
        TOL_BF16,
    ))
}

fn check_scale(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (len, scale) = (640 * 3, 640f64.sqrt() as f32);
    let x = rng.bf16_vec(len, 0.1, 0.0);
    let mut d_x = upload(s, &x)?;
    k.scale(s, &mut d_x, len, scale)?;
    let out = to_f64(&download(s, &d_x)?);
    let xf = to_f64(&x);
    let scaled = |by: f64| -> Vec<f64> { xf.iter().map(|v| round_bf16(v * by)).collect() };
    Ok(compare_with_canary(
        "scale_bf16",
        format!("len={len} scale={scale}"),
        &out,
        &scaled(scale.into()),
        &scaled(f64::from(scale) * 1.01),
        TOL_BF16,
    ))
}

/// The projections at Gemma 3 270M's shapes (hidden 640): the tied LM head over a 262 144-row
/// vocabulary (GEMM for prompt rows, GEMV for decode rows, f32 out) and the fused q/k/v GEMV
/// (1 024 / 256 / 256 rows), against the f64 product.
fn check_shapes(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (vocab, hidden) = (262_144, 640);
    let mut results = Vec::new();
    let head = rng.bf16_vec(vocab * hidden, 0.05, 0.0);
    let x = rng.bf16_vec(3 * hidden, 1.0, 0.0);
    let (d_head, d_x) = (upload(s, &head)?, upload(s, &x)?);
    let mut gemm = LtGemm::new(s)?;
    for m in [1, 3] {
        let right = matmul_ref(&x, &head, (m, vocab, hidden), 0);
        let wrong = matmul_ref(&x, &head, (m, vocab, hidden), 1);
        let mut y = poisoned_f32(s, m * vocab)?;
        gemm.matmul(
            &mut y,
            &d_x.slice(..m * hidden),
            &d_head,
            m,
            vocab,
            hidden,
            GemmOut::F32,
        )?;
        let y: Vec<f64> = download(s, &y)?.iter().map(|&v| v.into()).collect();
        let case = format!("lm head m={m} n={vocab} k={hidden}");
        results.extend(compare_with_canary(
            "gemm_f32",
            case.clone(),
            &y,
            &right,
            &wrong,
            TOL_F32,
        ));
        let mut y = poisoned_f32(s, m * vocab)?;
        k.gemv_f32(
            s,
            &mut y,
            &d_x.slice(..m * hidden),
            &d_head,
            m,
            vocab,
            hidden,
        )?;
        let y: Vec<f64> = download(s, &y)?.iter().map(|&v| v.into()).collect();
        results.extend(compare_with_canary(
            "gemv_f32", case, &y, &right, &wrong, TOL_F32,
        ));
    }
    let ns = [1024, 256, 256];
    let ws: Vec<_> = ns
        .iter()
        .map(|&n| rng.bf16_vec(n * hidden, 0.05, 0.0))
        .collect();
    let d_ws = ws
        .iter()
        .map(|w| upload(s, w))
        .collect::<Result<Vec<_>, _>>()?;
    let m = 1;
    let mut outs = ns
        .iter()
        .map(|&n| poisoned_bf16(s, m * n))
        .collect::<Result<Vec<_>, _>>()?;
    {
        let [a, b, c] = &mut outs[..] else {
            unreachable!("three outputs")
        };
        k.gemv3(
            s,
            [
                &mut a.as_view_mut(),
                &mut b.as_view_mut(),
                &mut c.as_view_mut(),
            ],
            &d_x.slice(..m * hidden),
            [&d_ws[0].as_view(), &d_ws[1].as_view(), &d_ws[2].as_view()],
            m,
            ns,
            hidden,
        )?;
    }
    for (i, n) in ns.into_iter().enumerate() {
        let y = to_f64(&download(s, &outs[i])?);
        let round = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(round_bf16).collect() };
        results.extend(compare_with_canary(
            "gemv_mma3_bf16",
            format!("q/k/v output {i}: m={m} n={n} k={hidden}"),
            &y,
            &round(matmul_ref(&x, &ws[i], (m, n, hidden), 0)),
            &round(matmul_ref(&x, &ws[i], (m, n, hidden), 1)),
            TOL_BF16,
        ));
    }
    Ok(results)
}
