//! `rlx._rlx.NcclComm` and `nccl_unique_id`: the NCCL communicator of a CUDA rank, for
//! `rlx.distributed`'s NCCL backend (averaging a step's gradient region in the arena and
//! broadcasting the weight store, both on the GPU).
use crate::errors::to_py;
use crate::exec::PyExecutable;
use crate::gate::native;
use crate::store::PyStore;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rlx_cuda::nccl::{self, Comm};
use rlx_ir::Error;
use std::time::Duration;

/// A new NCCL unique id (rank 0 makes it; the launcher gives it to every rank).
#[pyfunction]
pub fn nccl_unique_id(py: Python<'_>) -> PyResult<Py<PyBytes>> {
    let id = native(py, nccl::unique_id)?;
    Ok(PyBytes::new(py, &id).unbind())
}

/// Why NCCL cannot be used here, or None.
#[pyfunction]
pub fn nccl_unavailable() -> Option<String> {
    nccl::available().err()
}

#[pyclass(name = "NcclComm", module = "rlx._rlx", frozen)]
pub struct PyNcclComm {
    comm: Comm,
}

#[pymethods]
impl PyNcclComm {
    /// Joins the `size`-rank communicator named by `id` as `rank` on GPU `ordinal`; collectives
    /// fail (and abort it) after `timeout_s` seconds.
    #[new]
    fn new(
        py: Python<'_>,
        id: Vec<u8>,
        size: usize,
        rank: usize,
        ordinal: usize,
        timeout_s: f64,
    ) -> PyResult<PyNcclComm> {
        let Some(t) = Duration::try_from_secs_f64(timeout_s)
            .ok()
            .filter(|t| !t.is_zero())
        else {
            return Err(to_py(
                py,
                Error::input(
                    "nccl",
                    format!("the timeout must be a finite number of seconds > 0, got {timeout_s}"),
                ),
            ));
        };
        let comm = native(py, || Comm::new(ordinal, &id, size, rank, t))?;
        Ok(PyNcclComm { comm })
    }

    /// Replaces the gradient region of `exe`'s arena by its mean over the ranks.
    fn allreduce_grads(&self, py: Python<'_>, exe: &PyExecutable) -> PyResult<()> {
        let exe = exe.inner();
        let Some((offset, bytes)) = exe.grad_region() else {
            return Err(to_py(
                py,
                Error::input("nccl", "the step was not compiled with distributed=True"),
            ));
        };
        native(py, || {
            self.comm
                .all_reduce_mean(exe.arena().as_ref(), offset, bytes)
        })
    }

    /// Overwrites the whole of `store` (every tensor) with rank `root`'s.
    fn broadcast_store(&self, py: Python<'_>, store: &PyStore, root: usize) -> PyResult<()> {
        let buf = store.store.buffer().clone();
        let bytes = buf.len() / 4 * 4;
        native(py, || self.comm.broadcast(buf.as_ref(), 0, bytes, root))
    }

    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank
    }

    #[getter]
    fn size(&self) -> usize {
        self.comm.size
    }
}
