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
}

/// Plans and lowers `graph`. Params are looked up in `params`; inputs and constants are pinned.
pub fn lower(graph: &Graph, params: &Store, align: usize) -> Result<Lowered> {
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
    let storage = |id: NodeId| match graph.node(id).op {
        Op::Param { .. } => Storage::External,
        Op::Input { .. } | Op::Const { .. } => Storage::Pinned,
        _ => Storage::Temporary,
    };
    let plan = plan_graph(graph, storage, align);
    let live = graph.live_mask();
    let mut loc: Vec<Option<TRef>> = vec![None; graph.len()];
    let mut program = Program::default();
    let mut consts = Vec::new();
    for (id, node) in graph.nodes().iter().enumerate() {
        if !live[id] {
            continue;
        }
        let root = plan.root[id];
        let (buf, offset) = match &graph.node(root).op {
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
    Ok(Lowered {
        program,
        loc,
        consts,
        arena_bytes: plan.arena_bytes,
        naive_bytes: plan.naive_bytes,
    })
}
