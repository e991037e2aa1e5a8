//! The `rlx._rlx` extension module: registers the classes and functions, nothing else.
#![warn(unsafe_op_in_unsafe_fn)]
mod buffer;
mod devices;
mod dlpack;
mod errors;
mod exec;
mod gate;
mod graph;
mod nccl;
mod store;

use pyo3::prelude::*;

#[pymodule]
fn _rlx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    devices::register_python_paths(m.py());
    m.add_class::<graph::PyGraph>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<exec::PyExecutable>()?;
    m.add_class::<buffer::ArenaView>()?;
    m.add_class::<nccl::PyNcclComm>()?;
    m.add_function(wrap_pyfunction!(nccl::nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(nccl::nccl_unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(devices::devices, m)?)?;
    m.add_function(wrap_pyfunction!(devices::check_device, m)?)?;
    m.add_function(wrap_pyfunction!(devices::cpu_isa, m)?)?;
    m.add_function(wrap_pyfunction!(devices::cpu_bf16_path, m)?)?;
    m.add_function(wrap_pyfunction!(devices::cpu_gemm_path, m)?)?;
    m.add_function(wrap_pyfunction!(store::save_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(store::optimizer_slots, m)?)?;
    m.add_function(wrap_pyfunction!(store::load_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(store::load_checkpoint_raw, m)?)?;
    m.add_function(wrap_pyfunction!(store::checkpoint_header, m)?)?;
    m.add_function(wrap_pyfunction!(gate::_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(gate::_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_panic_for_tests, m)?)?;
    Ok(())
}
