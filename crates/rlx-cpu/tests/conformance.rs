//! Runs the backend-neutral conformance suite on the CPU backend.
#[test]
fn cpu_passes_the_conformance_suite() {
    let backend: std::sync::Arc<dyn rlx_runtime::Backend> =
        std::sync::Arc::new(rlx_cpu::CpuBackend);
    rlx_runtime::conformance::run_all(&backend);
}
