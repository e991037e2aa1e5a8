//! Runs a planned program: resolves each operand to a device address, queues every step on the
//! device's stream, waits, and reports the first error a kernel flagged (bad label, id, integer
//! division by zero) as the CPU backend would.
use crate::driver::{Device, Func};
use crate::mem::CudaBuffer;
use crate::plan::{self, Kernel, Plan, Step};
use crate::source;
use rlx_ir::{Error, Result};
use rlx_runtime::{Compiled, DeviceBuffer, OptimHyper, Program};
use std::sync::Arc;

pub struct CudaProgram {
    dev: Arc<Device>,
    plan: Plan,
    /// The function of each launch step (None for other steps), resolved at compile time.
    funcs: Vec<Option<Func>>,
    lens: Vec<usize>,
    scratch: CudaBuffer,
}

impl CudaProgram {
    pub fn new(dev: Arc<Device>, program: &Program, lens: &[usize]) -> Result<CudaProgram> {
        let plan = plan::plan(program, lens)?;
        let lib = dev.module(&format!("{}{}", source::PRELUDE, source::LIBRARY))?;
        let fused_mod = if plan.fused.is_empty() {
            None
        } else {
            let mut src = source::PRELUDE.to_string();
            for (i, f) in plan.fused.iter().enumerate() {
                src.push_str(&source::fused_kernel(&format!("rlx_fused_{i}"), f));
            }
            Some(dev.module(&src)?)
        };
        let funcs = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Launch { kernel, .. } => match kernel {
                    Kernel::Library(name) => lib.func(name).map(Some),
                    Kernel::Fused(i) => fused_mod
                        .as_ref()
                        .expect("fused kernels compiled")
                        .func(&format!("rlx_fused_{i}"))
                        .map(Some),
                },
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let scratch = CudaBuffer::zeroed(dev.clone(), plan.scratch_bytes)?;
        Ok(CudaProgram {
            dev,
            plan,
            funcs,
            lens: lens.to_vec(),
            scratch,
        })
    }

    fn run_steps(&self, bases: &[u64; 5], hyper: Option<&OptimHyper>) -> Result<()> {
        let row = hyper.map(plan::hyper_row);
        let row_bytes: Vec<u8> = row
            .iter()
            .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
            .collect();
        let addr = |l: &plan::Loc| bases[l.buf] + l.offset as u64;
        self.dev.memset_async(
            addr(&plan::Loc {
                buf: plan::SCRATCH,
                offset: plan::ERR_AT,
            }),
            16,
        )?;
        for (step, func) in self.plan.steps.iter().zip(&self.funcs) {
            match step {
                Step::Launch {
                    grid,
                    block,
                    p,
                    operands,
                    ..
                } => {
                    let mut p = **p;
                    for (slot, loc) in operands {
                        p.ptr[*slot] = addr(loc);
                    }
                    self.dev.launch(
                        func.expect("launch steps have functions"),
                        *grid,
                        *block,
                        &mut p,
                    )?;
                }
                Step::Fill { at, bytes } => self.dev.memset_async(addr(at), *bytes)?,
                Step::Gemm { g, a, b, c } => self.dev.gemm(g, addr(a), addr(b), addr(c))?,
                Step::HyperRow { at } => {
                    if row_bytes.is_empty() {
                        return Err(Error::Graph(
                            "optimizer step without hyper-parameters".into(),
                        ));
                    }
                    // SAFETY: `row_bytes` lives until the stream is synchronised below (in
                    // `run`, before this function's caller returns).
                    unsafe { self.dev.write_async(addr(at), &row_bytes)? };
                }
            }
        }
        // `row_bytes` must outlive the queued copy.
        let r = self.dev.sync();
        drop(row_bytes);
        r
    }

    /// The first failure a kernel flagged in this run, as the CPU backend reports it.
    fn flagged(&self) -> Result<()> {
        let mut w = [0u8; 8];
        self.scratch.read(plan::ERR_AT, &mut w)?;
        let code = i32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let value = i32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        match code {
            0 => Ok(()),
            source::err::LABEL => Err(Error::input(
                "labels",
                format!(
                    "[cross_entropy] label {value} is out of range [0, {})",
                    self.plan.classes.unwrap_or(0)
                ),
            )),
            source::err::ID => Err(Error::input(
                "ids",
                format!(
                    "[gather] id {value} is out of range [0, {})",
                    self.plan.rows.unwrap_or(0)
                ),
            )),
            source::err::INT_DIV_ZERO => {
                let (name, shape) =
                    self.plan.int_div.clone().unwrap_or_else(|| {
                        ("floor_divide".into(), rlx_ir::Shape::new([0usize; 0]))
                    });
                Err(Error::Graph(format!(
                    "[{name}] integer division by zero (the int32 divisor {shape} holds a 0)"
                )))
            }
            c => Err(Error::Internal(format!(
                "[cuda] unknown kernel error code {c}"
            ))),
        }
    }
}

impl Compiled for CudaProgram {
    unsafe fn run(
        &mut self,
        buffers: &[&dyn DeviceBuffer],
        hyper: Option<&OptimHyper>,
    ) -> Result<()> {
        let mut bases = [0u64; 5];
        for (i, &len) in self.lens.iter().enumerate() {
            if len == 0 {
                continue;
            }
            let b = buffers.get(i).ok_or_else(|| {
                Error::Internal(format!(
                    "the program needs buffer {i}, the run gave {}",
                    buffers.len()
                ))
            })?;
            if b.len() < len {
                return Err(Error::Internal(format!(
                    "buffer {i} has {} bytes, the program was compiled for {len}",
                    b.len()
                )));
            }
            let c = CudaBuffer::of(*b).ok_or_else(|| {
                Error::Device("a cuda program runs only over cuda buffers".into())
            })?;
            if c.device().ordinal != self.dev.ordinal {
                return Err(Error::Device(
                    "a buffer of another GPU was given to this program".into(),
                ));
            }
            bases[i] = c.device_ptr();
        }
        bases[plan::SCRATCH] = self.scratch.device_ptr();
        let _one_at_a_time = self.dev.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.dev.bind()?;
        self.run_steps(&bases, hyper)?;
        self.flagged()
    }
}
