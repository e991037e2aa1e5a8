//! The backend-neutral conformance suite on the CPU backend: one test per check; then the
//! whole suite again with the integer narrowing the GPU backends ask for
//! (`Backend::narrows_integers`), so `rlx_ir::narrow` is checked against the CPU's own int64
//! and bool kernels without a GPU.
rlx_runtime::conformance_tests!(std::sync::Arc::new(rlx_cpu::CpuBackend));

mod narrowed {
    use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, Program, Result};
    use std::sync::Arc;

    /// The CPU backend, asking for int64 and bool to be narrowed to int32 like a GPU backend.
    struct Narrowing(rlx_cpu::CpuBackend);

    impl Backend for Narrowing {
        fn name(&self) -> String {
            self.0.name()
        }
        fn alignment(&self) -> usize {
            self.0.alignment()
        }
        fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
            self.0.alloc(bytes)
        }
        fn compile(&self, program: &Program, lens: &[usize]) -> Result<Box<dyn Compiled>> {
            self.0.compile(program, lens)
        }
        fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
            self.0.copy_engine()
        }
        fn runs_together(&self, graph: &rlx_ir::Graph, a: usize, b: usize) -> bool {
            self.0.runs_together(graph, a, b)
        }
        fn narrows_integers(&self) -> bool {
            true
        }
    }

    rlx_runtime::conformance_tests!(Arc::new(Narrowing(rlx_cpu::CpuBackend)));
}
