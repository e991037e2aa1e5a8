//! The runtime's conformance checks that the Metal backend passes on the host emulation, on the
//! system's real Metal device (Apple only; type-checked in CI, never run on Apple hardware here).
#![cfg(target_vendor = "apple")]
use std::sync::Arc;

fn backend() -> Arc<dyn rlx_runtime::Backend> {
    let device = rlx_metal::MetalDevice::system().expect("a Metal device");
    Arc::new(rlx_metal::MetalBackend::new(device))
}

#[test]
fn copy_engine_contract() {
    rlx_runtime::conformance::copy_engine_contract(&backend());
}

#[test]
fn compile_rejects_bad_programs() {
    rlx_runtime::conformance::compile_rejects_bad_programs(&backend());
}
