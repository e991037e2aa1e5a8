//! A compiled executable: one arena, resident weights and inputs, the whole step as one call.
use crate::backend::check_range;
use crate::lower::lower;
use crate::{
    Backend, Buf, Compiled, CopyDst, CopyEngine, CopySrc, DeviceBuffer, Error, HostBytes, Instr,
    OptimHyper, Program, Result, Store, TRef,
};
use rlx_ir::{planner::align_up, BarrierToken, DType, Graph, Op};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

pub use crate::train::OptimizerSetup;

/// A named input's pinned slot in the arena.
#[derive(Clone, Debug)]
pub struct InputSlot {
    pub name: String,
    pub at: TRef,
    /// Bound once as a resident input: later runs need not supply it.
    pub bound: bool,
    /// For integer class ids / token ids: every value must be in `0..limit`.
    pub limit: Option<(i64, &'static str)>,
}

/// What `step.memory()` reports; [`MemoryReport::entries`] names each field as Python sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    pub arena_bytes: usize,
    pub naive_bytes: usize,
    pub param_bytes: usize,
    pub optimizer_state_bytes: usize,
}

impl MemoryReport {
    /// `(key, bytes)` for every field, keyed by the field's name (the keys of `step.memory()`).
    pub fn entries(&self) -> [(&'static str, usize); 4] {
        [
            ("arena_bytes", self.arena_bytes),
            ("naive_bytes", self.naive_bytes),
            ("param_bytes", self.param_bytes),
            ("optimizer_state_bytes", self.optimizer_state_bytes),
        ]
    }
}

struct Inner {
    compiled: Box<dyn Compiled>,
    inputs: Vec<InputSlot>,
    prefetch: Option<Prefetch>,
    /// Batches a parent process had prefetched when this (child) process was forked.
    lost_at_fork: usize,
}

impl Inner {
    /// After `fork()`, the prefetch state belongs to the parent (its copy thread does not exist
    /// here): it is dropped, and the batches it held are counted so a run can say so.
    fn forget_parent_prefetch(&mut self) {
        if self
            .prefetch
            .as_ref()
            .is_some_and(|p| p.pid != std::process::id())
        {
            let pf = self.prefetch.take().expect("checked");
            self.lost_at_fork += pf.queue.len();
            // The engine's own drop is fork-aware; the staging memory is this process's copy.
            drop(pf);
        }
    }
}

/// Double-buffered prefetch: two input sets in a staging buffer, a program variant reading each,
/// and the queue of batches whose copies were issued.
struct Prefetch {
    /// The process that made it (a forked child must not use its copy engine).
    pid: u32,
    engine: Arc<CopyEngine>,
    stage: Arc<dyn DeviceBuffer>,
    /// Per set: the program reading that set's inputs (bound inputs still come from the arena).
    variants: Vec<Box<dyn Compiled>>,
    /// (input name, byte offset within a set) of every prefetched (unbound) input.
    layout: Vec<(String, usize)>,
    set_bytes: usize,
    queue: VecDeque<Queued>,
}

struct Queued {
    set: usize,
    token: BarrierToken,
    /// The source arrays, kept alive until the batch is consumed.
    _keep: Vec<Arc<dyn HostBytes>>,
}

/// Batches that may wait in the prefetch queue.
pub const PREFETCH_DEPTH: usize = 2;

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
        // Elementwise chains become fused instructions (`RLX_FUSION=0` turns this off). The
        // fused graph keeps the inputs, parameters and outputs in order, so everything below
        // reads it like the original.
        let fused;
        let graph = if rlx_ir::fuse::enabled() {
            fused = rlx_ir::fuse::fuse(graph);
            &fused
        } else {
            graph
        };
        let low = lower(graph, &params, backend.alignment())?;
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
        let compiled = backend_ref.compile(&program, &[arena.len(), params.bytes(), state_len])?;
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
                inputs,
                prefetch: None,
                lost_at_fork: 0,
            }),
            outputs,
            memory,
        })
    }

    pub fn memory(&self) -> MemoryReport {
        self.memory
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

    /// Number of prefetched batches waiting to be consumed.
    pub fn prefetched(&self) -> usize {
        let mut inner = self.lock();
        inner.forget_parent_prefetch();
        inner.prefetch.as_ref().map_or(0, |p| p.queue.len())
    }

    /// Starts copying a batch (every unbound input) into a free staging set and returns at once.
    /// Runs without feeds consume prefetched batches in order. At most [`PREFETCH_DEPTH`] wait.
    pub fn prefetch(&self, feeds: Vec<(String, Arc<dyn HostBytes>)>) -> Result<()> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        inner.forget_parent_prefetch();
        let views: Vec<(&str, &[u8])> =
            feeds.iter().map(|(n, d)| (n.as_str(), d.bytes())).collect();
        check_feeds(&inner.inputs, &views, "prefetch only the per-call inputs")?;
        if let Some(missing) = missing_input(&inner.inputs, &views) {
            return Err(Error::input(
                &missing.name,
                "missing input in prefetch (every per-call input is needed)",
            ));
        }
        if inner
            .prefetch
            .as_ref()
            .is_some_and(|p| p.queue.len() >= PREFETCH_DEPTH)
        {
            return Err(Error::Graph(format!(
                "[prefetch] {PREFETCH_DEPTH} prefetched batches are already waiting; run a step first"
            )));
        }
        if inner.prefetch.is_none() {
            inner.prefetch = Some(self.make_prefetch(&inner.inputs)?);
        }
        let pf = inner.prefetch.as_mut().expect("made above");
        let set = (0..PREFETCH_DEPTH)
            .find(|s| !pf.queue.iter().any(|q| q.set == *s))
            .expect("a set is free");
        let mut token = None;
        let mut keep = Vec::with_capacity(feeds.len());
        for (name, data) in feeds {
            let offset = pf
                .layout
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, o)| *o)
                .expect("unbound input");
            let dst = CopyDst {
                buffer: pf.stage.clone(),
                offset: set * pf.set_bytes + offset,
            };
            let len = data.bytes().len();
            token = Some(pf.engine.issue(CopySrc::Host(data.clone()), dst, len)?);
            keep.push(data);
        }
        // FIFO engine: the last copy's token covers the whole batch.
        let token = match token {
            Some(t) => t,
            None => pf.engine.issue(
                CopySrc::Host(Arc::new(Vec::new())),
                CopyDst {
                    buffer: pf.stage.clone(),
                    offset: 0,
                },
                0,
            )?,
        };
        pf.queue.push_back(Queued {
            set,
            token,
            _keep: keep,
        });
        Ok(())
    }

    /// The staging buffer and the program variants reading it, for the current bound set.
    fn make_prefetch(&self, inputs: &[InputSlot]) -> Result<Prefetch> {
        let align = self.backend.alignment();
        let mut layout = Vec::new();
        let mut remap = Vec::new(); // (arena offset, offset within a set)
        let mut at = 0;
        for s in inputs.iter().filter(|s| !s.bound) {
            layout.push((s.name.clone(), at));
            if s.at.bytes() > 0 {
                remap.push((s.at.offset, at));
            }
            at = align_up(at + s.at.bytes(), align);
        }
        let set_bytes = at;
        let stage = self.backend.alloc(set_bytes * PREFETCH_DEPTH)?;
        let lens = [
            self.arena.len(),
            self.params.bytes(),
            self.state_len(),
            stage.len(),
        ];
        let variants = (0..PREFETCH_DEPTH)
            .map(|set| {
                let program = retarget(&self.program, &remap, set * set_bytes);
                self.backend.compile(&program, &lens)
            })
            .collect::<Result<_>>()?;
        Ok(Prefetch {
            pid: std::process::id(),
            engine: self.backend.copy_engine()?,
            stage,
            variants,
            layout,
            set_bytes,
            queue: VecDeque::new(),
        })
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

    /// Places `data` in the input slot `name` once; later runs may omit it.
    pub fn bind(&self, name: &str, data: &[u8]) -> Result<()> {
        let mut inner = self.lock();
        let slot = find_slot(&inner.inputs, name)?;
        check_feed(slot, data)?;
        if !slot.bound && inner.prefetch.as_ref().is_some_and(|p| !p.queue.is_empty()) {
            return Err(Error::input(
                name,
                "cannot bind an input while prefetched batches wait; run them first",
            ));
        }
        let _params = self.params.lock();
        self.arena.write(slot.at.offset, data)?;
        let slot = inner
            .inputs
            .iter_mut()
            .find(|s| s.name == name)
            .expect("found above");
        if !slot.bound {
            slot.bound = true;
            inner.prefetch = None; // the staging layout depends on which inputs are bound
        }
        Ok(())
    }

    /// Writes `count` rows along `axis` of the input `name`, starting at row `start`, in place.
    pub fn write_rows(&self, name: &str, axis: usize, start: usize, data: &[u8]) -> Result<()> {
        let inner = self.lock();
        let slot = find_slot(&inner.inputs, name)?;
        let dims = slot.at.shape.dims();
        if axis >= dims.len() {
            return Err(Error::shape(
                name,
                format!("axis {axis} is out of range for shape {}", slot.at.shape),
            ));
        }
        let outer: usize = dims[..axis].iter().product();
        let inner_len: usize = dims[axis + 1..].iter().product::<usize>() * slot.at.dtype.size();
        let row_block = inner_len * outer;
        if row_block == 0 || data.len() % row_block != 0 {
            return Err(Error::shape(
                name,
                format!(
                    "rows of {} bytes do not fit whole rows of shape {} along axis {axis}",
                    data.len(),
                    slot.at.shape
                ),
            ));
        }
        let count = data.len() / row_block;
        if start.checked_add(count).is_none_or(|end| end > dims[axis]) {
            return Err(Error::input(
                name,
                format!(
                    "writing {count} rows at {start} overflows axis {axis} of size {} (shape {})",
                    dims[axis], slot.at.shape
                ),
            ));
        }
        check_limit(slot, data)?;
        let _params = self.params.lock();
        let chunk = count * inner_len;
        for o in 0..outer {
            let dst = slot.at.offset + (o * dims[axis] + start) * inner_len;
            check_range(name, dst, chunk, self.arena.len())?;
            self.arena.write(dst, &data[o * chunk..(o + 1) * chunk])?;
        }
        Ok(())
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
        // Declared before the locks so that a consumed batch's sources are released after them.
        let consumed: Option<Queued>;
        let mut inner = self.lock();
        inner.forget_parent_prefetch();
        check_feeds(&inner.inputs, feeds, "")?;
        let queued =
            feeds.is_empty() && inner.prefetch.as_ref().is_some_and(|p| !p.queue.is_empty());
        if let Some(missing) = missing_input(&inner.inputs, feeds).filter(|_| !queued) {
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
        for (name, data) in feeds {
            let slot = find_slot(&inner.inputs, name)?;
            self.arena.write(slot.at.offset, data)?;
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
        if queued {
            let pf = inner.prefetch.as_mut().expect("queued");
            let batch = pf.queue.pop_front().expect("queued");
            let (set, token) = (batch.set, batch.token);
            consumed = Some(batch);
            // Only this batch's copy is waited for; a later prefetch keeps copying meanwhile.
            pf.engine.wait(token)?;
            bufs.push(pf.stage.as_ref());
            // SAFETY: see below; the copy into this staging set has completed (waited above) and
            // the copy engine only writes the other set.
            #[allow(unsafe_code)]
            unsafe {
                pf.variants[set].run(&bufs, hyper)?
            };
        } else {
            consumed = None;
            // SAFETY: `inner` (this executable's mutex: arena, staging) and the params/state
            // run locks are held, so no other run, write or read of these buffers goes on.
            #[allow(unsafe_code)]
            unsafe {
                inner.compiled.run(&bufs, hyper)?
            };
        }
        let _ = &consumed;
        read.iter()
            .map(|&i| {
                let o = &self.outputs[i];
                let mut out = vec![0; o.bytes()];
                bufs[o.buf as usize].read(o.offset, &mut out)?;
                Ok(out)
            })
            .collect()
    }
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

/// The program with every reference to a remapped input slot moved into the staging buffer.
fn retarget(program: &Program, remap: &[(usize, usize)], base: usize) -> Program {
    let fix = |t: &TRef| -> TRef {
        match remap
            .iter()
            .find(|(from, _)| t.buf == Buf::Arena && *from == t.offset)
        {
            Some((_, to)) => TRef {
                buf: Buf::Stage,
                offset: base + to,
                ..t.clone()
            },
            None => t.clone(),
        }
    };
    let instrs = program
        .instrs
        .iter()
        .map(|i| match i {
            Instr::Op { op, ins, out } => Instr::Op {
                op: op.clone(),
                ins: ins.iter().map(fix).collect(),
                out: fix(out),
            },
            other => other.clone(),
        })
        .collect();
    Program { instrs }
}

fn find_slot<'a>(slots: &'a [InputSlot], name: &str) -> Result<&'a InputSlot> {
    slots.iter().find(|s| s.name == name).ok_or_else(|| {
        let known: Vec<&str> = slots.iter().map(|s| s.name.as_str()).collect();
        Error::input(
            name,
            format!("unknown input; this function takes {known:?}"),
        )
    })
}

/// Checks every feed before anything runs: a known name given once, the exact byte size, ids in
/// range. With `bound_refusal` non-empty, feeding a bound (resident) input is an error saying so.
fn check_feeds(slots: &[InputSlot], feeds: &[(&str, &[u8])], bound_refusal: &str) -> Result<()> {
    for (i, (name, data)) in feeds.iter().enumerate() {
        if feeds[..i].iter().any(|(n, _)| n == name) {
            return Err(Error::input(*name, "given twice"));
        }
        let slot = find_slot(slots, name)?;
        if slot.bound && !bound_refusal.is_empty() {
            return Err(Error::input(
                *name,
                format!("is a bound (resident) input; {bound_refusal}"),
            ));
        }
        check_feed(slot, data)?;
    }
    Ok(())
}

/// The first unbound input the feeds do not supply.
fn missing_input<'a>(slots: &'a [InputSlot], feeds: &[(&str, &[u8])]) -> Option<&'a InputSlot> {
    slots
        .iter()
        .find(|s| !s.bound && !feeds.iter().any(|(n, _)| *n == s.name))
}

fn check_feed(slot: &InputSlot, data: &[u8]) -> Result<()> {
    if data.len() != slot.at.bytes() {
        return Err(Error::shape(
            &slot.name,
            format!(
                "expected {} {} ({} bytes), got {} bytes",
                slot.at.shape,
                slot.at.dtype,
                slot.at.bytes(),
                data.len()
            ),
        ));
    }
    check_limit(slot, data)
}

fn check_limit(slot: &InputSlot, data: &[u8]) -> Result<()> {
    let Some((limit, what)) = slot.limit else {
        return Ok(());
    };
    let bad = data
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
        .find(|&v| v < 0 || v >= limit);
    match bad {
        Some(v) => Err(Error::input(
            &slot.name,
            format!("{what} {v} is out of range [0, {limit})"),
        )),
        None => Ok(()),
    }
}

/// If input `id` is used (directly or through reshapes) as class labels or as embedding ids, the
/// exclusive upper bound of its values, checked before any run.
fn index_limit(graph: &Graph, id: usize) -> Option<(i64, &'static str)> {
    if graph.node(id).dtype != DType::I32 {
        return None;
    }
    let mut sources = vec![id];
    let mut limit: Option<(i64, &'static str)> = None;
    let mut tighten = |bound: usize, what: &'static str| {
        let bound = bound as i64;
        if limit.is_none_or(|(l, _)| bound < l) {
            limit = Some((bound, what));
        }
    };
    for (n, node) in graph.nodes().iter().enumerate().skip(id + 1) {
        match &node.op {
            Op::Reshape { .. } if sources.contains(&node.inputs[0]) => sources.push(n),
            Op::SoftmaxCrossEntropy if sources.contains(&node.inputs[1]) => {
                tighten(graph.node(node.inputs[0]).shape.dims()[1], "label")
            }
            Op::Gather if sources.contains(&node.inputs[1]) => {
                tighten(graph.node(node.inputs[0]).shape.dims()[0], "id")
            }
            _ => {}
        }
    }
    limit
}
