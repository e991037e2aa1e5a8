//! Device names -> backends. The only place that knows which backends are compiled in.
use crate::errors::IntoPy;
use pyo3::prelude::*;
use rlx_ir::Error;
use rlx_runtime::Backend;
use std::sync::Arc;

/// Devices that can run here.
#[pyfunction]
pub fn devices() -> Vec<String> {
    let mut out = vec!["cpu".to_string()];
    if let Ok(n) = rlx_cuda::available() {
        if n > 0 {
            out.push("cuda".into());
            out.extend((0..n).map(|i| format!("cuda:{i}")));
        }
    }
    if metal().is_ok() {
        out.push("metal".into());
    }
    out
}

/// The instruction set the CPU kernels run with in this process: `"avx512"`, `"avx2"` or
/// `"portable"`
/// (chosen once from the CPU and `RLX_CPU_ISA`).
#[pyfunction]
pub fn cpu_isa() -> &'static str {
    rlx_cpu::isa::current().name()
}

/// The bfloat16 matmul path in use on the CPU: `"avx512bf16"` or `"portable"`.
#[pyfunction]
pub fn cpu_bf16_path() -> &'static str {
    rlx_cpu::bf16dot::path_name()
}

/// The float32 GEMM the CPU kernels use in this process: `"avx512"`, `"avx2"` (rlx's own kernels)
/// or `"crate"` (the `gemm` crate), chosen once from the CPU and `RLX_CPU_GEMM`.
#[pyfunction]
pub fn cpu_gemm_path() -> &'static str {
    rlx_cpu::sgemm::path().name()
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
        "cuda" => cuda(device, 0),
        d if d.starts_with("cuda:") => match d[5..].parse::<usize>() {
            Ok(i) if d[5..].bytes().all(|c| c.is_ascii_digit()) => cuda(d, i),
            _ => Err(Error::Device(format!(
                "bad device name '{d}': write 'cuda' or 'cuda:N' with N a GPU number"
            ))),
        },
        "metal" => metal().map_err(|why| {
            Error::Device(format!(
                "device 'metal' is not available: {why}; available devices: {available:?}"
            ))
        }),
        d => Err(Error::Device(format!(
            "unknown device '{d}'; available devices: {available:?} (names: 'cpu', 'cuda', 'cuda:N', 'metal')"
        ))),
    }
}

/// The Metal backend on the system's default GPU (its kernel library compiled once per
/// process), or why there is none.
#[cfg(target_vendor = "apple")]
fn metal() -> Result<Arc<dyn Backend>, String> {
    static DEVICE: std::sync::OnceLock<Result<rlx_metal::MetalDevice, String>> =
        std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| rlx_metal::MetalDevice::system().map_err(|e| e.to_string()))
        .clone()
        .map(|d| {
            Arc::new(rlx_metal::MetalBackend::new(d, rlx_cpu::host_update)) as Arc<dyn Backend>
        })
}

/// Off Apple platforms there is no Metal backend.
#[cfg(not(target_vendor = "apple"))]
fn metal() -> Result<Arc<dyn Backend>, String> {
    Err("this rlx build has no Metal backend (it is built on Apple platforms only)".into())
}

/// The CUDA backend of GPU `ordinal`, or why it cannot be used here.
fn cuda(device: &str, ordinal: usize) -> Result<Arc<dyn Backend>, Error> {
    let with_list = |e: Error| {
        Error::Device(format!(
            "{}; available devices: {:?}",
            e.to_string().trim_start_matches("device error: "),
            devices()
        ))
    };
    if rlx_cuda::available().is_err() {
        return Err(with_list(rlx_cuda::unavailable(device)));
    }
    rlx_cuda::CudaBackend::new(ordinal)
        .map(|b| Arc::new(b) as Arc<dyn Backend>)
        .map_err(with_list)
}

/// Tells the CUDA backend where this interpreter's packages are (`sys.path`), so the NVRTC and
/// cuBLAS libraries of the `nvidia-*` wheels are found next to PyTorch's.
pub fn register_python_paths(py: Python<'_>) {
    let paths: Vec<std::path::PathBuf> = py
        .import("sys")
        .and_then(|sys| sys.getattr("path"))
        .and_then(|p| p.extract::<Vec<String>>())
        .map(|v| v.into_iter().map(Into::into).collect())
        .unwrap_or_default();
    rlx_cuda::add_package_dirs(paths);
}
