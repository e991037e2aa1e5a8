//! Prefetch: the next batches copied into a staging buffer while the current step runs.
use super::{check_feeds, missing_input, Executable, Inner, InputSlot};
use crate::{
    Buf, Compiled, CopyDst, CopyEngine, CopySrc, DeviceBuffer, Error, HostBytes, Instr, Program,
    Result, TRef,
};
use rlx_ir::{planner::align_up, BarrierToken};
use std::collections::VecDeque;
use std::sync::Arc;

/// Double-buffered prefetch: two input sets in a staging buffer, a program variant reading each,
/// and the queue of batches whose copies were issued.
pub(super) struct Prefetch {
    /// The process that made it (a forked child must not use its copy engine).
    pub(super) pid: u32,
    pub(super) engine: Arc<CopyEngine>,
    pub(super) stage: Arc<dyn DeviceBuffer>,
    /// Per set: the program reading that set's inputs (bound inputs still come from the arena).
    pub(super) variants: Vec<Box<dyn Compiled>>,
    /// (input name, byte offset within a set) of every prefetched (unbound) input.
    pub(super) layout: Vec<(String, usize)>,
    /// (arena offset, offset within a set) of every prefetched input that has bytes.
    pub(super) remap: Vec<(usize, usize)>,
    pub(super) set_bytes: usize,
    pub(super) queue: VecDeque<Queued>,
}

pub(super) struct Queued {
    pub(super) set: usize,
    /// The copy engine's token for the batch's last copy (none: written into staging directly).
    pub(super) token: Option<BarrierToken>,
}

/// Batches that may wait in the prefetch queue.
pub const PREFETCH_DEPTH: usize = 2;

impl Inner {
    /// After `fork()`, the prefetch state belongs to the parent (its copy thread does not exist
    /// here): it is dropped, and the batches it held are counted so a run can say so.
    pub(super) fn forget_parent_prefetch(&mut self) {
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

impl Executable {
    /// Number of prefetched batches waiting to be consumed.
    pub fn prefetched(&self) -> usize {
        let mut inner = self.lock();
        inner.forget_parent_prefetch();
        inner.prefetch.as_ref().map_or(0, |p| p.queue.len())
    }

    /// Takes a batch (every unbound input) for a later run without feeds and returns without
    /// running anything. The batch is a snapshot: the caller may change or reuse its arrays as
    /// soon as this returns. Where the staging buffer is host-visible (CPU, unified memory) the
    /// snapshot is the copy into a free staging set, made here; elsewhere the bytes are copied
    /// once on the host and the copy to the device runs on the copy engine, off this thread.
    /// Runs without feeds consume prefetched batches in order. At most [`PREFETCH_DEPTH`] wait.
    pub fn prefetch(&self, feeds: &[(&str, &[u8])]) -> Result<()> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        inner.forget_parent_prefetch();
        check_feeds(&inner.inputs, feeds, "prefetch only the per-call inputs")?;
        if let Some(missing) = missing_input(&inner.inputs, feeds) {
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
        let host_visible = pf.stage.host_ptr().is_some();
        let mut token = None;
        for (name, data) in feeds {
            let offset = pf
                .layout
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, o)| *o)
                .expect("unbound input");
            let at = set * pf.set_bytes + offset;
            if host_visible {
                // No run reads this set (it is not queued) and `inner` is locked.
                pf.stage.write(at, data)?;
            } else {
                let snapshot: Arc<dyn HostBytes> = Arc::new(data.to_vec());
                let dst = CopyDst {
                    buffer: pf.stage.clone(),
                    offset: at,
                };
                token = Some(pf.engine.issue(CopySrc::Host(snapshot), dst, data.len())?);
            }
        }
        // FIFO engine: the last copy's token covers the whole batch.
        pf.queue.push_back(Queued { set, token });
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
                let program = retarget(&self.body(), &remap, set * set_bytes);
                self.backend.compile(&program, &lens)
            })
            .collect::<Result<_>>()?;
        Ok(Prefetch {
            pid: std::process::id(),
            engine: self.backend.copy_engine()?,
            stage,
            variants,
            layout,
            remap,
            set_bytes,
            queue: VecDeque::new(),
        })
    }
}

/// The program with every reference to a remapped input slot moved into the staging buffer.
pub(super) fn retarget(program: &Program, remap: &[(usize, usize)], base: usize) -> Program {
    let fix = |t: &TRef| staged(t, remap, base);
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

/// Where a program variant reading the staging set at `base` finds `t`: in the set when `t` is
/// a prefetched input (or an alias of one, at its offset), else where it was.
pub(super) fn staged(t: &TRef, remap: &[(usize, usize)], base: usize) -> TRef {
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
}
