//! A compiled executable: one arena, resident weights and inputs, the whole step as one call.
//!
//! This file owns compiling and running; the rest lives beside it: [`feeds`] (input slots and the
//! checks every feed passes), [`resident`] (inputs bound once, row writes) and [`prefetch`]
//! (staging the next batches while a step runs).
use crate::backend::check_range;
use crate::lower::lower_with_region;
use crate::{
    Backend, Buf, Compiled, DeviceBuffer, Error, HostRead, HostWrite, Instr, OptimHyper, Program,
    Result, Store, TRef,
};
use rlx_ir::Graph;
use std::sync::{Arc, Mutex};

mod feeds;
mod prefetch;
mod resident;

pub use crate::train::OptimizerSetup;
pub use feeds::InputSlot;
use feeds::{check_feed, check_feeds, check_limit, find_slot, index_limit, missing_input};
pub use prefetch::PREFETCH_DEPTH;
use prefetch::{Prefetch, Queued};

/// What `step.memory()` reports; [`MemoryReport::entries`] names each field as Python sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    pub arena_bytes: usize,
    pub naive_bytes: usize,
    pub param_bytes: usize,
    pub optimizer_state_bytes: usize,
    /// Device memory the backend keeps per program besides the arena (a GPU backend's scratch
    /// and product buffers, e.g. attention scores; 0 on the CPU).
    pub workspace_bytes: usize,
}

impl MemoryReport {
    /// `(key, bytes)` for every field, keyed by the field's name (the keys of `step.memory()`).
    pub fn entries(&self) -> [(&'static str, usize); 5] {
        [
            ("arena_bytes", self.arena_bytes),
            ("naive_bytes", self.naive_bytes),
            ("param_bytes", self.param_bytes),
            ("optimizer_state_bytes", self.optimizer_state_bytes),
            ("workspace_bytes", self.workspace_bytes),
        ]
    }
}

struct Inner {
    compiled: Box<dyn Compiled>,
    /// A data-parallel step's update, compiled apart from `compiled` (which then stops before it).
    update: Option<Box<dyn Compiled>>,
    inputs: Vec<InputSlot>,
    prefetch: Option<Prefetch>,
    /// Batches a parent process had prefetched when this (child) process was forked.
    lost_at_fork: usize,
}

/// A graph compiled for one device. All methods take `&self`; runs are serialised internally.
pub struct Executable {
    backend: Arc<dyn Backend>,
    program: Program,
    arena: Arc<dyn DeviceBuffer>,
    params: Arc<Store>,
    state: Option<Arc<Store>>,
    inner: Mutex<Inner>,
    input_names: Vec<String>,
    outputs: Vec<TRef>,
    memory: MemoryReport,
    /// A data-parallel step's gradients: one `(offset, bytes)` range of the arena.
    grad_region: Option<(usize, usize)>,
}

/// What one [`Executable::run_phase`] call runs. A step without a separate update (every step
/// not compiled for data parallelism) runs only as [`Phase::Step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The whole step: forward, backward and the update.
    Step,
    /// Forward and backward only (feeds as for a step); the gradients wait in the arena.
    Gradients,
    /// The update alone, over the gradients in the arena (no feeds).
    Update,
}

impl Executable {
    /// Compiles `graph` against the weight store `params`. With an optimizer, the graph's outputs
    /// must be `[loss, grad of each param node in graph order]`, and each run ends with the update.
    pub fn new(
        backend: Arc<dyn Backend>,
        graph: &Graph,
        params: Arc<Store>,
        optimizer: Option<OptimizerSetup>,
    ) -> Result<Executable> {
        if params.device() != backend.name() {
            return Err(Error::Device(format!(
                "the weights live on {} but the executable is for {}",
                params.device(),
                backend.name()
            )));
        }
        // A backend that computes integers in int32 gets int64 and bool only at the edges, and
        // elementwise chains become fused instructions (`RLX_FUSION=0` turns this off). Both
        // rewrites keep the inputs, parameters and outputs in order (and the outputs' dtypes),
        // so everything below reads the result like the original.
        let narrowed;
        let graph = if backend.narrows_integers() {
            let name = backend.name();
            let kind = name.split(':').next().unwrap_or_default();
            narrowed = rlx_ir::narrow::narrow_integers(graph, kind)?.0;
            &narrowed
        } else {
            graph
        };
        let fused;
        let graph = if rlx_ir::fuse::enabled() {
            fused = rlx_ir::fuse::fuse(graph);
            &fused
        } else {
            graph
        };
        let distributed = optimizer.as_ref().is_some_and(|o| o.options.distributed);
        let region = if distributed {
            let n = optimizer
                .as_ref()
                .and_then(|o| o.options.trainable.as_ref().map(|t| t.len()))
                .unwrap_or_else(|| graph.params().len());
            1..(1 + n).min(graph.outputs().len())
        } else {
            0..0
        };
        let low = lower_with_region(graph, &params, backend.alignment(), region, |a, b| {
            backend.runs_together(graph, a, b)
        })?;
        let backend_ref = backend.as_ref();
        let mut program = low.program;
        let mut outputs: Vec<TRef> = graph
            .outputs()
            .iter()
            .map(|&o| low.loc[o].clone().expect("outputs are live"))
            .collect();
        let mut arena_bytes = low.arena_bytes;
        if let Some(opt) = &optimizer {
            // The update ends the program; its statistics become the last output.
            let up = crate::train::plan_update(
                graph,
                &low.loc,
                low.arena_bytes,
                &params,
                &outputs,
                opt,
                backend.alignment(),
            )?;
            program.instrs.push(up.instr);
            outputs.push(up.stats);
            arena_bytes = up.arena_bytes;
        }
        let arena = backend_ref.alloc(arena_bytes)?;
        for (offset, bytes) in &low.consts {
            arena.write(*offset, bytes)?;
        }
        let state_len = optimizer.as_ref().map_or(0, |o| o.state.bytes());
        let lens = [arena.len(), params.bytes(), state_len];
        let (compiled, update) = if distributed {
            let (body, update) = split_update(&program);
            (
                backend_ref.compile(&body, &lens)?,
                Some(backend_ref.compile(&update, &lens)?),
            )
        } else {
            (backend_ref.compile(&program, &lens)?, None)
        };
        let mut inputs = Vec::new();
        for (id, name) in graph.inputs() {
            if let Some(at) = low.loc[id].clone() {
                inputs.push(InputSlot {
                    name: name.to_string(),
                    at,
                    bound: false,
                    limit: index_limit(graph, id),
                });
            }
        }
        let memory = MemoryReport {
            arena_bytes, // as allocated: the plan plus the update's tail
            naive_bytes: low.naive_bytes + (arena_bytes - low.arena_bytes), // the tail counts in both
            param_bytes: params.bytes(),
            optimizer_state_bytes: state_len,
            workspace_bytes: compiled.workspace_bytes()
                + update.as_ref().map_or(0, |u| u.workspace_bytes()),
        };
        Ok(Executable {
            backend,
            program,
            arena,
            params,
            state: optimizer.map(|o| o.state),
            input_names: inputs.iter().map(|s| s.name.clone()).collect(),
            inner: Mutex::new(Inner {
                compiled,
                update,
                inputs,
                prefetch: None,
                lost_at_fork: 0,
            }),
            outputs,
            memory,
            grad_region: low.region,
        })
    }

    /// A data-parallel step's gradient region `(offset, bytes)` in the arena: every gradient
    /// output, in order, each aligned (the padding between them stays zero).
    pub fn grad_region(&self) -> Option<(usize, usize)> {
        self.grad_region
    }

    /// The program each run starts with: all of it, or all but the separate update.
    fn body(&self) -> Program {
        if self.grad_region.is_some() {
            split_update(&self.program).0
        } else {
            self.program.clone()
        }
    }

    pub fn memory(&self) -> MemoryReport {
        let mut m = self.memory;
        // The prefetch variants (one program per staging set) keep workspaces of their own.
        if let Some(pf) = &self.lock().prefetch {
            m.workspace_bytes += pf
                .variants
                .iter()
                .map(|v| v.workspace_bytes())
                .sum::<usize>();
        }
        m
    }

    pub fn arena(&self) -> &Arc<dyn DeviceBuffer> {
        &self.arena
    }

    pub fn params(&self) -> &Arc<Store> {
        &self.params
    }

    pub fn state(&self) -> Option<&Arc<Store>> {
        self.state.as_ref()
    }

    pub fn outputs(&self) -> &[TRef] {
        &self.outputs
    }

    /// A readable listing of the lowered program (see [`crate::listing`]).
    pub fn listing(&self) -> String {
        crate::listing::program(
            &self.program,
            &self.input_names,
            &self.outputs,
            &self.memory,
            (&self.params, self.state.as_deref()),
        )
    }

    /// The buffer a tensor reference points into.
    pub fn buffer(&self, buf: Buf) -> Option<&Arc<dyn DeviceBuffer>> {
        match buf {
            Buf::Arena => Some(&self.arena),
            Buf::Params => Some(self.params.buffer()),
            Buf::State => self.state.as_ref().map(|s| s.buffer()),
            Buf::Stage => None,
        }
    }

    fn state_len(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.bytes())
    }

    /// Names of the inputs the graph reads (dead inputs are left out), in declaration order.
    pub fn input_names(&self) -> &[String] {
        &self.input_names
    }

    /// A copy of the input slots (names, places, whether bound).
    pub fn inputs(&self) -> Vec<InputSlot> {
        self.lock().inputs.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copies the feeds into their slots, runs the program (and the optimizer update when there
    /// is one) and reads back the outputs listed in `read`. Every feed is checked before anything
    /// is written, so a bad call changes nothing.
    pub fn run(
        &self,
        feeds: &[(&str, &[u8])],
        hyper: Option<&OptimHyper>,
        read: &[usize],
    ) -> Result<Vec<Vec<u8>>> {
        self.run_phase(feeds, hyper, read, Phase::Step)
    }

    /// [`Executable::run`], or one phase of a data-parallel step (see [`Phase`]).
    pub fn run_phase(
        &self,
        feeds: &[(&str, &[u8])],
        hyper: Option<&OptimHyper>,
        read: &[usize],
        phase: Phase,
    ) -> Result<Vec<Vec<u8>>> {
        // Declared before the locks so that a consumed batch's sources are released after them.
        let consumed: Option<Queued>;
        let mut inner = self.lock();
        inner.forget_parent_prefetch();
        if phase != Phase::Step && inner.update.is_none() {
            return Err(Error::unsupported(
                "run",
                format!("{phase:?} alone: only a data-parallel training step runs in phases"),
            ));
        }
        if phase == Phase::Update && !feeds.is_empty() {
            return Err(Error::input(
                feeds[0].0,
                "the update phase takes no inputs (they belong to the gradients phase)",
            ));
        }
        check_feeds(&inner.inputs, feeds, "")?;
        let queued =
            feeds.is_empty() && inner.prefetch.as_ref().is_some_and(|p| !p.queue.is_empty());
        let missing = missing_input(&inner.inputs, feeds).filter(|_| !queued);
        if let Some(missing) = missing.filter(|_| phase != Phase::Update) {
            let missing = missing.name.clone();
            if feeds.is_empty() && inner.lost_at_fork > 0 {
                let lost = std::mem::take(&mut inner.lost_at_fork);
                return Err(Error::input(
                    &missing,
                    format!(
                        "missing input: the {lost} batch(es) prefetched before fork() belong to \
                         the parent process; prefetch again in this process"
                    ),
                ));
            }
            return Err(Error::input(
                &missing,
                "missing input (neither given, bound, nor prefetched)",
            ));
        }
        if self.state.is_some() && hyper.is_none() {
            return Err(Error::Graph(
                "a training executable needs optimizer hyper-parameters".into(),
            ));
        }
        if let Some(&bad) = read.iter().find(|&&i| i >= self.outputs.len()) {
            return Err(Error::Bounds(format!(
                "output {bad} does not exist ({} outputs)",
                self.outputs.len()
            )));
        }
        let _params = self.params.lock();
        let _state = self.state.as_ref().map(|s| s.lock());
        // Without a separate update, the feeds and the outputs read travel with the run itself
        // (on a GPU: copies in the run's own submission); otherwise around the runs.
        let fold = inner.update.is_none();
        let mut writes = Vec::with_capacity(feeds.len());
        for (name, data) in feeds {
            let slot = find_slot(&inner.inputs, name)?;
            if fold {
                writes.push(HostWrite {
                    buf: Buf::Arena as usize,
                    offset: slot.at.offset,
                    data,
                });
            } else {
                self.arena.write(slot.at.offset, data)?;
            }
        }
        // Where each output read is: a run of a prefetched batch reads its inputs from the
        // staging set, so an output that is an input (or an alias of one) is read there too.
        let out_at: Vec<TRef> = read
            .iter()
            .map(|&i| match inner.prefetch.as_ref().filter(|_| queued) {
                Some(pf) => {
                    let set = pf.queue.front().expect("queued").set;
                    prefetch::staged(&self.outputs[i], &pf.remap, set * pf.set_bytes)
                }
                None => self.outputs[i].clone(),
            })
            .collect();
        let mut outs: Vec<Vec<u8>> = out_at.iter().map(|o| vec![0; o.bytes()]).collect();
        let mut reads: Vec<HostRead<'_>> = Vec::new();
        if fold {
            reads = out_at
                .iter()
                .zip(outs.iter_mut())
                .map(|(o, out)| HostRead {
                    buf: o.buf as usize,
                    offset: o.offset,
                    out,
                })
                .collect();
        }
        let empty;
        let state_buf: &dyn DeviceBuffer = match &self.state {
            Some(s) => s.buffer().as_ref(),
            None => {
                empty = EmptyBuffer;
                &empty
            }
        };
        let mut bufs: Vec<&dyn DeviceBuffer> = vec![
            self.arena.as_ref(),
            self.params.buffer().as_ref(),
            state_buf,
        ];
        let inner = &mut *inner;
        if phase == Phase::Update {
            consumed = None;
        } else if queued {
            let pf = inner.prefetch.as_mut().expect("queued");
            let batch = pf.queue.pop_front().expect("queued");
            let (set, token) = (batch.set, batch.token);
            consumed = Some(batch);
            // Only this batch's copy is waited for (by the device itself where it can: a GPU
            // stream waits on the copy's event); a later prefetch keeps copying meanwhile.
            if let Some(token) = token {
                pf.engine.wait_on_device(token)?;
            }
            bufs.push(pf.stage.as_ref());
            // SAFETY: see below; the run is ordered after the copy into this staging set
            // (waited above, on the host or on the device) and the copy engine only writes the
            // other set.
            #[allow(unsafe_code)]
            unsafe {
                pf.variants[set].run_io(&bufs, hyper, &writes, &mut reads)?
            };
        } else {
            consumed = None;
            // SAFETY: `inner` (this executable's mutex: arena, staging) and the params/state
            // run locks are held, so no other run, write or read of these buffers goes on.
            #[allow(unsafe_code)]
            unsafe {
                inner.compiled.run_io(&bufs, hyper, &writes, &mut reads)?
            };
        }
        if let (Some(update), true) = (inner.update.as_mut(), phase != Phase::Gradients) {
            // SAFETY: as above (the same locks are held); the update reads no staging buffer.
            #[allow(unsafe_code)]
            unsafe {
                update.run(&bufs[..3], hyper)?
            };
        }
        let _ = &consumed;
        drop(reads);
        if !fold {
            for (o, out) in out_at.iter().zip(outs.iter_mut()) {
                bufs[o.buf as usize].read(o.offset, out)?;
            }
        }
        Ok(outs)
    }
}

/// A training program as `(everything before the update, the update alone)`.
fn split_update(program: &Program) -> (Program, Program) {
    let mut body = program.clone();
    let update = match body.instrs.last() {
        Some(Instr::Update(_)) => body.instrs.pop().into_iter().collect(),
        _ => Vec::new(),
    };
    (body, Program { instrs: update })
}

impl Drop for Executable {
    fn drop(&mut self) {
        // Let every issued copy finish before the staging buffer and the source arrays go
        // (in a forked child the parent's copies are not waited for: see `Inner`).
        if let Some(pf) = self.inner.get_mut().ok().and_then(|i| i.prefetch.as_ref()) {
            if pf.pid == std::process::id() {
                let _ = pf.engine.wait_all();
            }
        }
    }
}

/// Stands in for an absent buffer so buffer indices stay fixed.
struct EmptyBuffer;

impl DeviceBuffer for EmptyBuffer {
    fn len(&self) -> usize {
        0
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }
    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("write", offset, data.len(), 0)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("read", offset, out.len(), 0)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
