//! `rlx._rlx.Store` (a model's weights or an optimizer's state on one device) and checkpoints.
use crate::buffer::{ArenaView, Bytes};
use crate::devices::backend;
use crate::errors::{to_py, IntoPy};
use crate::gate::native;
use crate::graph::parse_dtype;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rlx_ir::{Error, Shape};
use rlx_runtime::{checkpoint, OptimRule, Store};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

#[pyclass(name = "Store", module = "rlx._rlx", frozen)]
pub struct PyStore {
    pub store: Arc<Store>,
}

/// The parameter-shaped state tensors optimizer `rule` keeps per parameter
/// (`Store.for_optimizer` names them `<param>.<slot>`): the one list, read by Python too.
#[pyfunction]
pub fn optimizer_slots(py: Python<'_>, rule: &str) -> PyResult<Vec<&'static str>> {
    Ok(OptimRule::parse(rule).py_err(py)?.slots().to_vec())
}

#[pymethods]
impl PyStore {
    /// A zeroed store on `device` holding `[(name, shape, dtype)]`.
    #[new]
    fn new(
        py: Python<'_>,
        device: &str,
        specs: Vec<(String, Vec<usize>, String)>,
    ) -> PyResult<PyStore> {
        let b = backend(device).py_err(py)?;
        let specs = specs
            .into_iter()
            .map(|(n, s, d)| parse_dtype(&d).map(|d| (n, Shape(s), d)))
            .collect::<Result<Vec<_>, _>>()
            .py_err(py)?;
        let store = native(py, || Store::new(b.as_ref(), &specs))?;
        Ok(PyStore {
            store: Arc::new(store),
        })
    }

    /// The state store of optimizer `rule` for the weights in `params`; with `hyper_table`, it
    /// holds a `hyper` table of settings, one row per parameter, that updates read.
    #[staticmethod]
    #[pyo3(signature = (rule, params, hyper_table=true))]
    fn for_optimizer(
        py: Python<'_>,
        rule: &str,
        params: &PyStore,
        hyper_table: bool,
    ) -> PyResult<PyStore> {
        let b = backend(params.store.device()).py_err(py)?;
        let rule = OptimRule::parse(rule).py_err(py)?;
        let store = Store::for_optimizer(b.as_ref(), rule, &params.store, hyper_table);
        Ok(PyStore {
            store: Arc::new(store.py_err(py)?),
        })
    }

    #[getter]
    fn device(&self) -> String {
        self.store.device().to_string()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.store.bytes()
    }

    /// `[(name, shape, dtype)]` in layout order.
    fn entries(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        self.store
            .entries()
            .iter()
            .map(|e| (e.name.clone(), e.shape.0.clone(), e.dtype.name()))
            .collect()
    }

    /// Overwrites tensor `name` with the bytes of a C-contiguous array.
    fn write(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = Bytes::get(data, name)?;
        let slice = bytes.as_slice();
        native(py, || self.store.write(name, slice))
    }

    /// Overwrites several tensors `[(name, array)]` as one change: all are checked first, then
    /// written under the store's lock, so no run sees a mix of old and new values.
    fn write_many(&self, py: Python<'_>, tensors: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<()> {
        let held = tensors
            .iter()
            .map(|(n, d)| Bytes::get(d, n).map(|b| (n.as_str(), b)))
            .collect::<PyResult<Vec<_>>>()?;
        let views: Vec<(&str, &[u8])> = held.iter().map(|(n, b)| (*n, b.as_slice())).collect();
        native(py, || self.store.write_many(&views))
    }

    /// A copy of tensor `name`'s bytes.
    fn read<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let v = native(py, || self.store.read(name))?;
        Ok(PyBytes::new(py, &v))
    }

    /// `[(name, bytes)]` of every tensor, copied under the store's lock: one consistent
    /// snapshot, never half of one step's update and half of the next.
    fn read_all<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let all = native(py, || self.store.read_all())?;
        Ok(all
            .into_iter()
            .map(|(n, v)| (n, PyBytes::new(py, &v)))
            .collect())
    }

    /// A DLPack capsule over tensor `name` in GPU memory (no copy), or None when the memory is
    /// not a GPU's (host-visible memory exports through its numpy view).
    fn dlpack(&self, py: Python<'_>, name: &str) -> PyResult<Option<Py<PyAny>>> {
        let e = self
            .store
            .entry(name)
            .ok_or_else(|| to_py(py, Error::input(name, "no such tensor")))?;
        crate::dlpack::export(py, self.store.buffer(), e.offset, e.shape.dims(), e.dtype)
    }

    /// `(DLPack device type, ordinal)` of the store's GPU memory, or None for host memory.
    fn dlpack_device(&self) -> Option<(i32, usize)> {
        crate::dlpack::device(self.store.buffer().as_ref())
    }

    /// A zero-copy view of tensor `name`, or None when the device memory is not host-visible.
    fn view(&self, py: Python<'_>, name: &str) -> PyResult<Option<ArenaView>> {
        let e = self
            .store
            .entry(name)
            .ok_or_else(|| to_py(py, Error::input(name, "no such tensor")))?;
        Ok(ArenaView::new(
            self.store.buffer().clone(),
            e.offset,
            e.bytes(),
        ))
    }
}

/// Writes `[(name, dtype, shape, array)]` to `path` atomically in the safetensors format, with
/// optional string `metadata` in the header.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata=None))]
pub fn save_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    tensors: Vec<(String, String, Vec<usize>, Bound<'_, PyAny>)>,
    metadata: Option<HashMap<String, String>>,
) -> PyResult<()> {
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, data) in &tensors {
        owned.push((
            name.as_str(),
            parse_dtype(dtype).py_err(py)?,
            shape.as_slice(),
            Bytes::get(data, name)?,
        ));
    }
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| (*n, *d, *s, b.as_slice()))
        .collect();
    native(py, || {
        checkpoint::save_with_metadata(&path, &views, metadata)
    })
}

/// One loaded tensor as Python sees it: (name, dtype, shape, bytes).
type LoadedTensor<'py> = (String, &'static str, Vec<usize>, Bound<'py, PyBytes>);

/// Reads and validates a safetensors file: `[(name, dtype, shape, bytes)]` sorted by name.
/// Files holding more than `max_bytes` of tensor data are refused before their data is read.
#[pyfunction]
#[pyo3(signature = (path, max_bytes=None))]
pub fn load_checkpoint<'py>(
    py: Python<'py>,
    path: PathBuf,
    max_bytes: Option<u64>,
) -> PyResult<Vec<LoadedTensor<'py>>> {
    let tensors = native(py, || checkpoint::load(&path, max_bytes))?;
    Ok(tensors
        .into_iter()
        .map(|t| (t.name, t.dtype.name(), t.shape, PyBytes::new(py, &t.data)))
        .collect())
}

/// A loaded file as Python sees it: `([(name, dtype, shape, bytes)], metadata)`.
type LoadedFile<'py> = (
    Vec<(String, &'static str, Vec<usize>, Bound<'py, PyBytes>)>,
    HashMap<String, String>,
);

/// Like `load_checkpoint`, but tensors of any common dtype (named as numpy names them, e.g.
/// `"bfloat16"`, `"int64"`) and the header's metadata are returned; the caller converts.
#[pyfunction]
#[pyo3(signature = (path, max_bytes=None))]
pub fn load_checkpoint_raw<'py>(
    py: Python<'py>,
    path: PathBuf,
    max_bytes: Option<u64>,
) -> PyResult<LoadedFile<'py>> {
    let (tensors, metadata) = native(py, || checkpoint::load_raw(&path, max_bytes))?;
    let tensors = tensors
        .into_iter()
        .map(|t| (t.name, t.dtype, t.shape, PyBytes::new(py, &t.data)))
        .collect();
    Ok((tensors, metadata))
}

/// `[(name, dtype, shape)]` of a safetensors file's tensors, read from its header only (dtype as
/// the format names it: "F32", "BF16", ...), sorted by name.
#[pyfunction]
pub fn checkpoint_header(py: Python<'_>, path: PathBuf) -> PyResult<Vec<checkpoint::HeaderEntry>> {
    native(py, || checkpoint::header(&path))
}
