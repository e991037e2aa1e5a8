//! `rlx._rlx.Executable`: a compiled graph; runs release the GIL.
use crate::buffer::{ArenaView, Bytes};
use crate::devices::backend;
use crate::errors::{to_py, IntoPy};
use crate::gate::native;
use crate::graph::PyGraph;
use crate::store::PyStore;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use rlx_ir::Error;
use rlx_runtime::{Executable, OptimHyper, OptimizerSetup, Phase};

/// An input slot as Python sees it: (name, shape, dtype, bound).
type SlotInfo = (String, Vec<usize>, &'static str, bool);

#[pyclass(name = "Executable", module = "rlx._rlx", frozen)]
pub struct PyExecutable {
    exe: Executable,
}

impl PyExecutable {
    /// The native executable (for the NCCL collectives).
    pub fn inner(&self) -> &Executable {
        &self.exe
    }
}

#[pymethods]
impl PyExecutable {
    /// Compiles `graph` on `device` against the weight store `params`; with `optimizer =
    /// (rule, state_store)` the graph's outputs are `[loss, grads...]` and each run updates.
    #[new]
    #[pyo3(signature = (graph, params, device, optimizer=None))]
    fn new(
        py: Python<'_>,
        graph: &PyGraph,
        params: &PyStore,
        device: &str,
        optimizer: Option<(String, PyRef<'_, PyStore>)>,
    ) -> PyResult<PyExecutable> {
        let b = backend(device).py_err(py)?;
        let optimizer = match optimizer {
            Some((spec, state)) => {
                Some(OptimizerSetup::parse(&spec, state.store.clone()).py_err(py)?)
            }
            None => None,
        };
        let g = graph.graph.clone();
        let store = params.store.clone();
        let exe = native(py, || Executable::new(b, &g, store, optimizer))?;
        Ok(PyExecutable { exe })
    }

    /// Runs once. `feeds` maps input names to C-contiguous arrays of the exact dtype and size;
    /// `hyper = (lr, momentum, weight_decay, beta1, beta2, eps)` for training; returns the bytes
    /// of the outputs listed in `read`. A data-parallel step also runs as `phase="gradients"`
    /// then `phase="update"` (default `"step"`: all of it).
    #[pyo3(signature = (feeds, hyper=None, read=Vec::new(), phase="step"))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        feeds: &Bound<'py, PyDict>,
        hyper: Option<(f32, f32, f32, f32, f32, f32)>,
        read: Vec<usize>,
        phase: &str,
    ) -> PyResult<Vec<Bound<'py, PyByteArray>>> {
        let phase = match phase {
            "step" => Phase::Step,
            "gradients" => Phase::Gradients,
            "update" => Phase::Update,
            p => {
                return Err(to_py(
                    py,
                    Error::input(
                        "phase",
                        format!("unknown phase '{p}' (step, gradients, update)"),
                    ),
                ))
            }
        };
        let held = held_feeds(feeds)?;
        let views = feed_views(&held);
        let hyper = hyper.map(
            |(lr, momentum, weight_decay, beta1, beta2, eps)| OptimHyper {
                lr,
                momentum,
                weight_decay,
                beta1,
                beta2,
                eps,
            },
        );
        let outs = native(py, || {
            self.exe.run_phase(&views, hyper.as_ref(), &read, phase)
        })?;
        drop(views);
        drop(held); // the callers' buffers are released here, with the GIL held
        Ok(outs.iter().map(|o| PyByteArray::new(py, o)).collect())
    }

    /// Snapshots a batch for a later run without feeds (taken now without the GIL, so the caller
    /// may change or reuse its arrays at once; see `Executable::prefetch`). No Python object is
    /// kept.
    fn prefetch(&self, py: Python<'_>, feeds: &Bound<'_, PyDict>) -> PyResult<()> {
        let held = held_feeds(feeds)?;
        let views = feed_views(&held);
        native(py, || self.exe.prefetch(&views))
    }

    /// A readable listing of the lowered program (ops, shapes, buffer offsets).
    fn listing(&self) -> String {
        self.exe.listing()
    }

    /// Batches waiting in the prefetch queue.
    fn prefetched(&self, py: Python<'_>) -> PyResult<usize> {
        native(py, || Ok(self.exe.prefetched()))
    }

    /// Places a resident input once; later runs may omit it.
    fn bind(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = Bytes::get(data, name)?;
        let slice = bytes.as_slice();
        native(py, || self.exe.bind(name, slice))
    }

    /// Writes whole rows along `axis` of input `name` from row `start`, in place.
    fn write_rows(
        &self,
        py: Python<'_>,
        name: &str,
        axis: usize,
        start: usize,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let bytes = Bytes::get(data, name)?;
        let slice = bytes.as_slice();
        native(py, || self.exe.write_rows(name, axis, start, slice))
    }

    /// Planned sizes in bytes.
    fn memory<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (key, bytes) in self.exe.memory().entries() {
            d.set_item(key, bytes)?;
        }
        Ok(d)
    }

    /// `[(name, shape, dtype, bound)]` of the inputs the program reads.
    fn input_slots(&self, py: Python<'_>) -> PyResult<Vec<SlotInfo>> {
        let slots = native(py, || Ok(self.exe.inputs()))?;
        Ok(slots
            .into_iter()
            .map(|s| (s.name, s.at.shape.0, s.at.dtype.name(), s.bound))
            .collect())
    }

    /// `[(shape, dtype)]` of the outputs.
    fn outputs(&self) -> Vec<(Vec<usize>, &'static str)> {
        self.exe
            .outputs()
            .iter()
            .map(|t| (t.shape.0.clone(), t.dtype.name()))
            .collect()
    }

    /// A zero-copy view of input `name`'s slot (None when not host-visible).
    fn input_view(&self, py: Python<'_>, name: &str) -> PyResult<Option<ArenaView>> {
        let slot = native(py, || Ok(self.exe.inputs()))?
            .into_iter()
            .find(|s| s.name == name);
        let slot = slot.ok_or_else(|| to_py(py, Error::input(name, "unknown input")))?;
        Ok(ArenaView::new(
            self.exe.arena().clone(),
            slot.at.offset,
            slot.at.bytes(),
        ))
    }

    /// A copy of input `name`'s slot (for devices whose memory the host cannot see).
    fn input_read<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let slot = native(py, || Ok(self.exe.inputs()))?
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| to_py(py, Error::input(name, "unknown input")))?;
        let arena = self.exe.arena().clone();
        let mut out = vec![0u8; slot.at.bytes()];
        native(py, || arena.read(slot.at.offset, &mut out))?;
        Ok(PyBytes::new(py, &out))
    }

    /// A copy of output `i`'s bytes as the last run left them (for devices whose memory the
    /// host cannot see).
    fn output_read<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyBytes>> {
        let t = self
            .exe
            .outputs()
            .get(i)
            .ok_or_else(|| to_py(py, Error::Graph(format!("no output {i}"))))?
            .clone();
        let buf = self
            .exe
            .buffer(t.buf)
            .ok_or_else(|| to_py(py, Error::Graph("output buffer missing".into())))?
            .clone();
        let mut out = vec![0u8; t.bytes()];
        native(py, || buf.read(t.offset, &mut out))?;
        Ok(PyBytes::new(py, &out))
    }

    /// A data-parallel step's gradient region: `(zero-copy view or None when not host-visible,
    /// bytes)`, or None for any other executable.
    fn grad_region(&self) -> Option<(Option<ArenaView>, usize)> {
        self.exe.grad_region().map(|(offset, bytes)| {
            (
                ArenaView::new(self.exe.arena().clone(), offset, bytes),
                bytes,
            )
        })
    }

    /// A DLPack capsule over output `i` in GPU memory (no copy; it holds the buffer), or None
    /// when the memory is host-visible (export its `output_view` instead).
    fn output_dlpack(&self, py: Python<'_>, i: usize) -> PyResult<Option<Py<PyAny>>> {
        let t = self
            .exe
            .outputs()
            .get(i)
            .ok_or_else(|| to_py(py, Error::Graph(format!("no output {i}"))))?;
        let buf = self
            .exe
            .buffer(t.buf)
            .ok_or_else(|| to_py(py, Error::Graph("output buffer missing".into())))?;
        crate::dlpack::export(py, buf, t.offset, t.shape.dims(), t.dtype)
    }

    /// A DLPack capsule over input `name`'s arena slot in GPU memory (no copy; it holds the
    /// arena), or None when the memory is host-visible (export its `input_view` instead).
    fn input_dlpack(&self, py: Python<'_>, name: &str) -> PyResult<Option<Py<PyAny>>> {
        let slot = native(py, || Ok(self.exe.inputs()))?
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| to_py(py, Error::input(name, "unknown input")))?;
        crate::dlpack::export(
            py,
            self.exe.arena(),
            slot.at.offset,
            slot.at.shape.dims(),
            slot.at.dtype,
        )
    }

    /// `(DLPack device type, ordinal)` of the arena's GPU memory, or None for host memory.
    fn dlpack_device(&self) -> Option<(i32, usize)> {
        crate::dlpack::device(self.exe.arena().as_ref())
    }

    /// A zero-copy view of output `i` (None when not host-visible).
    fn output_view(&self, py: Python<'_>, i: usize) -> PyResult<Option<ArenaView>> {
        let t = self
            .exe
            .outputs()
            .get(i)
            .ok_or_else(|| to_py(py, Error::Graph(format!("no output {i}"))))?;
        let buf = self
            .exe
            .buffer(t.buf)
            .ok_or_else(|| to_py(py, Error::Graph("output buffer missing".into())))?;
        Ok(ArenaView::new(buf.clone(), t.offset, t.bytes()))
    }
}

/// The buffers of a feeds dict (held, so the arrays stay put until they are dropped).
fn held_feeds(feeds: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Bytes)>> {
    feeds
        .iter()
        .map(|(k, v)| {
            let name: String = k.extract()?;
            let bytes = Bytes::get(&v, &name)?;
            Ok((name, bytes))
        })
        .collect()
}

/// (name, bytes) views of held feeds, as the runtime takes them.
fn feed_views(held: &[(String, Bytes)]) -> Vec<(&str, &[u8])> {
    held.iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect()
}
