//! rlx-ir: the device-free heart of rlx — graph, ops, shape inference, autodiff, memory planning.
#![forbid(unsafe_code)]

pub mod autocast;
pub mod autodiff;
pub mod copy;
pub mod dtype;
pub mod error;
pub mod fuse;
pub mod graph;
pub mod infer;
pub mod narrow;
pub mod node;
pub mod op;
pub mod planner;
pub mod shape;

pub use autocast::autocast;
pub use autodiff::grad;
pub use copy::{AsyncCopy, BarrierToken};
pub use dtype::DType;
pub use error::{Error, Result};
pub use graph::Graph;
pub use node::{Node, NodeId};
pub use op::{dropout_keep, BinaryOp, Fused, FusedStep, Op, ReduceOp, UnaryOp, Window};
pub use planner::{plan, Interval, Plan};
pub use shape::Shape;
