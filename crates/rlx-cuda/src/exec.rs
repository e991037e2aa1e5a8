//! Runs a planned program: resolves each operand to a device address, queues every step on the
//! device's stream, waits, and reports the first error a kernel flagged (bad label, id, integer
//! division by zero) as the CPU backend would.
use crate::driver::{Device, Event, Func, GraphExec, Pinned};
use crate::epilogue::{self, LtMode, LtStep};
use crate::lt::Matmul;
use crate::mem::CudaBuffer;
use crate::plan::{self, Kernel, Plan, Step};
use crate::source;
use rlx_ir::{Error, Result};
use rlx_runtime::backend::{check_range, io_buffer};
use rlx_runtime::{profile, Compiled, DeviceBuffer, HostRead, HostWrite, OptimHyper, Program};
use std::sync::Arc;

pub struct CudaProgram {
    dev: Arc<Device>,
    plan: Plan,
    /// What a run queues, in order: plan steps, and cuBLASLt products standing for a GEMM and
    /// the steps it absorbed (see `epilogue.rs`).
    units: Vec<Unit>,
    /// The function of each launch step (None for other steps), resolved at compile time.
    funcs: Vec<Option<Func>>,
    lens: Vec<usize>,
    scratch: CudaBuffer,
    /// Matmul products read by their epilogues.
    product: CudaBuffer,
    /// The run's hyper-parameter row, copied to the device by the run (also inside a graph).
    hyper: Pinned,
    /// The error word, copied back by every run of a program with kernels that can fail.
    err: Option<Pinned>,
    /// The pointer arrays of the plan's `GemmGrid` steps (see [`Grids`]).
    grids: Grids,
    /// The captured run and what it was captured with (base addresses, host copies).
    graph: Option<(GraphKey, GraphExec)>,
    /// The host copies of the current run, through pinned memory (see [`Compiled::run_io`]).
    io: Io,
    /// Graph capture: on unless `RLX_CUDA_GRAPHS=0` or profiling, and off for good once a
    /// capture failed.
    use_graphs: bool,
    runs: u64,
    /// With `RLX_PROFILE=1`: milliseconds and calls per step kind, printed when dropped (runs
    /// are then launched step by step, never replayed from a graph).
    profile: Option<profile::Profile>,
    /// The profiled run's timing events, one before the first step and one after each.
    marks: Vec<Event>,
    /// With `RLX_PROFILE=step`: per run, the device milliseconds between events around the
    /// submission and the host milliseconds of the whole `run_io` call, printed when dropped.
    step_times: Option<Vec<(f64, f64)>>,
}

/// One piece of a run's work.
enum Unit {
    Step(usize),
    Lt(Box<(LtStep, Matmul)>),
}

/// The device addresses `Step::GemmGrid` products read their matrices from: three arrays of
/// `batch` addresses a step (A, B, C) in one allocation, written before a run whenever the
/// buffers' base addresses differ from the last run's (a captured graph replays only with the
/// bases it was captured with).
struct Grids {
    /// Per plan step, the byte offset of its arrays (steps that are not grids: none).
    at: Vec<Option<usize>>,
    tables: Option<CudaBuffer>,
    written_for: Option<[u64; 6]>,
}

impl Grids {
    fn new(dev: &Arc<Device>, plan: &Plan) -> Result<Grids> {
        let mut end = 0;
        let at: Vec<Option<usize>> = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::GemmGrid { g, .. } => {
                    let here = end;
                    end += 3 * g.batch * 8;
                    Some(here)
                }
                _ => None,
            })
            .collect();
        let tables = match end {
            0 => None,
            n => Some(CudaBuffer::zeroed(dev.clone(), n)?),
        };
        Ok(Grids {
            at,
            tables,
            written_for: None,
        })
    }

    /// Writes the arrays for the buffers at `bases` unless they hold those already (the caller
    /// holds the device's run lock; nothing is queued or being captured).
    fn write(&mut self, dev: &Device, plan: &Plan, bases: &[u64; 6]) -> Result<()> {
        let Some(tables) = &self.tables else {
            return Ok(());
        };
        if self.written_for == Some(*bases) {
            return Ok(());
        }
        let mut bytes = Vec::new();
        for s in &plan.steps {
            if let Step::GemmGrid { g, a, b, c } = s {
                for grid in [a, b, c] {
                    debug_assert_eq!(grid.units * grid.heads, g.batch);
                    let base = bases[grid.at.buf];
                    for off in grid.offsets() {
                        bytes.extend_from_slice(&(base + off as u64).to_le_bytes());
                    }
                }
            }
        }
        dev.write_holding_run_lock(tables.device_ptr(), &bytes)?;
        self.written_for = Some(*bases);
        Ok(())
    }

    /// The device addresses of step `i`'s three arrays.
    fn arrays(&self, i: usize, batch: usize) -> Result<[u64; 3]> {
        match (&self.tables, self.at.get(i).copied().flatten()) {
            (Some(t), Some(at)) => {
                let base = t.device_ptr() + at as u64;
                Ok([0, 1, 2].map(|k| base + (k * batch * 8) as u64))
            }
            _ => Err(Error::Internal(
                "a pointer-array product without its arrays".into(),
            )),
        }
    }
}

/// One host copy of a run: `len` bytes between byte `pos` of the pinned memory and the device
/// address `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct IoCopy {
    at: u64,
    len: usize,
    pos: usize,
}

/// A run's host copies: feeds in before the steps, outputs out after them, each through pinned
/// memory so that they join the run's submission (and its captured graph).
#[derive(Default)]
struct Io {
    writes: Vec<IoCopy>,
    reads: Vec<IoCopy>,
    pin_in: Option<Pinned>,
    pin_out: Option<Pinned>,
}

/// What a captured graph depends on: the buffers' base addresses and the host copies.
type GraphKey = ([u64; 6], Vec<IoCopy>, Vec<IoCopy>);

/// Lays `sizes` out one after another, 64-byte aligned; returns the positions and the total.
fn layout(sizes: impl Iterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut at = 0;
    let pos = sizes
        .map(|n| {
            let p = at;
            at += n.div_ceil(64) * 64;
            p
        })
        .collect();
    (pos, at)
}

impl Drop for CudaProgram {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", profile::render("rlx cuda profile", p));
        }
        if let Some(t) = self.step_times.as_ref().filter(|t| t.len() > 2) {
            // The first two runs are left out: the first launches step by step and warms the
            // caches, the second captures the graph.
            let runs = t.len() - 2;
            let mut gpu: Vec<f64> = t[2..].iter().map(|r| r.0).collect();
            let mut host: Vec<f64> = t[2..].iter().map(|r| r.1).collect();
            eprintln!(
                "rlx cuda step profile: {} steps, {runs} runs ({}); device {}; host call {}",
                self.units.len(),
                if self.graph.is_some() {
                    "graph replay"
                } else {
                    "stream launches"
                },
                profile::spread_us(&mut gpu),
                profile::spread_us(&mut host)
            );
        }
    }
}

/// A GEMM's profile name: dtype, transposes, shape and batch.
fn gemm_key(g: &plan::Gemm) -> String {
    let t = |t: bool| if t { "T" } else { "N" };
    format!(
        "gemm {} {}{} m{} n{} k{} x{}",
        g.dtype,
        t(g.ta),
        t(g.tb),
        g.m,
        g.n,
        g.k,
        g.batch
    )
}

/// The profile row of a unit: the kernel (or GEMM shape and epilogue) it runs.
fn profile_key(plan: &Plan, unit: &Unit) -> String {
    let i = match unit {
        Unit::Step(i) => *i,
        Unit::Lt(l) => {
            let residual = if l.0.spec.residual { " +C" } else { "" };
            return format!("lt {} {:?}{residual}", gemm_key(&l.0.spec.g), l.0.spec.epi);
        }
    };
    match &plan.steps[i] {
        Step::Launch {
            kernel,
            grid,
            block,
            ..
        } => match kernel {
            Kernel::Library(name) => format!("{name} <<<{grid},{block}>>>"),
            Kernel::Fused(f) => format!("fused#{f} <<<{grid},{block}>>>"),
        },
        Step::Fill { bytes, .. } => format!("fill {bytes} B"),
        Step::Gemm { g, .. } => gemm_key(g),
        Step::GemmGrid { g, .. } => format!("{} (pointer arrays)", gemm_key(g)),
        Step::HyperRow { .. } => "hyper-parameter row".into(),
        Step::HostUpdate(_) => "host update".into(),
    }
}

/// The plan target: `RLX_CUDA_ATTENTION=gemm` runs every attention as batched GEMMs,
/// `=gemm-grad` only gradients, `=fused` none (the register-tiled and warp kernels); unset or
/// `auto` decides by size (see `Target::gemm_attention`). Those GEMMs read packed heads in
/// place through pointer arrays (`RLX_CUDA_GRIDS=1`, the default); `=0` copies them head-major
/// first.
fn target() -> Result<plan::Target> {
    let cuda = plan::Target::CUDA;
    let (gemm_attention, gemm_attention_forward) = match std::env::var("RLX_CUDA_ATTENTION")
        .as_deref()
        .map(str::trim)
    {
        Err(_) | Ok("") | Ok("auto") => (cuda.gemm_attention, cuda.gemm_attention_forward),
        Ok("gemm") => (Some(0), true),
        Ok("gemm-grad") => (Some(0), false),
        Ok("fused") => (None, false),
        Ok(other) => {
            return Err(Error::Input {
                name: "RLX_CUDA_ATTENTION".into(),
                msg: format!("must be auto, gemm, gemm-grad or fused, got {other:?}"),
            })
        }
    };
    Ok(plan::Target {
        gemm_attention,
        gemm_attention_forward,
        gemm_grids: match std::env::var("RLX_CUDA_GRIDS").as_deref().map(str::trim) {
            Ok("1") => true,
            Ok("0") => false,
            _ => cuda.gemm_grids,
        },
        ..cuda
    })
}

/// The run's units: every plan step in order, except that each cuBLASLt candidate
/// (`RLX_CUDA_LT`, see `epilogue.rs`) cuBLASLt has an algorithm for replaces its steps, queued
/// where its GEMM was. `RLX_CUDA_DEBUG=1` says which candidates kept their steps.
fn lt_units(dev: &Device, plan: &Plan) -> Result<Vec<Unit>> {
    let mode = LtMode::from_env().map_err(|msg| Error::Input {
        name: "RLX_CUDA_LT".into(),
        msg,
    })?;
    let n = plan.steps.len();
    let mut at: Vec<Option<Unit>> = (0..n).map(|_| None).collect();
    let mut skip = vec![false; n];
    if let Some(lt) = (mode != LtMode::Off).then(|| dev.lt()).flatten() {
        dev.bind()?;
        let tf32 = std::env::var("RLX_CUDA_TF32").is_ok_and(|v| v == "1");
        let tune = crate::tune::enabled();
        for c in epilogue::candidates(plan, mode) {
            match lt.plan(&c.spec, tf32)? {
                Some(mut m) => {
                    if tune {
                        crate::tune::tune(dev, &c.spec, tf32, &mut m)?;
                    }
                    for &s in &c.steps {
                        skip[s] = true;
                    }
                    let first = c.steps[0];
                    at[first] = Some(Unit::Lt(Box::new((c, m))));
                }
                None if std::env::var("RLX_CUDA_DEBUG").is_ok_and(|v| v == "1") => {
                    eprintln!(
                        "rlx cuda: no cuBLASLt algorithm for {:?}; steps {:?} stay",
                        c.spec, c.steps
                    )
                }
                None => {}
            }
        }
    }
    Ok(at
        .into_iter()
        .enumerate()
        .filter_map(|(i, u)| match u {
            Some(u) => Some(u),
            None if skip[i] => None,
            None => Some(Unit::Step(i)),
        })
        .collect())
}

fn graphs_enabled() -> bool {
    std::env::var("RLX_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0")
}

impl CudaProgram {
    pub fn new(dev: Arc<Device>, program: &Program, lens: &[usize]) -> Result<CudaProgram> {
        let plan = plan::plan(program, lens, target()?)?;
        let profiling = profile::requested();
        let lib = dev.module(&format!("{}{}", source::PRELUDE, source::LIBRARY))?;
        let fused_mod = if plan.fused.is_empty() {
            None
        } else {
            let mut src = source::PRELUDE.to_string();
            for (i, f) in plan.fused.iter().enumerate() {
                src.push_str(&source::fused_kernel(&format!("rlx_fused_{i}"), f));
            }
            Some(dev.module(&src)?)
        };
        let funcs = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Launch { kernel, .. } => match kernel {
                    Kernel::Library(name) => lib.func(name).map(Some),
                    Kernel::Fused(i) => fused_mod
                        .as_ref()
                        .expect("fused kernels compiled")
                        .func(&format!("rlx_fused_{i}"))
                        .map(Some),
                },
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let units = lt_units(&dev, &plan)?;
        let scratch = CudaBuffer::zeroed(dev.clone(), plan.scratch_bytes)?;
        for (off, bytes) in &plan.tables {
            scratch.write(*off, bytes)?;
        }
        let product = CudaBuffer::zeroed(dev.clone(), plan.product_bytes)?;
        let grids = Grids::new(&dev, &plan)?;
        let hyper = Pinned::new(dev.clone(), rlx_runtime::hyper_col::LEN * 4)?;
        let err_at = plan::Loc {
            buf: plan::SCRATCH,
            offset: plan::ERR_AT,
        };
        let may_fail = plan.steps.iter().any(|s| match s {
            Step::Launch { operands, .. } => operands.iter().any(|(_, l)| *l == err_at),
            _ => false,
        });
        let err = if may_fail {
            Some(Pinned::new(dev.clone(), 8)?)
        } else {
            None
        };
        Ok(CudaProgram {
            dev,
            plan,
            units,
            funcs,
            lens: lens.to_vec(),
            scratch,
            product,
            hyper,
            err,
            grids,
            graph: None,
            io: Io::default(),
            use_graphs: graphs_enabled() && !profiling,
            runs: 0,
            profile: profiling.then(profile::Profile::new),
            marks: Vec::new(),
            step_times: profile::step_requested().then(Vec::new),
        })
    }

    /// Queues every step (on the stream, or into a capture); with the profiler on, a timing
    /// event after each.
    fn enqueue(&mut self, bases: &[u64; 6]) -> Result<()> {
        let err_at = bases[plan::SCRATCH] + plan::ERR_AT as u64;
        if self.err.is_some() {
            self.dev.memset_async(err_at, 16)?;
        }
        if let Some(pin) = &self.io.pin_in {
            for w in self.io.writes.iter().filter(|w| w.len > 0) {
                pin.copy_range_to(w.pos, w.len, w.at)?;
            }
        }
        let mut marks = Vec::new();
        if self.profile.is_some() {
            marks.push(self.dev.timing()?);
        }
        for unit in &self.units {
            match unit {
                Unit::Step(i) => self.enqueue_step(*i, bases)?,
                Unit::Lt(l) => self.enqueue_lt(&l.0, &l.1, bases)?,
            }
            if self.profile.is_some() {
                marks.push(self.dev.timing()?);
            }
        }
        if let Some(e) = &mut self.err {
            e.copy_from(err_at)?;
        }
        if let Some(pin) = &mut self.io.pin_out {
            for r in self.io.reads.iter().filter(|r| r.len > 0) {
                pin.copy_range_from(r.pos, r.len, r.at)?;
            }
        }
        self.marks = marks;
        Ok(())
    }

    fn enqueue_step(&self, i: usize, bases: &[u64; 6]) -> Result<()> {
        let (step, func) = (&self.plan.steps[i], self.funcs[i]);
        let addr = |l: &plan::Loc| bases[l.buf] + l.offset as u64;
        match step {
            Step::Launch {
                grid,
                block,
                p,
                operands,
                ..
            } => {
                let mut p = **p;
                for (slot, loc) in operands {
                    p.ptr[*slot] = addr(loc);
                }
                let f = func.ok_or_else(|| Error::Internal("launch without kernel".into()))?;
                self.dev.launch(f, *grid, *block, &mut p)
            }
            Step::Fill { at, bytes } => self.dev.memset_async(addr(at), *bytes),
            Step::Gemm { g, a, b, c } => self.dev.gemm(g, addr(a), addr(b), addr(c)),
            Step::GemmGrid { g, .. } => self.dev.gemm_grid(g, self.grids.arrays(i, g.batch)?),
            Step::HyperRow { at } => self.hyper.copy_to(addr(at)),
            Step::HostUpdate(_) => Err(Error::Internal("a host-side update in a cuda plan".into())),
        }
    }

    /// Queues a cuBLASLt product at this run's addresses.
    fn enqueue_lt(&self, l: &LtStep, m: &Matmul, bases: &[u64; 6]) -> Result<()> {
        let addr = |l: &plan::Loc| bases[l.buf] + l.offset as u64;
        let ops = l.ops.each_ref().map(addr);
        if ops
            .iter()
            .zip(l.spec.align)
            .any(|(a, align)| a % align as u64 != 0)
        {
            return Err(Error::Internal(
                "a cuBLASLt operand is less aligned than its algorithm was chosen for".into(),
            ));
        }
        self.dev.lt_matmul(m, ops, l.bias.as_ref().map_or(0, addr))
    }

    /// Adds the finished run's per-step times to the profile (after the stream synchronised).
    fn take_marks(&mut self) -> Result<()> {
        let (Some(profile), marks) = (self.profile.as_mut(), std::mem::take(&mut self.marks))
        else {
            return Ok(());
        };
        for (unit, w) in self.units.iter().zip(marks.windows(2)) {
            let ms = w[1].ms_since(&w[0])? as f64;
            profile::add(profile, profile_key(&self.plan, unit), ms);
        }
        Ok(())
    }

    /// One run: replays the captured graph where the buffers are the ones it was captured with,
    /// captures one from the second run on, else queues the steps; then waits.
    fn run_steps(&mut self, bases: &[u64; 6], hyper: Option<&OptimHyper>) -> Result<()> {
        let needs_hyper = self
            .plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::HyperRow { .. }));
        match hyper {
            Some(h) => {
                let row: Vec<u8> = plan::hyper_row(h)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                self.hyper.set(&row);
            }
            None if needs_hyper => {
                return Err(Error::Graph(
                    "optimizer step without hyper-parameters".into(),
                ))
            }
            None => {}
        }
        self.runs += 1;
        self.grids.write(&self.dev, &self.plan, bases)?;
        let key: GraphKey = (*bases, self.io.writes.clone(), self.io.reads.clone());
        if self.graph.as_ref().is_some_and(|(k, _)| *k != key) {
            self.graph = None;
        }
        if self.use_graphs && self.graph.is_none() && self.runs >= 2 {
            self.dev.begin_capture()?;
            let queued = self.enqueue(bases);
            match (queued.is_ok(), self.dev.end_capture(queued.is_ok())) {
                (true, Ok(g)) => self.graph = Some((key, g)),
                (_, e) => {
                    if std::env::var("RLX_CUDA_DEBUG").is_ok_and(|v| v == "1") {
                        eprintln!(
                            "rlx cuda: graph capture impossible ({:?} / {:?}); launching on the stream",
                            queued.err(),
                            e.err()
                        );
                    }
                    self.use_graphs = false;
                }
            }
        }
        let start = match self.step_times {
            Some(_) => Some(self.dev.timing()?),
            None => None,
        };
        match &self.graph {
            Some((_, g)) => self.dev.launch_graph(g)?,
            None => self.enqueue(bases)?,
        }
        let end = match start {
            Some(_) => Some(self.dev.timing()?),
            None => None,
        };
        self.dev.sync()?;
        if let (Some(t), Some(s), Some(e)) = (self.step_times.as_mut(), start, end) {
            t.push((e.ms_since(&s)? as f64, 0.0));
        }
        self.take_marks()
    }

    /// The first failure a kernel flagged in this run, as the CPU backend reports it.
    fn flagged(&self) -> Result<()> {
        let Some(e) = &self.err else {
            return Ok(());
        };
        let w = e.get();
        let code = i32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let value = i32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        self.plan.flagged(code, value, "cuda")
    }
}

impl Compiled for CudaProgram {
    fn workspace_bytes(&self) -> usize {
        self.scratch.len() + self.product.len()
    }

    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        // SAFETY: the caller upholds `run`'s contract, which `run_io` shares.
        unsafe { self.run_io(buffers, hyper, &[], &mut []) }
    }

    unsafe fn run_io(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
        writes: &[HostWrite<'_>],
        reads: &mut [HostRead<'_>],
    ) -> Result<()> {
        let called = std::time::Instant::now();
        let before = self.step_times.as_ref().map_or(0, Vec::len);
        // SAFETY: the caller upholds `run_io`'s contract, which `run_io_timed` shares.
        let done = unsafe { self.run_io_timed(buffers, hyper, writes, reads) };
        if let Some(t) = self.step_times.as_mut().filter(|t| t.len() > before) {
            t[before].1 = called.elapsed().as_secs_f64() * 1e3;
        }
        done
    }
}

impl CudaProgram {
    /// [`Compiled::run_io`] (the caller times it under `RLX_PROFILE=step`).
    unsafe fn run_io_timed(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
        writes: &[HostWrite<'_>],
        reads: &mut [HostRead<'_>],
    ) -> Result<()> {
        let mut bases = [0u64; 6];
        for (i, &len) in self.lens.iter().enumerate() {
            if len == 0 {
                continue;
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
            bases[i] = self.device_base(*b)?;
        }
        bases[plan::SCRATCH] = self.scratch.device_ptr();
        bases[plan::PRODUCT] = self.product.device_ptr();
        let io = |buf: usize, offset: usize, len: usize| -> Result<u64> {
            let b = io_buffer(buffers, buf)?;
            check_range("host copy", offset, len, b.len())?;
            Ok(self.device_base(b)? + offset as u64)
        };
        let (wpos, win) = layout(writes.iter().map(|w| w.data.len()));
        let (rpos, rout) = layout(reads.iter().map(|r| r.out.len()));
        let new_writes = writes
            .iter()
            .zip(&wpos)
            .map(|(w, &pos)| {
                Ok(IoCopy {
                    at: io(w.buf, w.offset, w.data.len())?,
                    len: w.data.len(),
                    pos,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let new_reads = reads
            .iter()
            .zip(&rpos)
            .map(|(r, &pos)| {
                Ok(IoCopy {
                    at: io(r.buf, r.offset, r.out.len())?,
                    len: r.out.len(),
                    pos,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let dev = self.dev.clone();
        let _one_at_a_time = dev.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        dev.bind()?;
        // Pinned memory grows (never shrinks); a new allocation invalidates the captured graph.
        for (pin, need) in [(&mut self.io.pin_in, win), (&mut self.io.pin_out, rout)] {
            if need > 0 && pin.as_ref().is_none_or(|p| p.len() < need) {
                *pin = Some(Pinned::new(dev.clone(), need)?);
                self.graph = None;
            }
        }
        if let Some(pin) = &mut self.io.pin_in {
            for (w, c) in writes.iter().zip(&new_writes) {
                pin.set_at(c.pos, w.data);
            }
        }
        self.io.writes = new_writes;
        self.io.reads = new_reads;
        self.run_steps(&bases, hyper)?;
        if let Some(pin) = &self.io.pin_out {
            for (r, c) in reads.iter_mut().zip(&self.io.reads) {
                pin.get_at(c.pos, r.out);
            }
        }
        self.flagged()
    }
}

impl CudaProgram {
    /// The device address of a buffer of this program's GPU.
    fn device_base(&self, b: &dyn DeviceBuffer) -> Result<u64> {
        let c = CudaBuffer::of(b)
            .ok_or_else(|| Error::Device("a cuda program runs only over cuda buffers".into()))?;
        if c.device().ordinal != self.dev.ordinal {
            return Err(Error::Device(
                "a buffer of another GPU was given to this program".into(),
            ));
        }
        Ok(c.device_ptr())
    }
}
