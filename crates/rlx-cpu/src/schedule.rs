//! The order the CPU runs a program's instructions in, and which pairs it runs together:
//! conv2d's patch copies with the products beside them, image by image
//! (`kernels::conv_gemm`), and two independent products side by side, one on each thread
//! (a layer's input and weight gradients: the same work, each on a core of its own rather
//! than both split). A pair is formed only where running it changes no result: the
//! instructions read and write the same bytes as one after the other would, an instruction
//! moved past others touches nothing they touch, and a pair's output never overwrites an input
//! it still has to read (where the planner reused that memory, the input is first copied).
//! A pair splits its work over the threads by image only, so it is formed only for batches of
//! at least two images a thread (a smaller batch's products are split over the threads
//! instead). `RLX_CPU_CONV_PIPE=0` turns pairing off (read at each compile). The snapshot copy
//! above is the patch pairs'; a product pair needs none: the memory planner asks this file
//! (`nodes_run_together`, through `Backend::runs_together`) which products it pairs and keeps
//! the first's inputs out of the second's output.
use rlx_ir::{DType, Graph, NodeId, Op, Shape};
use rlx_runtime::{Instr, TRef};

/// One position of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Instruction `i` alone.
    One(usize),
    /// `im2col` (the first instruction) and the product that reads its patches (the next one).
    /// `snapshot`: the product's output overlaps the image the patches come from, so the image
    /// is copied first.
    Im2ColMatMul {
        im2col: usize,
        matmul: usize,
        snapshot: bool,
    },
    /// The product that writes patches and the `col2im` that reads them, run where the `col2im`
    /// was (the product moved down past the instructions between them).
    MatMulCol2Im { matmul: usize, col2im: usize },
    /// Two adjacent products that share no written byte with each other, run at the same time,
    /// each on its own share of the threads (`RLX_CPU_MATMUL_PAIRS=0` turns this off, read at
    /// each compile).
    Both { first: usize, second: usize },
}

impl Step {
    /// The instructions this step runs, in program order.
    pub fn instrs(self) -> Vec<usize> {
        match self {
            Step::One(i) => vec![i],
            Step::Im2ColMatMul { im2col, matmul, .. } => vec![im2col, matmul],
            Step::MatMulCol2Im { matmul, col2im } => vec![matmul, col2im],
            Step::Both { first, second } => vec![first, second],
        }
    }
}

/// The schedule of `instrs` for a pool of `threads`: every instruction exactly once.
pub fn schedule(instrs: &[Instr], threads: usize) -> Vec<Step> {
    let off = std::env::var("RLX_CPU_CONV_PIPE").is_ok_and(|v| v == "0");
    let side_by_side = pairs_on(threads);
    let n = instrs.len();
    // For each instruction that ends a pair, the pair; producers moved into a pair are skipped.
    let mut ends: Vec<Option<Step>> = vec![None; n];
    let mut moved = vec![false; n];
    for i in 0..n {
        if off || moved[i] || ends[i].is_some() {
            continue;
        }
        if let Some(step) = forward_pair(instrs, i, threads) {
            ends[i + 1] = Some(step);
            moved[i] = true;
        } else if let Some(j) = backward_pair(instrs, i, &ends, threads) {
            ends[j] = Some(Step::MatMulCol2Im {
                matmul: i,
                col2im: j,
            });
            moved[i] = true;
        }
    }
    let mut steps: Vec<Step> = (0..n)
        .filter(|&i| !moved[i])
        .map(|i| ends[i].unwrap_or(Step::One(i)))
        .collect();
    if side_by_side {
        let mut k = 0;
        while k + 1 < steps.len() {
            if let (Step::One(a), Step::One(b)) = (steps[k], steps[k + 1]) {
                if b == a + 1 && independent_products(&instrs[a], &instrs[b]) {
                    steps[k] = Step::Both {
                        first: a,
                        second: b,
                    };
                    steps.remove(k + 1);
                }
            }
            k += 1;
        }
    }
    steps
}

/// Whether independent products may run side by side with a pool of `threads`
/// (`RLX_CPU_MATMUL_PAIRS=0` turns it off; read at each compile).
pub fn pairs_on(threads: usize) -> bool {
    threads >= 2 && !std::env::var("RLX_CPU_MATMUL_PAIRS").is_ok_and(|v| v == "0")
}

/// Multiply-adds of a product (`None` for any other op): `a` is its first operand's dims.
fn product_work(op: &Op, a: &[usize], out: &Shape) -> Option<usize> {
    let (Op::MatMul { trans_a, .. } | Op::MatMulEpilogue { trans_a, .. }) = op else {
        return None;
    };
    if a.len() < 2 {
        return None;
    }
    let k = if *trans_a {
        a[a.len() - 2]
    } else {
        a[a.len() - 1]
    };
    Some(out.numel() * k)
}

/// Products below this many multiply-adds are not worth a pair (a join costs a few
/// microseconds).
const PAIR_MIN_WORK: usize = 1 << 18;

/// Whether two products of `wx` and `wy` multiply-adds are worth running side by side: each
/// large enough, neither more than 3x the other (a layer's input and weight gradients are
/// equal), so neither thread waits long for the other.
fn worth_a_pair(wx: usize, wy: usize) -> bool {
    wx.min(wy) >= PAIR_MIN_WORK && wx.max(wy) <= 3 * wx.min(wy)
}

/// Graph nodes `a` and `b` (`b` the next computing node, not reading `a`) as the planner
/// asks (`Backend::runs_together`): both float32 products worth a pair. The schedule still
/// checks the planned bytes before pairing them.
pub fn nodes_run_together(graph: &Graph, a: NodeId, b: NodeId, threads: usize) -> bool {
    let work = |id: NodeId| {
        let node = graph.node(id);
        let first = graph.node(*node.inputs.first()?);
        (node.dtype == DType::F32).then_some(())?;
        product_work(&node.op, first.shape.dims(), &node.shape)
    };
    pairs_on(threads)
        && match (work(a), work(b)) {
            (Some(wa), Some(wb)) => worth_a_pair(wa, wb),
            _ => false,
        }
}

/// Whether two products may run at the same time: neither writes a byte the other reads or
/// writes, and their work is within 3x of each other (a layer's input and weight gradients are
/// equal), so neither thread waits long for the other.
fn independent_products(x: &Instr, y: &Instr) -> bool {
    let (Some((ox, ix, outx)), Some((oy, iy, outy))) = (op(x), op(y)) else {
        return false;
    };
    let work =
        |op, ins: &[TRef], out: &TRef| product_work(op, ins.first()?.shape.dims(), &out.shape);
    let (Some(wx), Some(wy)) = (work(ox, ix, outx), work(oy, iy, outy)) else {
        return false;
    };
    let disjoint = !overlap(outx, outy)
        && iy.iter().all(|t| !overlap(t, outx))
        && ix.iter().all(|t| !overlap(t, outy));
    disjoint && worth_a_pair(wx, wy)
}

/// The instruction's op, inputs and output (`None` for the optimizer update).
fn op(instr: &Instr) -> Option<(&Op, &[TRef], &TRef)> {
    match instr {
        Instr::Op { op, ins, out } => Some((op, ins, out)),
        Instr::Update(_) => None,
    }
}

/// Whether two tensors share a byte.
fn overlap(a: &TRef, b: &TRef) -> bool {
    a.buf == b.buf
        && a.bytes() > 0
        && b.bytes() > 0
        && a.offset < b.offset + b.bytes()
        && b.offset < a.offset + a.bytes()
}

/// Whether a batch (`t`'s first dim) gives every thread at least two images.
fn enough_images(t: &TRef, threads: usize) -> bool {
    t.shape.dims().first().copied().unwrap_or(0) >= 2 * threads.max(1)
}

fn all_f32(ins: &[TRef], out: &TRef) -> bool {
    out.dtype == DType::F32 && ins.iter().all(|t| t.dtype == DType::F32)
}

/// `im2col` (tap-major) at `i` followed by a float32 product `w @ patches` (a 2-D `w`,
/// neither operand transposed, an optional epilogue) that reads the patches as its right
/// operand and nothing else of them.
fn forward_pair(instrs: &[Instr], i: usize, threads: usize) -> Option<Step> {
    let (Op::Im2Col { k_major: true, .. }, [x], cols) = op(instrs.get(i)?)? else {
        return None;
    };
    let (mm, ins, out) = op(instrs.get(i + 1)?)?;
    let plain = matches!(
        mm,
        Op::MatMul {
            trans_a: false,
            trans_b: false
        } | Op::MatMulEpilogue {
            trans_a: false,
            trans_b: false,
            ..
        }
    );
    let fits = plain
        && all_f32(ins, out)
        && x.dtype == DType::F32
        && ins.len() >= 2
        && ins[1] == *cols
        && ins[0].shape.rank() == 2
        && out.shape.dims().first() == x.shape.dims().first()
        && enough_images(x, threads)
        && ins
            .iter()
            .enumerate()
            .all(|(k, t)| k == 1 || !overlap(t, cols));
    fits.then_some(Step::Im2ColMatMul {
        im2col: i,
        matmul: i + 1,
        snapshot: overlap(out, x),
    })
}

/// A float32 product `op(w) @ dy` at `i` (a 2-D `w`, `dy` not transposed) whose output is the
/// patches a later tap-major `col2im` reads, where the product may run just before that
/// `col2im`: no instruction between them reads or writes the patches, or writes what the
/// product reads, and the `col2im`'s output overlaps nothing the product reads.
fn backward_pair(
    instrs: &[Instr],
    i: usize,
    ends: &[Option<Step>],
    threads: usize,
) -> Option<usize> {
    let (Op::MatMul { trans_b: false, .. }, ins @ [w, dy], cols) = op(instrs.get(i)?)? else {
        return None;
    };
    if !all_f32(ins, cols)
        || w.shape.rank() != 2
        || dy.shape.rank() != 3
        || !enough_images(dy, threads)
    {
        return None;
    }
    for j in i + 1..instrs.len() {
        let (o, ins, out) = op(&instrs[j])?;
        if matches!(o, Op::Col2Im { k_major: true, .. }) && ins.len() == 1 && ins[0] == *cols {
            let fits = ends[j].is_none()
                && out.dtype == DType::F32
                && out.shape.dims().first() == dy.shape.dims().first()
                && !overlap(out, w)
                && !overlap(out, dy);
            return fits.then_some(j);
        }
        // Instruction `j` runs before the product once it moves: it must not see the patches,
        // nor change what the product reads.
        let touches = ins.iter().any(|t| overlap(t, cols))
            || overlap(out, cols)
            || overlap(out, w)
            || overlap(out, dy);
        if touches || ends[j].is_some() {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{Shape, UnaryOp, Window};
    use rlx_runtime::Buf;

    fn t(offset: usize, dims: &[usize]) -> TRef {
        TRef {
            buf: Buf::Arena,
            offset,
            shape: Shape::new(dims.to_vec()),
            dtype: DType::F32,
        }
    }

    fn instr(op: Op, ins: Vec<TRef>, out: TRef) -> Instr {
        Instr::Op { op, ins, out }
    }

    const W: Window = Window {
        kernel: [3, 3],
        stride: [1, 1],
        padding: [1, 1],
    };

    /// x [2, 4, 16, 16] at 0; patches [2, 36, 256] at 1 MB; conv output [2, 8, 16, 16] at `y`.
    fn forward(y: usize) -> Vec<Instr> {
        let (x, cols) = (t(0, &[2, 4, 16, 16]), t(1 << 20, &[2, 36, 256]));
        let w = TRef {
            buf: Buf::Params,
            ..t(0, &[8, 36])
        };
        vec![
            instr(
                Op::Im2Col {
                    window: W,
                    k_major: true,
                },
                vec![x],
                cols.clone(),
            ),
            instr(
                Op::MatMul {
                    trans_a: false,
                    trans_b: false,
                },
                vec![w, cols],
                t(y, &[2, 8, 256]),
            ),
        ]
    }

    #[test]
    fn im2col_and_its_product_pair_and_an_overwritten_image_is_copied_first() {
        let im = |snapshot| Step::Im2ColMatMul {
            im2col: 0,
            matmul: 1,
            snapshot,
        };
        assert_eq!(schedule(&forward(2 << 20), 1), vec![im(false)]);
        // The product's output reuses the image's memory.
        assert_eq!(schedule(&forward(4096), 1), vec![im(true)]);
        // A position-major im2col is not paired.
        let mut p = forward(2 << 20);
        if let Instr::Op { op, .. } = &mut p[0] {
            *op = Op::Im2Col {
                window: W,
                k_major: false,
            };
        }
        assert_eq!(schedule(&p, 1), vec![Step::One(0), Step::One(1)]);
        // Two images cannot give two threads two each: the product is split instead.
        assert_eq!(
            schedule(&forward(2 << 20), 2),
            vec![Step::One(0), Step::One(1)]
        );
    }

    /// dy [2, 8, 256] at 0; patches' gradient [2, 36, 256] at 1 MB; then `between`; then
    /// col2im into dx [2, 4, 16, 16] at 2 MB.
    fn backward(between: Instr) -> Vec<Instr> {
        let (dy, cols) = (t(0, &[2, 8, 256]), t(1 << 20, &[2, 36, 256]));
        let w = TRef {
            buf: Buf::Params,
            ..t(0, &[8, 36])
        };
        vec![
            instr(
                Op::MatMul {
                    trans_a: true,
                    trans_b: false,
                },
                vec![w, dy],
                cols.clone(),
            ),
            between,
            instr(
                Op::Col2Im {
                    window: W,
                    k_major: true,
                    size: [16, 16],
                },
                vec![cols],
                t(2 << 20, &[2, 4, 16, 16]),
            ),
        ]
    }

    fn relu(from: usize, to: usize) -> Instr {
        instr(Op::Unary(UnaryOp::Relu), vec![t(from, &[64])], t(to, &[64]))
    }

    #[test]
    fn a_product_moves_down_to_its_col2im_only_past_instructions_that_do_not_touch_it() {
        let pair = Step::MatMulCol2Im {
            matmul: 0,
            col2im: 2,
        };
        let far = 3 << 20;
        assert_eq!(
            schedule(&backward(relu(far, far + 4096)), 1),
            vec![Step::One(1), pair]
        );
        // The instruction between overwrites the product's input, reads its output, or
        // writes its output: the order stays.
        let kept = vec![Step::One(0), Step::One(1), Step::One(2)];
        assert_eq!(schedule(&backward(relu(far, 0)), 1), kept);
        assert_eq!(schedule(&backward(relu(1 << 20, far)), 1), kept);
        assert_eq!(schedule(&backward(relu(far, (1 << 20) + 64)), 1), kept);
    }

    /// A layer's input-gradient product (dy [64, 256] @ w [256, 256]) and weight-gradient product
    /// (dy^T @ x [64, 256]); `dx` and `dw` are where their outputs go.
    fn gradients(dx: usize, dw: usize) -> Vec<Instr> {
        let (dy, x) = (t(0, &[64, 256]), t(65536, &[64, 256]));
        let w = TRef {
            buf: Buf::Params,
            ..t(0, &[256, 256])
        };
        let mm = |ta| Op::MatMul {
            trans_a: ta,
            trans_b: false,
        };
        vec![
            instr(mm(false), vec![dy.clone(), w], t(dx, &[64, 256])),
            instr(mm(true), vec![dy, x], t(dw, &[256, 256])),
        ]
    }

    #[test]
    fn independent_products_run_side_by_side_only_where_nothing_written_is_shared() {
        let both = vec![Step::Both {
            first: 0,
            second: 1,
        }];
        let apart = vec![Step::One(0), Step::One(1)];
        assert_eq!(schedule(&gradients(1 << 20, 2 << 20), 2), both);
        // One thread: nothing to run beside.
        assert_eq!(schedule(&gradients(1 << 20, 2 << 20), 1), apart);
        // The second writes over what the first reads (dy), or over the first's output.
        assert_eq!(schedule(&gradients(1 << 20, 0), 2), apart);
        assert_eq!(schedule(&gradients(1 << 20, (1 << 20) + 4096), 2), apart);
        // The first writes over what the second reads (x).
        assert_eq!(schedule(&gradients(65536 + 256, 2 << 20), 2), apart);
        // An elementwise instruction is not a product.
        let mut p = gradients(1 << 20, 2 << 20);
        p[0] = relu(3 << 20, 4 << 20);
        assert_eq!(schedule(&p, 2), apart);
        // Work far apart (a tiny product beside a large one) is not paired either.
        let mut p = gradients(1 << 20, 2 << 20);
        if let Instr::Op { ins, .. } = &mut p[1] {
            ins[0] = t(0, &[2, 256]);
            ins[1] = t(65536, &[2, 256]);
        }
        assert_eq!(schedule(&p, 2), apart);
    }
}
