//! The one error type shared by every rlx crate; each variant maps to one Python exception class.
use thiserror::Error;

/// Every failure rlx reports. Messages start with the op or input in brackets, e.g. `[matmul] ...`.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Error {
    /// Shapes that do not fit together (Python: `rlx.ShapeError`).
    #[error("[{op}] {msg}")]
    Shape { op: String, msg: String },
    /// Element types that do not fit together (Python: `rlx.DTypeError`).
    #[error("[{op}] {msg}")]
    DType { op: String, msg: String },
    /// A bad input value or name at run time (Python: `rlx.InputError`).
    #[error("[{name}] {msg}")]
    Input { name: String, msg: String },
    /// A device that is unknown, absent or failing (Python: `rlx.DeviceError`).
    #[error("{0}")]
    Device(String),
    /// A feature this build or backend does not have (Python: `rlx.UnsupportedError`).
    #[error("[{op}] {msg}")]
    Unsupported { op: String, msg: String },
    /// A checkpoint that cannot be written or read (Python: `rlx.CheckpointError`).
    #[error("{0}")]
    Checkpoint(String),
    /// A node id, output index or byte range outside what it indexes (Python: `rlx.RlxError`).
    #[error("{0}")]
    Bounds(String),
    /// A broken invariant inside rlx: a bug to report, never the caller's fault (Python:
    /// `rlx.RlxError`, the message says so).
    #[error("internal error (a bug in rlx, please report it): {0}")]
    Internal(String),
    /// A malformed graph: a duplicate name, a wrong number of inputs, a misuse of a constructor
    /// (Python: `rlx.RlxError`).
    #[error("{0}")]
    Graph(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn shape(op: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Shape {
            op: op.into(),
            msg: msg.into(),
        }
    }
    pub fn dtype(op: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::DType {
            op: op.into(),
            msg: msg.into(),
        }
    }
    pub fn input(name: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Input {
            name: name.into(),
            msg: msg.into(),
        }
    }
    pub fn unsupported(op: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Unsupported {
            op: op.into(),
            msg: msg.into(),
        }
    }
}
