//! The runtime's whole conformance suite on the Metal backend over the host-emulated device
//! (the MSL kernels compiled by the system C++ compiler and run on the CPU; Linux CI), three
//! times: with the options the environment gives (by default the device-side update and the
//! matrix engine above its size threshold), with the update on the host, and with every matmul
//! and every attention the engine takes (both layouts, forward and gradient) on the matrix engine. Each check is skipped, with a message, where there is no C++ compiler.
use rlx_metal::matmul::MatmulPolicy;
use rlx_metal::{MetalOptions, UpdateMode};
use rlx_runtime::Backend;
use std::sync::Arc;

fn make(options: Option<MetalOptions>) -> Result<Arc<dyn Backend>, String> {
    if rlx_metal::host::cxx().is_none() {
        return Err("no C++ compiler to build the MSL kernels for the host".into());
    }
    let device = rlx_metal::MetalDevice::host().map_err(|e| e.to_string())?;
    Ok(Arc::new(match options {
        None => rlx_metal::MetalBackend::new(device, rlx_cpu::host_update),
        Some(o) => rlx_metal::MetalBackend::with_options(device, rlx_cpu::host_update, o),
    }))
}

rlx_runtime::conformance_tests!(skip_unless: make(None));

mod host_update {
    use super::*;
    rlx_runtime::conformance_tests!(skip_unless: make(Some(MetalOptions {
        matmul: MatmulPolicy::default(),
        attention: MatmulPolicy::default(),
        update: UpdateMode::Host,
    })));
}

mod every_matmul_on_the_engine {
    use super::*;
    rlx_runtime::conformance_tests!(skip_unless: make(Some(MetalOptions {
        matmul: MatmulPolicy::ALL,
        attention: MatmulPolicy::ALL,
        update: UpdateMode::Kernel,
    })));
}
