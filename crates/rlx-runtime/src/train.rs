//! The training update of an executable: which parameters it trains, the optimizer options
//! (clipping, accumulation, skipping non-finite steps) and the `Update` instruction that ends a
//! training program.
use crate::{Buf, Error, Instr, OptimRule, Result, Store, TRef, UpdateParam, UpdatePlan};
use rlx_ir::planner::align_up;
use rlx_ir::{DType, Graph, Shape};
use std::sync::Arc;

/// Options of a training step, fixed at compile time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainOptions {
    /// Scale gradients so their global L2 norm is at most this (PyTorch's `clip_grad_norm_`).
    pub clip: Option<f64>,
    /// Update on every k-th run with the mean of the k gradients (0 and 1: every run).
    pub accumulate: u32,
    /// A run whose loss or gradient norm is not finite changes nothing.
    pub skip_nonfinite: bool,
    /// Names of the parameters the graph's gradient outputs belong to, in order; `None`: every
    /// parameter of the graph in graph order.
    pub trainable: Option<Vec<String>>,
    /// `(graph output index, weight-store name)`: after each run that is not skipped, the
    /// named buffer takes that output's value.
    pub buffer_updates: Vec<(usize, String)>,
    /// Data parallel: the gradients get one contiguous arena region
    /// ([`crate::Executable::grad_region`]) and the update may run as a phase of its own
    /// ([`crate::executable::Phase`]), so a communicator can average the region between them.
    pub distributed: bool,
}

/// The optimizer of a training executable: its rule, its state store and the step options.
pub struct OptimizerSetup {
    pub rule: OptimRule,
    pub state: Arc<Store>,
    pub options: TrainOptions,
}

impl OptimizerSetup {
    pub fn new(rule: OptimRule, state: Arc<Store>) -> OptimizerSetup {
        OptimizerSetup {
            rule,
            state,
            options: TrainOptions::default(),
        }
    }

    /// From the front end's description: a rule name (`"adam"`), or a JSON object
    /// `{"rule": "adam", "clip": 1.0, "accumulate": 4, "skip_nonfinite": true,
    /// "trainable": ["fc.weight", ...]}`.
    pub fn parse(spec: &str, state: Arc<Store>) -> Result<OptimizerSetup> {
        if !spec.trim_start().starts_with('{') {
            return Ok(OptimizerSetup::new(OptimRule::parse(spec)?, state));
        }
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Spec {
            rule: String,
            clip: Option<f64>,
            #[serde(default)]
            accumulate: u32,
            #[serde(default)]
            skip_nonfinite: bool,
            trainable: Option<Vec<String>>,
            #[serde(default)]
            buffer_updates: Vec<(usize, String)>,
            #[serde(default)]
            distributed: bool,
        }
        let s: Spec = serde_json::from_str(spec)
            .map_err(|e| Error::Graph(format!("bad optimizer description: {e}")))?;
        if let Some(c) = s.clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::input(
                    "clip_grad_norm",
                    format!("must be a positive finite number, got {c}"),
                ));
            }
        }
        Ok(OptimizerSetup {
            rule: OptimRule::parse(&s.rule)?,
            state,
            options: TrainOptions {
                clip: s.clip,
                accumulate: s.accumulate,
                skip_nonfinite: s.skip_nonfinite,
                trainable: s.trainable,
                buffer_updates: s.buffer_updates,
                distributed: s.distributed,
            },
        })
    }
}

/// What [`plan_update`] adds to an executable.
pub struct PlannedUpdate {
    pub instr: Instr,
    /// The statistics tensor ([`crate::stat`]), appended to the executable's outputs.
    pub stats: TRef,
    /// Arena bytes needed in all, tail included.
    pub arena_bytes: usize,
}

/// Plans the update of a training graph whose outputs are `[loss, gradients of the trainable
/// parameters..., anything else]`, lowered with node locations `loc`. The statistics and
/// accumulation buffers go into a tail of the arena after `arena_bytes`. Parameters the loss does not depend on are not updated
/// at all (no decay, no step), as PyTorch skips parameters without a gradient.
pub fn plan_update(
    graph: &Graph,
    loc: &[Option<TRef>],
    arena_bytes: usize,
    params: &Store,
    outputs: &[TRef],
    opt: &OptimizerSetup,
    align: usize,
) -> Result<PlannedUpdate> {
    let graph_params = graph.params();
    let names: Vec<String> = match &opt.options.trainable {
        Some(t) => t.clone(),
        None => graph_params.iter().map(|(_, n)| n.to_string()).collect(),
    };
    if outputs.len() < names.len() + 1 {
        return Err(Error::Graph(format!(
            "a training graph needs outputs [loss, one gradient per trained parameter]: {} outputs for {} parameters",
            outputs.len(),
            names.len()
        )));
    }
    let loss_id = graph.outputs()[0];
    let used = ancestors(graph, loss_id);
    let mut tail = align_up(arena_bytes, align);
    let mut take = |shape: Shape, dtype: DType| {
        let t = TRef {
            buf: Buf::Arena,
            offset: tail,
            shape,
            dtype,
        };
        tail = align_up(tail + t.bytes(), align);
        t
    };
    let stats = take(Shape::new([crate::stat::LEN]), DType::F32);
    let hyper = opt.state.entry("hyper").map(|e| TRef {
        buf: Buf::State,
        offset: e.offset,
        shape: e.shape.clone(),
        dtype: e.dtype,
    });
    let rows = hyper.as_ref().map_or(usize::MAX, |h| h.shape.dims()[0]);
    let accumulate = opt.options.accumulate.max(1);
    let mut plan_params = Vec::new();
    for (name, grad) in names.iter().zip(&outputs[1..]) {
        let Some(&(id, _)) = graph_params.iter().find(|(_, n)| *n == name.as_str()) else {
            return Err(Error::input(name, "trained parameter not in the graph"));
        };
        if !used[id] {
            continue;
        }
        let param = loc[id].clone().unwrap_or_else(|| {
            let e = params.entry(name).expect("checked by lower");
            TRef {
                buf: Buf::Params,
                offset: e.offset,
                shape: e.shape.clone(),
                dtype: e.dtype,
            }
        });
        if grad.shape != param.shape {
            return Err(Error::shape(
                name,
                format!(
                    "gradient {} does not match parameter {}",
                    grad.shape, param.shape
                ),
            ));
        }
        if grad.dtype != param.dtype || !param.dtype.is_trainable() {
            return Err(Error::input(
                name,
                format!(
                    "a {} parameter with a {} gradient cannot be trained (float32 and float64 weights are, \
                     with gradients of their dtype)",
                    param.dtype, grad.dtype
                ),
            ));
        }
        // The hyper table has one row per trainable tensor (those with optimizer state).
        let row = params
            .entries()
            .iter()
            .filter(|e| e.dtype.is_trainable())
            .position(|e| e.name == *name)
            .ok_or_else(|| Error::input(name, "not in the weight store"))?;
        if row >= rows {
            return Err(Error::Graph(format!(
                "optimizer hyper table has {rows} rows; parameter '{name}' is number {row}"
            )));
        }
        let state = opt
            .rule
            .slots()
            .iter()
            .map(|s| state_ref(&opt.state, &format!("{name}.{s}")))
            .collect::<Result<_>>()?;
        let started = match opt.rule {
            OptimRule::Sgd => Some(state_ref(&opt.state, &format!("{name}.started"))?),
            _ => None,
        };
        let acc = (accumulate > 1).then(|| take(param.shape.clone(), param.dtype));
        plan_params.push(UpdateParam {
            param,
            grad: grad.clone(),
            acc,
            state,
            step: state_ref(&opt.state, &format!("{name}.step"))?,
            started,
            row,
        });
    }
    let mut buffer_updates = Vec::new();
    for (index, name) in &opt.options.buffer_updates {
        let src = outputs.get(*index).ok_or_else(|| {
            Error::Graph(format!(
                "buffer update of '{name}' names output {index}, which does not exist"
            ))
        })?;
        let e = params
            .entry(name)
            .ok_or_else(|| Error::input(name, "buffer to update is not in the weight store"))?;
        if names.iter().any(|n| n == name) {
            return Err(Error::input(
                name,
                "a trained parameter cannot also be updated as a buffer",
            ));
        }
        if e.shape != src.shape || e.dtype != src.dtype {
            return Err(Error::shape(
                name,
                format!(
                    "buffer is {} {} but its update is {} {}",
                    e.dtype, e.shape, src.dtype, src.shape
                ),
            ));
        }
        let dst = TRef {
            buf: Buf::Params,
            offset: e.offset,
            shape: e.shape.clone(),
            dtype: e.dtype,
        };
        if buffer_updates.iter().any(|(_, d): &(TRef, TRef)| *d == dst) {
            return Err(Error::input(name, "updated twice in one step"));
        }
        buffer_updates.push((src.clone(), dst));
    }
    let plan = UpdatePlan {
        rule: opt.rule,
        params: plan_params,
        hyper,
        loss: outputs[0].clone(),
        stats: stats.clone(),
        clip: opt.options.clip,
        accumulate,
        skip_nonfinite: opt.options.skip_nonfinite,
        buffer_updates,
    };
    Ok(PlannedUpdate {
        instr: Instr::Update(Box::new(plan)),
        stats,
        arena_bytes: tail,
    })
}

/// Which nodes `root` depends on (itself included).
fn ancestors(graph: &Graph, root: usize) -> Vec<bool> {
    let mut used = vec![false; graph.len()];
    used[root] = true;
    for id in (0..=root).rev() {
        if used[id] {
            for &i in &graph.node(id).inputs {
                used[i] = true;
            }
        }
    }
    used
}

pub(crate) fn state_ref(state: &Store, name: &str) -> Result<TRef> {
    let e = state
        .entry(name)
        .ok_or_else(|| Error::Graph(format!("optimizer state has no '{name}'")))?;
    Ok(TRef {
        buf: Buf::State,
        offset: e.offset,
        shape: e.shape.clone(),
        dtype: e.dtype,
    })
}
