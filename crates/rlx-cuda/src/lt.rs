//! cuBLASLt, the FFI half: a matrix product described once at compile time (operation and
//! matrix layouts, the epilogue, an algorithm picked by cuBLASLt's heuristic for the operands'
//! alignments, or the fastest of its first few where `tune.rs` times them) and run at arena
//! addresses with a bias vector read (or, for a bias gradient,
//! written) at its own address. What to fuse is decided in `epilogue.rs`; every `unsafe` call
//! here is FFI with its `// SAFETY:` note.
use crate::epilogue::{Epi, LtSpec};
use cudarc::cublaslt::sys as lt;
use rlx_ir::{DType, Error, Result};
use std::ffi::c_void;

/// Bytes of the workspace a product may use (one allocation a device, reused by every product:
/// they run one after another on one stream).
pub const WORKSPACE: usize = 32 << 20;

/// How many of the heuristic's algorithms a product keeps to choose from (see `tune.rs`).
pub const CANDIDATES: usize = 8;

fn check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Device(format!("[cuda] {what} failed: {s:?}")))
    }
}

/// A cuBLASLt handle (one a device) and the workspace its products share.
pub struct Handle {
    h: lt::cublasLtHandle_t,
    workspace: u64,
}

// SAFETY: a cuBLASLt handle is a host object usable from any thread; the device's run lock
// keeps products of one device from being queued concurrently.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Handle {
    /// A handle, or `None` where libcublasLt did not load (products then take plain cuBLAS).
    /// `workspace` is a device allocation of [`WORKSPACE`] bytes kept for the process.
    pub fn new(workspace: u64) -> Option<Handle> {
        // SAFETY: a dlopen probe of the library cudarc is about to use.
        if !unsafe { lt::is_culib_present() } {
            return None;
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: cuBLASLt writes a new handle into `h`.
        let ok = unsafe { lt::cublasLtCreate(&mut h) };
        (ok == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(Handle { h, workspace })
    }

    /// Describes `spec` and asks the heuristic for up to [`CANDIDATES`] algorithms (the first
    /// in use); `Ok(None)` where cuBLASLt has none for it (the caller keeps the unfused steps).
    pub fn plan(&self, spec: &LtSpec, tf32: bool) -> Result<Option<Matmul>> {
        let g = &spec.g;
        let ab = match g.dtype {
            DType::F32 => lt::cudaDataType::CUDA_R_32F,
            DType::BF16 => lt::cudaDataType::CUDA_R_16BF,
            DType::F16 => lt::cudaDataType::CUDA_R_16F,
            _ => return Ok(None),
        };
        let compute = if tf32 && g.dtype == DType::F32 {
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let mut m = Matmul {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 4],
            algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspace: 0,
            beta: if spec.residual { 1.0 } else { 0.0 },
            choices: Vec::new(),
        };
        let epi = match spec.epi {
            Epi::None => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epi::Relu => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU,
            Epi::GeluTanh => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            Epi::Bias => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epi::ReluBias => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
            Epi::GeluTanhBias => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            Epi::BiasGradB => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
        };
        let op = |t: bool| -> i32 { t as i32 }; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        let (ta, tb) = (op(g.ta), op(g.tb));
        // Stored shapes (column-major): op(A) is m x k, op(B) is k x n, C and D m x n.
        let dims = [
            if g.ta { (g.k, g.m) } else { (g.m, g.k) },
            if g.tb { (g.n, g.k) } else { (g.k, g.n) },
            (g.m, g.n),
            (g.m, g.n),
        ];
        let lds = [g.lda, g.ldb, g.ldc, g.ldc];
        let strides = [g.stride_a, g.stride_b, g.stride_c, g.stride_c];
        let types = [
            ab,
            ab,
            lt::cudaDataType::CUDA_R_32F,
            lt::cudaDataType::CUDA_R_32F,
        ];
        // SAFETY: every descriptor is created here, written only through the setters with
        // buffers of the attribute's documented type and size, and destroyed by `Matmul`'s
        // drop (also on the early returns: `m` owns whatever was created so far).
        unsafe {
            check(
                lt::cublasLtMatmulDescCreate(&mut m.desc, compute, lt::cudaDataType::CUDA_R_32F),
                "cublasLtMatmulDescCreate",
            )?;
            let set = |attr, v: *const c_void, size: usize| {
                check(
                    lt::cublasLtMatmulDescSetAttribute(m.desc, attr, v, size),
                    "cublasLtMatmulDescSetAttribute",
                )
            };
            use lt::cublasLtMatmulDescAttributes_t as A;
            set(A::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as _, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as _, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi as *const _ as _, 4)?;
            for (i, slot) in m.layouts.iter_mut().enumerate() {
                let (rows, cols) = dims[i];
                check(
                    lt::cublasLtMatrixLayoutCreate(
                        slot,
                        types[i],
                        rows as u64,
                        cols as u64,
                        lds[i] as i64,
                    ),
                    "cublasLtMatrixLayoutCreate",
                )?;
                if g.batch > 1 {
                    use lt::cublasLtMatrixLayoutAttribute_t as L;
                    let (count, stride) = (g.batch as i32, strides[i] as i64);
                    for (attr, v, size) in [
                        (
                            L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                            &count as *const i32 as *const c_void,
                            4,
                        ),
                        (
                            L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            &stride as *const i64 as _,
                            8,
                        ),
                    ] {
                        check(
                            lt::cublasLtMatrixLayoutSetAttribute(*slot, attr, v, size),
                            "cublasLtMatrixLayoutSetAttribute",
                        )?;
                    }
                }
            }
            let mut pref = std::ptr::null_mut();
            check(
                lt::cublasLtMatmulPreferenceCreate(&mut pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let found = (|| {
                use lt::cublasLtMatmulPreferenceAttributes_t as PA;
                let ws = WORKSPACE as u64;
                let mut attrs = vec![(PA::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws)];
                for (attr, a) in [
                    PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    PA::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                ]
                .into_iter()
                .zip(spec.align)
                {
                    attrs.push((attr, a as u64));
                }
                for (attr, v) in attrs {
                    // The alignments are uint32 attributes, the workspace a uint64 one.
                    let v32 = v as u32;
                    let (ptr, size) = if attr == PA::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES {
                        (&v as *const u64 as *const c_void, 8)
                    } else {
                        (&v32 as *const u32 as *const c_void, 4)
                    };
                    check(
                        lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, ptr, size),
                        "cublasLtMatmulPreferenceSetAttribute",
                    )?;
                }
                let mut results: [lt::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
                    std::mem::zeroed();
                let mut count = 0i32;
                let s = lt::cublasLtMatmulAlgoGetHeuristic(
                    self.h,
                    m.desc,
                    m.layouts[0],
                    m.layouts[1],
                    m.layouts[2],
                    m.layouts[3],
                    pref,
                    CANDIDATES as i32,
                    results.as_mut_ptr(),
                    &mut count,
                );
                if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Ok::<_, Error>(Vec::new());
                }
                Ok(results[..(count.clamp(0, CANDIDATES as i32) as usize)]
                    .iter()
                    .filter(|r| {
                        r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                            && r.workspaceSize <= WORKSPACE
                    })
                    .map(|r| (r.algo, r.workspaceSize))
                    .collect())
            })();
            lt::cublasLtMatmulPreferenceDestroy(pref);
            m.choices = found?;
            if m.choices.is_empty() {
                return Ok(None);
            }
            m.choose(0);
            Ok(Some(m))
        }
    }

    /// Queues the product `m` on `stream`: `d = epilogue(a b + beta c)`, the epilogue's vector
    /// at `bias` (read for a bias, written for a bias gradient; 0 for none).
    pub fn run(
        &self,
        m: &Matmul,
        [a, b, c, d]: [u64; 4],
        bias: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let alpha = 1.0f32;
        // SAFETY: the descriptors are live (owned by `m`); the caller (exec.rs) checked every
        // operand address against the alignment the algorithm was chosen for, and the plan
        // checked every matrix of every batch (and the bias vector) against its buffer; the
        // workspace is the device's, at least `m.workspace` bytes, used by one product at a
        // time (runs hold the device's run lock).
        unsafe {
            if bias != 0 {
                check(
                    lt::cublasLtMatmulDescSetAttribute(
                        m.desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        &bias as *const u64 as *const c_void,
                        8,
                    ),
                    "cublasLtMatmulDescSetAttribute(bias)",
                )?;
            }
            check(
                lt::cublasLtMatmul(
                    self.h,
                    m.desc,
                    &alpha as *const f32 as *const c_void,
                    a as *const c_void,
                    m.layouts[0],
                    b as *const c_void,
                    m.layouts[1],
                    &m.beta as *const f32 as *const c_void,
                    c as *const c_void,
                    m.layouts[2],
                    d as *mut c_void,
                    m.layouts[3],
                    &m.algo,
                    self.workspace as *mut c_void,
                    m.workspace,
                    stream as lt::cudaStream_t,
                ),
                "cublasLtMatmul",
            )
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is not used after this.
        unsafe {
            lt::cublasLtDestroy(self.h);
        }
    }
}

/// One described product: its descriptors, algorithm and `beta` (1 with a residual as `C`).
pub struct Matmul {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 4],
    algo: lt::cublasLtMatmulAlgo_t,
    workspace: usize,
    beta: f32,
    /// The heuristic's usable algorithms (and their workspace bytes), best guess first;
    /// `tune.rs` may pick another by timing them.
    choices: Vec<(lt::cublasLtMatmulAlgo_t, usize)>,
}

impl Matmul {
    /// How many algorithms the heuristic offered for this product.
    pub fn candidates(&self) -> usize {
        self.choices.len()
    }

    /// Runs later products with the heuristic's `i`-th algorithm.
    pub fn choose(&mut self, i: usize) {
        (self.algo, self.workspace) = self.choices[i];
    }
}

// SAFETY: descriptors are host objects; a program's products are queued under its device's
// run lock, one at a time.
unsafe impl Send for Matmul {}
unsafe impl Sync for Matmul {}

impl Drop for Matmul {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Handle::plan` (or is null, which is skipped)
        // and is not used after this.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}
