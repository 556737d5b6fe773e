//! cuBLASLt GEMM for prefill rows: `y[M, N] = x[M, K] · w[N, K]ᵀ`, bf16 in, f32 compute,
//! bf16 or f32 out.
//!
//! Batch invariance (DESIGN §3) asks that row `m` of `y` does not depend on M. cuBLASLt's
//! heuristic picks a different kernel for a different problem size, and split-K / stream-K
//! kernels split the K reduction across blocks in an M-dependent way. So one algorithm is pinned
//! per weight shape `(N, K, out dtype)`: chosen once from the heuristic at a representative
//! M ([`REPRESENTATIVE_M`]), restricted to algorithms without a split-K reduction (reduction
//! scheme mask NONE, split count forced to 1, and one that needs no workspace preferred, since
//! workspace holds cross-block partial sums), and only verified with `cublasLtMatmulAlgoCheck`
//! for each actual M. The device self-test checks the invariance bitwise.
//!
//! Tensor parallelism (DESIGN.md §5) needs the same bits from a rank's slice of a weight as from
//! the whole weight: a [`GemmShape`] can read `x` and `w` rows `ld` apart (a K-slice of the
//! row-parallel projections) and take the algorithm chosen for a wider `algo_n` (a column
//! slice): the heuristic always runs on the contiguous shape `(algo_n, k)`, so every TP degree
//! pins the same algorithm, and without split-K every output element's reduction is that
//! algorithm's over its own K-slice.
//!
//! FP8 (W8A8, [`LtGemm::matmul_fp8`]): the same pinned-algorithm rules over e4m3 operands, f32
//! out with f32 accumulation (cuBLASLt's FP8 needs exactly this "TN" arrangement: the weight
//! transposed, the activations not); the scales multiply afterwards
//! ([`crate::Kernels::fp8_scale_out`]), one per activation row and one per weight row.
//!
//! Row-major to cuBLASLt's column-major: `yᵀ (N×M) = op(W)·xᵀ` with `W` seen as a K×N
//! column-major matrix (ld K) transposed, `xᵀ` as K×M (ld K), `yᵀ` as N×M (ld N).

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use crate::launch::{need_len, product};
use crate::{KernelError, ensure_shape, libs};

/// The M the algorithm of a weight shape is chosen for.
pub const REPRESENTATIVE_M: usize = 2048;
/// Workspace preallocated per handle.
pub const WORKSPACE_BYTES: usize = 32 << 20;
/// Heuristic candidates examined when pinning.
const CANDIDATES: usize = 32;

/// The operand dtype of a GEMM: both operands are of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmIn {
    Bf16,
    /// e4m3 codes (float8_e4m3fn), scaled after the product.
    Fp8,
}

impl GemmIn {
    fn data_type(self) -> sys::cudaDataType {
        match self {
            GemmIn::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            GemmIn::Fp8 => sys::cudaDataType::CUDA_R_8F_E4M3,
        }
    }
}

/// The output dtype of a GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmOut {
    Bf16,
    F32,
}

impl GemmOut {
    fn data_type(self) -> sys::cudaDataType {
        match self {
            GemmOut::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            GemmOut::F32 => sys::cudaDataType::CUDA_R_32F,
        }
    }
}

fn lt_err(call: &str) -> impl Fn(lt::CublasError) -> KernelError + '_ {
    move |e| KernelError::Cublas(format!("{call}: {e}"))
}

/// One weight shape of [`LtGemm`]: `w` is `n` rows of `k` values, rows `ld` apart (`ld = k`
/// for a whole weight), `x` rows likewise `ld` apart; the algorithm is the one pinned for the
/// contiguous `(algo_n, k)` shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub n: usize,
    pub k: usize,
    pub ld: usize,
    pub out: GemmOut,
    pub algo_n: usize,
}

impl GemmShape {
    /// A whole `[n, k]` weight.
    pub fn new(n: usize, k: usize, out: GemmOut) -> Self {
        GemmShape {
            n,
            k,
            ld: k,
            out,
            algo_n: n,
        }
    }
}

/// The pinned algorithm and descriptors of one weight shape.
struct Plan {
    input: GemmIn,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    shape: GemmShape,
    /// Row counts the algorithm was verified for, with their B and D layouts.
    per_m: HashMap<usize, (sys::cublasLtMatrixLayout_t, sys::cublasLtMatrixLayout_t)>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once, here.
        unsafe {
            for (b, d) in self.per_m.values() {
                let _ = lt::destroy_matrix_layout(*b);
                let _ = lt::destroy_matrix_layout(*d);
            }
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle bound to one stream, its workspace, and the pinned algorithm per weight
/// shape. Create one per stream; not shared across threads.
pub struct LtGemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: HashMap<(GemmShape, GemmIn), Plan>,
    /// Row counts that failed the algorithm check, so the error repeats without re-checking.
    rejected: HashSet<(GemmShape, GemmIn, usize)>,
}

// SAFETY: a cuBLASLt handle and its descriptors may be used from any thread, one at a time;
// every use goes through `&mut self`, so moving the whole value to another thread is sound.
unsafe impl Send for LtGemm {}

impl LtGemm {
    /// Creates the handle for `stream` and preallocates [`WORKSPACE_BYTES`] of workspace.
    pub fn new(stream: &Arc<CudaStream>) -> Result<LtGemm, KernelError> {
        libs::ensure_driver()?;
        libs::ensure_cublaslt()?;
        stream.context().bind_to_thread()?;
        let handle = lt::create_handle().map_err(lt_err("cublasLtCreate"))?;
        let workspace = match stream.alloc_zeros::<u8>(WORKSPACE_BYTES) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, not used elsewhere.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e.into());
            }
        };
        Ok(LtGemm {
            handle,
            stream: stream.clone(),
            workspace,
            plans: HashMap::new(),
            rejected: HashSet::new(),
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Pins the algorithm for weight shape `[n, k]` and `out` now (otherwise the first
    /// [`LtGemm::matmul`] of that shape does). Idempotent.
    pub fn pin(&mut self, n: usize, k: usize, out: GemmOut) -> Result<(), KernelError> {
        self.pin_shape(GemmShape::new(n, k, out))
    }

    /// [`LtGemm::pin`] for any [`GemmShape`].
    pub fn pin_shape(&mut self, shape: GemmShape) -> Result<(), KernelError> {
        self.pin_input(shape, GemmIn::Bf16)
    }

    fn pin_input(&mut self, shape: GemmShape, input: GemmIn) -> Result<(), KernelError> {
        if !self.plans.contains_key(&(shape, input)) {
            let plan = self.choose(shape, input)?;
            self.plans.insert((shape, input), plan);
        }
        Ok(())
    }

    /// `y[m, :] = x[m, :] · wᵀ`, on this handle's stream.
    ///
    /// `x` `[m, k]` bf16, `w` `[n, k]` bf16 row-major (HF Linear layout), `y` `[m, n]` of
    /// `out`'s dtype (`T` must be `bf16` for [`GemmOut::Bf16`], `f32` for [`GemmOut::F32`]);
    /// `k % 8 == 0`, `n % 8 == 0` (16-byte rows for the tensor-core kernels).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul<T: DeviceRepr>(
        &mut self,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k: usize,
        out: GemmOut,
    ) -> Result<(), KernelError> {
        self.matmul_shape(y, x, w, m, GemmShape::new(n, k, out))
    }

    /// [`LtGemm::matmul`] for any [`GemmShape`]: `x` `[m, ld]` and `w` `[n, ld]` read over
    /// their first `k` columns, `y` `[m, n]` contiguous; `ld % 8 == 0`, `ld ≥ k`.
    pub fn matmul_shape<T: DeviceRepr>(
        &mut self,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        shape: GemmShape,
    ) -> Result<(), KernelError> {
        const K: &str = "gemm";
        let GemmShape { n, k, ld, out, .. } = shape;
        let want = match out {
            GemmOut::Bf16 => size_of::<bf16>(),
            GemmOut::F32 => size_of::<f32>(),
        };
        ensure_shape!(
            size_of::<T>() == want,
            K,
            "output element of {} bytes does not match {out:?}",
            size_of::<T>()
        );
        ensure_shape!(
            k.is_multiple_of(8) && n.is_multiple_of(8) && k > 0 && n > 0,
            K,
            "n = {n}, k = {k} must be positive multiples of 8"
        );
        ensure_shape!(
            ld >= k && ld.is_multiple_of(8) && shape.algo_n >= n,
            K,
            "ld = {ld} must be a multiple of 8 and at least k = {k}, algo_n = {} at least n",
            shape.algo_n
        );
        let strided = |rows: usize| -> Result<usize, KernelError> {
            Ok(match rows {
                0 => 0,
                _ => product(K, &[rows - 1, ld])? + k,
            })
        };
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        need_len(K, "x", x.len(), strided(m)?)?;
        need_len(K, "w", w.len(), strided(n)?)?;
        if m == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let (yp, _y) = y.device_ptr_mut(&stream);
        let (xp, _x) = x.device_ptr(&stream);
        let (wp, _w) = w.device_ptr(&stream);
        self.run(shape, GemmIn::Bf16, m, (yp, xp, wp))
    }

    /// `y[m, :] = x[m, :] · wᵀ` over e4m3 codes: `x` `[m, k]`, `w` `[n, k]` row-major, `y`
    /// `[m, n]` f32, accumulated in f32 (no fast-accumulation mode), unscaled: the scales
    /// multiply afterwards ([`crate::Kernels::fp8_scale_out`]). `k % 16 == 0`, `n % 16 == 0`;
    /// the buffers 16-byte aligned. Needs an FP8 tensor-core GPU (sm_89 and later); cuBLASLt
    /// refuses the others.
    pub fn matmul_fp8(
        &mut self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<u8>,
        w: &impl DevicePtr<u8>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        const K: &str = "gemm_fp8";
        ensure_shape!(
            k.is_multiple_of(16) && n.is_multiple_of(16) && k > 0 && n > 0,
            K,
            "n = {n}, k = {k} must be positive multiples of 16"
        );
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        need_len(K, "w", w.len(), product(K, &[n, k])?)?;
        if m == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let (yp, _y) = y.device_ptr_mut(&stream);
        let (xp, _x) = x.device_ptr(&stream);
        let (wp, _w) = w.device_ptr(&stream);
        for (what, ptr) in [("y", yp), ("x", xp), ("w", wp)] {
            ensure_shape!(ptr.is_multiple_of(16), K, "{what} is not 16-byte aligned");
        }
        self.run(
            GemmShape::new(n, k, GemmOut::F32),
            GemmIn::Fp8,
            m,
            (yp, xp, wp),
        )
    }

    /// The pinned algorithm of `(shape, input)` on `m` rows at device addresses `(y, x, w)`,
    /// whose buffers the caller checked against the shape.
    fn run(
        &mut self,
        shape: GemmShape,
        input: GemmIn,
        m: usize,
        (yp, xp, wp): (u64, u64, u64),
    ) -> Result<(), KernelError> {
        ensure_shape!(
            !self.rejected.contains(&(shape, input, m)),
            "gemm",
            "the pinned algorithm for {shape:?} {input:?} does not support m={m}"
        );
        self.pin_input(shape, input)?;
        let (handle, ws_len) = (self.handle, self.workspace.len());
        let plan = self
            .plans
            .get_mut(&(shape, input))
            .expect("pinned just above");
        if !plan.per_m.contains_key(&m) {
            match verify(handle, plan, m, ws_len) {
                Ok(layouts) => {
                    plan.per_m.insert(m, layouts);
                }
                Err(e) => {
                    self.rejected.insert((shape, input, m));
                    return Err(e);
                }
            }
        }
        let plan = &self.plans[&(shape, input)];
        let (b_layout, d_layout) = plan.per_m[&m];
        let stream = &self.stream;
        let (ws, _ws) = self.workspace.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: descriptors and layouts describe exactly these buffers (lengths checked
        // above); the algorithm passed cublasLtMatmulAlgoCheck for this m; the workspace is
        // this handle's own and at least as large as the check asked.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                wp as *const c_void,
                plan.a,
                xp as *const c_void,
                b_layout,
                yp as *const c_void,
                d_layout,
                yp as *mut c_void,
                d_layout,
                &plan.algo,
                ws as *mut c_void,
                ws_len,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_err("cublasLtMatmul"))
    }

    /// Builds the descriptors for `shape` and picks its algorithm at [`REPRESENTATIVE_M`] on the
    /// contiguous `(algo_n, k)` shape.
    fn choose(&self, shape: GemmShape, input: GemmIn) -> Result<Plan, KernelError> {
        let GemmShape {
            n,
            k,
            ld,
            out,
            algo_n,
        } = shape;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("cublasLtMatmulDescCreate"))?;
        let mut plan = Plan {
            input,
            desc,
            a: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            shape,
            per_m: HashMap::new(),
        };
        let transpose = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: the attribute buffer is a live cublasOperation_t of the size passed.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const _ as *const c_void,
                size_of::<cudarc::cublas::sys::cublasOperation_t>(),
            )
        }
        .map_err(lt_err("TRANSA"))?;
        let dtype = input.data_type();
        plan.a = layout(dtype, k, n, ld)?;
        let (a, b, d) = (
            layout(dtype, k, algo_n, k)?,
            layout(dtype, k, REPRESENTATIVE_M, k)?,
            layout(out.data_type(), algo_n, REPRESENTATIVE_M, algo_n)?,
        );
        let candidates = heuristic(self.handle, plan.desc, a, b, d, self.workspace.len());
        // SAFETY: created just above, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(a);
            let _ = lt::destroy_matrix_layout(b);
            let _ = lt::destroy_matrix_layout(d);
        }
        let candidates = candidates?;
        let no_split: Vec<_> = candidates
            .iter()
            .filter(|r| split_k(&r.algo).is_ok_and(|s| s <= 1))
            .collect();
        let best = no_split
            .iter()
            .find(|r| r.workspaceSize == 0)
            .or_else(|| no_split.first())
            .ok_or_else(|| {
                KernelError::Cublas(format!(
                    "no algorithm without split-K for n={n} k={k} {input:?} in, {out:?} out \
                     ({} candidates)",
                    candidates.len()
                ))
            })?;
        plan.algo = best.algo;
        let one: u32 = 1;
        // SAFETY: the buffer is a live u32 of the size passed; the algo is owned by the plan.
        unsafe {
            sys::cublasLtMatmulAlgoConfigSetAttribute(
                &mut plan.algo,
                sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                &one as *const u32 as *const c_void,
                size_of::<u32>(),
            )
        }
        .result()
        .map_err(lt_err("SPLITK_NUM"))?;
        Ok(plan)
    }

    /// A one-line description of the pinned algorithm of a shape, for logs and receipts.
    pub fn describe(&self, n: usize, k: usize, out: GemmOut) -> Option<String> {
        let plan = self.plans.get(&(GemmShape::new(n, k, out), GemmIn::Bf16))?;
        let attr = |a| config_u32(&plan.algo, a).unwrap_or(u32::MAX);
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        Some(format!(
            "n={} k={} {:?}: algo {} tile {} stages {} split-k {}",
            plan.shape.n,
            plan.shape.k,
            plan.shape.out,
            attr(A::CUBLASLT_ALGO_CONFIG_ID),
            attr(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
            attr(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            attr(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        ))
    }
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle was created in `new` and is destroyed once, after its plans.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A column-major layout of `rows × cols` with leading dimension `ld`.
fn layout(
    dtype: sys::cudaDataType,
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<sys::cublasLtMatrixLayout_t, KernelError> {
    lt::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)
        .map_err(lt_err("cublasLtMatrixLayoutCreate"))
}

/// The heuristic's candidates for the plan at the given B/D layouts, restricted to algorithms
/// without a split-K reduction and within the workspace.
fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    workspace: usize,
) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>, KernelError> {
    let pref = lt::create_matmul_pref().map_err(lt_err("cublasLtMatmulPreferenceCreate"))?;
    let workspace = workspace as u64;
    let no_reduction = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    // SAFETY: attribute buffers are live values of the sizes passed; `results` has room for
    // CANDIDATES entries; the preference is destroyed once at the end.
    unsafe {
        let set = lt::set_matmul_pref_attribute(
            pref,
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &workspace as *const u64 as *const c_void,
            size_of::<u64>(),
        )
        .and_then(|_| {
            lt::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &no_reduction as *const u32 as *const c_void,
                size_of::<u32>(),
            )
        });
        let mut results =
            vec![std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); CANDIDATES];
        let mut count: std::ffi::c_int = 0;
        let status = set.and_then(|_| {
            sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                a,
                b,
                d,
                d,
                pref,
                CANDIDATES as std::ffi::c_int,
                results.as_mut_ptr(),
                &mut count,
            )
            .result()
        });
        let _ = lt::destroy_matmul_pref(pref);
        status.map_err(lt_err("cublasLtMatmulAlgoGetHeuristic"))?;
        results.truncate(count.max(0) as usize);
        results.retain(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
        Ok(results)
    }
}

/// Checks the pinned algorithm for `m` rows; returns the B and D layouts for that `m`.
fn verify(
    handle: sys::cublasLtHandle_t,
    plan: &Plan,
    m: usize,
    workspace: usize,
) -> Result<(sys::cublasLtMatrixLayout_t, sys::cublasLtMatrixLayout_t), KernelError> {
    let GemmShape { n, k, ld, out, .. } = plan.shape;
    let b = layout(plan.input.data_type(), k, m, ld)?;
    let d = match layout(out.data_type(), n, m, n) {
        Ok(d) => d,
        Err(e) => {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { lt::destroy_matrix_layout(b) };
            return Err(e);
        }
    };
    // SAFETY: all descriptors are live; `result` is a valid out-pointer.
    let checked = unsafe {
        let mut result = std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>();
        sys::cublasLtMatmulAlgoCheck(handle, plan.desc, plan.a, b, d, d, &plan.algo, &mut result)
            .result()
            .map(|_| result)
    };
    let problem = match checked {
        Ok(r) if r.workspaceSize <= workspace => None,
        Ok(r) => Some(format!("needs {} bytes of workspace", r.workspaceSize)),
        Err(e) => Some(e.to_string()),
    };
    if let Some(problem) = problem {
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(b);
            let _ = lt::destroy_matrix_layout(d);
        }
        return Err(KernelError::Cublas(format!(
            "the algorithm pinned for {:?} fails its check at m={m}: {problem}",
            plan.shape
        )));
    }
    Ok((b, d))
}

fn config_u32(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
) -> Result<u32, KernelError> {
    let mut value: u32 = 0;
    let mut written = 0usize;
    // SAFETY: the buffer is a live u32 of the size passed.
    unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            attr,
            &mut value as *mut u32 as *mut c_void,
            size_of::<u32>(),
            &mut written,
        )
    }
    .result()
    .map_err(lt_err("cublasLtMatmulAlgoConfigGetAttribute"))?;
    Ok(value)
}

fn split_k(algo: &sys::cublasLtMatmulAlgo_t) -> Result<u32, KernelError> {
    config_u32(
        algo,
        sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
    )
}
