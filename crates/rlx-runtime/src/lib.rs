//! rlx-runtime: everything between the IR and a device — the backend seam, lowering a graph to a
//! program over one arena, executables with resident weights and inputs, optimizers, checkpoints.
// `unsafe` here is only the contract of `Compiled::run` (declared in backend.rs) and its one
// caller, `Executable::run`, whose locks keep it.
#![deny(unsafe_code)]

pub mod backend;
pub mod checkpoint;
pub mod conformance;
pub mod conformance_vision;
pub mod executable;
pub mod expr_source;
pub mod gpu_plan;
pub mod listing;
pub mod lower;
pub mod profile;
pub mod program;
pub mod store;
pub mod train;
pub mod validate;

pub use backend::{
    Backend, Compiled, CopyDst, CopyEngine, CopySrc, DeviceBuffer, HostBytes, HostRead, HostWrite,
};
pub use executable::{Executable, InputSlot, MemoryReport, OptimizerSetup, Phase};
pub use program::{
    hyper_col, stat, Buf, Instr, OptimHyper, OptimRule, Program, TRef, UpdateParam, UpdatePlan,
};
pub use rlx_ir::{Error, Result};
pub use store::{Store, StoreEntry};
pub use train::TrainOptions;
