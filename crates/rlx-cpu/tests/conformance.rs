//! Runs the backend-neutral conformance suite on the CPU backend.
#[test]
fn cpu_passes_the_conformance_suite() {
    rlx_runtime::conformance::run_all(&rlx_cpu::CpuBackend);
}
