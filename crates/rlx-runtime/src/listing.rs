//! A readable text listing of a lowered program: one line per instruction with its operands'
//! buffers, byte offsets, shapes and dtypes (`step.graph()` / `fn.graph()` in Python).
use crate::{Buf, Instr, MemoryReport, Program, Store, TRef};
use rlx_ir::Op;
use std::fmt::Write;

/// An op's name, with the operand transposes of a matrix product and a fused expression's steps
/// (`r0`.. are the operands in order; in a matmul epilogue `r0` is the product and `r1`.. the
/// operands after `a` and `b`).
fn op_name(op: &Op) -> String {
    match op {
        Op::Fused(f) => format!("fused[{f}]"),
        Op::FusedSumTo { expr, .. } => format!("fused_sum_to[{expr}]"),
        Op::MatMul { trans_a, trans_b } => format!(
            "matmul{}{}",
            if *trans_a { "[a^T]" } else { "" },
            if *trans_b { "[b^T]" } else { "" }
        ),
        Op::MatMulEpilogue {
            trans_a,
            trans_b,
            epilogue,
        } => format!(
            "matmul_epilogue{}{}[r0=a@b; {epilogue}]",
            if *trans_a { "[a^T]" } else { "" },
            if *trans_b { "[b^T]" } else { "" }
        ),
        Op::Attention { causal, heads, .. } | Op::AttentionGrad { causal, heads, .. } => format!(
            "{}[{}{}]",
            op.name(),
            causal.map_or("no mask".to_string(), |o| format!("causal {o:+}")),
            heads.map_or(String::new(), |h| format!(", packed {h} heads"))
        ),
        other => other.name().to_string(),
    }
}

fn place_at(t: &TRef) -> String {
    let buf = match t.buf {
        Buf::Arena => "arena",
        Buf::Params => "params",
        Buf::State => "state",
        Buf::Stage => "stage",
    };
    format!("{} {}@{buf}+{}", t.dtype, t.shape, t.offset)
}

/// The listing of `program` with its inputs, outputs and memory summary; tensors in the weight
/// and optimizer stores are shown with their names.
pub fn program(
    program: &Program,
    inputs: &[String],
    outputs: &[TRef],
    memory: &MemoryReport,
    stores: (&Store, Option<&Store>),
) -> String {
    let place = |t: &TRef| -> String {
        let store = match t.buf {
            Buf::Params => Some(stores.0),
            Buf::State => stores.1,
            _ => None,
        };
        let name = store.and_then(|st| {
            st.entries()
                .iter()
                .find(|e| e.offset == t.offset && e.shape == t.shape)
                .map(|e| e.name.clone())
        });
        match name {
            Some(n) => format!("{} '{n}'", place_at(t)),
            None => place_at(t),
        }
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "program: {} instructions; arena {} bytes (naive {}), params {} bytes, optimizer state {} bytes",
        program.instrs.len(),
        memory.arena_bytes,
        memory.naive_bytes,
        memory.param_bytes,
        memory.optimizer_state_bytes
    );
    let _ = writeln!(s, "inputs: {}", inputs.join(", "));
    for (i, instr) in program.instrs.iter().enumerate() {
        match instr {
            Instr::Op { op, ins, out } => {
                let args: Vec<String> = ins.iter().map(&place).collect();
                let _ = writeln!(
                    s,
                    "{i:4}  {} = {}({})",
                    place(out),
                    op_name(op),
                    args.join(", ")
                );
            }
            Instr::Update(plan) => {
                let mut opts = Vec::new();
                if let Some(c) = plan.clip {
                    opts.push(format!("clip_grad_norm={c}"));
                }
                if plan.accumulate > 1 {
                    opts.push(format!("accumulate={}", plan.accumulate));
                }
                if plan.skip_nonfinite {
                    opts.push("skip_nonfinite".to_string());
                }
                let _ = writeln!(
                    s,
                    "{i:4}  update {:?} over {} parameters{}{}",
                    plan.rule,
                    plan.params.len(),
                    if opts.is_empty() { "" } else { ": " },
                    opts.join(", ")
                );
                for p in &plan.params {
                    let _ = writeln!(s, "        {} -= f({})", place(&p.param), place(&p.grad));
                }
                for (src, dst) in &plan.buffer_updates {
                    let _ = writeln!(s, "        {} = {}", place(dst), place(src));
                }
            }
        }
    }
    let outs: Vec<String> = outputs.iter().map(&place).collect();
    let _ = writeln!(s, "outputs: {}", outs.join(", "));
    s
}
