//! Kernel source for fused element-wise expressions (`rlx_ir::Fused`), shared by the GPU
//! backends: one statement per expression step over float32 locals, in a C-family dialect that
//! names its math functions and float literals (CUDA C, MSL). Helpers the text calls (`rx_relu`,
//! `rx_sigmoid`, `rx_gelu*`, `rx_floor_div`, `rx_rem`) come from each backend's kernel prelude,
//! where they compute what the CPU kernels compute. Pure string building, tested without a GPU.
use rlx_ir::{BinaryOp, Fused, FusedStep, UnaryOp};

/// How a dialect spells float32 math and exact float literals.
#[derive(Clone, Copy, Debug)]
pub struct Dialect {
    pub exp: &'static str,
    pub log: &'static str,
    pub tanh: &'static str,
    pub sqrt: &'static str,
    /// `pow(x, y)` for any sign of `x` (integral `y` on a negative base), as the CPU computes.
    pub pow: &'static str,
    /// The macro or function turning a 32-bit pattern (written as a hex literal) into a float.
    pub bits: &'static str,
}

impl Dialect {
    pub const CUDA: Dialect = Dialect {
        exp: "expf",
        log: "logf",
        tanh: "tanhf",
        sqrt: "sqrtf",
        pow: "powf",
        bits: "__int_as_float",
    };

    /// A bit-exact float literal.
    pub fn lit(&self, v: f32) -> String {
        format!("{}({:#x})", self.bits, v.to_bits() as i32)
    }

    pub fn unary(&self, u: UnaryOp, a: &str) -> String {
        match u {
            UnaryOp::Neg => format!("(-{a})"),
            UnaryOp::Relu => format!("rx_relu({a})"),
            UnaryOp::Tanh => format!("{}({a})", self.tanh),
            UnaryOp::Sigmoid => format!("rx_sigmoid({a})"),
            UnaryOp::Exp => format!("{}({a})", self.exp),
            UnaryOp::Log => format!("{}({a})", self.log),
            UnaryOp::Sqrt => format!("{}({a})", self.sqrt),
            UnaryOp::PowScalar(2.0) => format!("({a} * {a})"),
            UnaryOp::PowScalar(p) => format!("{}({a}, {})", self.pow, self.lit(p)),
            UnaryOp::Gelu => format!("rx_gelu({a})"),
            UnaryOp::GeluTanh => format!("rx_gelu_tanh({a})"),
            UnaryOp::GeluDeriv => format!("rx_gelu_deriv({a})"),
            UnaryOp::GeluTanhDeriv => format!("rx_gelu_tanh_deriv({a})"),
        }
    }

    pub fn binary(&self, b: BinaryOp, x: &str, y: &str) -> String {
        let cmp = |o: &str| format!("(({x} {o} {y}) ? 1.0f : 0.0f)");
        match b {
            BinaryOp::Add => format!("({x} + {y})"),
            BinaryOp::Sub => format!("({x} - {y})"),
            BinaryOp::Mul => format!("({x} * {y})"),
            BinaryOp::Div => format!("({x} / {y})"),
            BinaryOp::FloorDiv => format!("rx_floor_div({x}, {y})"),
            BinaryOp::Mod => format!("rx_rem({x}, {y})"),
            BinaryOp::Lt => cmp("<"),
            BinaryOp::Le => cmp("<="),
            BinaryOp::Gt => cmp(">"),
            BinaryOp::Ge => cmp(">="),
            BinaryOp::Eq => cmp("=="),
            BinaryOp::Ne => cmp("!="),
        }
    }

    /// The statements evaluating `f` for one element: `load(k)` is the expression reading input
    /// `k`; register `r{k}` holds input `k`, then one register per step. Returns the statements
    /// and the name of the register holding the result.
    pub fn body(&self, f: &Fused, load: impl Fn(usize) -> String) -> (String, String) {
        let mut body = String::new();
        for k in 0..f.n_inputs {
            body.push_str(&format!("    float r{k} = {};\n", load(k)));
        }
        let r = |i: u16| format!("r{i}");
        for (s, step) in f.steps.iter().enumerate() {
            let out = f.n_inputs + s;
            let e = match *step {
                FusedStep::Unary(u, a) => self.unary(u, &r(a)),
                FusedStep::Binary(b, x, y) => self.binary(b, &r(x), &r(y)),
                FusedStep::Where(c, x, y) => {
                    format!("({} != 0.0f ? {} : {})", r(c), r(x), r(y))
                }
            };
            body.push_str(&format!("    float r{out} = {e};\n"));
        }
        let last = format!("r{}", (f.n_inputs + f.steps.len()).saturating_sub(1));
        (body, last)
    }
}

/// A stable 64-bit FNV-1a hash (names kernels and keys caches).
pub fn hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::Shape;

    #[test]
    fn body_reads_inputs_and_names_the_last_register() {
        let f = Fused {
            shape: Shape::new([4]),
            n_inputs: 2,
            steps: vec![
                FusedStep::Binary(BinaryOp::Add, 0, 1),
                FusedStep::Unary(UnaryOp::Exp, 2),
                FusedStep::Unary(UnaryOp::PowScalar(3.0), 3),
            ],
        };
        let d = Dialect {
            exp: "EXP",
            log: "LOG",
            tanh: "TANH",
            sqrt: "SQRT",
            pow: "POW",
            bits: "BITS",
        };
        let (body, last) = d.body(&f, |k| format!("in{k}"));
        assert!(body.contains("float r0 = in0;"), "{body}");
        assert!(body.contains("float r2 = (r0 + r1);"), "{body}");
        assert!(body.contains("float r3 = EXP(r2);"), "{body}");
        assert!(body.contains("POW(r3, BITS(0x40400000))"), "{body}");
        assert_eq!(last, "r4");
    }

    #[test]
    fn every_op_has_an_expression_and_hash_is_stable() {
        let d = Dialect::CUDA;
        for b in [
            BinaryOp::Add,
            BinaryOp::FloorDiv,
            BinaryOp::Mod,
            BinaryOp::Ne,
            BinaryOp::Le,
        ] {
            assert!(!d.binary(b, "a", "b").is_empty());
        }
        assert_eq!(d.unary(UnaryOp::PowScalar(2.0), "x"), "(x * x)");
        assert_eq!(hash("abc"), hash("abc"));
        assert_ne!(hash("abc"), hash("abd"));
        assert_eq!(d.lit(1.0), "__int_as_float(0x3f800000)");
    }
}
