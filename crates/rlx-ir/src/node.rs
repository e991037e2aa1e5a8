//! A graph node: the op that makes a value, its inputs and its inferred type. Its own file so
//! that shape inference (which reads nodes) and the graph (which infers them) do not import
//! each other.
use crate::{DType, Op, Shape};

/// Index of a node in its graph.
pub type NodeId = usize;

/// One value of the graph: the op that makes it, its inputs and its inferred type.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Shape,
    pub dtype: DType,
}
