//! Running a runtime `Program` on a Metal device: the program is lowered once, at compile, by
//! the plan the GPU backends share (`rlx_runtime::gpu_plan`, with the training update kept for
//! the host); its fused expressions become one MSL library (compiled once per distinct source).
//! A run patches each step's operands to GPU addresses, encodes the kernel launches in order on
//! the compute queue and waits; the update runs in place on the host (the backend's `HostUpdate`,
//! the CPU backend's kernels) over the same shared memory, between the launches before and after it. Failures
//! kernels flag (bad label, bad id, integer division by zero) come back as the CPU backend
//! reports them.
use crate::backend::HostUpdate;
use crate::gpu::{Dispatch, GpuLibrary};
use crate::kernels::{self, Gemm};
use crate::{MetalBuffer, MetalDevice};
use rlx_ir::{Error, Result};
use rlx_runtime::gpu_plan::{self, Kernel, Loc, Plan, Step, Target, P};
use rlx_runtime::{Compiled, DeviceBuffer, OptimHyper, Program};
use std::sync::Arc;

/// The Metal backend's plan target: the update stays on the host.
pub const TARGET: Target = Target {
    backend: "metal",
    host_update: true,
    tiled_attention: false,
    low_precision: false,
    gemm_attention: None,
    gemm_attention_forward: false,
};

/// A program lowered to kernel launches.
pub struct MetalProgram {
    device: MetalDevice,
    host_update: HostUpdate,
    plan: Plan,
    /// The fused kernels of this program (`rlx_fused_{i}` for `plan.fused[i]`).
    fused: Option<Arc<dyn GpuLibrary>>,
    lens: Vec<usize>,
    scratch: Arc<MetalBuffer>,
    /// Matmul products read by their epilogues, expressions summed down.
    product: Arc<MetalBuffer>,
    /// Whether some kernel may flag a failure in the error word.
    may_fail: bool,
}

impl MetalProgram {
    pub fn new(
        device: MetalDevice,
        program: &Program,
        lens: &[usize],
        host_update: HostUpdate,
    ) -> Result<Self> {
        let plan = gpu_plan::plan(program, lens, TARGET)?;
        let fused = if plan.fused.is_empty() {
            None
        } else {
            let mut src = String::new();
            for (i, f) in plan.fused.iter().enumerate() {
                src.push_str(&kernels::fused_kernel(&format!("rlx_fused_{i}"), f));
            }
            Some(device.compile_cached(&src)?)
        };
        let err_at = Loc {
            buf: gpu_plan::SCRATCH,
            offset: gpu_plan::ERR_AT,
        };
        let mut may_fail = false;
        for s in &plan.steps {
            match s {
                Step::Launch {
                    kernel,
                    p,
                    operands,
                    ..
                } => {
                    if let Kernel::Library(name) = kernel {
                        if !kernels::NAMES.contains(name) {
                            return Err(Error::Internal(format!(
                                "[metal] the plan launches '{name}', which the Metal library lacks"
                            )));
                        }
                        kernels::threads(name, p)?;
                    }
                    may_fail |= operands.iter().any(|(_, l)| *l == err_at);
                }
                Step::HyperRow { .. } => {
                    return Err(Error::Internal(
                        "[metal] a device-side update step in a host-update plan".into(),
                    ))
                }
                _ => {}
            }
        }
        // (never empty: Metal has no zero-length buffers)
        let scratch = device.alloc(plan.scratch_bytes.max(16))?;
        for (off, bytes) in &plan.tables {
            scratch.write(*off, bytes)?;
        }
        let product = device.alloc(plan.product_bytes.max(16))?;
        Ok(Self {
            device,
            host_update,
            plan,
            fused,
            lens: lens.to_vec(),
            scratch,
            product,
            may_fail,
        })
    }

    /// The first failure a kernel flagged in this run, as the CPU backend reports it.
    fn flagged(&self) -> Result<()> {
        if !self.may_fail {
            return Ok(());
        }
        let mut w = [0u8; 8];
        self.scratch.read(gpu_plan::ERR_AT, &mut w)?;
        let code = i32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
        let value = i32::from_ne_bytes([w[4], w[5], w[6], w[7]]);
        self.plan.flagged(code, value, "metal")
    }
}

/// One encoded launch: which library, kernel, record and grid.
struct Launch {
    library: Arc<dyn GpuLibrary>,
    kernel: String,
    record: Vec<u8>,
    threads: usize,
}

impl Compiled for MetalProgram {
    #[allow(unsafe_code)] // implements the trait's contract; the host update passes it on
    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        // The program's buffers (arena, params, state, stage), then scratch and product.
        let mut metal: Vec<Option<&MetalBuffer>> = vec![None; gpu_plan::PRODUCT + 1];
        for (i, &len) in self.lens.iter().enumerate() {
            if len == 0 {
                continue;
            }
            if i >= gpu_plan::SCRATCH {
                return Err(Error::Internal(format!(
                    "[metal] a program over {} buffers (at most {})",
                    self.lens.len(),
                    gpu_plan::SCRATCH
                )));
            }
            let b = buffers.get(i).ok_or_else(|| {
                Error::Internal(format!(
                    "the program needs buffer {i}, the run gave {}",
                    buffers.len()
                ))
            })?;
            if b.len() < len {
                return Err(Error::Internal(format!(
                    "buffer {i} has {} bytes, the program was compiled for {len}",
                    b.len()
                )));
            }
            let m = b.as_any().downcast_ref::<MetalBuffer>().ok_or_else(|| {
                Error::Device("a metal program runs only over metal buffers".into())
            })?;
            metal[i] = Some(m);
        }
        metal[gpu_plan::SCRATCH] = Some(&self.scratch);
        metal[gpu_plan::PRODUCT] = Some(&self.product);
        let addr = |l: &Loc| -> Result<u64> {
            metal
                .get(l.buf)
                .copied()
                .flatten()
                .ok_or_else(|| Error::Internal(format!("[metal] no buffer {}", l.buf)))?
                .address(l.offset)
        };
        if self.may_fail {
            self.scratch.write(gpu_plan::ERR_AT, &[0u8; 16])?;
        }
        let uses: Vec<&MetalBuffer> = metal.iter().flatten().copied().collect();
        let lib = self.device.library().clone();
        let mut pending: Vec<Launch> = Vec::new();
        let flush = |pending: &mut Vec<Launch>| -> Result<()> {
            let dispatches: Vec<Dispatch<'_>> = pending
                .iter()
                .map(|l| Dispatch {
                    library: l.library.as_ref(),
                    kernel: &l.kernel,
                    record: &l.record,
                    threads: l.threads,
                })
                .collect();
            if !dispatches.is_empty() {
                self.device.run(None, &dispatches, &uses)?;
            }
            pending.clear();
            Ok(())
        };
        for step in &self.plan.steps {
            match step {
                Step::Launch {
                    kernel,
                    p,
                    operands,
                    ..
                } => {
                    let mut p: P = **p;
                    for (slot, loc) in operands {
                        p.ptr[*slot] = addr(loc)?;
                    }
                    let (library, name) = match kernel {
                        Kernel::Library(name) => (lib.clone(), name.to_string()),
                        Kernel::Fused(i) => (
                            self.fused
                                .clone()
                                .ok_or_else(|| Error::Internal("fused kernels missing".into()))?,
                            format!("rlx_fused_{i}"),
                        ),
                    };
                    let threads = kernels::threads(&name, &p)?;
                    pending.push(Launch {
                        library,
                        kernel: name,
                        record: kernels::record(&p),
                        threads,
                    });
                }
                Step::Fill { at, bytes } => {
                    if bytes % 4 != 0 {
                        return Err(Error::Internal(format!("[metal] a fill of {bytes} bytes")));
                    }
                    let mut p = P::sized(bytes / 4);
                    p.ptr[0] = addr(at)?;
                    pending.push(Launch {
                        library: lib.clone(),
                        kernel: "rlx_zero32".into(),
                        record: kernels::record(&p),
                        threads: kernels::threads("rlx_zero32", &p)?,
                    });
                }
                Step::Gemm { g, a, b, c } => {
                    let (record, threads) =
                        Gemm::from_plan(g, addr(a)?, addr(b)?, addr(c)?).record()?;
                    pending.push(Launch {
                        library: lib.clone(),
                        kernel: "rlx_gemm_f32".into(),
                        record,
                        threads,
                    });
                }
                Step::HostUpdate(u) => {
                    // Everything before the update has completed once `flush` returns; the
                    // update then works in place on the shared memory the kernels wrote.
                    flush(&mut pending)?;
                    // SAFETY: the caller's contract (nothing else touches the buffers during
                    // the run) is the one `host_update` needs; no GPU work is in flight.
                    unsafe { (self.host_update)(buffers, &self.lens, u, hyper)? };
                }
                Step::HyperRow { .. } => {
                    return Err(Error::Internal(
                        "[metal] a device-side update step in a host-update plan".into(),
                    ))
                }
            }
        }
        flush(&mut pending)?;
        self.flagged()
    }
}
