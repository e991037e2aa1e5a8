//! rlx-cpu: the CPU backend. Host memory is unified memory, so every buffer is host-visible.
//!
//! Where `unsafe` lives, each use with a `// SAFETY:` note: `mem.rs` (the aligned allocation,
//! race-free atomic byte copies, the typed slices a run hands to kernels), `exec.rs` (taking each
//! instruction's slices, after `CpuProgram::new` checked every range and that no output overlaps
//! an input; implementing the `unsafe` `Compiled::run`), `isa.rs` (calling the AVX2+FMA copy of a
//! kernel loop after feature detection), `f16c.rs` (the F16C float16 conversions, after feature
//! detection), `bf16dot.rs` (the AVX512-BF16 micro-kernel, after feature detection) and
//! `sgemm/` (the float32 GEMM: `avx512.rs` and `avx2.rs`, the micro-kernels' vector loads and
//! stores after feature detection and bounds asserts; `mod.rs`, the output pointer the threads
//! of a split write disjoint blocks through; `fallback.rs`, the `gemm` crate call). Kernels themselves are safe code over slices.
//!
//! ```
//! use rlx_ir::{DType, Graph, Op, Shape, UnaryOp};
//! use rlx_runtime::{Executable, Store};
//! use std::sync::Arc;
//!
//! // y = relu(x) on the CPU.
//! let mut g = Graph::new();
//! let x = g.input("x", Shape::new([3]), DType::F32)?;
//! let y = g.add(Op::Unary(UnaryOp::Relu), &[x])?;
//! g.set_outputs(vec![y])?;
//! let backend: Arc<dyn rlx_runtime::Backend> = Arc::new(rlx_cpu::CpuBackend);
//! let params = Arc::new(Store::new(backend.as_ref(), &[])?);
//! let exe = Executable::new(backend, &g, params, None)?;
//! let xs: Vec<u8> = [-1.0f32, 0.5, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let out = exe.run(&[("x", &xs)], None, &[0])?;
//! let ys: Vec<f32> = out[0].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
//! assert_eq!(ys, [0.0, 0.5, 2.0]);
//! # Ok::<(), rlx_runtime::Error>(())
//! ```
#![warn(unsafe_op_in_unsafe_fn)]

pub mod bf16dot;
mod copy;
mod exec;
pub mod f16c;
pub mod isa;
mod kernels;
mod mem;
mod pool;
mod schedule;
pub mod sgemm;
mod train;

use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, Program, Result};
use std::sync::Arc;

pub use copy::CpuCopyEngine;
pub use mem::CpuBuffer;
pub use pool::thread_count;

/// Runs a training update (`Instr::Update`) on the host with the CPU backend's kernels over any
/// host-visible buffers (the Metal backend's shared arena and stores, in place), after checking
/// it as a program of its own over buffers of `lens` bytes.
///
/// # Safety
/// As `Compiled::run`: nothing else reads or writes the buffers' bytes meanwhile, and the
/// buffers stay alive and keep the lengths `lens` for the call.
pub unsafe fn host_update(
    buffers: &[&dyn DeviceBuffer],
    lens: &[usize],
    plan: &rlx_runtime::UpdatePlan,
    hyper: Option<&rlx_runtime::OptimHyper>,
) -> Result<()> {
    let program = Program {
        instrs: vec![rlx_runtime::Instr::Update(Box::new(plan.clone()))],
    };
    let mut compiled = exec::CpuProgram::new(&program, lens)?;
    // SAFETY: the caller's contract is `Compiled::run`'s.
    unsafe { compiled.run(buffers, hyper) }
}

/// Planned tensors start on cache-line multiples that also suit AVX-512 loads.
pub const ALIGN: usize = 64;

/// The CPU backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn alignment(&self) -> usize {
        ALIGN
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(Arc::new(CpuBuffer::zeroed(bytes)?))
    }

    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        Ok(Box::new(exec::CpuProgram::new(program, buffer_lens)?))
    }

    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(Arc::new(CpuCopyEngine::new()?))
    }

    fn runs_together(&self, graph: &rlx_ir::Graph, a: rlx_ir::NodeId, b: rlx_ir::NodeId) -> bool {
        schedule::nodes_run_together(graph, a, b, pool::thread_count())
    }
}
