//! Runs the `Update` instruction on the host: hands the kernel in `kernels::optim` one slice per
//! tensor of the update plan.
use crate::kernels::optim::{self, Float, Hyper, Options, ParamSlot, Slot};
use crate::mem::Bases;
use crate::mem::Elem;
use rlx_ir::DType;
use rlx_runtime::{hyper_col, Error, OptimHyper, Result, TRef, UpdateParam, UpdatePlan};

/// # Safety
/// `CpuProgram::new` must have validated the program (`rlx_runtime::validate`) over `plan.operands()`: every tensor inside its buffer, the
/// written tensors disjoint from each other and from every read tensor.
pub unsafe fn run(b: &Bases, plan: &UpdatePlan, run_hyper: Option<&OptimHyper>) -> Result<()> {
    // SAFETY (every `get`/`get_mut` below): the caller's contract; each written tensor is taken
    // once as `&mut` and no read tensor overlaps a written one.
    // The hyper table: float32, or float64 where a float64 parameter is trained.
    let table: Option<Table<'_>> = plan.hyper.as_ref().map(|h| match h.dtype {
        DType::F64 => Table::F64(unsafe { b.get::<f64>(h) }),
        _ => Table::F32(unsafe { b.get::<f32>(h) }),
    });
    let fallback = match (&table, run_hyper) {
        (Some(_), _) => None,
        (None, Some(h)) => Some(Hyper::from_run(h)),
        (None, None) => {
            return Err(Error::Graph(
                "optimizer step without hyper-parameters".into(),
            ))
        }
    };
    // A float64 model's loss is float64 (checked for finiteness as such); the statistics stay
    // float32.
    let loss = match plan.loss.dtype {
        DType::F64 => unsafe { b.get::<f64>(&plan.loss) }
            .first()
            .copied()
            .unwrap_or(f64::NAN),
        _ => unsafe { b.get::<f32>(&plan.loss) }
            .first()
            .map_or(f64::NAN, |&l| l as f64),
    };
    let stats = unsafe { b.get_mut::<f32>(&plan.stats) };
    let mut slots: Vec<Slot<'_>> = plan
        .params
        .iter()
        .map(|p| {
            let row = p.row * hyper_col::LEN..(p.row + 1) * hyper_col::LEN;
            let hyper = match (&table, fallback) {
                (Some(Table::F32(t)), _) => Hyper::from_row(&t[row]),
                (Some(Table::F64(t)), _) => Hyper::from_row(&t[row]),
                (None, Some(h)) => h,
                (None, None) => unreachable!("checked above"),
            };
            // SAFETY: the caller's contract (above).
            match p.param.dtype {
                DType::F64 => Slot::F64(unsafe { slot(b, p, hyper) }),
                _ => Slot::F32(unsafe { slot(b, p, hyper) }),
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
            // SAFETY: as above; `dst` (weight store) is disjoint from `src` (arena), and both
            // have one dtype (`check_dtypes`), copied element by element at its size.
            unsafe {
                match src.dtype.size() {
                    8 => copy::<u64>(b, src, dst),
                    2 => copy::<u16>(b, src, dst),
                    1 => copy::<u8>(b, src, dst),
                    _ => copy::<u32>(b, src, dst),
                }
            }
        }
    }
    Ok(())
}

/// One parameter's tensors viewed as `T` (its dtype: `plan_update` gives the gradient, the
/// state and the accumulation buffer the parameter's dtype).
///
/// # Safety
/// As [`run`]'s.
unsafe fn slot<'a, T: Float + Elem>(
    b: &'a Bases,
    p: &UpdateParam,
    hyper: Hyper,
) -> ParamSlot<'a, T> {
    // SAFETY (every `get`/`get_mut`): the caller's contract; each written tensor is taken once
    // as `&mut` and no read tensor overlaps a written one.
    unsafe {
        ParamSlot {
            p: b.get_mut::<T>(&p.param),
            g: b.get::<T>(&p.grad),
            acc: p.acc.as_ref().map(|a| b.get_mut::<T>(a)),
            state: p.state.iter().map(|s| b.get_mut::<T>(s)).collect(),
            step: &mut b.get_mut::<i32>(&p.step)[0],
            started: p.started.as_ref().map(|s| &mut b.get_mut::<i32>(s)[0]),
            hyper,
        }
    }
}

/// The optimizer's `hyper` table as stored.
enum Table<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// `dst = src` for two tensors of one dtype whose elements are `T`-sized.
///
/// # Safety
/// As [`run`]'s; `src` and `dst` are disjoint.
unsafe fn copy<T: Elem>(b: &Bases, src: &TRef, dst: &TRef) {
    // SAFETY: the caller's contract.
    let (s, d) = unsafe { (b.get::<T>(src), b.get_mut::<T>(dst)) };
    d.copy_from_slice(s);
}
