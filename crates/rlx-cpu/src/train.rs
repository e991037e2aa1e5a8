//! Runs the `Update` instruction on the host: hands the kernel in `kernels::optim` one slice per
//! tensor of the update plan.
use crate::kernels::optim::{self, Hyper, Options, ParamSlot};
use crate::mem::Bases;
use rlx_runtime::{hyper_col, Error, OptimHyper, Result, UpdatePlan};

/// # Safety
/// `CpuProgram::new` must have validated the program (`rlx_runtime::validate`) over `plan.operands()`: every tensor inside its buffer, the
/// written tensors disjoint from each other and from every read tensor.
pub unsafe fn run(b: &Bases, plan: &UpdatePlan, run_hyper: Option<&OptimHyper>) -> Result<()> {
    // SAFETY (every `get`/`get_mut` below): the caller's contract; each written tensor is taken
    // once as `&mut` and no read tensor overlaps a written one.
    let table: Option<&[f32]> = plan.hyper.as_ref().map(|h| unsafe { b.get::<f32>(h) });
    let fallback = match (table, run_hyper) {
        (Some(_), _) => None,
        (None, Some(h)) => Some(Hyper::from_run(h)),
        (None, None) => {
            return Err(Error::Graph(
                "optimizer step without hyper-parameters".into(),
            ))
        }
    };
    let loss = unsafe { b.get::<f32>(&plan.loss) }
        .first()
        .copied()
        .unwrap_or(f32::NAN);
    let stats = unsafe { b.get_mut::<f32>(&plan.stats) };
    let mut slots: Vec<ParamSlot<'_>> = plan
        .params
        .iter()
        .map(|p| {
            let hyper = match (table, fallback) {
                (Some(t), _) => {
                    Hyper::from_row(&t[p.row * hyper_col::LEN..(p.row + 1) * hyper_col::LEN])
                }
                (None, Some(h)) => h,
                (None, None) => unreachable!("checked above"),
            };
            ParamSlot {
                p: unsafe { b.get_mut::<f32>(&p.param) },
                g: unsafe { b.get::<f32>(&p.grad) },
                acc: p.acc.as_ref().map(|a| unsafe { b.get_mut::<f32>(a) }),
                state: p
                    .state
                    .iter()
                    .map(|s| unsafe { b.get_mut::<f32>(s) })
                    .collect(),
                step: &mut unsafe { b.get_mut::<i32>(&p.step) }[0],
                started: p
                    .started
                    .as_ref()
                    .map(|s| &mut unsafe { b.get_mut::<i32>(s) }[0]),
                hyper,
            }
        })
        .collect();
    let opts = Options {
        clip: plan.clip,
        accumulate: plan.accumulate,
        skip_nonfinite: plan.skip_nonfinite,
    };
    let skipped_before = stats[rlx_runtime::stat::SKIPPED];
    optim::train_update(plan.rule, opts, loss, stats, &mut slots);
    if stats[rlx_runtime::stat::SKIPPED] == skipped_before {
        for (src, dst) in &plan.buffer_updates {
            // SAFETY: as above; `dst` (weight store) is disjoint from `src` (arena).
            let (s, d) = unsafe { (b.get::<f32>(src), b.get_mut::<f32>(dst)) };
            d.copy_from_slice(s);
        }
    }
    Ok(())
}
