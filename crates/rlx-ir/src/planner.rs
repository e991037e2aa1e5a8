//! The memory planner: tensor lifetimes -> byte offsets in one arena.
//!
//! Up to [`EXACT_LIMIT`] buffers are placed offline, size-descending best fit (each buffer goes
//! into the smallest gap between already-placed buffers that are live at the same time): tight,
//! but quadratic. Larger programs (very deep graphs) are placed by simulating a best-fit heap in
//! program order — O(n log n) — after packing the pinned buffers together at the bottom.
use crate::{Graph, NodeId, Op};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

/// One buffer to place: its size in bytes and the first and last program step it is live (inclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub size: usize,
    pub start: usize,
    pub end: usize,
}

impl Interval {
    /// Live from before the first step to after the last: never shares space.
    pub fn pinned(size: usize) -> Interval {
        Interval {
            size,
            start: 0,
            end: usize::MAX,
        }
    }
    fn overlaps_in_time(&self, o: &Interval) -> bool {
        self.start <= o.end && o.start <= self.end
    }
}

/// Where each buffer lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub offsets: Vec<usize>,
    /// Bytes the arena needs.
    pub arena_bytes: usize,
    /// Bytes with no reuse at all: every buffer's aligned size summed.
    pub naive_bytes: usize,
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn align_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

/// Plans of at most this many buffers use the offline best fit; larger ones the heap simulation.
pub const EXACT_LIMIT: usize = 4096;

/// Gives every interval an `align`-aligned offset such that buffers live at the same time never
/// overlap (see the module comment for the two strategies).
pub fn plan(items: &[Interval], align: usize) -> Plan {
    if items.len() <= EXACT_LIMIT {
        plan_best_fit(items, align)
    } else {
        plan_streaming(items, align)
    }
}

/// Largest first; each goes into the smallest gap between time-overlapping buffers already
/// placed that fits it, else above them. Quadratic in the number of buffers.
pub fn plan_best_fit(items: &[Interval], align: usize) -> Plan {
    assert!(align.is_power_of_two(), "alignment must be a power of two");
    let sizes: Vec<usize> = items.iter().map(|i| align_up(i.size, align)).collect();
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| {
        sizes[b]
            .cmp(&sizes[a])
            .then(items[a].start.cmp(&items[b].start))
    });
    let mut offsets = vec![0; items.len()];
    let mut placed: Vec<usize> = Vec::with_capacity(items.len());
    let mut arena = 0;
    for &i in &order {
        let size = sizes[i];
        if size == 0 {
            continue;
        }
        let mut conflicts: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&p| items[p].overlaps_in_time(&items[i]))
            .map(|&p| (offsets[p], offsets[p] + sizes[p]))
            .collect();
        conflicts.sort_unstable();
        let mut cursor = 0;
        let mut best: Option<(usize, usize)> = None; // (gap, offset)
        for (lo, hi) in conflicts {
            if lo >= cursor + size {
                let gap = lo - cursor;
                if best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(hi);
        }
        offsets[i] = best.map_or(cursor, |(_, o)| o);
        arena = arena.max(offsets[i] + size);
        placed.push(i);
    }
    Plan {
        offsets,
        arena_bytes: arena,
        naive_bytes: sizes.iter().sum(),
    }
}

/// Pinned buffers packed from offset 0, then the others placed in program order (by start) by a
/// best-fit heap: a buffer is freed after its last step, free neighbours merge, and a request
/// takes the smallest free block that fits, else grows the arena. O(n log n).
pub fn plan_streaming(items: &[Interval], align: usize) -> Plan {
    assert!(align.is_power_of_two(), "alignment must be a power of two");
    let sizes: Vec<usize> = items.iter().map(|i| align_up(i.size, align)).collect();
    let mut offsets = vec![0; items.len()];
    let mut top = 0;
    let mut order = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        if sizes[i] == 0 {
            continue;
        }
        if it.start == 0 && it.end == usize::MAX {
            offsets[i] = top;
            top += sizes[i];
        } else {
            order.push(i);
        }
    }
    order.sort_by_key(|&i| (items[i].start, i));
    let mut heap = FreeBlocks::new(top);
    // Live buffers by end step, earliest first (a max-heap of reversed keys).
    let mut live: BinaryHeap<std::cmp::Reverse<(usize, usize)>> = BinaryHeap::new();
    for i in order {
        while let Some(&std::cmp::Reverse((end, j))) = live.peek() {
            if end >= items[i].start {
                break;
            }
            live.pop();
            heap.free(offsets[j], sizes[j]);
        }
        offsets[i] = heap.take(sizes[i]);
        live.push(std::cmp::Reverse((items[i].end, i)));
    }
    Plan {
        offsets,
        arena_bytes: heap.top,
        naive_bytes: sizes.iter().sum(),
    }
}

/// The free blocks of a growing arena, found by offset (to merge neighbours) and by size.
struct FreeBlocks {
    by_offset: BTreeMap<usize, usize>,
    by_size: BTreeSet<(usize, usize)>,
    /// Everything from `base` up to `top` is either free or taken.
    base: usize,
    top: usize,
}

impl FreeBlocks {
    fn new(base: usize) -> FreeBlocks {
        FreeBlocks {
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            base,
            top: base,
        }
    }

    fn remove(&mut self, offset: usize, size: usize) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(size, offset));
    }

    fn insert(&mut self, offset: usize, size: usize) {
        self.by_offset.insert(offset, size);
        self.by_size.insert((size, offset));
    }

    /// The smallest free block that fits (lowest offset among equals), else the arena grows
    /// (from a free block touching the top, if there is one).
    fn take(&mut self, size: usize) -> usize {
        if let Some(&(have, at)) = self.by_size.range((size, 0)..).next() {
            self.remove(at, have);
            if have > size {
                self.insert(at + size, have - size);
            }
            return at;
        }
        let at = match self.by_offset.iter().next_back() {
            Some((&o, &s)) if o + s == self.top => {
                self.remove(o, s);
                o
            }
            _ => self.top,
        };
        self.top = at + size;
        at
    }

    fn free(&mut self, mut offset: usize, mut size: usize) {
        debug_assert!(offset >= self.base && offset + size <= self.top);
        if let Some((&o, &s)) = self.by_offset.range(..offset).next_back() {
            if o + s == offset {
                self.remove(o, s);
                offset = o;
                size += s;
            }
        }
        if let Some(&s) = self.by_offset.get(&(offset + size)) {
            self.remove(offset + size, s);
            size += s;
        }
        self.insert(offset, size);
    }
}

/// How a node's storage is provided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    /// Planned in the arena by lifetime.
    Temporary,
    /// In the arena for the executable's whole life (inputs, constants).
    Pinned,
    /// Outside the arena (parameters in the weight store).
    External,
}

/// The arena layout of a whole graph.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphPlan {
    /// The node whose storage each node uses (itself, or the source of an alias chain).
    pub root: Vec<NodeId>,
    /// Arena byte offset of each live node's root; `None` for dead or external storage.
    pub offset: Vec<Option<usize>>,
    pub arena_bytes: usize,
    pub naive_bytes: usize,
}

/// Plans the arena for the live nodes of `graph`, run in node order. Alias ops (reshape) share
/// their source's storage, which then stays live for the alias's uses too. Graph outputs stay
/// live to the end of the program.
///
/// `together(a, b)` says whether the backend may run node `b` at the same time as node `a`, the
/// computing node just before it, where `b` does not read `a` (two independent products side
/// by side on two cores): `a`'s inputs then stay live through `b`, so `b`'s output is never
/// placed over them. Pairs are taken greedily in program order (the second of a pair is not
/// asked about the node after it). `|_, _| false` plans strictly one node after another.
pub fn plan_graph(
    graph: &Graph,
    storage: impl Fn(NodeId) -> Storage,
    align: usize,
    together: impl Fn(NodeId, NodeId) -> bool,
) -> GraphPlan {
    let n = graph.len();
    let live = graph.live_mask();
    let mut root: Vec<NodeId> = (0..n).collect();
    // Identical constants (each Python scalar becomes one) share one slot.
    let mut consts: HashMap<(crate::DType, &[usize], &[u32]), NodeId> = HashMap::new();
    for (id, node) in graph.nodes().iter().enumerate() {
        if node.op.is_alias() {
            root[id] = root[node.inputs[0]];
        } else if let Op::Const { data } = &node.op {
            if live[id] {
                let key = (node.dtype, node.shape.dims(), data.as_slice());
                root[id] = *consts.entry(key).or_insert(id);
            }
        }
    }
    let mut last_use: Vec<usize> = (0..n).collect();
    for (id, node) in graph.nodes().iter().enumerate() {
        if live[id] {
            for &i in &node.inputs {
                let r = root[i];
                last_use[r] = last_use[r].max(id);
            }
        }
    }
    // Pairs the backend runs at once: the first's inputs live until the second is done.
    let computes = |id: NodeId| {
        let op = &graph.node(id).op;
        live[id]
            && !op.is_alias()
            && !matches!(op, Op::Input { .. } | Op::Param { .. } | Op::Const { .. })
    };
    let mut prev: Option<NodeId> = None;
    for id in (0..n).filter(|&id| computes(id)) {
        if let Some(a) = prev {
            let reads_a = graph.node(id).inputs.iter().any(|&i| root[i] == root[a]);
            if !reads_a && together(a, id) {
                for &i in &graph.node(a).inputs {
                    let r = root[i];
                    last_use[r] = last_use[r].max(id);
                }
                // As a schedule pairs greedily: the second of a pair starts no other.
                prev = None;
                continue;
            }
        }
        prev = Some(id);
    }
    for &o in graph.outputs() {
        last_use[root[o]] = usize::MAX;
    }
    let mut items = Vec::new();
    let mut owners = Vec::new();
    for id in 0..n {
        if !live[id] || root[id] != id || storage(id) == Storage::External {
            continue;
        }
        let node = graph.node(id);
        let size = node.shape.numel() * node.dtype.size();
        items.push(match storage(id) {
            Storage::Pinned => Interval::pinned(size),
            _ => Interval {
                size,
                start: id,
                end: last_use[id],
            },
        });
        owners.push(id);
    }
    let p = plan(&items, align);
    let mut offset = vec![None; n];
    for (k, &id) in owners.iter().enumerate() {
        offset[id] = Some(p.offsets[k]);
    }
    for id in 0..n {
        if live[id] && root[id] != id {
            offset[id] = offset[root[id]];
        }
    }
    GraphPlan {
        root,
        offset,
        arena_bytes: p.arena_bytes,
        naive_bytes: p.naive_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, DType, Op, Shape, UnaryOp};
    use proptest::prelude::*;

    fn check_no_overlap(items: &[Interval], p: &Plan, align: usize) {
        for i in 0..items.len() {
            assert_eq!(p.offsets[i] % align, 0);
            for j in i + 1..items.len() {
                let (a, b) = (&items[i], &items[j]);
                if a.size == 0 || b.size == 0 || !a.overlaps_in_time(b) {
                    continue;
                }
                let (ao, bo) = (p.offsets[i], p.offsets[j]);
                assert!(
                    ao + a.size <= bo || bo + b.size <= ao,
                    "{i} {a:?}@{ao} overlaps {j} {b:?}@{bo}"
                );
            }
            assert!(p.offsets[i] + items[i].size <= p.arena_bytes || items[i].size == 0);
        }
        assert!(p.arena_bytes <= p.naive_bytes);
    }

    proptest! {
        #[test]
        fn intervals_never_overlap(raw in prop::collection::vec((0usize..5000, 0usize..60, 0usize..30, any::<bool>()), 0..80),
                                   align_pow in 6u32..9) {
            let align = 1usize << align_pow;
            let items: Vec<Interval> = raw.iter().map(|&(size, start, len, pin)| {
                if pin { Interval::pinned(size) } else { Interval { size, start, end: start + len } }
            }).collect();
            let p = plan(&items, align);
            check_no_overlap(&items, &p, align);
            let p = plan_streaming(&items, align);
            check_no_overlap(&items, &p, align);
        }

        /// Random graphs of unary/binary/reshape ops: simultaneously-live tensors never overlap.
        #[test]
        fn random_graphs_never_overlap(ops in prop::collection::vec((0u8..4, any::<prop::sample::Index>(), any::<prop::sample::Index>()), 1..60),
                                      n_out in 1usize..4) {
            let mut g = Graph::new();
            let shape = Shape::new([4, 6]);
            let mut ids = vec![g.input("x", shape.clone(), DType::F32).unwrap(),
                               g.param("w", shape.clone(), DType::F32).unwrap()];
            for (kind, a, b) in ops {
                let (a, b) = (ids[a.index(ids.len())], ids[b.index(ids.len())]);
                let id = match kind {
                    0 => g.add(Op::Unary(UnaryOp::Tanh), &[a]),
                    1 => g.add(Op::Binary(BinaryOp::Mul), &[a, b]),
                    2 => {
                        let s = if g.node(a).shape == shape { Shape::new([24]) } else { shape.clone() };
                        g.add(Op::Reshape { shape: s }, &[a])
                    }
                    _ => g.add(Op::Binary(BinaryOp::Add), &[a, b]),
                };
                // Shapes may differ after a reshape; a failed add is simply skipped.
                if let Ok(id) = id { ids.push(id); }
            }
            let outs: Vec<NodeId> = ids.iter().rev().take(n_out).copied().collect();
            g.set_outputs(outs.clone()).unwrap();
            let storage = |id: NodeId| match g.node(id).op {
                Op::Param { .. } => Storage::External,
                Op::Input { .. } => Storage::Pinned,
                _ => Storage::Temporary,
            };
            let gp = plan_graph(&g, storage, 64, |_, _| false);
            assert!(gp.arena_bytes <= gp.naive_bytes);
            // Replay the schedule: at each step, every live root's bytes are disjoint.
            let live = g.live_mask();
            let n = g.len();
            let mut last = vec![0usize; n];
            for (id, node) in g.nodes().iter().enumerate() {
                if live[id] { for &i in &node.inputs { last[gp.root[i]] = last[gp.root[i]].max(id); } }
            }
            for &o in &outs { last[gp.root[o]] = usize::MAX; }
            for step in 0..n {
                let mut spans: Vec<(usize, usize, usize)> = Vec::new();
                for id in 0..n {
                    let pinned = storage(id) == Storage::Pinned;
                    if !live[id] || gp.root[id] != id || storage(id) == Storage::External { continue; }
                    if pinned || (id <= step && step <= last[id]) {
                        let off = gp.offset[id].unwrap();
                        spans.push((off, off + g.node(id).shape.numel() * g.node(id).dtype.size(), id));
                    }
                }
                spans.sort();
                for w in spans.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "step {step}: {:?} overlaps {:?}", w[0], w[1]);
                }
            }
        }
    }

    #[test]
    fn dead_buffers_are_reused() {
        // A chain: each buffer dies when the next is made, so two slots suffice.
        let items: Vec<Interval> = (0..10)
            .map(|i| Interval {
                size: 100,
                start: i,
                end: i + 1,
            })
            .collect();
        for p in [plan(&items, 64), plan_streaming(&items, 64)] {
            check_no_overlap(&items, &p, 64);
            assert_eq!(p.arena_bytes, 2 * 128);
            assert_eq!(p.naive_bytes, 10 * 128);
        }
    }

    #[test]
    fn deep_programs_plan_in_near_linear_time_and_reuse_memory() {
        // 200k buffers: a chain of short-lived temporaries, long-lived "activations" freed in
        // reverse order (as a backward pass does), and pinned constants.
        let n = 200_000;
        let mut items = Vec::with_capacity(n);
        for i in 0..n / 2 {
            items.push(Interval {
                size: 256,
                start: i,
                end: i + 1,
            });
        }
        for i in 0..n / 4 {
            items.push(Interval {
                size: 64,
                start: i,
                end: n - i,
            });
        }
        for _ in 0..n / 4 {
            items.push(Interval::pinned(4));
        }
        let t = std::time::Instant::now();
        let p = plan(&items, 64);
        // A quadratic planner needs minutes here; the streaming one well under a second.
        assert!(
            t.elapsed().as_secs() < 20,
            "planning took {:?}",
            t.elapsed()
        );
        assert!(
            p.arena_bytes <= (n / 4) * 64 * 2 + 2 * 256 + 64,
            "arena {}",
            p.arena_bytes
        );
        // Sweep over time: the spans live at once are kept by offset; each new one must not
        // touch its neighbours there.
        let mut events: Vec<(usize, bool, usize)> = Vec::new(); // (time, is_start, item)
        for (i, it) in items.iter().enumerate() {
            events.push((it.start, true, i));
            if it.end != usize::MAX {
                events.push((it.end + 1, false, i));
            }
        }
        events.sort();
        let mut open: BTreeMap<usize, (usize, usize)> = BTreeMap::new(); // offset -> (end, item)
        for (_, start, i) in events {
            let (lo, hi) = (p.offsets[i], p.offsets[i] + align_up(items[i].size, 64));
            if !start {
                open.remove(&lo);
                continue;
            }
            if let Some((_, &(end, j))) = open.range(..=lo).next_back() {
                assert!(end <= lo, "{i} at {lo} overlaps {j}");
            }
            if let Some((&o, &(_, j))) = open.range(lo..).next() {
                assert!(hi <= o, "{i} at {lo}..{hi} overlaps {j} at {o}");
            }
            open.insert(lo, (hi, i));
        }
    }

    /// Two independent products the backend runs at once: the second's output is never placed
    /// over what the first reads, though the first's inputs die with it in program order.
    #[test]
    fn products_run_together_keep_the_first_ones_inputs() {
        let mut g = Graph::new();
        let s = Shape::new([64, 64]);
        let x = g.input("x", s.clone(), DType::F32).unwrap();
        let w = g.input("w", s.clone(), DType::F32).unwrap();
        let y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
        let z = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: false,
        };
        let a = g.add(mm.clone(), &[y, w]).unwrap();
        let b = g.add(mm, &[z, w]).unwrap();
        let c = g.add(Op::Binary(BinaryOp::Add), &[a, b]).unwrap();
        g.set_outputs(vec![c]).unwrap();
        let storage = |id: NodeId| match g.node(id).op {
            Op::Input { .. } => Storage::Pinned,
            _ => Storage::Temporary,
        };
        let at = |gp: &GraphPlan, id: NodeId| gp.offset[id].unwrap();
        // One after another, b's output takes the place of y (dead after a).
        let apart = plan_graph(&g, storage, 64, |_, _| false);
        assert_eq!(at(&apart, b), at(&apart, y));
        let both = plan_graph(&g, storage, 64, |p, q| (p, q) == (a, b));
        let bytes = 64 * 64 * 4;
        for t in [y, w, a] {
            let (lo, hi) = (at(&both, t), at(&both, t) + bytes);
            assert!(
                at(&both, b) + bytes <= lo || hi <= at(&both, b),
                "{t} overlaps b"
            );
        }
        // A second product that reads the first is never extended over it.
        let mut g2 = Graph::new();
        let x2 = g2.input("x", s.clone(), DType::F32).unwrap();
        let y2 = g2.add(Op::Unary(UnaryOp::Tanh), &[x2]).unwrap();
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: false,
        };
        let a2 = g2.add(mm.clone(), &[y2, x2]).unwrap();
        let b2 = g2.add(mm, &[a2, x2]).unwrap();
        g2.set_outputs(vec![b2]).unwrap();
        let storage2 = |id: NodeId| match g2.node(id).op {
            Op::Input { .. } => Storage::Pinned,
            _ => Storage::Temporary,
        };
        let chained = plan_graph(&g2, storage2, 64, |_, _| true);
        assert_eq!(chained.offset[b2], chained.offset[y2]);
    }

    #[test]
    fn identical_constants_share_a_slot() {
        let mut g = Graph::new();
        let x = g.input("x", Shape::new([4]), DType::F32).unwrap();
        let c1 = g.constant_f32(&[1.5; 4], Shape::new([4])).unwrap();
        let c2 = g.constant_f32(&[1.5; 4], Shape::new([4])).unwrap();
        let c3 = g.constant_f32(&[2.5; 4], Shape::new([4])).unwrap();
        let a = g.add(Op::Binary(BinaryOp::Mul), &[x, c1]).unwrap();
        let b = g.add(Op::Binary(BinaryOp::Add), &[a, c2]).unwrap();
        let c = g.add(Op::Binary(BinaryOp::Add), &[b, c3]).unwrap();
        g.set_outputs(vec![c]).unwrap();
        let storage = |id: NodeId| match g.node(id).op {
            Op::Input { .. } | Op::Const { .. } => Storage::Pinned,
            _ => Storage::Temporary,
        };
        let gp = plan_graph(&g, storage, 64, |_, _| false);
        assert_eq!(gp.root[c2], c1);
        assert_eq!(gp.offset[c1], gp.offset[c2]);
        assert_ne!(gp.offset[c1], gp.offset[c3]);
    }
}
