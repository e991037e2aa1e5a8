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

/// The update rules, as PyTorch defines them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimRule {
    /// `state = [momentum_buffer]` when momentum is on, else empty.
    Sgd { momentum: bool },
    /// `state = [exp_avg, exp_avg_sq]`; weight decay is L2 added to the gradient.
    Adam,
    /// Adam with decoupled weight decay.
    AdamW,
}

impl OptimRule {
    /// The per-parameter state tensors of the rule, in the order `Instr::Optim::state` lists them;
    /// the optimizer store names them `<param>.<slot>` (PyTorch's names). The one list of them:
    /// the stores, the executables and Python's `Optimizer.state` all read it from here.
    pub fn slots(self) -> &'static [&'static str] {
        match self {
            OptimRule::Sgd { momentum: false } => &[],
            OptimRule::Sgd { momentum: true } => &["momentum_buffer"],
            OptimRule::Adam | OptimRule::AdamW => &["exp_avg", "exp_avg_sq"],
        }
    }
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
    /// Adds one to the int32 step counter.
    CountStep { counter: TRef },
    /// Updates `param` in place from `grad` and its `state` buffers.
    Optim {
        rule: OptimRule,
        param: TRef,
        grad: TRef,
        state: Vec<TRef>,
        counter: TRef,
    },
}

/// A whole program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    pub instrs: Vec<Instr>,
}
