//! The runtime's whole conformance suite on the system's real Metal device (Apple only;
//! type-checked in CI, never run on Apple hardware here).
#![cfg(target_vendor = "apple")]
use std::sync::Arc;

fn backend() -> Arc<dyn rlx_runtime::Backend> {
    let device = rlx_metal::MetalDevice::system().expect("a Metal device");
    Arc::new(rlx_metal::MetalBackend::new(device, rlx_cpu::host_update))
}

rlx_runtime::conformance_tests!(backend());
