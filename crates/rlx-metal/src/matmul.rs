//! The matrix engine's decisions, platform-neutral: which planned GEMMs run as a compiled
//! matrix-multiplication graph (MPSGraph on Apple, `crate::sys`) instead of the MSL GEMM
//! kernel, whether a GEMM's operands can be expressed as packed arrays over the arena at their
//! byte offsets, which matmul epilogues (bias, activation) the executable computes too, the key
//! an executable is compiled and cached under, the policy that turns the
//! engine off (`RLX_METAL_MPSGRAPH`), and the command-buffer bookkeeping around an encode that
//! may commit and continue the command buffer. Tested on Linux against the host GPU, which runs
//! each engine matmul through the MSL GEMM kernel rebuilt from the key alone.
use crate::kernels::Gemm;
use rlx_ir::{BinaryOp, Error, Fused, FusedStep, Result, UnaryOp};
use rlx_runtime::gpu_plan::{self, P};
use std::ops::Range;

/// A matmul as the engine compiles it, in row-major terms: `C[z] = op(A[z]) op(B[z])` for
/// `z < batch`, with `A` stored packed as `a_batch` matrices of `m x k` (`k x m` when `ta`),
/// `B` as `b_batch` matrices of `k x n` (`n x k` when `tb`) and `C` as `batch` matrices of
/// `m x n`. `a_batch` and `b_batch` are 1 (one matrix for every product) or `batch`. Offsets
/// are not part of the key: one executable serves every placement of the same shapes. With an
/// epilogue, `C = act(op(A) op(B) + bias)`, the bias a vector of `n` broadcast over every row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulKey {
    pub batch: usize,
    pub a_batch: usize,
    pub b_batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub epilogue: Epilogue,
}

/// An activation the engine applies after the product (and bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    Relu,
    Tanh,
    Sigmoid,
}

impl Activation {
    /// The activation of one float32 value, as the MSL kernels compute it (the host engine).
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        }
    }
}

/// What the engine computes after the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Epilogue {
    /// `+ bias`, a packed vector of `n` float32 (the executable's third feed).
    pub bias: bool,
    pub act: Option<Activation>,
}

impl Epilogue {
    pub fn is_none(&self) -> bool {
        !self.bias && self.act.is_none()
    }
}

fn activation(op: UnaryOp) -> Option<Activation> {
    match op {
        UnaryOp::Relu => Some(Activation::Relu),
        UnaryOp::Tanh => Some(Activation::Tanh),
        UnaryOp::Sigmoid => Some(Activation::Sigmoid),
        _ => None,
    }
}

/// The engine's form of a planned matmul epilogue — the fused launch `f` with record `p` (the
/// product its operand 0, contiguous; the result its operand `f.n_inputs`) — over products of
/// `n` columns, or why it has none (the epilogue then stays an MSL kernel after an engine or
/// kernel product). The engine takes `act(product)`, `product + bias` and
/// `act(product + bias)` for relu, tanh and sigmoid, the bias a packed vector of `n` read
/// again for every row.
pub fn epilogue_of(f: &Fused, p: &P, n: usize) -> std::result::Result<Epilogue, String> {
    let no = || format!("the epilogue {f} is not bias + relu/tanh/sigmoid");
    let (bias, rest) = match (f.n_inputs, f.steps.as_slice()) {
        (1, [FusedStep::Unary(op, 0)]) => {
            return Ok(Epilogue {
                bias: false,
                act: Some(activation(*op).ok_or_else(no)?),
            })
        }
        (2, [FusedStep::Binary(BinaryOp::Add, a, b), rest @ ..])
            if (*a, *b) == (0, 1) || (*a, *b) == (1, 0) =>
        {
            (true, rest)
        }
        _ => return Err(no()),
    };
    let act = match rest {
        [] => None,
        [FusedStep::Unary(op, 2)] => Some(activation(*op).ok_or_else(no)?),
        _ => return Err(no()),
    };
    let o = f.n_inputs;
    if p.mode[0] != 1 || p.mode[o] != 1 {
        return Err("the epilogue's product or result is not contiguous".into());
    }
    if bias && !gpu_plan::reads_row_vector(p, 1, n) {
        return Err(format!(
            "the epilogue's bias is not a packed vector of {n} for every row"
        ));
    }
    Ok(Epilogue { bias, act })
}

/// The most elements one engine array may hold (MPSNDArray's limit: below 2^31).
pub const MAX_ARRAY_ELEMENTS: usize = (1 << 31) - 1;

impl MatmulKey {
    /// The bias's shape as a feed: `[1, 1, n]`, broadcast over batches and rows.
    pub fn bias_shape(&self) -> [usize; 3] {
        [1, 1, self.n]
    }

    /// The stored shapes `[batches, rows, cols]` of A, B and C (slowest dimension first).
    pub fn shapes(&self) -> [[usize; 3]; 3] {
        let a = if self.ta {
            [self.a_batch, self.k, self.m]
        } else {
            [self.a_batch, self.m, self.k]
        };
        let b = if self.tb {
            [self.b_batch, self.n, self.k]
        } else {
            [self.b_batch, self.k, self.n]
        };
        [a, b, [self.batch, self.m, self.n]]
    }

    /// Bytes each of A, B and C spans from its offset.
    pub fn bytes(&self) -> [usize; 3] {
        self.shapes().map(|s| s.iter().product::<usize>() * 4)
    }

    /// Multiply-adds of one run (the engine's size threshold compares against it).
    pub fn work(&self) -> usize {
        self.batch * self.m * self.n * self.k
    }

    /// The same product as the MSL GEMM kernel's record over the given addresses (the host
    /// GPU runs engine matmuls this way, so a wrong key gives wrong numbers in the tests).
    pub fn as_gemm(&self, a: u64, b: u64, c: u64) -> Gemm {
        let (m, n, k) = (self.m, self.n, self.k);
        Gemm {
            a,
            b,
            c,
            m,
            n,
            k,
            batch: self.batch,
            a_strides: if self.ta { (1, m) } else { (k, 1) },
            b_strides: if self.tb { (1, k) } else { (n, 1) },
            c_row: n,
            a_batch: if self.a_batch == 1 { 0 } else { m * k },
            b_batch: if self.b_batch == 1 { 0 } else { k * n },
            c_batch: m * n,
        }
    }
}

/// Whether a row-major `rows x cols` operand with element strides `(row, col)` is packed
/// as stored (`Some(false)`), packed transposed (`Some(true)`), or neither (`None`). Size-1
/// dimensions take any stride.
fn packed(rows: usize, cols: usize, (row, col): (usize, usize)) -> Option<bool> {
    let plain = (col == 1 || cols == 1) && (row == cols || rows == 1);
    let trans = (row == 1 || rows == 1) && (col == rows || cols == 1);
    if plain {
        Some(false)
    } else if trans {
        Some(true)
    } else {
        None
    }
}

/// How many stored matrices an operand advancing `stride` elements per product holds:
/// 1 when every product reads the same one, `batch` when they are consecutive packed matrices.
fn batches(batch: usize, stride: usize, size: usize) -> Option<usize> {
    if batch == 1 || stride == 0 {
        Some(1)
    } else if stride == size {
        Some(batch)
    } else {
        None
    }
}

/// The engine's key for a GEMM of the MSL kernel's terms (addresses ignored), or why the
/// engine cannot express it (the GEMM then runs on the MSL kernel).
pub fn key_of(g: &Gemm) -> std::result::Result<MatmulKey, String> {
    let (m, n, k, batch) = (g.m, g.n, g.k, g.batch.max(1));
    let ta = packed(m, k, g.a_strides).ok_or_else(|| {
        format!(
            "A ({m} x {k}) is not packed (element strides {:?})",
            g.a_strides
        )
    })?;
    let tb = packed(k, n, g.b_strides).ok_or_else(|| {
        format!(
            "B ({k} x {n}) is not packed (element strides {:?})",
            g.b_strides
        )
    })?;
    if packed(m, n, (g.c_row, 1)) != Some(false) {
        return Err(format!(
            "C ({m} x {n}) has row stride {}, not packed",
            g.c_row
        ));
    }
    let a_batch = batches(batch, g.a_batch, m * k)
        .ok_or_else(|| format!("A's matrices are {} elements apart, not packed", g.a_batch))?;
    let b_batch = batches(batch, g.b_batch, k * n)
        .ok_or_else(|| format!("B's matrices are {} elements apart, not packed", g.b_batch))?;
    if batches(batch, g.c_batch, m * n) != Some(batch) && batch > 1 {
        return Err(format!(
            "C's matrices are {} elements apart, not packed",
            g.c_batch
        ));
    }
    let key = MatmulKey {
        batch,
        a_batch,
        b_batch,
        m,
        n,
        k,
        ta,
        tb,
        epilogue: Epilogue::default(),
    };
    for (what, s) in ["A", "B", "C"].iter().zip(key.shapes()) {
        let count = s.iter().product::<usize>();
        if count > MAX_ARRAY_ELEMENTS {
            return Err(format!(
                "{what} has {count} elements, more than an MPSNDArray holds"
            ));
        }
    }
    Ok(key)
}

/// Whether a byte offset can start an engine array (a whole float32 element).
pub fn offset_ok(offset: usize) -> std::result::Result<(), String> {
    if offset % 4 == 0 {
        Ok(())
    } else {
        Err(format!("byte offset {offset} is not a float32 boundary"))
    }
}

/// When the engine runs a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulPolicy {
    /// Off: every GEMM runs on the MSL kernel.
    pub enabled: bool,
    /// GEMMs of fewer multiply-adds stay on the MSL kernel (an engine encode costs more fixed
    /// time than a small kernel launch).
    pub min_work: usize,
}

/// The default size threshold: 64^3 multiply-adds. Below it the product is a few microseconds
/// of arithmetic, which a graph encode (an Objective-C call chain and array objects per
/// operand) does not win back. Not measured on Apple hardware: a reasoned default.
pub const DEFAULT_MIN_WORK: usize = 64 * 64 * 64;

impl Default for MatmulPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            min_work: DEFAULT_MIN_WORK,
        }
    }
}

impl MatmulPolicy {
    /// Every GEMM on the MSL kernel.
    pub const OFF: MatmulPolicy = MatmulPolicy {
        enabled: false,
        min_work: 0,
    };
    /// Every expressible GEMM on the engine, however small.
    pub const ALL: MatmulPolicy = MatmulPolicy {
        enabled: true,
        min_work: 0,
    };

    /// The policy a value of `RLX_METAL_MPSGRAPH` asks for: unset or empty, `1`/`on` (the
    /// default threshold), `0`/`off`, `all` (no threshold); anything else is an `Input` error.
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("1") | Some("on") => Ok(Self::default()),
            Some("0") | Some("off") => Ok(Self::OFF),
            Some("all") => Ok(Self::ALL),
            Some(v) => Err(Error::input(
                "RLX_METAL_MPSGRAPH",
                format!("must be 0, off, 1, on or all, not {v:?}"),
            )),
        }
    }

    /// The policy of the environment (`RLX_METAL_MPSGRAPH`).
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var("RLX_METAL_MPSGRAPH").ok().as_deref())
    }

    /// Whether a GEMM of key (or ineligibility) `key` runs on the engine; `Err` says why not.
    pub fn route(
        &self,
        key: std::result::Result<MatmulKey, String>,
    ) -> std::result::Result<MatmulKey, String> {
        if !self.enabled {
            return Err("the engine is off (RLX_METAL_MPSGRAPH=0)".into());
        }
        let key = key?;
        if key.work() < self.min_work {
            return Err(format!(
                "{} multiply-adds, below the engine's threshold of {}",
                key.work(),
                self.min_work
            ));
        }
        Ok(key)
    }
}

/// One stretch of a command buffer's work: kernel dispatches that share one compute encoder,
/// or one engine matmul (encoded with no compute encoder open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    Kernels(Range<usize>),
    Matmul(usize),
}

/// Splits a run's work (`is_matmul[i]` for item `i`) into encoder segments, in order: every
/// maximal run of kernels is one compute encoder, every matmul a segment of its own.
pub fn segments(is_matmul: &[bool]) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &mm) in is_matmul.iter().enumerate() {
        if mm {
            if start < i {
                out.push(Segment::Kernels(start..i));
            }
            out.push(Segment::Matmul(i));
            start = i + 1;
        }
    }
    if start < is_matmul.len() {
        out.push(Segment::Kernels(start..is_matmul.len()));
    }
    out
}

/// The command buffers one submission went through. An engine encode may commit the command
/// buffer it was given and continue on a new one (MPSCommandBuffer's `commitAndContinue`), so
/// after every encode the submission asks for the current one again — a compute encoder is
/// only ever made from the current buffer, after the encode — and keeps each distinct buffer
/// it saw, to wait on and check them all at the end (they complete in order, on one queue).
#[derive(Debug)]
pub struct CommandBuffers<T> {
    seen: Vec<T>,
}

impl<T: PartialEq> CommandBuffers<T> {
    /// Starts with the submission's first command buffer.
    pub fn new(first: T) -> Self {
        Self { seen: vec![first] }
    }
    /// Records the current command buffer after an encode; true when it changed (the encode
    /// committed the previous one).
    pub fn observe(&mut self, current: T) -> bool {
        if self.seen.last() == Some(&current) {
            return false;
        }
        self.seen.push(current);
        true
    }
    /// The current command buffer (the one to encode on and commit).
    pub fn current(&self) -> &T {
        self.seen.last().expect("never empty")
    }
    /// Every command buffer seen, oldest first.
    pub fn all(&self) -> &[T] {
        &self.seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: usize, n: usize, k: usize, batch: usize) -> Gemm {
        MatmulKey {
            batch,
            a_batch: batch,
            b_batch: batch,
            m,
            n,
            k,
            ta: false,
            tb: false,
            epilogue: Epilogue::default(),
        }
        .as_gemm(0, 0, 0)
    }

    #[test]
    fn keys_round_trip_through_the_kernel_terms() {
        for &(batch, a_batch, b_batch) in &[(1, 1, 1), (3, 3, 1), (3, 1, 3), (4, 4, 4)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let key = MatmulKey {
                        batch,
                        a_batch,
                        b_batch,
                        m: 5,
                        n: 7,
                        k: 3,
                        ta,
                        tb,
                        epilogue: Epilogue::default(),
                    };
                    assert_eq!(key_of(&key.as_gemm(1, 2, 3)), Ok(key), "{key:?}");
                }
            }
        }
    }

    #[test]
    fn unpacked_operands_are_refused_with_the_reason() {
        let mut g = gemm(4, 6, 5, 1);
        g.a_strides = (8, 1); // rows padded to 8
        assert!(key_of(&g).unwrap_err().contains("A (4 x 5) is not packed"));
        let mut g = gemm(4, 6, 5, 1);
        g.b_strides = (6, 2);
        assert!(key_of(&g).unwrap_err().contains("B (5 x 6) is not packed"));
        let mut g = gemm(4, 6, 5, 1);
        g.c_row = 7;
        assert!(key_of(&g).unwrap_err().contains("row stride 7"));
        let mut g = gemm(4, 6, 5, 3);
        g.a_batch = 21;
        assert!(key_of(&g).unwrap_err().contains("A's matrices are 21"));
        let mut g = gemm(4, 6, 5, 3);
        g.c_batch = 30;
        assert!(key_of(&g).unwrap_err().contains("C's matrices are 30"));
        let g = gemm(1 << 16, 1 << 16, 2, 1);
        assert!(key_of(&g).unwrap_err().contains("more than an MPSNDArray"));
        assert!(offset_ok(6).unwrap_err().contains("byte offset 6"));
        assert_eq!(offset_ok(1024), Ok(()));
    }

    #[test]
    fn size_one_dimensions_take_any_stride() {
        // a row vector times a matrix: A is 1 x k whatever its row stride says
        let mut g = gemm(1, 6, 5, 1);
        g.a_strides = (999, 1);
        g.c_row = 0;
        let key = key_of(&g).unwrap();
        assert!(!key.ta && key.m == 1);
        // a column: k x 1 stored as 1 x k is the same bytes
        let mut g = gemm(4, 1, 5, 1);
        g.b_strides = (1, 77);
        assert!(key_of(&g).is_ok());
    }

    #[test]
    fn policy_from_the_environment_value_and_threshold() {
        assert_eq!(MatmulPolicy::parse(None).unwrap(), MatmulPolicy::default());
        assert_eq!(MatmulPolicy::parse(Some("0")).unwrap(), MatmulPolicy::OFF);
        assert_eq!(MatmulPolicy::parse(Some("off")).unwrap(), MatmulPolicy::OFF);
        assert_eq!(
            MatmulPolicy::parse(Some(" all ")).unwrap(),
            MatmulPolicy::ALL
        );
        let e = MatmulPolicy::parse(Some("yes")).unwrap_err();
        assert!(matches!(e, Error::Input { .. }), "{e}");
        assert!(e.to_string().contains("RLX_METAL_MPSGRAPH"), "{e}");
        let big = key_of(&gemm(64, 64, 64, 1));
        let small = key_of(&gemm(8, 8, 8, 1));
        let p = MatmulPolicy::default();
        assert!(p.route(big.clone()).is_ok());
        assert!(p
            .route(small.clone())
            .unwrap_err()
            .contains("below the engine's threshold"));
        assert!(MatmulPolicy::ALL.route(small).is_ok());
        assert!(MatmulPolicy::OFF.route(big).unwrap_err().contains("off"));
    }

    #[test]
    fn work_splits_into_encoder_segments() {
        use Segment::*;
        assert_eq!(segments(&[]), vec![]);
        assert_eq!(segments(&[false, false]), vec![Kernels(0..2)]);
        assert_eq!(
            segments(&[true, false, false, true, true, false]),
            vec![
                Matmul(0),
                Kernels(1..3),
                Matmul(3),
                Matmul(4),
                Kernels(5..6)
            ]
        );
    }

    #[test]
    fn command_buffers_follow_commit_and_continue() {
        let mut cbs = CommandBuffers::new(1);
        assert!(!cbs.observe(1));
        assert!(cbs.observe(2));
        assert!(!cbs.observe(2));
        assert!(cbs.observe(3));
        assert_eq!(*cbs.current(), 3);
        assert_eq!(cbs.all(), &[1, 2, 3]);
    }
}
