//! Device names -> backends. The only place that knows which backends are compiled in.
use crate::errors::IntoPy;
use pyo3::prelude::*;
use rlx_ir::Error;
use rlx_runtime::Backend;
use std::sync::Arc;

/// Devices that can run here.
#[pyfunction]
pub fn devices() -> Vec<String> {
    vec!["cpu".to_string()]
}

/// The instruction set the CPU kernels run with in this process: `"avx2"` or `"portable"`
/// (chosen once from the CPU and `RLX_CPU_ISA`).
#[pyfunction]
pub fn cpu_isa() -> &'static str {
    rlx_cpu::isa::current().name()
}

/// Normalises a device name, raising `DeviceError` for unknown or absent devices.
#[pyfunction]
pub fn check_device(py: Python<'_>, device: &str) -> PyResult<String> {
    backend(device).py_err(py).map(|b| b.name())
}

pub fn backend(device: &str) -> Result<Arc<dyn Backend>, Error> {
    let available = devices();
    match device {
        "cpu" => Ok(Arc::new(rlx_cpu::CpuBackend)),
        d if d == "cuda" || d.starts_with("cuda:") || d == "metal" => Err(Error::Device(format!(
            "device '{d}' is not available: this rlx build has no {} backend; available devices: {available:?}",
            if d == "metal" { "Metal" } else { "CUDA" }
        ))),
        d => Err(Error::Device(format!(
            "unknown device '{d}'; available devices: {available:?} (names: 'cpu', 'cuda', 'cuda:N', 'metal')"
        ))),
    }
}
