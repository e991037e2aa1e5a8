//! A lowered program: kernel calls on byte ranges of a few device buffers, in execution order.
use rlx_ir::{DType, Op, Shape};

/// Which buffer a tensor lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Buf {
    /// The executable's planned arena (activations, gradients, inputs, constants).
    Arena = 0,
    /// The model's weight store, shared by every executable compiled from the model.
    Params = 1,
    /// The optimizer's state store (moments, step count).
    State = 2,
    /// The staging buffer of prefetched inputs (two input sets), made at the first prefetch.
    Stage = 3,
}

/// A tensor at a fixed place: buffer, byte offset, shape and dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct TRef {
    pub buf: Buf,
    pub offset: usize,
    pub shape: Shape,
    pub dtype: DType,
}

impl TRef {
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
}

/// The update rules, as PyTorch defines them (`torch.optim.*`, default options).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimRule {
    /// SGD with optional momentum, dampening, Nesterov and L2 weight decay. The momentum buffer is
    /// always allocated, so momentum may be switched on between steps (it starts as PyTorch's
    /// does: the first step with momentum copies the gradient).
    Sgd,
    /// Adam; weight decay is L2 added to the gradient.
    Adam,
    /// Adam with decoupled weight decay.
    AdamW,
    /// RMSprop (not centred); momentum optional.
    RmsProp,
    /// Adagrad with learning-rate decay.
    Adagrad,
}

impl OptimRule {
    /// Parses the Python-side name of a rule.
    pub fn parse(name: &str) -> rlx_ir::Result<OptimRule> {
        Ok(match name {
            // "sgd_momentum" is accepted for callers written before momentum became a setting.
            "sgd" | "sgd_momentum" => OptimRule::Sgd,
            "adam" => OptimRule::Adam,
            "adamw" => OptimRule::AdamW,
            "rmsprop" => OptimRule::RmsProp,
            "adagrad" => OptimRule::Adagrad,
            r => {
                return Err(rlx_ir::Error::unsupported(
                    "optimizer",
                    format!("unknown update rule '{r}'"),
                ))
            }
        })
    }

    /// The parameter-shaped float32 state buffers of each parameter, as `"{param}.{slot}"`.
    pub fn slots(self) -> &'static [&'static str] {
        match self {
            OptimRule::Sgd => &["momentum_buffer"],
            OptimRule::Adam | OptimRule::AdamW => &["exp_avg", "exp_avg_sq"],
            OptimRule::RmsProp => &["square_avg", "momentum_buffer"],
            OptimRule::Adagrad => &["sum"],
        }
    }
}

/// Columns of one row of an optimizer's `hyper` state entry (one row per parameter, so
/// parameter groups may differ); written by the front end whenever a setting changes.
pub mod hyper_col {
    pub const LR: usize = 0;
    pub const WEIGHT_DECAY: usize = 1;
    pub const MOMENTUM: usize = 2;
    pub const DAMPENING: usize = 3;
    /// 1.0 for Nesterov momentum (SGD).
    pub const NESTEROV: usize = 4;
    pub const BETA1: usize = 5;
    pub const BETA2: usize = 6;
    pub const EPS: usize = 7;
    /// RMSprop's smoothing constant.
    pub const ALPHA: usize = 8;
    /// Adagrad's learning-rate decay.
    pub const LR_DECAY: usize = 9;
    /// `1 - alpha`, `1 - dampening`, `1 - beta1`, `1 - beta2`, computed by the front end in
    /// double precision and rounded once, as PyTorch passes them to its kernels.
    pub const ONE_MINUS_ALPHA: usize = 10;
    pub const ONE_MINUS_DAMPENING: usize = 11;
    pub const ONE_MINUS_BETA1: usize = 12;
    pub const ONE_MINUS_BETA2: usize = 13;
    /// Row length.
    pub const LEN: usize = 14;
}

/// Columns of a training step's statistics output (float32, [`stat::LEN`]).
pub mod stat {
    /// Global L2 norm of the gradient of the last update, before clipping (NaN unless the step
    /// clips or skips non-finite steps: the norm costs a pass over every gradient).
    pub const GRAD_NORM: usize = 0;
    /// Calls skipped because the loss or the gradient was not finite.
    pub const SKIPPED: usize = 1;
    /// Calls accumulated since the last update.
    pub const MICRO: usize = 2;
    /// 1.0 when the last call updated the weights.
    pub const UPDATED: usize = 3;
    pub const LEN: usize = 4;
}

/// One parameter's part of an update.
#[derive(Clone, Debug, PartialEq)]
pub struct UpdateParam {
    pub param: TRef,
    /// Read only: clipping and averaging scale it on the fly.
    pub grad: TRef,
    /// With gradient accumulation: the running sum of gradients (arena tail).
    pub acc: Option<TRef>,
    /// The rule's state buffers, in [`OptimRule::slots`] order.
    pub state: Vec<TRef>,
    /// int32 scalar: this parameter's update count (PyTorch keeps one per parameter).
    pub step: TRef,
    /// SGD: int32 scalar, 1 once the momentum buffer holds a value.
    pub started: Option<TRef>,
    /// This parameter's row of the `hyper` table.
    pub row: usize,
}

/// The end of a training step: gradient accumulation, the non-finite check, the global norm and
/// clipping, then the optimizer rule over every trained parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct UpdatePlan {
    pub rule: OptimRule,
    pub params: Vec<UpdateParam>,
    /// float32 (float64 where a float64 weight is trained) [n, hyper_col::LEN] in the state
    /// store; `None`: every row is the run's
    /// [`OptimHyper`].
    pub hyper: Option<TRef>,
    pub loss: TRef,
    /// float32 [stat::LEN] (arena tail), persistent across runs.
    pub stats: TRef,
    pub clip: Option<f64>,
    pub accumulate: u32,
    pub skip_nonfinite: bool,
    /// Buffers (non-trained weights, e.g. running statistics) set from a tensor of this run:
    /// `(source, destination in the weight store)`, copied at the end of every run that is not
    /// skipped.
    pub buffer_updates: Vec<(TRef, TRef)>,
}

/// Hyper-parameters read at every run, so they may change between steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimHyper {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

/// One step of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Instr {
    /// Computes `out = op(ins...)`.
    Op { op: Op, ins: Vec<TRef>, out: TRef },
    /// The training update (see [`UpdatePlan`]).
    Update(Box<UpdatePlan>),
}

/// A whole program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub instrs: Vec<Instr>,
}
