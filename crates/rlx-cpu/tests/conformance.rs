//! The backend-neutral conformance suite on the CPU backend: one test per check.
rlx_runtime::conformance_tests!(std::sync::Arc::new(rlx_cpu::CpuBackend));
