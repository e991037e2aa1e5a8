//! The rlx exception classes (defined here, re-exported by `rlx/errors.py`) and the conversion
//! of `rlx_ir::Error` into them.
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use rlx_ir::Error;

/// Each class: name, the built-in exception it also derives from (besides `RlxError`), doc.
const CLASSES: [(&str, &str, &str); 6] = [
    (
        "ShapeError",
        "ValueError",
        "Shapes that do not fit together; the message names the op and the shapes.",
    ),
    (
        "DTypeError",
        "TypeError",
        "Element types that do not fit together; the message names the op and the dtypes.",
    ),
    (
        "InputError",
        "ValueError",
        "A bad input at call time: an unknown or missing name, or a value out of range.",
    ),
    (
        "DeviceError",
        "RuntimeError",
        "A device that is unknown, not compiled in, or absent.",
    ),
    (
        "UnsupportedError",
        "NotImplementedError",
        "A feature this build or backend does not have.",
    ),
    (
        "CheckpointError",
        "Exception",
        "A checkpoint that cannot be written, read, or does not match the model.",
    ),
];

/// The classes by name (`RlxError` first), made once per interpreter.
static TYPES: PyOnceLock<Vec<(&'static str, Py<PyType>)>> = PyOnceLock::new();

fn make_types(py: Python<'_>) -> PyResult<Vec<(&'static str, Py<PyType>)>> {
    let builtins = py.import("builtins")?;
    let type_ = builtins.getattr("type")?;
    let make = |name: &str, bases: Bound<'_, PyTuple>, doc: &str| -> PyResult<Py<PyType>> {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "rlx.errors")?;
        ns.set_item("__doc__", doc)?;
        Ok(type_
            .call1((name, bases, ns))?
            .cast_into::<PyType>()?
            .unbind())
    };
    let exception = builtins.getattr("Exception")?;
    let base = make(
        "RlxError",
        PyTuple::new(py, [exception])?,
        "Base class of every rlx exception.",
    )?;
    let mut out = vec![("RlxError", base.clone_ref(py))];
    for (name, builtin, doc) in CLASSES {
        let bases: Vec<Bound<'_, PyAny>> = if builtin == "Exception" {
            vec![base.bind(py).clone().into_any()]
        } else {
            vec![base.bind(py).clone().into_any(), builtins.getattr(builtin)?]
        };
        out.push((name, make(name, PyTuple::new(py, bases)?, doc)?));
    }
    Ok(out)
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (name, cls) in TYPES.get_or_try_init(m.py(), || make_types(m.py()))? {
        m.add(*name, cls.bind(m.py()))?;
    }
    Ok(())
}

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

/// Converts an rlx error into an instance of the matching exception class.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    let name = class_name(&e);
    match TYPES.get_or_try_init(py, || make_types(py)) {
        Ok(types) => {
            let cls = types
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, c)| c.bind(py).clone())
                .expect("every class_name is made by make_types");
            PyErr::from_type(cls, msg)
        }
        Err(e) => e,
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
