//! Lowering: a graph plus its memory plan becomes a program of kernel calls on buffer ranges.
use crate::{Buf, Error, Instr, Program, Result, Store, TRef};
use rlx_ir::planner::{plan_graph, Storage};
use rlx_ir::{Graph, NodeId, Op};

/// A lowered graph: the program, where each node lives, and what must be written up front.
pub struct Lowered {
    pub program: Program,
    /// Location of every live node (`None` when dead).
    pub loc: Vec<Option<TRef>>,
    /// Constants to write into the arena once: (offset, bytes).
    pub consts: Vec<(usize, Vec<u8>)>,
    pub arena_bytes: usize,
    pub naive_bytes: usize,
    /// With a contiguous region asked for: its `(offset, bytes)` in the arena.
    pub region: Option<(usize, usize)>,
}

/// Plans and lowers `graph`. Params are looked up in `params`; inputs and constants are pinned.
pub fn lower(graph: &Graph, params: &Store, align: usize) -> Result<Lowered> {
    lower_with_region(graph, params, align, 0..0, |_, _| false)
}

/// [`lower`], with the graph outputs at `region` (indices into `graph.outputs()`) placed one
/// after another (each aligned) in a block of their own after the planned arena: one byte range
/// then covers them all, so a data-parallel step all-reduces its gradients in place with one
/// call. An output is computed straight into its place there; only one that cannot be (a
/// constant, an input, a parameter, or a node two outputs share) is copied in at the end.
/// `together` is the backend's [`crate::Backend::runs_together`] for the planner.
pub fn lower_with_region(
    graph: &Graph,
    params: &Store,
    align: usize,
    region: std::ops::Range<usize>,
    together: impl Fn(NodeId, NodeId) -> bool,
) -> Result<Lowered> {
    graph.verify()?;
    for (id, name) in graph.params() {
        let e = params.entry(name).ok_or_else(|| {
            Error::input(name, "the graph uses a parameter the model does not have")
        })?;
        let n = graph.node(id);
        if e.shape != n.shape || e.dtype != n.dtype {
            return Err(Error::shape(
                name,
                format!(
                    "parameter is {} {} in the model but {} {} in the graph",
                    e.shape, e.dtype, n.shape, n.dtype
                ),
            ));
        }
    }
    // Region outputs: the storage root each is computed into, when that root can move there.
    let mut placed: Vec<(NodeId, usize)> = Vec::new(); // (root, index in region)
    let mut copied: Vec<usize> = Vec::new(); // indices in region filled by a copy
    for (k, &o) in graph.outputs()[region.clone()].iter().enumerate() {
        let mut r = o;
        while graph.node(r).op.is_alias() {
            r = graph.node(r).inputs[0];
        }
        let movable = !matches!(
            graph.node(r).op,
            Op::Param { .. } | Op::Input { .. } | Op::Const { .. }
        );
        if movable && !placed.iter().any(|&(p, _)| p == r) {
            placed.push((r, k));
        } else {
            copied.push(k);
        }
    }
    let storage = |id: NodeId| match graph.node(id).op {
        Op::Param { .. } => Storage::External,
        Op::Input { .. } | Op::Const { .. } => Storage::Pinned,
        _ if placed.iter().any(|&(r, _)| r == id) => Storage::External,
        _ => Storage::Temporary,
    };
    let plan = plan_graph(graph, storage, align, together);
    // The region's slots, in output order, after the planned arena.
    let mut region_at = Vec::with_capacity(region.len());
    let region_start = rlx_ir::planner::align_up(plan.arena_bytes, align);
    let mut cursor = region_start;
    for &o in &graph.outputs()[region.clone()] {
        let n = graph.node(o);
        region_at.push(cursor);
        cursor = rlx_ir::planner::align_up(cursor + n.shape.numel() * n.dtype.size(), align);
    }
    let live = graph.live_mask();
    let mut loc: Vec<Option<TRef>> = vec![None; graph.len()];
    let mut program = Program::default();
    let mut consts = Vec::new();
    for (id, node) in graph.nodes().iter().enumerate() {
        if !live[id] {
            continue;
        }
        let root = plan.root[id];
        let moved = placed.iter().find(|&&(r, _)| r == root);
        let (buf, offset) = match &graph.node(root).op {
            _ if moved.is_some() => (Buf::Arena, region_at[moved.expect("checked").1]),
            Op::Param { name } => (
                Buf::Params,
                params.entry(name).map(|e| e.offset).unwrap_or_default(),
            ),
            _ => (
                Buf::Arena,
                plan.offset[id].expect("live arena node has an offset"),
            ),
        };
        let here = TRef {
            buf,
            offset,
            shape: node.shape.clone(),
            dtype: node.dtype,
        };
        match &node.op {
            Op::Input { .. } | Op::Param { .. } => {}
            Op::Const { data } => {
                if root == id {
                    consts.push((offset, data.iter().flat_map(|b| b.to_le_bytes()).collect()));
                }
            }
            op if op.is_alias() => {}
            op => {
                let ins = node
                    .inputs
                    .iter()
                    .map(|&i| loc[i].clone().expect("inputs are live"))
                    .collect();
                program.instrs.push(Instr::Op {
                    op: op.clone(),
                    ins,
                    out: here.clone(),
                });
            }
        }
        loc[id] = Some(here);
    }
    for k in copied {
        let o = graph.outputs()[region.start + k];
        let from = loc[o].clone().expect("outputs are live");
        let to = TRef {
            buf: Buf::Arena,
            offset: region_at[k],
            ..from.clone()
        };
        program.instrs.push(Instr::Op {
            op: Op::BroadcastTo {
                shape: from.shape.clone(),
            },
            ins: vec![from],
            out: to.clone(),
        });
        loc[o] = Some(to);
    }
    let (arena_bytes, region) = if region.is_empty() {
        (plan.arena_bytes, None)
    } else {
        (cursor, Some((region_start, cursor - region_start)))
    };
    Ok(Lowered {
        program,
        loc,
        consts,
        arena_bytes,
        naive_bytes: plan.naive_bytes + region.map_or(0, |r| r.1),
        region,
    })
}
