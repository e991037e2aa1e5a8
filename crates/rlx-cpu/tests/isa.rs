//! The baseline, AVX2+FMA and AVX-512 copies of the kernels give bit-identical results (one test in its own
//! binary: forcing the instruction set is process-wide).
mod common;

use common::*;
use rlx_cpu::isa::{self, Isa};
use rlx_ir::{BinaryOp, Op, ReduceOp, UnaryOp};

#[test]
fn portable_and_avx2_kernels_agree_bitwise() {
    // 300 x 1001: rows with vector tails, and large enough for the parallel paths.
    let x = rand(&[300, 1001], 1);
    let y = rand(&[1001], 2);
    let cases: Vec<(Op, Vec<Value>)> = vec![
        (Op::Unary(UnaryOp::Gelu), vec![x.clone()]),
        (Op::Unary(UnaryOp::GeluTanhDeriv), vec![x.clone()]),
        (Op::Unary(UnaryOp::Exp), vec![x.clone()]),
        (Op::Unary(UnaryOp::Tanh), vec![x.clone()]),
        (Op::Unary(UnaryOp::Sigmoid), vec![x.clone()]),
        (Op::Binary(BinaryOp::Div), vec![x.clone(), y.clone()]),
        (Op::Binary(BinaryOp::Mod), vec![x.clone(), y.clone()]),
        (Op::Softmax { axis: 1 }, vec![x.clone()]),
        (Op::LogSoftmax { axis: 0 }, vec![x.clone()]),
        (Op::Normalize { eps: 1e-5 }, vec![x.clone()]),
        (
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![1],
                keepdims: false,
            },
            vec![x.clone()],
        ),
        (
            Op::Reduce {
                op: ReduceOp::Max,
                axes: vec![0],
                keepdims: false,
            },
            vec![x.clone()],
        ),
    ];
    let run_all = |which: Isa| -> Vec<Vec<u32>> {
        assert!(isa::force(which));
        cases
            .iter()
            .map(|(op, vals)| eval(op.clone(), vals).iter().map(|v| v.to_bits()).collect())
            .collect()
    };
    let portable = run_all(Isa::Portable);
    assert_eq!(isa::current(), Isa::Portable);
    if !isa::avx2_fma_available() {
        return; // nothing to compare against on this CPU
    }
    let mut sets = vec![Isa::Avx2Fma];
    if isa::avx512_available() {
        sets.push(Isa::Avx512);
    } else {
        // Asking for a set the CPU lacks keeps the portable code.
        assert!(!isa::force(Isa::Avx512));
        assert_eq!(isa::current(), Isa::Portable);
    }
    for set in sets {
        let wide = run_all(set);
        assert_eq!(isa::current(), set);
        for ((op, _), (p, a)) in cases.iter().zip(portable.iter().zip(&wide)) {
            let diff = p.iter().zip(a).filter(|(x, y)| x != y).count();
            assert_eq!(
                diff,
                0,
                "{} on {}: {diff} elements differ",
                op.name(),
                set.name()
            );
        }
    }
}
