//! The runtime's whole conformance suite on the Metal backend over the host-emulated device
//! (the MSL kernels compiled by the system C++ compiler and run on the CPU; Linux CI). Each
//! check is skipped, with a message, where there is no C++ compiler.
use rlx_runtime::Backend;
use std::sync::Arc;

fn make() -> Result<Arc<dyn Backend>, String> {
    if rlx_metal::host::cxx().is_none() {
        return Err("no C++ compiler to build the MSL kernels for the host".into());
    }
    let device = rlx_metal::MetalDevice::host().map_err(|e| e.to_string())?;
    Ok(Arc::new(rlx_metal::MetalBackend::new(
        device,
        rlx_cpu::host_update,
    )))
}

rlx_runtime::conformance_tests!(skip_unless: make());
