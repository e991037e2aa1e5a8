//! Running a runtime `Program` on a Metal device: the program is lowered once, at compile, by
//! the plan the GPU backends share (`rlx_runtime::gpu_plan`); its fused expressions become one
//! MSL library (compiled once per distinct source), and each planned GEMM the matrix engine can
//! express (`crate::matmul`) is bound to an engine executable compiled once per shape key, the
//! others (and every GEMM when the engine is off) to the MSL GEMM kernel, each such choice
//! recorded with its reason. A run patches each step's operands to GPU addresses and submits
//! the kernel launches and engine matmuls in order in one command buffer; the training update
//! is the plan's multi-tensor kernels in that same submission (`UpdateMode::Kernel`, the run's
//! hyper-parameters written to the scratch buffer first) or runs in place on the host (the
//! backend's `HostUpdate`, the CPU backend's kernels) over the same shared memory, between the
//! submissions before and after it. Failures kernels flag (bad label, bad id, integer division
//! by zero) come back as the CPU backend reports them.
use crate::attention::{self, AttentionKey};
use crate::backend::{HostUpdate, MetalOptions, UpdateMode};
use crate::gpu::{AttentionCall, Dispatch, GpuAttention, GpuLibrary, GpuMatmul, MatmulCall, Work};
use crate::kernels::{self, Gemm};
use crate::matmul::{self, MatmulKey};
use crate::{MetalBuffer, MetalDevice};
use rlx_ir::{Error, Result};
use rlx_runtime::gpu_plan::{self, Kernel, Loc, Plan, Step, Target, P};
use rlx_runtime::{Compiled, DeviceBuffer, OptimHyper, Program};
use std::sync::Arc;

/// The Metal backend's plan target for an update mode.
pub fn target(update: UpdateMode) -> Target {
    Target {
        backend: "metal",
        host_update: update == UpdateMode::Host,
        tiled_attention: false,
        low_precision: false,
        gemm_attention: None,
        gemm_attention_forward: false,
        fused_x4: false,
        update_end: false,
        normalize_grad_add: false,
        layer_norm_grad: false,
        cross_entropy_grad: false,
        layer_norm: false,
        gemm_grids: false,
        integer_edges: false,
        int_reduce: false,
    }
}

/// Where a planned GEMM (or the epilogue after it) runs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MatmulRoute {
    /// The matrix engine, with the executable of this key (its epilogue included: the
    /// epilogue's launch is then not run).
    Engine(MatmulKey),
    /// The MSL GEMM kernel, for the reason given.
    Kernel(String),
    /// An epilogue launch after an engine GEMM that stays an MSL kernel, for the reason given.
    EpilogueKernel(String),
}

/// Where a planned attention launch (forward or gradient) runs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionRoute {
    /// The matrix engine, with the executable of this key.
    Engine(AttentionKey),
    /// The MSL attention kernel, for the reason given.
    Kernel(String),
}

/// An engine-bound attention: its executable and where its arrays are (as its key's shapes).
struct EngineAttention {
    exe: Arc<dyn GpuAttention>,
    places: Vec<Loc>,
}

/// An engine-bound GEMM: its executable and where its row-major A, B and C (and its
/// epilogue's bias) are.
struct EngineGemm {
    exe: Arc<dyn GpuMatmul>,
    a: Loc,
    b: Loc,
    c: Loc,
    bias: Option<Loc>,
}

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
    /// For each step, its engine matmul when the step is a GEMM bound to the engine.
    engine: Vec<Option<EngineGemm>>,
    /// Each planned GEMM's step index and route.
    routes: Vec<(usize, MatmulRoute)>,
    /// Steps not run because an engine matmul computes them (fused epilogues).
    skip: Vec<bool>,
    /// For each step, its engine attention when the step is an attention bound to the engine.
    attention: Vec<Option<EngineAttention>>,
    /// Each planned attention launch's step index and route.
    attention_routes: Vec<(usize, AttentionRoute)>,
}

impl MetalProgram {
    pub fn new(
        device: MetalDevice,
        program: &Program,
        lens: &[usize],
        host_update: HostUpdate,
        options: MetalOptions,
    ) -> Result<Self> {
        let plan = gpu_plan::plan(program, lens, target(options.update))?;
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
                // The Metal target never asks for them (`gemm_grids: false`).
                Step::GemmGrid { .. } => {
                    return Err(Error::Internal(
                        "[metal] the plan has a pointer-array product, which Metal lacks".into(),
                    ));
                }
                Step::HyperRow { .. } | Step::HostUpdate(_)
                    if (options.update == UpdateMode::Host) != matches!(s, Step::HostUpdate(_)) =>
                {
                    return Err(Error::Internal(format!(
                        "[metal] the plan's update does not match update mode {:?}",
                        options.update
                    )));
                }
                _ => {}
            }
        }
        let mut engine: Vec<Option<EngineGemm>> = Vec::with_capacity(plan.steps.len());
        let mut routes = Vec::new();
        let mut skip = vec![false; plan.steps.len()];
        let debug = std::env::var("RLX_METAL_DEBUG").is_ok_and(|v| v == "1");
        for (i, s) in plan.steps.iter().enumerate() {
            let Step::Gemm { g, a, b, c } = s else {
                engine.push(None);
                continue;
            };
            // Row-major terms: the kernel's A is the plan's (column-major) B, and B its A.
            let (ra, rb, rc) = (*b, *a, *c);
            let key = matmul::key_of(&Gemm::from_plan(g, 0, 0, 0)).and_then(|k| {
                for l in [ra, rb, rc] {
                    matmul::offset_ok(l.offset)?;
                }
                Ok(k)
            });
            let mut key = match options.matmul.route(key) {
                Ok(key) => key,
                Err(why) => {
                    if debug {
                        eprintln!("rlx metal: GEMM at step {i} on the MSL kernel: {why}");
                    }
                    engine.push(None);
                    routes.push((i, MatmulRoute::Kernel(why)));
                    continue;
                }
            };
            // A product into the product buffer read by the next step's fused epilogue: the
            // engine computes that epilogue too where it can.
            let product = Loc {
                buf: gpu_plan::PRODUCT,
                offset: 0,
            };
            let (mut out, mut bias) = (rc, None);
            if let (
                true,
                Some(Step::Launch {
                    kernel: Kernel::Fused(j),
                    p,
                    operands,
                    ..
                }),
            ) = (rc == product, plan.steps.get(i + 1))
            {
                let f = &plan.fused[*j];
                let slot = |k: usize| operands.iter().find(|(s, _)| *s == k).map(|(_, l)| *l);
                let fused = if slot(0) != Some(product) {
                    Err("the epilogue does not read the product".to_string())
                } else {
                    matmul::epilogue_of(f, p, key.n).and_then(|e| {
                        let o = slot(f.n_inputs).ok_or("the epilogue has no result")?;
                        let b = if e.bias {
                            Some(slot(1).ok_or("the epilogue has no bias")?)
                        } else {
                            None
                        };
                        for l in std::iter::once(o).chain(b) {
                            matmul::offset_ok(l.offset)?;
                        }
                        Ok((e, o, b))
                    })
                };
                match fused {
                    Ok((e, o, b)) => {
                        key.epilogue = e;
                        out = o;
                        bias = b;
                        skip[i + 1] = true;
                    }
                    Err(why) => {
                        if debug {
                            eprintln!(
                                "rlx metal: epilogue at step {} on an MSL kernel: {why}",
                                i + 1
                            );
                        }
                        routes.push((i + 1, MatmulRoute::EpilogueKernel(why)));
                    }
                }
            }
            let exe = device.matmul(key)?;
            engine.push(Some(EngineGemm {
                exe,
                a: ra,
                b: rb,
                c: out,
                bias,
            }));
            routes.push((i, MatmulRoute::Engine(key)));
        }
        routes.sort_by_key(|r| r.0);
        let mut engine_attention = Vec::with_capacity(plan.steps.len());
        let mut attention_routes = Vec::new();
        for (i, s) in plan.steps.iter().enumerate() {
            let (grad, p, operands) = match s {
                Step::Launch {
                    kernel: Kernel::Library(k @ ("rlx_attention" | "rlx_attention_grad")),
                    p,
                    operands,
                    ..
                } => (*k == "rlx_attention_grad", p, operands),
                _ => {
                    engine_attention.push(None);
                    continue;
                }
            };
            let found = attention::attention_of(p, operands, grad);
            let places = found.as_ref().map(|f| f.1.clone()).ok();
            // An executable that does not compile leaves the attention on the kernel.
            let routed = attention::route(&options.attention, found.map(|f| f.0)).and_then(|key| {
                device
                    .attention(key)
                    .map(|exe| (key, exe))
                    .map_err(|e| format!("its MPSGraph executable did not compile: {e}"))
            });
            match routed {
                Ok((key, exe)) => {
                    let places = places.ok_or_else(|| {
                        Error::Internal("[metal] an engine attention without places".into())
                    })?;
                    // The gradient's output is zeroed first for the kernel's sums; the engine
                    // writes every byte of it (dq | dk | dv), so that fill is not run.
                    if let (true, Some(Step::Fill { at, bytes })) =
                        (grad, i.checked_sub(1).and_then(|j| plan.steps.get(j)))
                    {
                        let out = operands.iter().find(|(slot, _)| *slot == 5).map(|o| o.1);
                        let written: usize = key.bytes()[key.feeds()..].iter().sum();
                        if out == Some(*at) && *bytes == written && places[key.feeds()] == *at {
                            skip[i - 1] = true;
                        }
                    }
                    engine_attention.push(Some(EngineAttention { exe, places }));
                    attention_routes.push((i, AttentionRoute::Engine(key)));
                }
                Err(why) => {
                    if debug {
                        eprintln!("rlx metal: attention at step {i} on the MSL kernel: {why}");
                    }
                    engine_attention.push(None);
                    attention_routes.push((i, AttentionRoute::Kernel(why)));
                }
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
            engine,
            routes,
            skip,
            attention: engine_attention,
            attention_routes,
        })
    }

    /// Each planned attention launch's step index and where it runs (the engine's key,
    /// or the reason it stays on the MSL kernel).
    pub fn attention_routes(&self) -> &[(usize, AttentionRoute)] {
        &self.attention_routes
    }

    /// Each planned GEMM's step index and where it runs (the engine's key, or the reason it
    /// stays on the MSL kernel).
    pub fn matmul_routes(&self) -> &[(usize, MatmulRoute)] {
        &self.routes
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

/// One item of a submission being built.
enum Item {
    Kernel(Launch),
    /// An engine matmul: its executable, (buffer, byte offset) of A, B and C, and of the bias.
    Matmul(
        Arc<dyn GpuMatmul>,
        [(usize, usize); 3],
        Option<(usize, usize)>,
    ),
    /// An engine attention: its executable, (buffer, byte offset) of each of its arrays.
    Attention(Arc<dyn GpuAttention>, Vec<(usize, usize)>),
}

impl Compiled for MetalProgram {
    fn workspace_bytes(&self) -> usize {
        self.scratch.len() + self.product.len()
    }

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
        // The update's multi-tensor kernel takes every buffer's base; absent ones are 0.
        let base = |b: usize| -> u64 {
            metal
                .get(b)
                .copied()
                .flatten()
                .map_or(0, |m| m.gpu().gpu_address())
        };
        if self.may_fail {
            self.scratch.write(gpu_plan::ERR_AT, &[0u8; 16])?;
        }
        // The run's hyper-parameters, where the device-side update reads them (written before
        // anything of this run is submitted; the previous run has completed).
        for step in &self.plan.steps {
            if let Step::HyperRow { at } = step {
                let h = hyper.ok_or_else(|| {
                    Error::Graph("optimizer step without hyper-parameters".into())
                })?;
                let row: Vec<u8> = gpu_plan::hyper_row(h)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let buf = metal
                    .get(at.buf)
                    .copied()
                    .flatten()
                    .ok_or_else(|| Error::Internal(format!("[metal] no buffer {}", at.buf)))?;
                buf.write(at.offset, &row)?;
            }
        }
        let uses: Vec<&MetalBuffer> = metal.iter().flatten().copied().collect();
        let lib = self.device.library().clone();
        let mut pending: Vec<Item> = Vec::new();
        let flush = |pending: &mut Vec<Item>| -> Result<()> {
            if pending.is_empty() {
                return Ok(());
            }
            let gpu = |b: usize| -> Result<&Arc<dyn crate::gpu::GpuBuffer>> {
                metal
                    .get(b)
                    .copied()
                    .flatten()
                    .map(|m| m.gpu())
                    .ok_or_else(|| Error::Internal(format!("[metal] no buffer {b}")))
            };
            let mut work: Vec<Work<'_>> = Vec::with_capacity(pending.len());
            for item in pending.iter() {
                work.push(match item {
                    Item::Kernel(l) => Work::Kernel(Dispatch {
                        library: l.library.as_ref(),
                        kernel: &l.kernel,
                        record: &l.record,
                        threads: l.threads,
                    }),
                    Item::Attention(exe, arrays) => Work::Attention(AttentionCall {
                        exe: exe.as_ref(),
                        arrays: arrays
                            .iter()
                            .map(|&(b, off)| Ok((gpu(b)?, off)))
                            .collect::<Result<_>>()?,
                    }),
                    Item::Matmul(exe, [a, b, c], bias) => Work::Matmul(MatmulCall {
                        exe: exe.as_ref(),
                        a: (gpu(a.0)?, a.1),
                        b: (gpu(b.0)?, b.1),
                        c: (gpu(c.0)?, c.1),
                        bias: match bias {
                            Some(l) => Some((gpu(l.0)?, l.1)),
                            None => None,
                        },
                    }),
                });
            }
            self.device.run_work(None, &work, &uses)?;
            pending.clear();
            Ok(())
        };
        for (i, step) in self.plan.steps.iter().enumerate() {
            if self.skip[i] {
                continue;
            }
            if let Some(a) = &self.attention[i] {
                // Each array must lie inside its buffer (the engine does not check).
                for (l, bytes) in a.places.iter().zip(a.exe.key().bytes()) {
                    let end = l.offset.checked_add(bytes);
                    let len = metal.get(l.buf).copied().flatten().map(|m| m.len());
                    if end.is_none() || len.is_none() || end > len {
                        return Err(Error::Internal(format!(
                            "[metal] engine attention array of {bytes} bytes at {} of buffer \
                             {} ({len:?} bytes)",
                            l.offset, l.buf
                        )));
                    }
                }
                pending.push(Item::Attention(
                    a.exe.clone(),
                    a.places.iter().map(|l| (l.buf, l.offset)).collect(),
                ));
                continue;
            }
            match step {
                Step::Launch {
                    kernel,
                    p,
                    operands,
                    ..
                } => {
                    let mut p: P = **p;
                    let multi = *kernel == Kernel::Library("rlx_update_multi");
                    for (slot, loc) in operands {
                        p.ptr[*slot] = if multi && *slot < 6 {
                            base(loc.buf)
                        } else {
                            addr(loc)?
                        };
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
                    pending.push(Item::Kernel(Launch {
                        library,
                        kernel: name,
                        record: kernels::record(&p),
                        threads,
                    }));
                }
                Step::Fill { at, bytes } => {
                    if bytes % 4 != 0 {
                        return Err(Error::Internal(format!("[metal] a fill of {bytes} bytes")));
                    }
                    let mut p = P::sized(bytes / 4);
                    p.ptr[0] = addr(at)?;
                    pending.push(Item::Kernel(Launch {
                        library: lib.clone(),
                        kernel: "rlx_zero32".into(),
                        record: kernels::record(&p),
                        threads: kernels::threads("rlx_zero32", &p)?,
                    }));
                }
                Step::Gemm { g, a, b, c } => match &self.engine[i] {
                    Some(e) => {
                        // Each array must lie inside its buffer (the engine does not check).
                        let places = [e.a, e.b, e.c];
                        let key = e.exe.key();
                        let arrays = places
                            .iter()
                            .zip(key.bytes())
                            .chain(e.bias.iter().map(|l| (l, key.n * 4)));
                        for (l, bytes) in arrays {
                            let end = l.offset.checked_add(bytes);
                            let len = metal.get(l.buf).copied().flatten().map(|m| m.len());
                            if end.is_none() || len.is_none() || end > len {
                                return Err(Error::Internal(format!(
                                    "[metal] engine matmul array of {bytes} bytes at {} of \
                                     buffer {} ({len:?} bytes)",
                                    l.offset, l.buf
                                )));
                            }
                        }
                        pending.push(Item::Matmul(
                            e.exe.clone(),
                            places.map(|l| (l.buf, l.offset)),
                            e.bias.map(|l| (l.buf, l.offset)),
                        ));
                    }
                    None => {
                        let (record, threads) =
                            Gemm::from_plan(g, addr(a)?, addr(b)?, addr(c)?).record()?;
                        pending.push(Item::Kernel(Launch {
                            library: lib.clone(),
                            kernel: "rlx_gemm_f32".into(),
                            record,
                            threads,
                        }));
                    }
                },
                Step::HostUpdate(u) => {
                    // Everything before the update has completed once `flush` returns; the
                    // update then works in place on the shared memory the kernels wrote.
                    flush(&mut pending)?;
                    // SAFETY: the caller's contract (nothing else touches the buffers during
                    // the run) is the one `host_update` needs; no GPU work is in flight.
                    unsafe { (self.host_update)(buffers, &self.lens, u, hyper)? };
                }
                // written above, before the submission
                Step::HyperRow { .. } => {}
                // refused when the program was made
                Step::GemmGrid { .. } => {
                    return Err(Error::Internal("a pointer-array product on Metal".into()))
                }
            }
        }
        flush(&mut pending)?;
        self.flagged()
    }
}
