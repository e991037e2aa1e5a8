//! Turns `rlx_ir::Error` into the Python exception classes defined in `rlx/errors.py`.
use pyo3::prelude::*;
use rlx_ir::Error;

/// The exception class name for each error kind.
fn class_name(e: &Error) -> &'static str {
    match e {
        Error::Shape { .. } => "ShapeError",
        Error::DType { .. } => "DTypeError",
        Error::Input { .. } => "InputError",
        Error::Device(_) => "DeviceError",
        Error::Unsupported { .. } => "UnsupportedError",
        Error::Checkpoint(_) => "CheckpointError",
        Error::Bounds(_) | Error::Internal(_) | Error::Graph(_) => "RlxError",
    }
}

/// Converts an rlx error into an instance of the matching `rlx.errors` class.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match py
        .import("rlx.errors")
        .and_then(|m| m.getattr(class_name(&e)))
    {
        Ok(cls) => PyErr::from_type(
            cls.cast_into().expect("rlx.errors holds exception classes"),
            msg,
        ),
        Err(import_err) => import_err,
    }
}

/// `?`-friendly conversion inside `#[pymethods]`.
pub trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// Runs `f`, turning a Rust panic (a bug in rlx) into an `RlxError` instead of a
/// `PanicException`, so a user's `except rlx.RlxError` still sees it and the process lives on.
pub fn guard<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Internal(msg))
    })
}

/// Panics inside `guard` on purpose, so tests can check that a panic reaches Python as an
/// `RlxError` (not an abort, not a `PanicException`).
#[pyo3::pyfunction]
pub fn _panic_for_tests(py: Python<'_>) -> PyResult<()> {
    guard(|| -> Result<(), Error> { panic!("deliberate panic for the test suite") }).py_err(py)
}
