//! The lowering shared by the GPU backends (CUDA and Metal): a `Program` becomes device steps,
//! once at compile time — kernel launches with their launch records (operands as buffer + byte
//! offset, patched to addresses at run time), GEMMs at fixed offsets, and fills. Each backend
//! ships a kernel library implementing every named kernel with the record contract documented
//! at the kernel (CUDA C in rlx-cuda, MSL in rlx-metal) and generates the fused kernels from
//! the same expressions (`crate::expr_source`). Where a backend has one kernel for a few adjacent
//! instructions (a layer norm, its backward, a cross-entropy with its gradient: the `Target`
//! flags), they are one launch where the program's tensors make that unobservable. No GPU is
//! touched here, so it is unit-tested in CI.
//! `grid`/`block` of a launch are the CUDA launch shape; backends with another execution model
//! derive their own from the kernel and its record.
use crate::{hyper_col, Instr, OptimRule, Program, TRef, UpdatePlan};
use rlx_ir::{BinaryOp, DType, Error, Fused, FusedStep, Op, ReduceOp, Result, Shape, UnaryOp};

/// Operands one launch record holds.
pub const MAX_OPS: usize = 16;
/// Iteration rank one launch record holds (after merging contiguous dims).
pub const MAX_RANK: usize = 8;

/// Error codes a kernel writes to the run's error word (scratch at [`ERR_AT`]: code, value).
pub mod err {
    pub const LABEL: i32 = 1;
    pub const ID: i32 = 2;
    pub const INT_DIV_ZERO: i32 = 3;
}

/// Codes of the integer binary kernel (`iv[0]`).
pub fn int_op_code(op: BinaryOp) -> i64 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::FloorDiv => 4,
        BinaryOp::Mod => 5,
        BinaryOp::Lt => 6,
        BinaryOp::Le => 7,
        BinaryOp::Gt => 8,
        BinaryOp::Ge => 9,
        BinaryOp::Eq => 10,
        BinaryOp::Ne => 11,
    }
}

/// The launch record every kernel takes (the layout of `struct P` in each backend's kernel source).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct P {
    pub ptr: [u64; MAX_OPS],
    pub n: i64,
    pub rank: i64,
    pub dims: [i64; MAX_RANK],
    pub st: [[i64; MAX_RANK]; MAX_OPS],
    pub iv: [i64; 8],
    pub fv: [f32; 8],
    pub mode: [i32; MAX_OPS],
}

impl P {
    /// A record for `n` iterations (elements, rows or outputs, as the kernel defines).
    pub fn sized(n: usize) -> P {
        P {
            n: n as i64,
            ..P::default()
        }
    }
}

impl Default for P {
    fn default() -> P {
        P {
            ptr: [0; MAX_OPS],
            n: 0,
            rank: 0,
            dims: [0; MAX_RANK],
            st: [[0; MAX_RANK]; MAX_OPS],
            iv: [0; 8],
            fv: [0.0; 8],
            mode: [0; MAX_OPS],
        }
    }
}

/// Where an operand lives: a program buffer (`Buf as usize`) or the program's scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    pub buf: usize,
    pub offset: usize,
}

/// The scratch buffer's index in a run's base addresses (after the four program buffers).
pub const SCRATCH: usize = 4;
/// The buffer holding a matmul product its epilogue reads (sized for the largest).
pub const PRODUCT: usize = 5;
/// Where a cross-entropy gradient finds its count of rows not labelled -100 (int32, scratch).
pub const COUNT_AT: usize = 64;
/// The counter of `rlx_ce_loss_grad`'s blocks (a u32 in scratch, zero between launches).
pub const CE_BLOCKS_AT: usize = 68;
/// Scratch layout: the error word, the update's control block, the run's hyper-parameter row,
/// then per-row cross-entropy losses.
pub const ERR_AT: usize = 0;
pub const CTRL_AT: usize = 256;
pub const HYPER_AT: usize = 512;
pub const ROWS_AT: usize = 1024;
/// The largest score matrix (bytes, all heads of one attention) the GEMM attention path
/// materialises; larger attention runs the fused kernels.
pub const GEMM_ATTENTION_MAX_SCORES: usize = 512 << 20;

/// Blocks a column reduction (`rlx_reduce_rows`) should spread over where it can: two per
/// multiprocessor of an H100.
const WIDE_GRID: usize = 264;

/// Rows up to which a cross-entropy and its gradient are one launch (`rlx_ce_loss_grad`): a
/// warp a row in at most 128 blocks, each of which counts every label. Measured on an H100:
/// the digits MLP's 64 rows and the tiny GPT's 1024 gain, the 4096 of the MLP B4096 lost 3 %
/// (four rows a warp, 16 KB of labels a block) and keep the four launches.
const CE_ROWS_MAX: usize = 1024;

/// A layer norm's backward is one launch (`rlx_layer_norm_grad`) up to this many rows (a
/// warp a row, 8 rows a block) and this many partial sums for the last block to add
/// (blocks x 2 x width). Measured on an H100: the tiny GPT's 1024 x 128 gains; GPT d768's
/// 4096 x 768 lost 1.6 % a step (four rows a warp in sequence, 196K partial sums added by one
/// block) and keeps its launches.
const LN_GRAD_ROWS_MAX: usize = 1024;
const LN_GRAD_PARTIALS_MAX: usize = 1 << 16;

/// Elements a block of the multi-tensor update takes at a time: the fewest that still give
/// [`UPDATE_BLOCKS`] blocks, between these bounds (multiples of [`UPDATE_CHUNK_MIN`]).
pub const UPDATE_CHUNK_MIN: usize = 1024;
pub const UPDATE_CHUNK_MAX: usize = 16384;
/// Blocks the update should have to fill a large GPU (four per multiprocessor of an H100).
const UPDATE_BLOCKS: usize = 528;

/// The update's chunk size for `total` elements of parameters (see [`UPDATE_CHUNK_MIN`]):
/// small models get many short chunks (a block's threads take a few elements each, so the
/// update is as wide as the GPU), large ones long chunks (a smaller table).
pub fn update_chunk(total: usize) -> usize {
    let want = total.div_ceil(UPDATE_BLOCKS).div_ceil(UPDATE_CHUNK_MIN) * UPDATE_CHUNK_MIN;
    want.clamp(UPDATE_CHUNK_MIN, UPDATE_CHUNK_MAX)
}

/// Whether operand `k` of launch record `p` reads element `i % n` at element `i`: a packed
/// vector of `n` (its trailing dims, stride 1 over `n` elements) broadcast over the leading
/// dims — a bias over the columns of a product, as the backends' matrix engines take it.
pub fn reads_row_vector(p: &P, k: usize, n: usize) -> bool {
    let rank = usize::try_from(p.rank).unwrap_or(0);
    let (mut tail, mut d) = (1usize, rank);
    while d > 0 && tail < n {
        d -= 1;
        if p.st[k][d] != tail as i64 {
            return false;
        }
        tail *= usize::try_from(p.dims[d]).unwrap_or(0);
    }
    tail == n && p.st[k][..d].iter().all(|&s| s == 0)
}

fn at(t: &TRef) -> Loc {
    Loc {
        buf: t.buf as usize,
        offset: t.offset,
    }
}

fn scratch(offset: usize) -> Loc {
    Loc {
        buf: SCRATCH,
        offset,
    }
}

/// A `[units, heads]` grid of equally shaped matrices: matrix `u * heads + h` starts at byte
/// `at.offset + u * su + h * sh` of buffer `at.buf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub at: Loc,
    pub units: usize,
    pub heads: usize,
    pub su: usize,
    pub sh: usize,
}

impl Grid {
    /// The byte offset of every matrix, in batch order.
    pub fn offsets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.units).flat_map(move |u| {
            (0..self.heads).map(move |h| self.at.offset + u * self.su + h * self.sh)
        })
    }
}

/// Which module a kernel is in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kernel {
    Library(&'static str),
    /// Index into [`Plan::fused`].
    Fused(usize),
}

/// `C = op(A) op(B)` in BLAS column-major terms (cuBLAS's), `batch` times with the given
/// element strides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// The dtype of `A` and `B` (float32, or bfloat16/float16 under mixed precision); `C` is
    /// always float32 and the products sum in float32.
    pub dtype: DType,
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub batch: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Launch {
        kernel: Kernel,
        grid: u32,
        block: u32,
        p: Box<P>,
        /// `(operand slot, where)`, patched into `p.ptr` at run time.
        operands: Vec<(usize, Loc)>,
    },
    Fill {
        at: Loc,
        bytes: usize,
    },
    Gemm {
        g: Gemm,
        a: Loc,
        b: Loc,
        c: Loc,
    },
    /// A batched GEMM whose matrices are not one stride apart (attention's heads read in place
    /// from a packed `[blocks, rows, 3 * heads * E]` tensor): `g` without its strides, each
    /// operand a [`Grid`] of `g.batch` matrices; the backend gives the GEMM the matrices'
    /// addresses as pointer arrays (only with [`Target::gemm_grids`]).
    GemmGrid {
        g: Gemm,
        a: Grid,
        b: Grid,
        c: Grid,
    },
    /// Writes the run's hyper-parameters (`OptimHyper`) as one table row at `at`.
    HyperRow {
        at: Loc,
    },
    /// The whole training update, run on the host over host-visible buffers after every
    /// earlier step completed (only with [`Target::host_update`]).
    HostUpdate(Box<UpdatePlan>),
}

/// A lowered program.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Generated elementwise expressions, each one kernel.
    pub fused: Vec<Fused>,
    pub scratch_bytes: usize,
    /// Bytes of the product buffer (matmul epilogues).
    pub product_bytes: usize,
    /// Classes of the first cross-entropy (for the error message of a bad label).
    pub classes: Option<usize>,
    /// Rows of the first embedding table (for the error message of a bad id).
    pub rows: Option<usize>,
    /// The first integer division's divisor shape (for its error message).
    pub int_div: Option<(String, Shape)>,
    /// Constant tables `(scratch byte offset, bytes)` a backend writes into its scratch buffer
    /// once, when it compiles the plan (the multi-tensor update's operand table).
    pub tables: Vec<(usize, Vec<u8>)>,
    /// `(column-sum step, weight-gradient GEMM step)`: a bias gradient `sum_to(dY)` and a later
    /// `dY^T X` product reading that very tensor (nothing writes its bytes in between), where
    /// nothing in between reads or writes the sum's output either: a backend may let the GEMM
    /// write the sum (cuBLASLt's BGRADB epilogue) and skip the sum's launch. See
    /// [`bias_grad_pairs`].
    pub bias_grads: Vec<(usize, usize)>,
}

impl Plan {
    /// The error a kernel flagged with `code` (see [`err`]) and `value` (the bad label, id...),
    /// worded as the CPU backend words it; `Ok` for code 0. `backend` names an unknown code's
    /// source.
    pub fn flagged(&self, code: i32, value: i32, backend: &str) -> Result<()> {
        match code {
            0 => Ok(()),
            err::LABEL => Err(Error::input(
                "labels",
                format!(
                    "[cross_entropy] label {value} is out of range [0, {})",
                    self.classes.unwrap_or(0)
                ),
            )),
            err::ID => Err(Error::input(
                "ids",
                format!(
                    "[gather] id {value} is out of range [0, {})",
                    self.rows.unwrap_or(0)
                ),
            )),
            err::INT_DIV_ZERO => {
                let (name, shape) = self
                    .int_div
                    .clone()
                    .unwrap_or_else(|| ("floor_divide".into(), Shape::new([0usize; 0])));
                Err(Error::Graph(format!(
                    "[{name}] integer division by zero (the int32 divisor {shape} holds a 0)"
                )))
            }
            c => Err(Error::Internal(format!(
                "[{backend}] unknown kernel error code {c}"
            ))),
        }
    }
}

const THREADS: u32 = 256;

fn grid_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block.max(1)).clamp(1, 132 * 32) as u32
}

/// Element strides reading `src` (right-aligned, numpy rules) while walking `out`.
fn broadcast(src: &[usize], out: &[usize]) -> Vec<i64> {
    let mut st = vec![0i64; out.len()];
    let mut s = 1i64;
    for k in 1..=src.len() {
        let d = src[src.len() - k];
        if d != 1 {
            st[out.len() - k] = s;
        }
        s *= d as i64;
    }
    st
}

fn contiguous(dims: &[usize]) -> Vec<i64> {
    let mut st = vec![0i64; dims.len()];
    let mut s = 1i64;
    for d in (0..dims.len()).rev() {
        st[d] = s;
        s *= dims[d] as i64;
    }
    st
}

/// Fills the iteration part of a launch record: walks `dims` with one stride list per operand,
/// merging dims every operand walks contiguously and dropping size-1 dims.
fn iterate(
    p: &mut P,
    dims: &[usize],
    strides: &[Vec<i64>],
    what: &str,
    backend: &str,
) -> Result<()> {
    let mut cd: Vec<i64> = Vec::new();
    let mut cs: Vec<Vec<i64>> = vec![Vec::new(); strides.len()];
    for (d, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let n = n as i64;
        let merge = !cd.is_empty()
            && strides
                .iter()
                .enumerate()
                .all(|(k, s)| *cs[k].last().expect("same rank") == s[d] * n);
        if merge {
            *cd.last_mut().expect("not empty") *= n;
            for (k, s) in strides.iter().enumerate() {
                *cs[k].last_mut().expect("not empty") = s[d];
            }
        } else {
            cd.push(n);
            for (k, s) in strides.iter().enumerate() {
                cs[k].push(s[d]);
            }
        }
    }
    if cd.len() > MAX_RANK || strides.len() > MAX_OPS {
        return Err(Error::unsupported(
            what,
            format!(
                "the {} backend walks at most {MAX_RANK} non-mergeable dims and {MAX_OPS} operands",
                backend
            ),
        ));
    }
    p.n = dims.iter().product::<usize>() as i64;
    p.rank = cd.len() as i64;
    for (d, &n) in cd.iter().enumerate() {
        p.dims[d] = n;
    }
    let cont = {
        let mut st = vec![0i64; cd.len()];
        let mut s = 1;
        for d in (0..cd.len()).rev() {
            st[d] = s;
            s *= cd[d];
        }
        st
    };
    for (k, s) in cs.iter().enumerate() {
        for (d, &v) in s.iter().enumerate() {
            p.st[k][d] = v;
        }
        p.mode[k] = if s.iter().all(|&v| v == 0) {
            0
        } else if *s == cont {
            1
        } else {
            2
        };
    }
    Ok(())
}

/// Which backend a plan is for, and how it runs the training update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The backend's name, in error messages.
    pub backend: &'static str,
    /// `true`: the update stays one [`Step::HostUpdate`] (run by the host over host-visible
    /// buffers); `false`: it is planned as kernels.
    pub host_update: bool,
    /// The backend has the tiled attention kernels (`rlx_att_fwd_{32,64}`,
    /// `rlx_att_bwd_q_{32,64}`, `rlx_att_bwd_kv_{32,64}`: 128 threads a block, a block per 64
    /// query rows, 32 query rows and 32 keys), used for head sizes up to 64; other
    /// sizes, and backends without them, run the warp-per-query kernels.
    pub tiled_attention: bool,
    /// The backend runs mixed precision: float32 <-> bfloat16/float16 casts
    /// (`rlx_cast_{f2bf,bf2f,f2h,h2f}`) and matrix products of bfloat16/float16 operands into
    /// float32 ([`Gemm::dtype`]). No other instruction takes a low-precision tensor.
    pub low_precision: bool,
    /// Attention of at least this many multiply-adds (`blocks x heads x L x S x max(E, Ev)`)
    /// runs as batched GEMMs over head-major copies with the scores materialised (the backend's
    /// vendor GEMM does the products; [`Builder::attention_gemm`]); `None`: never.
    pub gemm_attention: Option<usize>,
    /// Whether the forward pass takes the GEMM path too where the tiled kernels could run it
    /// (the gradient always does, above the threshold).
    pub gemm_attention_forward: bool,
    /// The fused kernels take four elements a thread with 16-byte loads and stores where every
    /// operand allows it (`iv[7]` set; see [`quads`]).
    pub fused_x4: bool,
    /// The update's bookkeeping in few launches: `rlx_update_ctrl` runs the phases
    /// `iv[0]..=iv[6]` (adjacent phases are one launch) and `rlx_update_end` counts the step of
    /// every tensor of the update table and ends the run (phase 3) in one launch; without it,
    /// one phase a launch and `rlx_update_finish` for five tensors at a time.
    pub update_end: bool,
    /// `rlx_normalize_grad` adds a tensor of its shape (`iv[1]` set, operand 3) to its result,
    /// so `NormalizeGradAdd` is one launch; without it, `normalize_grad` into the product buffer
    /// and a fused add (Metal). On CUDA it serves the layer norms `layer_norm_grad` leaves.
    pub normalize_grad_add: bool,
    /// The backend has `rlx_layer_norm_grad`: a layer norm's backward (the bias and weight
    /// gradients, `dY * w` and `normalize_grad` of it, plus a residual gradient) as one launch
    /// ([`layer_norm_grads`] finds the four instructions it stands for).
    pub layer_norm_grad: bool,
    /// The backend has `rlx_ce_loss_grad`: a cross-entropy loss and its gradient, adjacent
    /// instructions over the same logits and labels, as one launch ([`cross_entropy_grads`]).
    pub cross_entropy_grad: bool,
    /// The backend has `rlx_normalize_affine`: `normalize` and the `xhat * w + b` after it as
    /// one launch writing both ([`layer_norms`]).
    pub layer_norm: bool,
    /// The backend runs [`Step::GemmGrid`] (pointer-array batched GEMMs), so the GEMM
    /// attention reads and writes packed heads in place instead of copying them head-major.
    pub gemm_grids: bool,
    /// The backend has the casts at a narrowed program's integer edges
    /// (`rlx_cast_{b2i,i2b,i2l}`: bool -> int32, int32 -> bool, int32 -> int64; see
    /// `rlx_ir::narrow`). No other instruction takes a bool or int64 tensor.
    pub integer_edges: bool,
    /// The backend has `rlx_reduce_i32` (int32 sums, wrapping, and maxima); without it an
    /// integer reduction is refused by name.
    pub int_reduce: bool,
}

impl Target {
    pub const CUDA: Target = Target {
        backend: "cuda",
        host_update: false,
        tiled_attention: true,
        low_precision: true,
        gemm_attention: Some(1 << 24),
        gemm_attention_forward: true,
        fused_x4: true,
        update_end: true,
        normalize_grad_add: true,
        layer_norm_grad: true,
        cross_entropy_grad: true,
        layer_norm: true,
        // Measured on an H100 (GPT d768 fp32 step 57.5-57.8 ms against 58.9-59.1 ms copying
        // heads, 84 MiB less memory); `RLX_CUDA_GRIDS=0` turns it off.
        gemm_grids: true,
        integer_edges: true,
        int_reduce: true,
    };
}

/// Checks `program` against buffers of `lens` bytes and lowers it for `target`.
pub fn plan(program: &Program, lens: &[usize], target: Target) -> Result<Plan> {
    crate::validate::validate(program, lens, target.backend)?;
    let mut allowed = vec![DType::F32, DType::I32];
    if target.low_precision {
        allowed.extend([DType::BF16, DType::F16]);
    }
    if target.integer_edges {
        allowed.extend([DType::I64, DType::Bool]);
    }
    crate::validate::dtypes(program, target.backend, &allowed)?;
    if target.low_precision {
        low_precision_only_in_products(program, target.backend)?;
    }
    if target.integer_edges {
        integers_wide_only_at_edges(program, target.backend)?;
    }
    let mut b = Builder {
        plan: Plan {
            scratch_bytes: ROWS_AT,
            ..Plan::default()
        },
        target,
        chunked_sums: (Vec::new(), 0, 0),
    };
    let pairs = bias_grad_pairs(program);
    // Groups of adjacent instructions as one launch each (layer norms and their backwards,
    // cross-entropy losses with their gradients): the group's last instruction launches it, the others lower
    // to nothing.
    let mut found: Vec<(Vec<usize>, Group)> = Vec::new();
    if target.layer_norm_grad {
        let gs = layer_norm_grads(program)
            .into_iter()
            .filter(LayerNormGrad::one_launch);
        found.extend(
            gs.into_iter()
                .map(|g| (g.instrs.to_vec(), Group::LayerNorm(Box::new(g)))),
        );
    }
    if target.cross_entropy_grad {
        let gs = cross_entropy_grads(program);
        found.extend(
            gs.into_iter()
                .map(|g| (g.instrs.to_vec(), Group::CrossEntropy(Box::new(g)))),
        );
    }
    if target.layer_norm {
        let gs = layer_norms(program);
        found.extend(
            gs.into_iter()
                .map(|g| (g.instrs.to_vec(), Group::Forward(Box::new(g)))),
        );
    }
    // An instruction stands in one group at most (the first found).
    let mut groups: Vec<Option<Group>> = vec![None; program.instrs.len()];
    let mut grouped = vec![false; program.instrs.len()];
    for (instrs, g) in found {
        if instrs.iter().any(|&i| grouped[i]) {
            continue;
        }
        for &i in &instrs {
            grouped[i] = true;
        }
        groups[*instrs.last().expect("a group has instructions")] = Some(g);
    }
    // The first step each instruction lowered to, and how many.
    let mut lowered: Vec<(usize, usize)> = Vec::with_capacity(program.instrs.len());
    for (i, instr) in program.instrs.iter().enumerate() {
        let first = b.plan.steps.len();
        if let Some(g) = &groups[i] {
            match g {
                Group::LayerNorm(g) => b.layer_norm_grad(g)?,
                Group::CrossEntropy(g) => b.cross_entropy_grad(g),
                Group::Forward(g) => b.layer_norm(g),
            }
            lowered.push((first, b.plan.steps.len() - first));
            continue;
        }
        if grouped[i] {
            lowered.push((first, 0));
            continue;
        }
        if matches!(instr, Instr::Update(_)) && i + 1 != program.instrs.len() {
            // The update's table sits past everything else in the scratch buffer.
            return Err(Error::Internal(
                "the optimizer update must be a program's last instruction".into(),
            ));
        }
        match instr {
            Instr::Op { op, ins, out } => b.op(op, ins, out)?,
            Instr::Update(u) if target.host_update => {
                b.plan.steps.push(Step::HostUpdate(u.clone()))
            }
            Instr::Update(u) => b.update(u)?,
        }
        lowered.push((first, b.plan.steps.len() - first));
    }
    // A pair stands where each side lowered to one step: the column sum's launch and one GEMM.
    for (sum, gemm) in pairs {
        let ((s, sn), (g, gn)) = (lowered[sum], lowered[gemm]);
        let one_sum = sn == 1
            && matches!(
                &b.plan.steps[s],
                Step::Launch {
                    kernel: Kernel::Library("rlx_reduce_rows"),
                    ..
                }
            );
        if one_sum && gn == 1 && matches!(b.plan.steps[g], Step::Gemm { .. }) {
            b.plan.bias_grads.push((s, g));
        }
    }
    b.finish();
    Ok(b.plan)
}

/// `(sum, matmul)` instruction pairs of `program`: a float32 `sum_to` of `dY` (`[rows.., n]`)
/// down to `[n]`, and the first later `matmul` with `a^T` reading `dY` itself — the same bytes,
/// not rewritten by any instruction in between — where no instruction in between reads or
/// writes the sum's output. Writing that output at the matmul instead of at the sum is then
/// unobservable (the planner keeps it reserved from the sum on).
pub fn bias_grad_pairs(program: &Program) -> Vec<(usize, usize)> {
    use crate::validate::overlaps;
    let mut pairs = Vec::new();
    for (j, instr) in program.instrs.iter().enumerate() {
        let Instr::Op {
            op: Op::SumTo { .. },
            ins,
            out: db,
        } = instr
        else {
            continue;
        };
        let dy = &ins[0];
        let n = db.numel();
        if dy.dtype != DType::F32 || db.shape.rank() != 1 || dy.shape.dims().last() != Some(&n) {
            continue;
        }
        for (k, later) in program.instrs.iter().enumerate().skip(j + 1) {
            let (reads, writes) = later.operands();
            if let Instr::Op {
                op:
                    Op::MatMul {
                        trans_a: true,
                        trans_b: false,
                    },
                ins,
                ..
            } = later
            {
                let a = &ins[0];
                if a.buf == dy.buf
                    && a.offset == dy.offset
                    && a.numel() == dy.numel()
                    && a.dtype == DType::F32
                    && a.shape.rank() == 2
                    && a.shape.dims()[1] == n
                {
                    pairs.push((j, k));
                    break;
                }
            }
            if writes.iter().any(|w| overlaps(w, dy))
                || reads.iter().chain(&writes).any(|t| overlaps(t, db))
            {
                break;
            }
        }
    }
    pairs
}

/// Whether two tensors are the same elements: one buffer, one offset, one count.
fn same_place(a: &TRef, b: &TRef) -> bool {
    a.buf == b.buf && a.offset == b.offset && a.numel() == b.numel()
}

/// One operation of a program: its op, inputs and output.
type OpRef<'a> = (&'a Op, &'a [TRef], &'a TRef);

/// The adjacent operations of `program` (the update excluded): `(i, [instruction i - 1, i])`.
fn adjacent_ops(program: &Program) -> impl Iterator<Item = (usize, [OpRef<'_>; 2])> {
    program
        .instrs
        .windows(2)
        .enumerate()
        .filter_map(|(k, pair)| match pair {
            [Instr::Op {
                op: a,
                ins: ia,
                out: oa,
            }, Instr::Op {
                op: b,
                ins: ib,
                out: ob,
            }] => Some((k + 1, [(a, &ia[..], oa), (b, &ib[..], ob)])),
            _ => None,
        })
}

/// Adjacent instructions a backend runs as one launch, standing where the last of them stood
/// (the others lower to nothing).
#[derive(Clone, Debug, PartialEq)]
enum Group {
    LayerNorm(Box<LayerNormGrad>),
    CrossEntropy(Box<CrossEntropyGrad>),
    Forward(Box<LayerNorm>),
}

/// A layer norm's forward as two adjacent instructions: `xhat = normalize(x)` and
/// `y = xhat * w + b` (a `Fused` of one product and one sum, `w` and `b` of `[C]`; either
/// operand order), all float32.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub instrs: [usize; 2],
    pub eps: f32,
    pub x: TRef,
    pub w: TRef,
    pub b: TRef,
    pub xhat: TRef,
    pub y: TRef,
}

/// The layer norms of `program` one `rlx_normalize_affine` may stand for (run where the
/// affine step stood, writing `xhat` late): `xhat` and `y` each equal to or disjoint from `x`
/// (a row is rewritten by the warp that read it) and disjoint from `w`, `b` and each other.
pub fn layer_norms(program: &Program) -> Vec<LayerNorm> {
    use crate::validate::overlaps;
    let same = same_place;
    let mut out = Vec::new();
    for (i, [(first, nx, xhat), (second, ins, y)]) in adjacent_ops(program) {
        let (Op::Normalize { eps }, Op::Fused(f)) = (first, second) else {
            continue;
        };
        let x = &nx[0];
        let c = x.shape.dims().last().copied().unwrap_or(0);
        let n = x.numel();
        if ins.len() != 3 || c == 0 || n == 0 || y.numel() != n || xhat.numel() != n {
            continue;
        }
        // Registers: 0..3 the inputs, 3 the product, 4 the sum.
        let [FusedStep::Binary(BinaryOp::Mul, p, q), FusedStep::Binary(BinaryOp::Add, s, t)] =
            f.steps[..]
        else {
            continue;
        };
        let Some(h) = ins.iter().position(|t| same(t, xhat)) else {
            continue;
        };
        let h = h as u16;
        let wi = match (p == h, q == h) {
            (true, false) => q,
            (false, true) => p,
            _ => continue,
        };
        let bi = match (s == 3, t == 3) {
            (true, false) => t,
            (false, true) => s,
            _ => continue,
        };
        if wi >= 3 || bi >= 3 || wi == bi || bi == h {
            continue;
        }
        let (w, b) = (&ins[wi as usize], &ins[bi as usize]);
        let all = [x, w, b, xhat, y];
        let ok = all.iter().all(|t| t.dtype == DType::F32)
            && w.shape.dims() == [c]
            && b.shape.dims() == [c]
            && [xhat, y]
                .iter()
                .all(|o| (same(o, x) || !overlaps(o, x)) && !overlaps(o, w) && !overlaps(o, b))
            && !overlaps(xhat, y);
        if ok {
            out.push(LayerNorm {
                instrs: [i - 1, i],
                eps: *eps,
                x: x.clone(),
                w: w.clone(),
                b: b.clone(),
                xhat: xhat.clone(),
                y: y.clone(),
            });
        }
    }
    out
}

/// A cross-entropy loss and its gradient as adjacent instructions (what autodiff makes of
/// `cross_entropy(logits, labels)`): `loss = cross_entropy(L, y)`, then
/// `dL = cross_entropy_grad(L, y, g)` over the same logits and labels, `g` the loss's
/// gradient (a scalar).
#[derive(Clone, Debug, PartialEq)]
pub struct CrossEntropyGrad {
    pub instrs: [usize; 2],
    pub logits: TRef,
    pub labels: TRef,
    pub g: TRef,
    pub loss: TRef,
    pub dlogits: TRef,
}

/// The loss-and-gradient pairs of `program` one `rlx_ce_loss_grad` may stand for: float32
/// logits of 1 to [`CE_ROWS_MAX`] rows, int32 labels, and the loss (written late, by the kernel's last
/// block) and the gradient disjoint from every input and from each other.
pub fn cross_entropy_grads(program: &Program) -> Vec<CrossEntropyGrad> {
    use crate::validate::overlaps;
    let same = same_place;
    let mut out = Vec::new();
    for (i, [(first, f, loss), (second, b, dl)]) in adjacent_ops(program) {
        let (Op::SoftmaxCrossEntropy, Op::SoftmaxCrossEntropyGrad) = (first, second) else {
            continue;
        };
        let (l, y, g) = (&f[0], &f[1], &b[2]);
        let fits = same(l, &b[0])
            && same(y, &b[1])
            && l.dtype == DType::F32
            && y.dtype == DType::I32
            && g.dtype == DType::F32
            && loss.dtype == DType::F32
            && dl.dtype == DType::F32
            && l.shape.rank() == 2
            && l.numel() > 0
            && l.shape.dims()[0] <= CE_ROWS_MAX
            && [l, y, g, dl].iter().all(|t| !overlaps(loss, t))
            && [l, y, g].iter().all(|t| !overlaps(dl, t));
        if fits {
            out.push(CrossEntropyGrad {
                instrs: [i - 1, i],
                logits: l.clone(),
                labels: y.clone(),
                g: g.clone(),
                loss: loss.clone(),
                dlogits: dl.clone(),
            });
        }
    }
    out
}

/// A layer norm's backward as four adjacent instructions of a program (what autodiff and
/// `fuse` make of `normalize(x) * w + b`), in any order with `normalize_grad` last:
/// `db = sum_to(dY)`, `t = dY * w` (`w` of `[C]`), `dw = sum_to(dY * r)` (a `FusedSumTo`; `r`
/// is the saved normalized `x`, though nothing here relies on that) and
/// `dx = normalize_grad(x, t)` or `normalize_grad_add(x, t, acc)`, all float32, rows of `C`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormGrad {
    /// The instructions: the two sums and the product in program order, `normalize_grad` last.
    pub instrs: [usize; 4],
    pub eps: f32,
    pub x: TRef,
    pub dy: TRef,
    pub w: TRef,
    pub r: TRef,
    pub acc: Option<TRef>,
    pub t: TRef,
    pub dx: TRef,
    pub dw: TRef,
    pub db: TRef,
}

impl LayerNormGrad {
    /// Whether `rlx_layer_norm_grad` is faster than the separate launches at this size
    /// ([`LN_GRAD_ROWS_MAX`], [`LN_GRAD_PARTIALS_MAX`]).
    pub fn one_launch(&self) -> bool {
        let c = self.w.numel();
        let rows = self.x.numel() / c.max(1);
        rows <= LN_GRAD_ROWS_MAX && rows.div_ceil(8) * 2 * c <= LN_GRAD_PARTIALS_MAX
    }
}

/// The layer-norm backwards of `program` that one kernel may stand for (run where
/// `normalize_grad` stood; on CUDA `rlx_layer_norm_grad`, taken up to the sizes where that was
/// measured faster, [`LayerNormGrad::one_launch`]). It writes `t` as well (the
/// program may read it later: one store, no liveness argument), and `db` and `dw` late, so
/// it takes a group only where that and its own reads and writes are unobservable: the
/// product and the sums touch nothing the others read or write but what the pattern says; `t`,
/// `dw` and `db` are disjoint from every input and from each other; `dx` is disjoint from `w`
/// (read by every row), `dw` and `db`, and equal to or disjoint from `x`, `dY`, `r`, `acc` and
/// `t` (the kernel sums a chunk's columns before it writes the chunk's rows, and a row is
/// rewritten in place by the warp that read it). The planner often gives `dx` the place of
/// `r` or `dY`, whose last reader was the weight gradient's sum.
pub fn layer_norm_grads(program: &Program) -> Vec<LayerNormGrad> {
    use crate::validate::overlaps;
    let f32_all = |ts: &[&TRef]| ts.iter().all(|t| t.dtype == DType::F32);
    let same = same_place;
    let mul = |steps: &[FusedStep]| matches!(steps, [FusedStep::Binary(BinaryOp::Mul, 0, 1)]);
    let mut out = Vec::new();
    for d in 3..program.instrs.len() {
        let Instr::Op { op, ins, out: dx } = &program.instrs[d] else {
            continue;
        };
        let (eps, acc) = match op {
            Op::NormalizeGrad { eps } => (*eps, None),
            Op::NormalizeGradAdd { eps } => (*eps, Some(ins[2].clone())),
            _ => continue,
        };
        let (x, t) = (&ins[0], &ins[1]);
        let c = x.shape.dims().last().copied().unwrap_or(0);
        let n = x.numel();
        if c == 0 || n == 0 || n % c != 0 || dx.numel() != n || t.numel() != n {
            continue;
        }
        // The three before it, each recognised by its op.
        let (mut sum, mut prod, mut wsum) = (None, None, None);
        for k in d - 3..d {
            let Instr::Op { op, ins, out } = &program.instrs[k] else {
                break;
            };
            let vector = out.shape.dims() == [c];
            match op {
                Op::SumTo { .. } if vector && ins[0].numel() == n => {
                    sum = Some((k, ins[0].clone(), out.clone()))
                }
                Op::FusedSumTo { expr, .. }
                    if vector
                        && mul(&expr.steps)
                        && expr.shape.numel() == n
                        && ins.iter().all(|i| i.numel() == n) =>
                {
                    wsum = Some((k, ins[0].clone(), ins[1].clone(), out.clone()))
                }
                Op::Binary(BinaryOp::Mul) if same(out, t) => {
                    prod = Some((k, ins[0].clone(), ins[1].clone()))
                }
                Op::Fused(f) if same(out, t) && mul(&f.steps) && ins.len() == 2 => {
                    prod = Some((k, ins[0].clone(), ins[1].clone()))
                }
                _ => {}
            }
        }
        let (Some((ka, dy, db)), Some((kb, p0, p1)), Some((kc, q0, q1, dw))) = (sum, prod, wsum)
        else {
            continue;
        };
        // `t = dY * w` (either order), `dw = sum(dY * r)` (either order).
        let w = match (same(&p0, &dy), same(&p1, &dy)) {
            (true, false) => p1,
            (false, true) => p0,
            _ => continue,
        };
        let r = match (same(&q0, &dy), same(&q1, &dy)) {
            (true, _) => q1,
            (false, true) => q0,
            _ => continue,
        };
        if w.shape.dims() != [c] || r.numel() != n || dy.shape.dims().last() != Some(&c) {
            continue;
        }
        let t = t.clone();
        let mut ts: Vec<&TRef> = vec![x, &dy, &w, &r, &t, dx, &dw, &db];
        ts.extend(acc.as_ref());
        if !f32_all(&ts) {
            continue;
        }
        let mut inputs: Vec<&TRef> = vec![x, &dy, &w, &r];
        inputs.extend(acc.as_ref());
        let apart = |a: &TRef, bs: &[&TRef]| bs.iter().all(|b| !overlaps(a, b));
        let in_place_or_apart = |a: &TRef, b: &TRef| same(a, b) || !overlaps(a, b);
        let ok = apart(&t, &inputs)
            && apart(&dw, &inputs)
            && apart(&db, &inputs)
            && apart(&dw, &[&db, &t, dx])
            && apart(&db, &[&t, dx])
            && apart(dx, &[&w])
            && [x, &dy, &r, &t].iter().all(|b| in_place_or_apart(dx, b))
            && acc.as_ref().is_none_or(|a| in_place_or_apart(dx, a));
        if ok {
            let mut instrs = [ka, kb, kc, d];
            instrs[..3].sort_unstable();
            out.push(LayerNormGrad {
                instrs,
                eps,
                x: x.clone(),
                dy,
                w,
                r,
                acc,
                t,
                dx: dx.clone(),
                dw,
                db,
            });
        }
    }
    out
}

/// Under mixed precision a GPU program holds bfloat16/float16 tensors only as casts of float32
/// ones and as the operands of matrix products (what `rlx_ir::autocast` makes); anything else
/// on one is refused by name.
fn low_precision_only_in_products(program: &Program, backend: &str) -> Result<()> {
    for instr in &program.instrs {
        let Instr::Op { op, ins, out } = instr else {
            // The update (parameters, state, buffer updates) copies and computes in 4-byte
            // elements: a low-precision buffer there is refused by name.
            let (reads, writes) = instr.operands();
            if let Some(t) = reads
                .iter()
                .chain(&writes)
                .find(|t| t.dtype.is_low_precision())
            {
                return Err(Error::unsupported(
                    "optimizer update",
                    format!(
                        "the {backend} backend updates float32 and int32 tensors only, this step \
                         updates a {} tensor {} (a bfloat16/float16 buffer?); keep buffers \
                         float32 there or train on the cpu",
                        t.dtype, t.shape
                    ),
                ));
            }
            continue;
        };
        let low = |t: &TRef| t.dtype.is_low_precision();
        let ok = match op {
            Op::Cast { .. } if low(&ins[0]) || low(out) => {
                !(low(&ins[0]) && low(out)) && [ins[0].dtype, out.dtype].contains(&DType::F32)
            }
            Op::MatMul { .. } | Op::MatMulEpilogue { .. } => {
                !low(out) && !ins[2..].iter().any(low) && ins[0].dtype == ins[1].dtype
            }
            _ => !ins.iter().chain([out]).any(low),
        };
        if !ok {
            let dts: Vec<String> = ins
                .iter()
                .map(|t| format!("{} {}", t.dtype, t.shape))
                .collect();
            return Err(Error::unsupported(
                op.name(),
                format!(
                    "the {backend} backend runs bfloat16/float16 only in casts from and to float32 \
                     and in matrix products (mixed precision), not {} on [{}] -> {} {}; run it \
                     on the cpu or in float32",
                    op.name(),
                    dts.join(", "),
                    out.dtype,
                    out.shape
                ),
            ));
        }
    }
    Ok(())
}

/// A narrowed program (`rlx_ir::narrow`) holds bool and int64 tensors only in the casts at its
/// edges: bool -> int32, int32 -> bool and int32 -> int64. Anything else on one (a program that
/// was not narrowed) is refused by name.
fn integers_wide_only_at_edges(program: &Program, backend: &str) -> Result<()> {
    let wide = |t: &TRef| matches!(t.dtype, DType::I64 | DType::Bool);
    for instr in &program.instrs {
        let (reads, writes) = instr.operands();
        let Some(t) = reads.iter().chain(&writes).find(|t| wide(t)) else {
            continue;
        };
        let edge = match instr {
            Instr::Op {
                op: Op::Cast { .. },
                ins,
                out,
            } => matches!(
                (ins[0].dtype, out.dtype),
                (DType::Bool, DType::I32) | (DType::I32, DType::Bool) | (DType::I32, DType::I64)
            ),
            _ => false,
        };
        if !edge {
            let what = match instr {
                Instr::Op { op, .. } => op.name(),
                Instr::Update(_) => "optimizer update",
            };
            return Err(Error::dtype(
                what,
                format!(
                    "the {backend} backend computes integers in int32: a {} tensor {} may only be \
                     cast from or to int32 at the program's edges; cast it with \
                     .astype('int32') or run it on the cpu",
                    t.dtype, t.shape
                ),
            ));
        }
    }
    Ok(())
}

/// How the attention row kernels and copies are told the dtype of their low-precision writes
/// (`iv[4]`): 0 none (float32 only), 1 bfloat16, 2 float16.
fn low_code(dtype: DType) -> i64 {
    match dtype {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    }
}

/// Whether a fused launch (its record `p` after [`iterate`], its operands at `locs`, the output
/// last) can take four consecutive elements a thread: the count is a multiple of four, the
/// output is contiguous, and each input is a scalar, contiguous, or a broadcast whose innermost
/// dim is a multiple of four with stride 0 (one value for all four) or 1 (a run). Every run read
/// or written whole must start 16-byte aligned.
fn quads(p: &P, locs: &[Loc]) -> bool {
    let r = p.rank as usize;
    if p.n % 4 != 0 || r == 0 || p.mode[locs.len() - 1] != 1 {
        return false;
    }
    let inner = p.dims[r - 1];
    locs.iter().enumerate().all(|(k, l)| match p.mode[k] {
        0 => true,
        1 => l.offset % 16 == 0,
        _ => {
            let s = &p.st[k][..r];
            inner % 4 == 0
                && match s[r - 1] {
                    0 => true,
                    1 => s[..r - 1].iter().all(|v| v % 4 == 0) && l.offset % 16 == 0,
                    _ => false,
                }
        }
    })
}

/// The attributes of an `Attention` / `AttentionGrad` instruction (see `rlx_ir::Op`).
#[derive(Clone, Copy)]
struct Attn {
    scale: f32,
    causal: Option<i64>,
    heads: Option<usize>,
    lowp: Option<DType>,
}

/// One attention instruction for [`Builder::attention_gemm`]: `(blocks, heads, L, S, E, Ev)`,
/// per tensor (q, k, v, o/g, dq, dk, dv) `[block stride, head offset, row stride, base]` in
/// elements, the scale, the causal offset and the products' operand dtype (float32, or the
/// low precision of `Op::Attention`'s `lowp`).
struct AttentionGemm {
    dims: (usize, usize, usize, usize, usize, usize),
    st: [[i64; 4]; 7],
    scale: f32,
    causal: Option<i64>,
    operands: DType,
}

/// The `[units, heads]` matrices of one attention tensor: element strides between units,
/// heads and rows (columns contiguous), the first matrix at `at`.
#[derive(Clone, Copy)]
struct Heads {
    at: Loc,
    su: i64,
    sh: i64,
    sr: i64,
}

struct Builder {
    plan: Plan,
    target: Target,
    /// Column sums over several chunks (`rlx_reduce_rows`, `rlx_layer_norm_grad`): the steps
    /// with the operand slot of their partial sums (the counters' is the next), and the largest
    /// counter and partial-sum areas one needs. One area of each serves them all (each launch
    /// consumes its partials and resets its counters); `finish` places them past everything
    /// else in the scratch buffer, where no other kernel writes.
    chunked_sums: (Vec<(usize, usize)>, usize, usize),
}

impl Builder {
    /// Places the chunked column sums' shared areas (see [`Builder::chunked_sums`]): the
    /// counters (zero from the start: the scratch buffer is zeroed when it is made), then the
    /// partial sums.
    fn finish(&mut self) {
        let (steps, counter_bytes, partial_bytes) = std::mem::take(&mut self.chunked_sums);
        if steps.is_empty() {
            return;
        }
        let counters = self.plan.scratch_bytes.div_ceil(256) * 256;
        let partials = (counters + counter_bytes).div_ceil(256) * 256;
        self.plan.scratch_bytes = partials + partial_bytes;
        for (i, slot) in steps {
            if let Step::Launch { operands, .. } = &mut self.plan.steps[i] {
                operands.extend([(slot, scratch(partials)), (slot + 1, scratch(counters))]);
            }
        }
    }

    /// A layer norm's forward (see [`LayerNorm`]) as one `rlx_normalize_affine`, a warp a row.
    fn layer_norm(&mut self, g: &LayerNorm) {
        let c = g.w.numel();
        let rows = g.x.numel() / c;
        let mut p = P::sized(rows);
        p.iv[0] = c as i64;
        p.fv[0] = g.eps;
        let ops = vec![
            (0, at(&g.x)),
            (1, at(&g.w)),
            (2, at(&g.b)),
            (3, at(&g.xhat)),
            (4, at(&g.y)),
        ];
        self.launch(
            Kernel::Library("rlx_normalize_affine"),
            grid_for(rows, 8),
            THREADS,
            p,
            ops,
        );
    }

    /// A cross-entropy loss and its gradient (see [`CrossEntropyGrad`]) as one
    /// `rlx_ce_loss_grad`: every block counts the labelled rows itself, a warp takes a row (its
    /// loss to scratch, its gradient row), and the last block averages the rows' losses.
    fn cross_entropy_grad(&mut self, g: &CrossEntropyGrad) {
        let (rows, c) = (g.logits.shape.dims()[0], g.logits.shape.dims()[1]);
        self.plan.classes.get_or_insert(c);
        self.plan.scratch_bytes = self.plan.scratch_bytes.max(ROWS_AT + rows * 4);
        let mut p = P::sized(rows);
        p.iv[0] = c as i64;
        let ops = vec![
            (0, at(&g.logits)),
            (1, at(&g.labels)),
            (2, at(&g.g)),
            (3, at(&g.loss)),
            (4, at(&g.dlogits)),
            (5, scratch(ERR_AT)),
            (6, scratch(ROWS_AT)),
            (7, scratch(CE_BLOCKS_AT)),
        ];
        let grid = grid_for(rows, 8);
        self.launch(Kernel::Library("rlx_ce_loss_grad"), grid, THREADS, p, ops);
    }

    /// A layer norm's backward (see [`LayerNormGrad`]) as one `rlx_layer_norm_grad`: a block
    /// of 8 warps takes 8 rows; it sums their columns (`dw`, `db`), then a warp takes a row
    /// (`dx`, `t`); with more than one block the last one adds the blocks' partial sums.
    fn layer_norm_grad(&mut self, g: &LayerNormGrad) -> Result<()> {
        let c = g.w.numel();
        let rows = g.x.numel() / c;
        let chunk = 8;
        let chunks = rows.div_ceil(chunk);
        let blocks = u32::try_from(chunks)
            .map_err(|_| Error::unsupported("normalize_grad", format!("{rows} rows of {c}")))?;
        let mut p = P::sized(rows);
        p.iv[0] = c as i64;
        p.iv[1] = g.acc.is_some() as i64;
        p.iv[2] = chunk as i64;
        p.fv[0] = g.eps;
        let mut ops = vec![
            (0, at(&g.x)),
            (1, at(&g.dy)),
            (2, at(&g.w)),
            (3, at(&g.r)),
            (5, at(&g.t)),
            (6, at(&g.dx)),
            (7, at(&g.dw)),
            (8, at(&g.db)),
        ];
        if let Some(a) = &g.acc {
            ops.push((4, at(a)));
        }
        if chunks > 1 {
            let cs = &mut self.chunked_sums;
            cs.0.push((self.plan.steps.len(), 9));
            cs.1 = cs.1.max(4);
            cs.2 = cs.2.max(chunks * 2 * c * 4);
        }
        self.launch(
            Kernel::Library("rlx_layer_norm_grad"),
            blocks,
            THREADS,
            p,
            ops,
        );
        Ok(())
    }

    fn launch(&mut self, kernel: Kernel, grid: u32, block: u32, p: P, operands: Vec<(usize, Loc)>) {
        self.plan.steps.push(Step::Launch {
            kernel,
            grid,
            block,
            p: Box::new(p),
            operands,
        });
    }

    /// An elementwise launch over `dims` (grid-stride, one thread per element).
    fn map(
        &mut self,
        kernel: Kernel,
        dims: &[usize],
        ops: &[(Loc, Vec<i64>)],
        mut p: P,
        what: &str,
    ) -> Result<()> {
        let n: usize = dims.iter().product();
        if n == 0 {
            return Ok(());
        }
        let strides: Vec<Vec<i64>> = ops.iter().map(|(_, s)| s.clone()).collect();
        iterate(&mut p, dims, &strides, what, self.target.backend)?;
        let operands = ops.iter().enumerate().map(|(k, (l, _))| (k, *l)).collect();
        self.launch(kernel, grid_for(n, THREADS as usize), THREADS, p, operands);
        Ok(())
    }

    /// A fused expression over `f.shape` reading `ins` (each broadcast to it) into `out`.
    fn fused(&mut self, f: Fused, ins: &[TRef], out: &TRef) -> Result<()> {
        let ins: Vec<(Loc, Vec<usize>)> = ins
            .iter()
            .map(|t| (at(t), t.shape.dims().to_vec()))
            .collect();
        self.fused_at(f, &ins, at(out), out.numel())
    }

    /// A fused expression over operands given by place and dims.
    fn fused_at(
        &mut self,
        f: Fused,
        ins: &[(Loc, Vec<usize>)],
        out: Loc,
        total: usize,
    ) -> Result<()> {
        let od = f.shape.dims().to_vec();
        let numel = |d: &[usize]| d.iter().product::<usize>();
        let flat = ins.iter().all(|(_, d)| numel(d) == total || numel(d) == 1);
        let mut ops: Vec<(Loc, Vec<i64>)> = Vec::new();
        let dims: Vec<usize> = if flat { vec![total] } else { od.clone() };
        for (l, d) in ins {
            let st = if flat {
                vec![if numel(d) == total && total != 1 {
                    1
                } else {
                    0
                }]
            } else {
                broadcast(d, &od)
            };
            ops.push((*l, st));
        }
        ops.push((out, if flat { vec![1] } else { contiguous(&od) }));
        let idx = match self
            .plan
            .fused
            .iter()
            .position(|g| g.n_inputs == f.n_inputs && g.steps == f.steps)
        {
            Some(i) => i,
            None => {
                self.plan.fused.push(f);
                self.plan.fused.len() - 1
            }
        };
        let n: usize = dims.iter().product();
        if n == 0 {
            return Ok(());
        }
        let strides: Vec<Vec<i64>> = ops.iter().map(|(_, s)| s.clone()).collect();
        let mut p = P::default();
        iterate(&mut p, &dims, &strides, "fused", self.target.backend)?;
        let locs: Vec<Loc> = ops.iter().map(|(l, _)| *l).collect();
        let x4 = self.target.fused_x4 && quads(&p, &locs);
        p.iv[7] = x4 as i64;
        let threads = if x4 { n / 4 } else { n };
        let operands = locs.into_iter().enumerate().collect();
        self.launch(
            Kernel::Fused(idx),
            grid_for(threads, THREADS as usize),
            THREADS,
            p,
            operands,
        );
        Ok(())
    }

    fn copy32(
        &mut self,
        dims: &[usize],
        src: (Loc, Vec<i64>),
        dst: (Loc, Vec<i64>),
        what: &str,
    ) -> Result<()> {
        self.map(
            Kernel::Library("rlx_copy32"),
            dims,
            &[src, dst],
            P::default(),
            what,
        )
    }

    fn op(&mut self, op: &Op, ins: &[TRef], out: &TRef) -> Result<()> {
        let od = out.shape.dims().to_vec();
        let sh = |i: usize| ins[i].shape.dims().to_vec();
        let err = (3usize, scratch(ERR_AT));
        let _ = err;
        match op {
            Op::Unary(u) => self.fused(
                Fused {
                    shape: out.shape.clone(),
                    n_inputs: 1,
                    steps: vec![FusedStep::Unary(*u, 0)],
                },
                ins,
                out,
            ),
            Op::Fused(f) => self.fused((**f).clone(), ins, out),
            Op::Binary(bop) if ins[0].dtype == DType::F32 => self.fused(
                Fused {
                    shape: out.shape.clone(),
                    n_inputs: 2,
                    steps: vec![FusedStep::Binary(*bop, 0, 1)],
                },
                ins,
                out,
            ),
            Op::Binary(bop) => {
                if matches!(bop, BinaryOp::FloorDiv | BinaryOp::Mod) && self.plan.int_div.is_none()
                {
                    self.plan.int_div = Some((op.name().to_string(), ins[1].shape.clone()));
                }
                let mut p = P::default();
                p.iv[0] = int_op_code(*bop);
                let ops = [
                    (at(&ins[0]), broadcast(&sh(0), &od)),
                    (at(&ins[1]), broadcast(&sh(1), &od)),
                    (at(out), contiguous(&od)),
                    (scratch(ERR_AT), vec![0; od.len()]),
                ];
                self.map(Kernel::Library("rlx_ibinary"), &od, &ops, p, op.name())
            }
            Op::Where if ins[0].dtype == DType::F32 && out.dtype == DType::F32 => self.fused(
                Fused {
                    shape: out.shape.clone(),
                    n_inputs: 3,
                    steps: vec![FusedStep::Where(0, 1, 2)],
                },
                ins,
                out,
            ),
            Op::Where => {
                let mut p = P::default();
                p.iv[0] = (ins[0].dtype == DType::I32) as i64;
                let ops = [
                    (at(&ins[0]), broadcast(&sh(0), &od)),
                    (at(&ins[1]), broadcast(&sh(1), &od)),
                    (at(&ins[2]), broadcast(&sh(2), &od)),
                    (at(out), contiguous(&od)),
                ];
                self.map(Kernel::Library("rlx_where32"), &od, &ops, p, "where")
            }
            Op::Cast { to } => {
                let name = match (ins[0].dtype, to) {
                    (DType::F32, DType::I32) => "rlx_cast_f2i",
                    (DType::I32, DType::F32) => "rlx_cast_i2f",
                    (DType::F32, DType::BF16) => "rlx_cast_f2bf",
                    (DType::BF16, DType::F32) => "rlx_cast_bf2f",
                    (DType::F32, DType::F16) => "rlx_cast_f2h",
                    (DType::F16, DType::F32) => "rlx_cast_h2f",
                    (DType::Bool, DType::I32) => "rlx_cast_b2i",
                    (DType::I32, DType::Bool) => "rlx_cast_i2b",
                    (DType::I32, DType::I64) => "rlx_cast_i2l",
                    (a, b) if a.size() == 4 && b.size() == 4 => "rlx_copy32",
                    (a, b) => {
                        return Err(Error::unsupported(
                            "cast",
                            format!("the {} backend has no {a} -> {b} cast", self.target.backend),
                        ))
                    }
                };
                let n = out.numel();
                let (src, dst) = (at(&ins[0]), at(out));
                if ins[0].dtype == DType::F32
                    && to.is_low_precision()
                    && n % 4 == 0
                    && src.offset % 16 == 0
                    && dst.offset % 16 == 0
                {
                    // Four at a time: float4 loads, 8-byte stores.
                    let x4 = if *to == DType::BF16 {
                        "rlx_cast_f2bf_x4"
                    } else {
                        "rlx_cast_f2h_x4"
                    };
                    if n > 0 {
                        let grid = grid_for(n / 4, THREADS as usize);
                        let ops = vec![(0, src), (1, dst)];
                        self.launch(Kernel::Library(x4), grid, THREADS, P::sized(n / 4), ops);
                    }
                    return Ok(());
                }
                let ops = [(src, vec![1]), (dst, vec![1])];
                self.map(Kernel::Library(name), &[n], &ops, P::default(), "cast")
            }
            Op::BroadcastTo { .. } => self.copy32(
                &od,
                (at(&ins[0]), broadcast(&sh(0), &od)),
                (at(out), contiguous(&od)),
                "broadcast_to",
            ),
            Op::Transpose { perm } => {
                let cs = contiguous(&sh(0));
                let st: Vec<i64> = perm.iter().map(|&p| cs[p]).collect();
                self.copy32(
                    &od,
                    (at(&ins[0]), st),
                    (at(out), contiguous(&od)),
                    "transpose",
                )
            }
            Op::Slice { axis, start, .. } => {
                let xs = contiguous(&sh(0));
                let mut src = at(&ins[0]);
                src.offset += *start * xs[*axis] as usize * 4;
                self.copy32(&od, (src, xs), (at(out), contiguous(&od)), "slice")
            }
            Op::Pad { axis, before, .. } => {
                self.plan.steps.push(Step::Fill {
                    at: at(out),
                    bytes: out.bytes(),
                });
                let os = contiguous(&od);
                let mut dst = at(out);
                dst.offset += *before * os[*axis] as usize * 4;
                self.copy32(&sh(0), (at(&ins[0]), contiguous(&sh(0))), (dst, os), "pad")
            }
            Op::Concat { axis } => {
                let os = contiguous(&od);
                let mut from = 0usize;
                for t in ins {
                    let mut dst = at(out);
                    dst.offset += from * os[*axis] as usize * 4;
                    let d = t.shape.dims().to_vec();
                    self.copy32(&d, (at(t), contiguous(&d)), (dst, os.clone()), "concat")?;
                    from += d[*axis];
                }
                Ok(())
            }
            Op::MatMul { trans_a, trans_b } => self.matmul(ins, out, *trans_a, *trans_b),
            Op::Reduce { op: r, axes, .. }
                if ins[0].dtype == DType::I32 && self.target.int_reduce && *r != ReduceOp::Mean =>
            {
                self.reduce(*r, &ins[0], axes, out)
            }
            Op::Reduce { .. } if ins[0].dtype != DType::F32 => Err(Error::unsupported(
                op.name(),
                format!(
                    "the {} backend reduces only float32 tensors so far, got {} {}; \
                     run it on the cpu or cast with .astype('float32')",
                    self.target.backend, ins[0].dtype, ins[0].shape
                ),
            )),
            Op::Reduce { op: r, axes, .. } => self.reduce(*r, &ins[0], axes, out),
            Op::SumTo { .. } => {
                let xd = sh(0);
                let lead = xd.len() - od.len();
                let axes: Vec<usize> = (0..xd.len())
                    .filter(|&d| d < lead || (od[d - lead] == 1 && xd[d] != 1))
                    .collect();
                self.reduce(ReduceOp::Sum, &ins[0], &axes, out)
            }
            Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let xd = sh(0);
                let len = xd[*axis];
                let inner: usize = xd[axis + 1..].iter().product();
                let outer: usize = xd[..*axis].iter().product();
                if len == 0 || out.numel() == 0 {
                    return Ok(());
                }
                let mut p = P::sized(outer * inner);
                p.iv[0] = len as i64;
                p.iv[1] = inner as i64;
                p.iv[2] = matches!(op, Op::LogSoftmax { .. }) as i64;
                let rows = outer * inner;
                self.launch(
                    Kernel::Library("rlx_softmax"),
                    grid_for(rows, 8),
                    THREADS,
                    p,
                    vec![(0, at(&ins[0])), (1, at(out))],
                );
                Ok(())
            }
            Op::SoftmaxCrossEntropy => {
                let (rows, c) = (sh(0)[0], sh(0)[1]);
                self.plan.classes.get_or_insert(c);
                self.plan.scratch_bytes = self.plan.scratch_bytes.max(ROWS_AT + rows * 8);
                let mut p = P::sized(rows);
                p.iv[0] = c as i64;
                if rows > 0 {
                    self.launch(
                        Kernel::Library("rlx_ce_rows"),
                        grid_for(rows, 8),
                        THREADS,
                        p,
                        vec![
                            (0, at(&ins[0])),
                            (1, at(&ins[1])),
                            (2, scratch(ROWS_AT)),
                            (3, scratch(ERR_AT)),
                        ],
                    );
                }
                let q = P::sized(rows);
                self.launch(
                    Kernel::Library("rlx_mean_rows"),
                    1,
                    1024,
                    q,
                    vec![(0, scratch(ROWS_AT)), (1, at(out))],
                );
                Ok(())
            }
            Op::SoftmaxCrossEntropyGrad => {
                let (rows, c) = (sh(0)[0], sh(0)[1]);
                self.plan.classes.get_or_insert(c);
                if rows == 0 || c == 0 {
                    return Ok(());
                }
                let mut p = P::sized(rows);
                p.iv[0] = c as i64;
                self.launch(
                    Kernel::Library("rlx_count_labels"),
                    1,
                    1024,
                    P::sized(rows),
                    vec![(0, at(&ins[1])), (1, scratch(COUNT_AT))],
                );
                self.launch(
                    Kernel::Library("rlx_ce_grad"),
                    grid_for(rows, 8),
                    THREADS,
                    p,
                    vec![
                        (0, at(&ins[0])),
                        (1, at(&ins[1])),
                        (2, at(&ins[2])),
                        (3, at(out)),
                        (4, scratch(ERR_AT)),
                        (5, scratch(COUNT_AT)),
                    ],
                );
                Ok(())
            }
            Op::Mse => {
                let p = P::sized(ins[0].numel());
                self.launch(
                    Kernel::Library("rlx_mse"),
                    1,
                    1024,
                    p,
                    vec![(0, at(&ins[0])), (1, at(&ins[1])), (2, at(out))],
                );
                Ok(())
            }
            Op::Gather => {
                let rows = sh(0)[0];
                self.plan.rows.get_or_insert(rows);
                let width = ins[0].numel().checked_div(rows).unwrap_or(0);
                let n = ins[1].numel() * width;
                if n == 0 {
                    return Ok(());
                }
                let mut p = P::sized(n);
                p.iv[0] = rows as i64;
                p.iv[1] = width as i64;
                self.launch(
                    Kernel::Library("rlx_gather"),
                    grid_for(n, THREADS as usize),
                    THREADS,
                    p,
                    vec![
                        (0, at(&ins[0])),
                        (1, at(&ins[1])),
                        (2, at(out)),
                        (3, scratch(ERR_AT)),
                    ],
                );
                Ok(())
            }
            Op::ScatterAdd { rows } => {
                self.plan.rows.get_or_insert(*rows);
                self.plan.steps.push(Step::Fill {
                    at: at(out),
                    bytes: out.bytes(),
                });
                let width = out.numel().checked_div(*rows).unwrap_or(0);
                let n = ins[0].numel() * width;
                if n == 0 {
                    return Ok(());
                }
                let mut p = P::sized(n);
                p.iv[0] = *rows as i64;
                p.iv[1] = width as i64;
                self.launch(
                    Kernel::Library("rlx_scatter_add"),
                    grid_for(n, THREADS as usize),
                    THREADS,
                    p,
                    vec![
                        (0, at(&ins[0])),
                        (1, at(&ins[1])),
                        (2, at(out)),
                        (3, scratch(ERR_AT)),
                    ],
                );
                Ok(())
            }
            Op::Normalize { eps } | Op::NormalizeGrad { eps } => {
                let width = sh(0).last().copied().unwrap_or(1);
                if width == 0 || out.numel() == 0 {
                    return Ok(());
                }
                let rows = out.numel() / width;
                let mut p = P::sized(rows);
                p.iv[0] = width as i64;
                p.fv[0] = *eps;
                let (name, operands) = match op {
                    Op::Normalize { .. } => ("rlx_normalize", vec![(0, at(&ins[0])), (1, at(out))]),
                    _ => (
                        "rlx_normalize_grad",
                        vec![(0, at(&ins[0])), (1, at(&ins[1])), (2, at(out))],
                    ),
                };
                self.launch(
                    Kernel::Library(name),
                    grid_for(rows, 8),
                    THREADS,
                    p,
                    operands,
                );
                Ok(())
            }
            Op::MatMulEpilogue {
                trans_a,
                trans_b,
                epilogue,
            } => {
                // The product goes to the program's product buffer, the epilogue reads it there.
                let (ad, bd) = (sh(0), sh(1));
                let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
                let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
                let m = if *trans_a { ca } else { ra };
                let n = if *trans_b { rb } else { cb };
                let (pa, pb) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
                let r = pa.len().max(pb.len());
                let dim = |p: &[usize], i: usize| {
                    if i + p.len() >= r {
                        p[i + p.len() - r]
                    } else {
                        1
                    }
                };
                let mut pd: Vec<usize> = (0..r).map(|i| dim(pa, i).max(dim(pb, i))).collect();
                pd.extend([m, n]);
                let numel: usize = pd.iter().product();
                self.plan.product_bytes = self.plan.product_bytes.max(numel * 4);
                let prod = Loc {
                    buf: PRODUCT,
                    offset: 0,
                };
                self.matmul_at(
                    ins[0].dtype,
                    (at(&ins[0]), &ad),
                    (at(&ins[1]), &bd),
                    (prod, &pd),
                    *trans_a,
                    *trans_b,
                )?;
                let mut fins = vec![(prod, epilogue.shape.dims().to_vec())];
                fins.extend(ins[2..].iter().map(|t| (at(t), t.shape.dims().to_vec())));
                self.fused_at((**epilogue).clone(), &fins, at(out), out.numel())
            }
            Op::FusedSumTo { expr, .. } => {
                // The expression goes to the product buffer, then is summed down from there.
                let xd = expr.shape.dims().to_vec();
                let total = expr.shape.numel();
                self.plan.product_bytes = self.plan.product_bytes.max(total * 4);
                let prod = Loc {
                    buf: PRODUCT,
                    offset: 0,
                };
                let fins: Vec<(Loc, Vec<usize>)> = ins
                    .iter()
                    .map(|t| (at(t), t.shape.dims().to_vec()))
                    .collect();
                self.fused_at((**expr).clone(), &fins, prod, total)?;
                let lead = xd.len() - od.len();
                let axes: Vec<usize> = (0..xd.len())
                    .filter(|&d| d < lead || (od[d - lead] == 1 && xd[d] != 1))
                    .collect();
                self.reduce_at(ReduceOp::Sum, prod, &xd, &axes, out)
            }
            Op::NormalizeGradAdd { eps } => {
                // One launch where the kernel adds `acc` itself; else normalize_grad into the
                // product buffer, then `+ acc` into `out`.
                let width = sh(0).last().copied().unwrap_or(1);
                if width == 0 || out.numel() == 0 {
                    return Ok(());
                }
                let rows = out.numel() / width;
                if self.target.normalize_grad_add {
                    let mut p = P::sized(rows);
                    p.iv[0] = width as i64;
                    p.iv[1] = 1;
                    p.fv[0] = *eps;
                    self.launch(
                        Kernel::Library("rlx_normalize_grad"),
                        grid_for(rows, 8),
                        THREADS,
                        p,
                        vec![
                            (0, at(&ins[0])),
                            (1, at(&ins[1])),
                            (2, at(out)),
                            (3, at(&ins[2])),
                        ],
                    );
                    return Ok(());
                }
                self.plan.product_bytes = self.plan.product_bytes.max(out.numel() * 4);
                let prod = Loc {
                    buf: PRODUCT,
                    offset: 0,
                };
                let mut p = P::sized(rows);
                p.iv[0] = width as i64;
                p.fv[0] = *eps;
                self.launch(
                    Kernel::Library("rlx_normalize_grad"),
                    grid_for(rows, 8),
                    THREADS,
                    p,
                    vec![(0, at(&ins[0])), (1, at(&ins[1])), (2, prod)],
                );
                let add = Fused {
                    shape: out.shape.clone(),
                    n_inputs: 2,
                    steps: vec![FusedStep::Binary(BinaryOp::Add, 0, 1)],
                };
                let fins = [(prod, od.clone()), (at(&ins[2]), sh(2))];
                self.fused_at(add, &fins, at(out), out.numel())
            }
            Op::Log1p => {
                let n = out.numel();
                let ops = [(at(&ins[0]), vec![1]), (at(out), vec![1])];
                self.map(
                    Kernel::Library("rlx_log1p"),
                    &[n],
                    &ops,
                    P::default(),
                    "log1p",
                )
            }
            Op::StopGradient => {
                let n = out.numel();
                self.copy32(
                    &[n],
                    (at(&ins[0]), vec![1]),
                    (at(out), vec![1]),
                    "stop_gradient",
                )
            }
            Op::Dropout { p: drop } => {
                let n = out.numel();
                if n == 0 {
                    return Ok(());
                }
                let mut p = P::sized(n);
                p.fv[0] = *drop;
                p.fv[1] = 1.0 / (1.0 - *drop);
                self.launch(
                    Kernel::Library("rlx_dropout"),
                    grid_for(n, THREADS as usize),
                    THREADS,
                    p,
                    vec![(0, at(&ins[0])), (1, at(&ins[1])), (2, at(out))],
                );
                Ok(())
            }
            Op::Attention {
                scale,
                causal,
                heads,
                lowp,
            }
            | Op::AttentionGrad {
                scale,
                causal,
                heads,
                lowp,
            } => self.attention(
                matches!(op, Op::AttentionGrad { .. }),
                Attn {
                    scale: *scale,
                    causal: *causal,
                    heads: *heads,
                    lowp: *lowp,
                },
                ins,
                out,
            ),
            // The window kernels' `max` slot carries the patch layout for these two.
            Op::Im2Col { window, k_major } => {
                let d = sh(0);
                let ops = vec![(0, at(&ins[0])), (1, at(out))];
                self.window(
                    "rlx_im2col",
                    window,
                    [d[2], d[3]],
                    (*k_major, d[1]),
                    out.numel(),
                    ops,
                )
            }
            Op::Col2Im {
                window,
                size,
                k_major,
            } => {
                let ops = vec![(0, at(&ins[0])), (1, at(out))];
                self.window(
                    "rlx_col2im",
                    window,
                    *size,
                    (*k_major, od[1]),
                    out.numel(),
                    ops,
                )
            }
            Op::Pool2d { window, max } => {
                let d = sh(0);
                self.window(
                    "rlx_pool2d",
                    window,
                    [d[2], d[3]],
                    (*max, d[1]),
                    out.numel(),
                    vec![(0, at(&ins[0])), (1, at(out))],
                )
            }
            Op::Pool2dGrad { window, max } => {
                let d = sh(0);
                let ops = vec![(0, at(&ins[0])), (1, at(&ins[1])), (2, at(out))];
                self.window(
                    "rlx_pool2d_grad",
                    window,
                    [d[2], d[3]],
                    (*max, d[1]),
                    out.numel(),
                    ops,
                )
            }
            Op::Input { .. } | Op::Param { .. } | Op::Const { .. } | Op::Reshape { .. } => {
                Err(Error::Internal(format!("[{}] is not a kernel", op.name())))
            }
        }
    }

    /// A convolution-patch or pooling kernel over planes of `size` (one thread per output
    /// element).
    fn window(
        &mut self,
        name: &'static str,
        w: &rlx_ir::Window,
        size: [usize; 2],
        (max, channels): (bool, usize),
        n: usize,
        operands: Vec<(usize, Loc)>,
    ) -> Result<()> {
        let Some([oh, ow]) = w.out_size(size) else {
            return Err(Error::Internal(format!("[{name}] the window does not fit")));
        };
        if n == 0 {
            return Ok(());
        }
        let mut p = P::sized(n);
        p.iv.copy_from_slice(&[
            size[0] as i64,
            size[1] as i64,
            oh as i64,
            ow as i64,
            w.kernel[0] as i64,
            w.kernel[1] as i64,
            max as i64,
            channels as i64,
        ]);
        p.st[0][..4].copy_from_slice(&[
            w.stride[0] as i64,
            w.stride[1] as i64,
            w.padding[0] as i64,
            w.padding[1] as i64,
        ]);
        p.fv[0] = 1.0 / (w.kernel[0] * w.kernel[1]) as f32;
        self.launch(
            Kernel::Library(name),
            grid_for(n, THREADS as usize),
            THREADS,
            p,
            operands,
        );
        Ok(())
    }

    /// Attention forward or backward (see `rlx_attention` in the kernel source for the record).
    fn attention(&mut self, grad: bool, attn: Attn, ins: &[TRef], out: &TRef) -> Result<()> {
        let Attn {
            scale,
            causal,
            heads,
            lowp,
        } = attn;
        let d0 = ins[0].shape.dims();
        let mut p = P::default();
        let (units, h, l, s, e, ev);
        // Per tensor: [unit stride, head offset, row stride, base] in elements.
        let mut st = [[0i64; 4]; 7];
        match heads {
            Some(hh) => {
                (units, h, l, s) = (d0[0], hh, d0[1], d0[1]);
                e = d0[2] / (3 * hh);
                ev = e;
                let (row, t) = ((3 * hh * e) as i64, d0[1] as i64);
                for (x, base) in [(0, 0), (1, hh * e), (2, 2 * hh * e)] {
                    st[x] = [t * row, e as i64, row, base as i64];
                    st[x + 4] = st[x];
                }
                let orow = (hh * e) as i64;
                st[3] = [t * orow, e as i64, orow, 0];
            }
            None => {
                let (kd, vd) = (ins[1].shape.dims(), ins[2].shape.dims());
                let r = d0.len();
                units = d0[..r - 2].iter().product();
                (h, l, s, e, ev) = (1, d0[r - 2], kd[r - 2], d0[r - 1], vd[r - 1]);
                let (l_, s_, e_, ev_) = (l as i64, s as i64, e as i64, ev as i64);
                st[0] = [l_ * e_, 0, e_, 0];
                st[1] = [s_ * e_, 0, e_, 0];
                st[2] = [s_ * ev_, 0, ev_, 0];
                st[3] = [l_ * ev_, 0, ev_, 0];
                let (qn, kn) = (ins[0].numel() as i64, ins[1].numel() as i64);
                st[4] = st[0];
                st[5] = [s_ * e_, 0, e_, qn];
                st[6] = [s_ * ev_, 0, ev_, qn + kn];
            }
        }
        if e > 256 || ev > 256 {
            return Err(Error::unsupported(
                "attention",
                format!(
                    "the {} kernel takes head sizes up to 256, got {e} / {ev}",
                    self.target.backend
                ),
            ));
        }
        let rows = units * h * l;
        if out.numel() == 0 {
            return Ok(());
        }
        for (x, v) in st.iter().enumerate() {
            p.st[x][..4].copy_from_slice(v);
        }
        p.n = rows as i64;
        p.iv[..6].copy_from_slice(&[
            units as i64,
            h as i64,
            l as i64,
            s as i64,
            e as i64,
            ev as i64,
        ]);
        if let Some(off) = causal {
            p.iv[6] = 1;
            p.iv[7] = off;
        }
        p.fv[0] = scale;
        let packed = heads.is_some();
        let (q, k, v) = if packed {
            (at(&ins[0]), at(&ins[0]), at(&ins[0]))
        } else {
            (at(&ins[0]), at(&ins[1]), at(&ins[2]))
        };
        let tiled = self.target.tiled_attention && e <= 64 && ev <= 64;
        if let Some(min) = self.target.gemm_attention {
            let forward_too = self.target.gemm_attention_forward || !tiled;
            // The scores are materialised (twice for the gradient): past a bound, the fused
            // kernels' memory-light path instead.
            let scores = units * h * l * s * 4;
            // (Degenerate shapes, a product summing nothing, take the kernels.)
            if units * h * l * s * e.min(ev) > 0
                && units * h * l * s * e.max(ev) >= min
                && scores <= GEMM_ATTENTION_MAX_SCORES
                && (grad || forward_too)
            {
                // The gradient's inputs: q, k, v, o, g (o is not needed here).
                let g = match (grad, packed) {
                    (false, _) => None,
                    (true, true) => Some(at(&ins[2])),
                    (true, false) => Some(at(&ins[4])),
                };
                let a = AttentionGemm {
                    dims: (units, h, l, s, e, ev),
                    st,
                    scale,
                    causal,
                    // Backends without mixed precision compute in float32 throughout.
                    operands: match lowp {
                        Some(dt) if self.target.low_precision => dt,
                        _ => DType::F32,
                    },
                };
                return self.attention_gemm(&a, [q, k, v], g, at(out));
            }
        }
        let mut ops = vec![(0, q), (1, k), (2, v)];
        if tiled {
            let em = if e.max(ev) <= 32 { 32 } else { 64 };
            let blocks = |n: usize, per: usize| -> Result<u32> {
                u32::try_from(units * h * n.div_ceil(per)).map_err(|_| {
                    Error::unsupported(
                        "attention",
                        format!("{units}x{h} heads of {n} rows are too many for one launch"),
                    )
                })
            };
            if !grad {
                ops.push((3, at(out)));
                let name = if em == 32 {
                    "rlx_att_fwd_32"
                } else {
                    "rlx_att_fwd_64"
                };
                self.launch(Kernel::Library(name), blocks(l, 64)?, 128, p, ops);
                return Ok(());
            }
            let (o, g) = if packed {
                (&ins[1], &ins[2])
            } else {
                (&ins[3], &ins[4])
            };
            // Two floats per query row (log-sum-exp, g.out), passed from the dQ kernel to the
            // dK/dV kernel.
            self.plan.scratch_bytes = self.plan.scratch_bytes.max(ROWS_AT + rows * 8);
            ops.extend([(3, at(o)), (4, at(g)), (5, at(out)), (6, scratch(ROWS_AT))]);
            let (nq, nkv) = if em == 32 {
                ("rlx_att_bwd_q_32", "rlx_att_bwd_kv_32")
            } else {
                ("rlx_att_bwd_q_64", "rlx_att_bwd_kv_64")
            };
            self.launch(Kernel::Library(nq), blocks(l, 32)?, 128, p, ops.clone());
            if s > 0 {
                self.launch(Kernel::Library(nkv), blocks(s, 32)?, 128, p, ops);
            }
            return Ok(());
        }
        let name = if grad {
            let (o, g) = if packed {
                (&ins[1], &ins[2])
            } else {
                (&ins[3], &ins[4])
            };
            ops.extend([(3, at(o)), (4, at(g)), (5, at(out))]);
            self.plan.steps.push(Step::Fill {
                at: at(out),
                bytes: out.bytes(),
            });
            "rlx_attention_grad"
        } else {
            ops.push((3, at(out)));
            "rlx_attention"
        };
        if rows > 0 {
            self.launch(Kernel::Library(name), grid_for(rows, 8), THREADS, p, ops);
        }
        Ok(())
    }

    /// Attention as batched GEMMs (see [`Target::gemm_attention`]): the scores `q k^T` are one
    /// batched product, a row kernel turns them into probabilities in place (scale, causal
    /// mask, softmax), and `p v` is the output. The gradient recomputes the probabilities,
    /// then `dv = p^T g`, `dp = g v^T`, `ds = scale p (dp - rowsum(p dp))` in place,
    /// `dq = ds k`, `dk = ds^T q`.
    ///
    /// Each head's matrices are read and written where they are: one strided batched product
    /// where a tensor's heads are one stride apart (head-major), a pointer-array product
    /// ([`Step::GemmGrid`], with [`Target::gemm_grids`]) where they are not
    /// (packed heads). Without those, `q`, `k`, `v` and `g` are copied head-major into the
    /// product buffer and the products written there and copied out.
    ///
    /// With low-precision operands (`a.operands`, from `Op::Attention`'s `lowp`) the
    /// head-major copies are casts, the row kernels also write the probabilities and score
    /// gradients in that dtype, and every product reads those copies and sums in float32.
    fn attention_gemm(
        &mut self,
        a: &AttentionGemm,
        [q, k, v]: [Loc; 3],
        g: Option<Loc>,
        out: Loc,
    ) -> Result<()> {
        let (units, h, l, s, e, ev) = a.dims;
        let bh = units * h;
        let (f, lo) = (DType::F32, a.operands);
        let low = lo != f;
        // (An output never shares bytes with an input: `validate` refuses such programs, so
        // the products may read the inputs in place while writing the output.)
        let grids = self.target.gemm_grids;
        // Workspace in the product buffer, 256-byte aligned pieces.
        let ws = std::cell::Cell::new(0usize);
        let alloc = |elems: usize, dtype: DType| {
            let at = Loc {
                buf: PRODUCT,
                offset: ws.get(),
            };
            ws.set(ws.get() + (elems * dtype.size()).div_ceil(256) * 256);
            at
        };
        // Tensor `x` of the description (0 q, 1 k, 2 v, 3 o/g, 4 dq, 5 dk, 6 dv) at `base`.
        let view = |x: usize, base: Loc| {
            let [su, sh, sr, b] = a.st[x];
            let mut at = base;
            at.offset += b as usize * 4;
            Heads { at, su, sh, sr }
        };
        let packed = |rows: usize, cols: usize, at: Loc| Heads {
            at,
            su: (h * rows * cols) as i64,
            sh: (rows * cols) as i64,
            sr: cols as i64,
        };
        let uniform = |t: &Heads, rows: usize, cols: usize| {
            let want = packed(rows, cols, t.at);
            (units == 1 || t.su == want.su)
                && (h == 1 || t.sh == want.sh)
                && (rows == 1 || t.sr == want.sr)
        };
        let mut places = Vec::new();
        let srcs = [(0, q, l, e), (1, k, s, e), (2, v, s, ev)];
        for (x, base, rows, cols) in srcs.into_iter().chain(g.map(|g| (3, g, l, ev))) {
            let t = view(x, base);
            if !low && (grids || uniform(&t, rows, cols)) {
                places.push(t);
            } else {
                let to = alloc(bh * rows * cols, lo);
                let dims = [units, h, rows, cols];
                self.rows_copy(
                    &dims,
                    (t.at, [t.su, t.sh, t.sr, 1]),
                    (to, contiguous(&dims)),
                    lo,
                );
                places.push(packed(rows, cols, to));
            }
        }
        let (qh, kh, vh) = (places[0], places[1], places[2]);
        let probs = alloc(bh * l * s, f);
        // The probabilities as the products read them.
        let probs_lo = if low { alloc(bh * l * s, lo) } else { probs };
        let (pr, pr_lo) = (packed(l, s, probs), packed(l, s, probs_lo));
        let mm = |b: &mut Self, x: (Heads, usize, usize), y: (Heads, usize, usize), c, ta, tb| {
            b.matmul_heads(lo, (units, h), x, y, c, ta, tb)
        };
        mm(self, (qh, l, e), (kh, s, e), pr, false, true)?;
        let mut p = P::sized(bh * l);
        p.iv[0] = l as i64;
        p.iv[1] = s as i64;
        if let Some(off) = a.causal {
            p.iv[2] = 1;
            p.iv[3] = off;
        }
        p.iv[4] = low_code(lo);
        p.fv[0] = a.scale;
        let rows = grid_for(bh * l, 8);
        let mut ops = vec![(0, probs)];
        if low {
            ops.push((1, probs_lo));
        }
        // A forward pass with low-precision products reads only the low-precision copy.
        let mut ps = p;
        ps.iv[5] = (low && g.is_none()) as i64;
        self.launch(Kernel::Library("rlx_att_softmax"), rows, THREADS, ps, ops);
        // A product into output tensor `x` (`rows` x `cols` per head): straight there when it
        // can be, else through the product buffer.
        let into = |b: &mut Self,
                    x: usize,
                    rows: usize,
                    cols: usize,
                    product: &dyn Fn(&mut Self, Heads) -> Result<()>|
         -> Result<()> {
            let t = view(x, out);
            if grids || uniform(&t, rows, cols) {
                return product(b, t);
            }
            let tmp = alloc(bh * rows * cols, f);
            product(b, packed(rows, cols, tmp))?;
            let dims = [units, h, rows, cols];
            b.rows_copy(
                &dims,
                (tmp, contiguous(&dims)),
                (t.at, [t.su, t.sh, t.sr, 1]),
                f,
            );
            Ok(())
        };
        let Some(gh) = g.map(|_| places[3]) else {
            into(self, 3, l, ev, &|b, o| {
                mm(b, (pr_lo, l, s), (vh, s, ev), o, false, false)
            })?;
            self.plan.product_bytes = self.plan.product_bytes.max(ws.get());
            return Ok(());
        };
        into(self, 6, s, ev, &|b, dv| {
            mm(b, (pr_lo, l, s), (gh, l, ev), dv, true, false)
        })?;
        let ds = alloc(bh * l * s, f);
        let ds_lo = if low { alloc(bh * l * s, lo) } else { ds };
        mm(
            self,
            (gh, l, ev),
            (vh, s, ev),
            packed(l, s, ds),
            false,
            true,
        )?;
        let mut ops = vec![(0, probs), (1, ds)];
        if low {
            ops.push((2, ds_lo));
        }
        // With low-precision products only the low-precision score gradients are read.
        let mut pd = p;
        pd.iv[5] = low as i64;
        self.launch(Kernel::Library("rlx_att_dscore"), rows, THREADS, pd, ops);
        let dsh = packed(l, s, ds_lo);
        into(self, 4, l, e, &|b, dq| {
            mm(b, (dsh, l, s), (kh, s, e), dq, false, false)
        })?;
        into(self, 5, s, e, &|b, dk| {
            mm(b, (dsh, l, s), (qh, l, e), dk, true, false)
        })?;
        self.plan.product_bytes = self.plan.product_bytes.max(ws.get());
        Ok(())
    }

    /// `c = op(x) op(y)` for each of the `units x heads` matrices of three [`Heads`] (`x` is
    /// `rx x cx` row-major, `y` `ry x cy`; `x` and `y` in `dtype`, `c` float32): one strided
    /// batched GEMM where each operand's matrices are one stride apart, else one
    /// [`Step::GemmGrid`].
    #[allow(clippy::too_many_arguments)]
    fn matmul_heads(
        &mut self,
        dtype: DType,
        (units, heads): (usize, usize),
        (x, rx, cx): (Heads, usize, usize),
        (y, ry, cy): (Heads, usize, usize),
        c: Heads,
        tx: bool,
        ty: bool,
    ) -> Result<()> {
        let (m, k) = if tx { (cx, rx) } else { (rx, cx) };
        let n = if ty { ry } else { cy };
        if units * heads * m * n == 0 {
            return Ok(());
        }
        if k == 0 {
            return Err(Error::Internal(
                "an attention product with nothing to sum".into(),
            ));
        }
        // One stride for the whole batch, where there is one and the matrices do not
        // interleave (a matrix of `rows` rows spans `(rows - 1) * sr + cols` elements).
        let stride = |t: &Heads, rows: usize, cols: usize| -> Option<usize> {
            let s = if heads == 1 {
                t.su
            } else if units == 1 || t.su == heads as i64 * t.sh {
                t.sh
            } else {
                return None;
            };
            let span = (rows as i64 - 1) * t.sr + cols as i64;
            (units * heads == 1 || s >= span).then_some(s as usize)
        };
        debug_assert!([x, y, c].iter().all(|t| t.su >= 0 && t.sh >= 0 && t.sr > 0));
        let batch = units * heads;
        // Row-major C = X Y is column-major C^T = Y^T X^T: cuBLAS's A is our Y.
        let mut g = Gemm {
            dtype,
            ta: ty,
            tb: tx,
            m: n,
            n: m,
            k,
            lda: y.sr as usize,
            ldb: x.sr as usize,
            ldc: c.sr as usize,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch,
        };
        if let (Some(sa), Some(sb), Some(sc)) =
            (stride(&y, ry, cy), stride(&x, rx, cx), stride(&c, m, n))
        {
            (g.stride_a, g.stride_b, g.stride_c) = (sa, sb, sc);
            self.plan.steps.push(Step::Gemm {
                g,
                a: y.at,
                b: x.at,
                c: c.at,
            });
            return Ok(());
        }
        let grid = |t: &Heads, size: usize| Grid {
            at: t.at,
            units,
            heads,
            su: t.su as usize * size,
            sh: t.sh as usize * size,
        };
        let es = dtype.size();
        self.plan.steps.push(Step::GemmGrid {
            g,
            a: grid(&y, es),
            b: grid(&x, es),
            c: grid(&c, 4),
        });
        Ok(())
    }

    /// Copies the rows of a `[blocks, heads, rows, cols]` float32 tensor (contiguous columns)
    /// between two layouts given by element strides, writing `to` (float32, or cast to
    /// bfloat16 / float16); four at a time where both sides allow it.
    fn rows_copy(
        &mut self,
        dims: &[usize; 4],
        src: (Loc, impl AsRef<[i64]>),
        dst: (Loc, impl AsRef<[i64]>),
        to: DType,
    ) {
        let (ss, ds) = (src.1.as_ref(), dst.1.as_ref());
        let n = dims[0] * dims[1] * dims[2];
        if n * dims[3] == 0 {
            return;
        }
        let mut p = P::sized(n);
        p.iv[0] = dims[1] as i64;
        p.iv[1] = dims[2] as i64;
        p.iv[2] = dims[3] as i64;
        p.st[0][..3].copy_from_slice(&ss[..3]);
        p.st[1][..3].copy_from_slice(&ds[..3]);
        let vec4 = dims[3] % 4 == 0
            && ss[..3].iter().chain(&ds[..3]).all(|s| s % 4 == 0)
            && src.0.offset % 16 == 0
            && dst.0.offset % 16 == 0;
        p.iv[3] = vec4 as i64;
        p.iv[4] = low_code(to);
        let per = if vec4 { dims[3] / 4 } else { dims[3] };
        self.launch(
            Kernel::Library("rlx_att_copy"),
            grid_for(n * per, THREADS as usize),
            THREADS,
            p,
            vec![(0, src.0), (1, dst.0)],
        );
    }

    fn reduce(&mut self, r: ReduceOp, x: &TRef, axes: &[usize], out: &TRef) -> Result<()> {
        self.reduce_at(r, at(x), x.shape.dims(), axes, out)
    }

    /// `reduce` of an operand given by place and dims.
    fn reduce_at(
        &mut self,
        r: ReduceOp,
        xl: Loc,
        xd: &[usize],
        axes: &[usize],
        out: &TRef,
    ) -> Result<()> {
        let n = out.numel();
        if n == 0 {
            return Ok(());
        }
        let count: usize = axes.iter().map(|&a| xd[a]).product();
        let is_prefix = axes.iter().enumerate().all(|(i, &a)| a == i);
        let int = out.dtype == DType::I32;
        if is_prefix && r != ReduceOp::Max && count >= 64 && !int {
            // Leading rows summed column-wise: coalesced reads.
            // Blocks of 32 columns and a chunk of rows. Up to 256 rows are one chunk: each
            // block stores its columns' sums. More rows: the chunk halves (down to 16 rows, two
            // a warp) until there are blocks enough for a large GPU; the blocks' partial sums
            // go to a scratch area and the last block of each 32 columns (a counter a column
            // block, zero between launches) adds them up (areas placed by `finish`).
            let colblocks = n.div_ceil(32);
            let mut chunk = 256;
            if count <= chunk {
                chunk = count;
            }
            while chunk < count && chunk > 16 && colblocks * count.div_ceil(chunk) < WIDE_GRID {
                chunk /= 2;
            }
            let blocks = colblocks * count.div_ceil(chunk);
            let blocks = u32::try_from(blocks).map_err(|_| {
                Error::unsupported("reduce", format!("{count} rows of {n} columns"))
            })?;
            if chunk < count {
                let c = &mut self.chunked_sums;
                c.0.push((self.plan.steps.len(), 2));
                c.1 = c.1.max(colblocks * 4);
                c.2 = c.2.max(count.div_ceil(chunk) * n * 4);
            }
            let mut p = P::sized(n);
            p.iv[0] = count as i64;
            p.iv[1] = n as i64;
            p.iv[2] = chunk as i64;
            p.fv[0] = if r == ReduceOp::Mean {
                1.0 / count as f32
            } else {
                1.0
            };
            let ops = vec![(0, xl), (1, at(out))];
            self.launch(Kernel::Library("rlx_reduce_rows"), blocks, THREADS, p, ops);
            return Ok(());
        }
        let xs = contiguous(xd);
        let kept: Vec<usize> = (0..xd.len()).filter(|d| !axes.contains(d)).collect();
        let kdims: Vec<usize> = kept.iter().map(|&d| xd[d]).collect();
        let kst: Vec<i64> = kept.iter().map(|&d| xs[d]).collect();
        let mut p = P::default();
        iterate(&mut p, &kdims, &[kst], "reduce", self.target.backend)?;
        p.n = n as i64;
        // Reduced dims, merged where contiguous with each other.
        let mut rd: Vec<i64> = Vec::new();
        let mut rs: Vec<i64> = Vec::new();
        for &a in axes {
            let (d, s) = (xd[a] as i64, xs[a]);
            if d == 1 {
                continue;
            }
            if let (Some(ld), Some(ls)) = (rd.last_mut(), rs.last_mut()) {
                if *ls == s * d {
                    *ld *= d;
                    *ls = s;
                    continue;
                }
            }
            rd.push(d);
            rs.push(s);
        }
        if rd.len() > MAX_RANK {
            return Err(Error::unsupported(
                "reduce",
                "more than 8 non-adjacent reduced axes",
            ));
        }
        for (i, (&d, &s)) in rd.iter().zip(&rs).enumerate() {
            p.st[2][i] = d;
            p.st[3][i] = s;
        }
        p.iv[0] = (r == ReduceOp::Max) as i64;
        p.iv[1] = count as i64;
        p.iv[2] = rd.len() as i64;
        p.fv[0] = if r == ReduceOp::Mean {
            1.0 / count as f32
        } else {
            1.0
        };
        let block = (count.next_power_of_two() as u32).clamp(32, THREADS);
        self.launch(
            Kernel::Library(if int { "rlx_reduce_i32" } else { "rlx_reduce" }),
            n.min(1 << 16) as u32,
            block,
            p,
            vec![(0, xl), (1, at(out))],
        );
        Ok(())
    }

    fn matmul(&mut self, ins: &[TRef], out: &TRef, ta: bool, tb: bool) -> Result<()> {
        let (ad, bd, od) = (ins[0].shape.dims(), ins[1].shape.dims(), out.shape.dims());
        let dtype = ins[0].dtype;
        self.matmul_at(
            dtype,
            (at(&ins[0]), ad),
            (at(&ins[1]), bd),
            (at(out), od),
            ta,
            tb,
        )
    }

    /// `c = op(a) @ op(b)` for operands of `dtype` given by place and dims (`c` float32).
    fn matmul_at(
        &mut self,
        dtype: DType,
        (a, ad): (Loc, &[usize]),
        (b, bd): (Loc, &[usize]),
        (c, od): (Loc, &[usize]),
        ta: bool,
        tb: bool,
    ) -> Result<()> {
        let out_numel: usize = od.iter().product();
        let (ra, ca) = (ad[ad.len() - 2], ad[ad.len() - 1]);
        let (rb, cb) = (bd[bd.len() - 2], bd[bd.len() - 1]);
        let (m, k) = if ta { (ca, ra) } else { (ra, ca) };
        let n = if tb { rb } else { cb };
        if out_numel == 0 {
            return Ok(());
        }
        if k == 0 {
            self.plan.steps.push(Step::Fill {
                at: c,
                bytes: out_numel * 4,
            });
            return Ok(());
        }
        let ob = &od[..od.len() - 2];
        let batch: usize = ob.iter().product();
        let a_batch: usize = ad[..ad.len() - 2].iter().product();
        let b_batch: usize = bd[..bd.len() - 2].iter().product();
        let esize = dtype.size();
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's A is our B.
        let g = |rows: usize, batch: usize, sa: usize, sb: usize| Gemm {
            dtype,
            ta: tb,
            tb: ta,
            m: n,
            n: rows,
            k,
            lda: cb,
            ldb: ca,
            ldc: n,
            stride_a: sb,
            stride_b: sa,
            stride_c: rows * n,
            batch,
        };
        if b_batch == 1 && !ta && a_batch == batch {
            // A stack of row-major matrices times one matrix is one tall GEMM.
            self.plan.steps.push(Step::Gemm {
                g: g(batch * m, 1, 0, 0),
                a: b,
                b: a,
                c,
            });
            return Ok(());
        }
        if (a_batch == batch || a_batch == 1) && (b_batch == batch || b_batch == 1) {
            let sa = if a_batch == 1 { 0 } else { ra * ca };
            let sb = if b_batch == 1 { 0 } else { rb * cb };
            self.plan.steps.push(Step::Gemm {
                g: g(m, batch, sa, sb),
                a: b,
                b: a,
                c,
            });
            return Ok(());
        }
        // General batch broadcasting: one GEMM per output matrix.
        let sa = broadcast(&ad[..ad.len() - 2], ob);
        let sbb = broadcast(&bd[..bd.len() - 2], ob);
        let offset = |s: &[i64], mut i: usize, size: usize| {
            let mut o = 0usize;
            for d in (0..ob.len()).rev() {
                o += (i % ob[d]) * s[d] as usize;
                i /= ob[d];
            }
            o * size * esize
        };
        for bi in 0..batch {
            let mut ai = a;
            ai.offset += offset(&sa, bi, ra * ca);
            let mut bi_ = b;
            bi_.offset += offset(&sbb, bi, rb * cb);
            let mut ci = c;
            ci.offset += bi * m * n * 4;
            self.plan.steps.push(Step::Gemm {
                g: g(m, 1, 0, 0),
                a: bi_,
                b: ai,
                c: ci,
            });
        }
        Ok(())
    }

    /// Step counts and momentum flags (`(step, started, hyper row)` of each tensor), five
    /// tensors a launch (backends without `rlx_update_end`).
    fn update_finish(&mut self, finish: &[(Loc, Option<Loc>, Loc)], ctrl: Loc) {
        for chunk in finish.chunks(5) {
            let mut p = P::default();
            p.iv[0] = chunk.len() as i64;
            let mut ops = vec![(0, ctrl)];
            for (i, (step, started, row)) in chunk.iter().enumerate() {
                ops.push((1 + 3 * i, *step));
                if let Some(s) = started {
                    ops.push((2 + 3 * i, *s));
                }
                ops.push((3 + 3 * i, *row));
            }
            self.launch(Kernel::Library("rlx_update_finish"), 1, 1, p, ops);
        }
    }

    fn update(&mut self, u: &UpdatePlan) -> Result<()> {
        let k = u.accumulate.max(1) as i64;
        let skip = u.skip_nonfinite;
        let need_norm = u.clip.is_some() || skip;
        let ctrl = scratch(CTRL_AT);
        let one = |s: &mut Self, name: &'static str, p: P, ops: Vec<(usize, Loc)>| {
            s.launch(Kernel::Library(name), 1, 1, p, ops)
        };
        // The norm's sums of squares are added into the control block: zeroed first. (Every
        // other field of it is set by phase 0.)
        if need_norm {
            self.plan.steps.push(Step::Fill {
                at: ctrl,
                bytes: 32,
            });
        }
        if u.hyper.is_none() {
            self.plan.steps.push(Step::HyperRow {
                at: scratch(HYPER_AT),
            });
        }
        let sumsq = |s: &mut Self, t: Loc, n: usize, slot: i64| {
            if n == 0 {
                return;
            }
            let mut p = P::sized(n);
            p.iv[0] = slot;
            s.launch(
                Kernel::Library("rlx_sumsq"),
                grid_for(n, 4 * THREADS as usize).min(264),
                THREADS,
                p,
                vec![(0, t), (1, ctrl)],
            );
        };
        if skip {
            for q in &u.params {
                sumsq(self, at(&q.grad), q.grad.numel(), 0);
            }
        }
        let ctrl_steps = |s: &mut Self, first: i64, last: i64| {
            let mut p = P::default();
            p.iv[0] = first;
            p.iv[6] = last;
            p.iv[1] = skip as i64;
            p.iv[2] = k;
            p.iv[3] = need_norm as i64;
            p.iv[4] = (k == 1 && skip) as i64;
            p.iv[5] = u.clip.is_some() as i64;
            p.fv[0] = u.clip.unwrap_or(0.0) as f32;
            one(
                s,
                "rlx_update_ctrl",
                p,
                vec![(0, ctrl), (1, at(&u.stats)), (2, at(&u.loss))],
            );
        };
        let ctrl_step = |s: &mut Self, phase: i64| ctrl_steps(s, phase, phase);
        // Phases 0 and 2 meet where nothing runs between them: no accumulation, and a norm
        // only from the sums taken before phase 0 (the skip check).
        let merge_02 = self.target.update_end && k == 1 && (skip || !need_norm);
        if merge_02 {
            ctrl_steps(self, 0, 2);
        } else {
            ctrl_step(self, 0);
        }
        let src = |q: &crate::UpdateParam| q.acc.as_ref().map_or(at(&q.grad), at);
        if k > 1 {
            for q in &u.params {
                let Some(acc) = &q.acc else {
                    return Err(Error::Internal("accumulation buffer not planned".into()));
                };
                let n = q.grad.numel().min(acc.numel());
                if n > 0 {
                    let p = P::sized(n);
                    self.launch(
                        Kernel::Library("rlx_accumulate"),
                        grid_for(n, THREADS as usize),
                        THREADS,
                        p,
                        vec![(0, at(&q.grad)), (1, at(acc)), (2, ctrl)],
                    );
                }
            }
            ctrl_step(self, 1);
        }
        if need_norm && !(k == 1 && skip) {
            for q in &u.params {
                sumsq(self, src(q), q.grad.numel(), 1);
            }
        }
        if !merge_02 {
            ctrl_step(self, 2);
        }
        let rule = match u.rule {
            OptimRule::Sgd => 0,
            OptimRule::Adam => 1,
            OptimRule::AdamW => 2,
            OptimRule::RmsProp => 3,
            OptimRule::Adagrad => 4,
        };
        // Every tensor's update in one launch, over a table of where each tensor's operands are
        // and which chunk of elements each block takes (uploaded once, at compile time).
        let enc = |l: Loc| ((l.buf as u64) << 56) | l.offset as u64;
        let (mut table, mut chunks) = (Vec::<u64>::new(), Vec::<u64>::new());
        let chunk = update_chunk(
            u.params
                .iter()
                .map(|q| q.param.numel().min(q.grad.numel()))
                .sum(),
        );
        let mut finish: Vec<(Loc, Option<Loc>, Loc)> = Vec::new();
        for q in &u.params {
            let row = match &u.hyper {
                Some(h) => {
                    let mut l = at(h);
                    l.offset += q.row * hyper_col::LEN * 4;
                    l
                }
                None => scratch(HYPER_AT),
            };
            let n = q.param.numel().min(q.grad.numel());
            // Every tensor has its row (`rlx_update_end` counts each one's step); only those
            // with elements have chunks.
            {
                let tensor = (table.len() / 8) as u64;
                let state = |i: usize| q.state.get(i).map_or(u64::MAX, |s| enc(at(s)));
                table.extend([
                    enc(at(&q.param)),
                    enc(src(q)),
                    state(0),
                    state(1),
                    enc(at(&q.step)),
                    q.started.as_ref().map_or(u64::MAX, |s| enc(at(s))),
                    enc(row),
                    n as u64,
                ]);
                if tensor >= 1 << 23 || n as u64 >= 1 << 40 {
                    return Err(Error::unsupported(
                        "optimizer update",
                        format!("{} tensors / {n} elements", tensor + 1),
                    ));
                }
                chunks.extend((0..n).step_by(chunk).map(|s| (tensor << 40) | s as u64));
            }
            finish.push((at(&q.step), q.started.as_ref().map(at), row));
        }
        let (tensors, n_chunks) = (table.len() / 8, chunks.len());
        let mut ops: Vec<(usize, Loc)> = (0..6).map(|b| (b, Loc { buf: b, offset: 0 })).collect();
        if tensors > 0 {
            table.extend(chunks);
            let bytes: Vec<u8> = table.iter().flat_map(|w| w.to_le_bytes()).collect();
            let off = self.plan.scratch_bytes.div_ceil(256) * 256;
            self.plan.scratch_bytes = off + bytes.len();
            self.plan.tables.push((off, bytes));
            ops.extend([(6, scratch(off)), (7, ctrl)]);
        }
        if n_chunks > 0 {
            let mut p = P::default();
            p.iv[..4].copy_from_slice(&[rule, tensors as i64, n_chunks as i64, chunk as i64]);
            let grid = n_chunks.min(65535) as u32;
            self.launch(
                Kernel::Library("rlx_update_multi"),
                grid,
                THREADS,
                p,
                ops.clone(),
            );
        }
        if self.target.update_end && tensors > 0 {
            // Step counts, momentum flags and phase 3, in one launch over the table.
            let mut p = P::default();
            p.iv[1] = tensors as i64;
            ops.push((8, at(&u.stats)));
            self.launch(Kernel::Library("rlx_update_end"), 1, THREADS, p, ops);
        } else {
            self.update_finish(&finish, ctrl);
            ctrl_step(self, 3);
        }
        for (s, d) in &u.buffer_updates {
            let n = s.numel().min(d.numel());
            if n > 0 {
                let p = P::sized(n);
                self.launch(
                    Kernel::Library("rlx_copy_unless_skipped"),
                    grid_for(n, THREADS as usize),
                    THREADS,
                    p,
                    vec![(0, at(s)), (1, at(d)), (2, ctrl)],
                );
            }
        }
        Ok(())
    }
}

/// The row of the hyper table a run's single set of settings stands for (as the CPU backend's
/// `Hyper::from_run`).
pub fn hyper_row(h: &crate::OptimHyper) -> [f32; hyper_col::LEN] {
    let mut r = [0.0f32; hyper_col::LEN];
    r[hyper_col::LR] = h.lr;
    r[hyper_col::WEIGHT_DECAY] = h.weight_decay;
    r[hyper_col::MOMENTUM] = h.momentum;
    r[hyper_col::BETA1] = h.beta1;
    r[hyper_col::BETA2] = h.beta2;
    r[hyper_col::EPS] = h.eps;
    r[hyper_col::ALPHA] = 0.99;
    r[hyper_col::ONE_MINUS_ALPHA] = (1.0 - 0.99f64) as f32;
    r[hyper_col::ONE_MINUS_DAMPENING] = 1.0;
    r[hyper_col::ONE_MINUS_BETA1] = (1.0 - h.beta1 as f64) as f32;
    r[hyper_col::ONE_MINUS_BETA2] = (1.0 - h.beta2 as f64) as f32;
    r
}

/// Silences an unused-import lint where `UnaryOp` is only used in tests.
#[allow(dead_code)]
fn _unary(_: UnaryOp) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Buf;

    fn t(offset: usize, dims: &[usize]) -> TRef {
        TRef {
            buf: Buf::Arena,
            offset,
            shape: Shape::from(dims),
            dtype: DType::F32,
        }
    }

    #[test]
    fn launch_record_layout_matches_the_c_struct() {
        // 16 pointers, n, rank, 8 dims, 16x8 strides, 8 ints, 8 floats, 16 modes.
        assert_eq!(
            std::mem::size_of::<P>(),
            128 + 8 + 8 + 64 + 1024 + 64 + 32 + 64
        );
    }

    /// Without mixed precision (Metal), tensors of dtypes other than float32 / int32 (even in a
    /// cast) are a `DTypeError` at compile naming the op and the dtype, never a wrong kernel.
    /// With it (CUDA), float16/bfloat16 may only be cast from/to float32 or multiplied.
    #[test]
    fn low_precision_tensors_only_in_casts_and_products() {
        let mut half = t(64, &[2, 3]);
        half.dtype = DType::F16;
        let cast = Program {
            instrs: vec![Instr::Op {
                op: Op::Cast { to: DType::F16 },
                ins: vec![t(0, &[2, 3])],
                out: half.clone(),
            }],
        };
        let metal_like = Target {
            low_precision: false,
            integer_edges: false,
            ..Target::CUDA
        };
        let e = plan(&cast, &[256], metal_like).unwrap_err();
        assert!(matches!(e, rlx_ir::Error::DType { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("[cast] the cuda backend supports only float32 and int32 tensors")
                && msg.contains("float16"),
            "{msg}"
        );
        let pl = plan(&cast, &[256], Target::CUDA).unwrap();
        assert!(matches!(
            pl.steps[0],
            Step::Launch {
                kernel: Kernel::Library("rlx_cast_f2h"),
                ..
            }
        ));
        let mut half_t = t(128, &[3, 2]);
        half_t.dtype = DType::F16;
        let transpose = Program {
            instrs: vec![Instr::Op {
                op: Op::Transpose { perm: vec![1, 0] },
                ins: vec![half],
                out: half_t,
            }],
        };
        let e = plan(&transpose, &[256], Target::CUDA).unwrap_err();
        assert!(matches!(e, rlx_ir::Error::Unsupported { .. }), "{e}");
        assert!(
            e.to_string().starts_with(
                "[transpose] the cuda backend runs bfloat16/float16 only in casts from and to \
                 float32 and in matrix products (mixed precision), not transpose on [float16 (2, 3)]"
            ),
            "{e}"
        );
    }

    /// A narrowed program's integer edges (bool -> int32, int32 -> bool, int32 -> int64)
    /// launch their casts on CUDA; an int64 tensor anywhere else (a program that was not
    /// narrowed), and the edges on a target without those casts (Metal), are `DTypeError`s
    /// naming the op and the tensor.
    #[test]
    fn bool_and_int64_only_in_the_casts_at_the_edges() {
        let typed = |offset: usize, dtype: DType| TRef {
            dtype,
            ..t(offset, &[2, 3])
        };
        let cast = |from: TRef, to: TRef| Instr::Op {
            op: Op::Cast { to: to.dtype },
            ins: vec![from],
            out: to,
        };
        let edges = Program {
            instrs: vec![
                cast(typed(0, DType::Bool), typed(64, DType::I32)),
                cast(typed(64, DType::I32), typed(128, DType::Bool)),
                cast(typed(64, DType::I32), typed(192, DType::I64)),
            ],
        };
        let pl = plan(&edges, &[256], Target::CUDA).unwrap();
        let names: Vec<&str> = pl
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch {
                    kernel: Kernel::Library(k),
                    ..
                } => Some(*k),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["rlx_cast_b2i", "rlx_cast_i2b", "rlx_cast_i2l"]);
        let metal_like = Target {
            integer_edges: false,
            ..Target::CUDA
        };
        let e = plan(&edges, &[256], metal_like).unwrap_err();
        assert!(matches!(e, rlx_ir::Error::DType { .. }), "{e}");
        assert!(e.to_string().contains("bool tensor (2, 3)"), "{e}");
        let wide_add = Program {
            instrs: vec![Instr::Op {
                op: Op::Binary(BinaryOp::Add),
                ins: vec![typed(0, DType::I64), typed(64, DType::I64)],
                out: typed(128, DType::I64),
            }],
        };
        // int32 sums and maxima (of a narrowed int64 or bool tensor): `rlx_reduce_i32`, also
        // for a leading axis (the float32 column-sum kernel would read floats).
        let sum = Program {
            instrs: vec![Instr::Op {
                op: Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![0],
                    keepdims: false,
                },
                ins: vec![TRef {
                    shape: Shape::from(&[100, 3][..]),
                    ..typed(0, DType::I32)
                }],
                out: TRef {
                    shape: Shape::from(&[3][..]),
                    ..typed(1216, DType::I32)
                },
            }],
        };
        let pl = plan(&sum, &[2048], Target::CUDA).unwrap();
        assert!(matches!(
            pl.steps[..],
            [Step::Launch {
                kernel: Kernel::Library("rlx_reduce_i32"),
                ..
            }]
        ));
        let without = Target {
            int_reduce: false,
            ..Target::CUDA
        };
        let e = plan(&sum, &[2048], without).unwrap_err();
        assert!(
            e.to_string().contains("reduces only float32 tensors"),
            "{e}"
        );
        let e = plan(&wide_add, &[256], Target::CUDA).unwrap_err();
        assert!(matches!(e, rlx_ir::Error::DType { .. }), "{e}");
        assert!(
            e.to_string().starts_with(
                "[add] the cuda backend computes integers in int32: a int64 tensor (2, 3) may \
                 only be cast from or to int32 at the program's edges"
            ),
            "{e}"
        );
    }

    /// A low-precision tensor in the update (a bfloat16 buffer's in-place update) is refused:
    /// the update's kernels move 4-byte elements.
    #[test]
    fn low_precision_buffers_in_the_update_are_refused() {
        let bf = |offset: usize| TRef {
            dtype: DType::BF16,
            ..t(offset, &[8])
        };
        let update = UpdatePlan {
            rule: OptimRule::Sgd,
            params: vec![],
            hyper: None,
            loss: t(128, &[1]),
            stats: t(192, &[2]),
            clip: None,
            accumulate: 1,
            skip_nonfinite: false,
            buffer_updates: vec![(bf(0), bf(64))],
        };
        let prog = Program {
            instrs: vec![Instr::Update(Box::new(update))],
        };
        let e = plan(&prog, &[256], Target::CUDA).unwrap_err();
        assert!(matches!(e, rlx_ir::Error::Unsupported { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("updates a bfloat16 tensor (8,) (a bfloat16/float16 buffer?)"),
            "{e}"
        );
    }

    /// A bfloat16 product with batch broadcasting: one float32-output GEMM per output matrix,
    /// operands stepped in 2-byte elements.
    #[test]
    fn bfloat16_products_step_operands_in_two_byte_elements() {
        let bf = |offset: usize, dims: &[usize]| TRef {
            dtype: DType::BF16,
            ..t(offset, dims)
        };
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::MatMul {
                    trans_a: false,
                    trans_b: true,
                },
                // (2, 5, 7) @ (2, 1, 3, 7)^T -> (2, 2, 5, 3)
                ins: vec![bf(0, &[2, 5, 7]), bf(256, &[2, 1, 3, 7])],
                out: t(512, &[2, 2, 5, 3]),
            }],
        };
        let pl = plan(&prog, &[1024], Target::CUDA).unwrap();
        let gemms: Vec<_> = pl
            .steps
            .iter()
            .map(|s| match s {
                Step::Gemm { g, a, b, c } => (g.dtype, b.offset, a.offset, c.offset),
                _ => panic!("{s:?}"),
            })
            .collect();
        // (our a, our b, c) per output matrix (z, y): a[y], b[z], c[(z, y)].
        let f = DType::BF16;
        assert_eq!(
            gemms,
            [
                (f, 0, 256, 512),
                (f, 70, 256, 512 + 60),
                (f, 0, 256 + 42, 512 + 120),
                (f, 70, 256 + 42, 512 + 180)
            ]
        );
    }

    #[test]
    fn broadcast_add_is_one_fused_launch_with_a_strided_operand() {
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Binary(BinaryOp::Add),
                ins: vec![t(0, &[2, 3]), t(64, &[3])],
                out: t(128, &[2, 3]),
            }],
        };
        let plan = plan(&prog, &[256], Target::CUDA).unwrap();
        assert_eq!(plan.fused.len(), 1);
        let Step::Launch { p, operands, .. } = &plan.steps[0] else {
            panic!("{:?}", plan.steps)
        };
        assert_eq!(p.n, 6);
        assert_eq!(&p.mode[..3], &[1, 2, 1]);
        assert_eq!(operands[1], (1, Loc { buf: 0, offset: 64 }));
    }

    #[test]
    fn matmul_of_a_stack_is_one_tall_gemm() {
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::MatMul {
                    trans_a: false,
                    trans_b: true,
                },
                ins: vec![t(0, &[4, 2, 3]), t(256, &[5, 3])],
                out: t(512, &[4, 2, 5]),
            }],
        };
        let plan = plan(&prog, &[1024], Target::CUDA).unwrap();
        let Step::Gemm { g, a, b, .. } = &plan.steps[0] else {
            panic!()
        };
        assert_eq!((g.m, g.n, g.k, g.batch), (5, 8, 3, 1));
        assert!(g.ta && !g.tb);
        assert_eq!((g.lda, g.ldb, g.ldc), (3, 3, 5));
        assert_eq!((a.offset, b.offset), (256, 0));
    }

    #[test]
    fn bad_programs_are_rejected() {
        let neg = |x: TRef, out: TRef| Program {
            instrs: vec![Instr::Op {
                op: Op::Unary(UnaryOp::Neg),
                ins: vec![x],
                out,
            }],
        };
        assert!(plan(&neg(t(0, &[8]), t(240, &[8])), &[256], Target::CUDA).is_err());
        assert!(plan(&neg(t(0, &[8]), t(16, &[8])), &[256], Target::CUDA).is_err());
        assert!(plan(&neg(t(0, &[8]), t(64, &[8])), &[256], Target::CUDA).is_ok());
        // Integer reductions run as `rlx_reduce_i32` on CUDA; a target without that kernel
        // (Metal) refuses them by name, never runs them as floats.
        let int = |offset: usize, dims: &[usize]| TRef {
            dtype: DType::I32,
            ..t(offset, dims)
        };
        let max = Program {
            instrs: vec![Instr::Op {
                op: Op::Reduce {
                    op: ReduceOp::Max,
                    axes: vec![0],
                    keepdims: false,
                },
                ins: vec![int(0, &[8])],
                out: int(64, &[]),
            }],
        };
        let no_int_reduce = Target {
            int_reduce: false,
            ..Target::CUDA
        };
        let e = plan(&max, &[256], no_int_reduce).unwrap_err().to_string();
        assert!(
            e.contains("[max] the cuda backend reduces only float32"),
            "{e}"
        );
        assert!(plan(&max, &[256], Target::CUDA).is_ok());
    }

    #[test]
    fn a_host_update_target_keeps_the_update_as_one_step() {
        let i32_at = |offset: usize| TRef {
            dtype: DType::I32,
            ..t(offset, &[1])
        };
        let update = UpdatePlan {
            rule: OptimRule::Adam,
            params: vec![crate::UpdateParam {
                param: t(0, &[8]),
                grad: t(64, &[8]),
                acc: None,
                state: vec![t(128, &[8]), t(192, &[8])],
                step: i32_at(256),
                started: None,
                row: 0,
            }],
            hyper: None,
            loss: t(320, &[1]),
            stats: t(384, &[4]),
            clip: Some(1.0),
            accumulate: 1,
            skip_nonfinite: true,
            buffer_updates: vec![],
        };
        let prog = Program {
            instrs: vec![Instr::Update(Box::new(update.clone()))],
        };
        let host = Target {
            backend: "metal",
            host_update: true,
            tiled_attention: false,
            low_precision: false,
            gemm_attention: None,
            gemm_attention_forward: false,
            fused_x4: false,
            update_end: false,
            normalize_grad_add: false,
            layer_norm_grad: false,
            cross_entropy_grad: false,
            layer_norm: false,
            gemm_grids: false,
            integer_edges: false,
            int_reduce: false,
        };
        let pl = plan(&prog, &[512], host).unwrap();
        assert_eq!(pl.steps, vec![Step::HostUpdate(Box::new(update))]);
        let device = plan(&prog, &[512], Target::CUDA).unwrap();
        let launches: Vec<_> = device
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch {
                    kernel: Kernel::Library("rlx_update_multi"),
                    p,
                    operands,
                    ..
                } => Some((p.iv, operands.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(launches.len(), 1, "one launch for every tensor");
        // The bookkeeping: phases 0 to 2 in one launch (nothing runs between them: the norm
        // comes from the sums taken before phase 0), then one end launch after the update.
        let kernels: Vec<(&str, i64, i64)> = device
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch {
                    kernel: Kernel::Library(k),
                    p,
                    ..
                } => Some((*k, p.iv[0], p.iv[6])),
                _ => None,
            })
            .collect();
        assert_eq!(
            kernels,
            [
                ("rlx_sumsq", 0, 0),
                ("rlx_update_ctrl", 0, 2),
                ("rlx_update_multi", 1, 0),
                ("rlx_update_end", 0, 0)
            ]
        );
        let one_phase_a_launch = plan(
            &prog,
            &[512],
            Target {
                update_end: false,
                ..Target::CUDA
            },
        )
        .unwrap();
        let ctrl_phases: Vec<(i64, i64)> = one_phase_a_launch
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Launch {
                    kernel: Kernel::Library("rlx_update_ctrl"),
                    p,
                    ..
                } => Some((p.iv[0], p.iv[6])),
                _ => None,
            })
            .collect();
        assert_eq!(ctrl_phases, [(0, 0), (2, 2), (3, 3)]);
        let (iv, operands) = &launches[0];
        assert_eq!(&iv[..4], &[1, 1, 1, UPDATE_CHUNK_MIN as i64]);
        // The table: the tensor's 8 words, then its one chunk.
        let (off, bytes) = &device.tables[0];
        assert_eq!(operands[6].1, scratch(*off));
        assert!(*off >= ROWS_AT && device.scratch_bytes >= off + bytes.len());
        let words: Vec<u64> = bytes
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words.len(), 9);
        assert_eq!(words[5], u64::MAX, "no started flag");
        assert_eq!(words[7], 8, "elements");
        assert_eq!(words[8], 0, "tensor 0 from element 0");
    }

    #[test]
    fn update_chunks_spread_small_models_and_cap_large_ones() {
        assert_eq!(update_chunk(10), UPDATE_CHUNK_MIN);
        // The digits MLP (85K parameters) and the tiny GPT (0.44M): 1024-element chunks.
        assert_eq!(update_chunk(85_002), 1024);
        assert_eq!(update_chunk(440_000), 1024);
        assert_eq!(update_chunk(2_000_000), 4096);
        assert_eq!(update_chunk(85_000_000), UPDATE_CHUNK_MAX);
    }

    #[test]
    fn leading_axis_sums_are_column_reductions_and_others_general() {
        let red = |axes: Vec<usize>, op: ReduceOp, out: &[usize]| {
            let prog = Program {
                instrs: vec![Instr::Op {
                    op: Op::Reduce {
                        op,
                        axes,
                        keepdims: false,
                    },
                    ins: vec![t(0, &[128, 6])],
                    out: t(4096, out),
                }],
            };
            plan(&prog, &[8192], Target::CUDA).unwrap().steps
        };
        // 128 rows: one chunk, one block of 32 columns storing its sums (no zeroing).
        let steps = red(vec![0], ReduceOp::Mean, &[6]);
        let Step::Launch {
            kernel, p, grid, ..
        } = &steps[0]
        else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_reduce_rows"));
        assert_eq!((p.iv[0], p.iv[1], p.fv[0]), (128, 6, 1.0 / 128.0));
        assert_eq!((p.iv[2], *grid, steps.len()), (128, 1, 1));
        // 1024 rows of 6 columns: chunks of 16 rows (64 blocks), their partial sums and the
        // column block's counter in scratch areas of their own (no zeroing pass).
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![0],
                    keepdims: false,
                },
                ins: vec![t(0, &[1024, 6])],
                out: t(32768, &[6]),
            }],
        };
        let pl = plan(&prog, &[65536], Target::CUDA).unwrap();
        assert_eq!(pl.steps.len(), 1);
        let Step::Launch {
            p, grid, operands, ..
        } = &pl.steps[0]
        else {
            panic!()
        };
        assert_eq!((p.iv[0], p.iv[2], *grid), (1024, 16, 64));
        let (partials, counters) = (operands[2].1, operands[3].1);
        assert_eq!((partials.buf, counters.buf), (SCRATCH, SCRATCH));
        assert!(
            counters.offset + 4 <= partials.offset,
            "one counter, then the partials"
        );
        assert!(pl.scratch_bytes >= partials.offset + 64 * 6 * 4);
        assert!(
            pl.tables.is_empty(),
            "counters start at zero: the scratch is zeroed"
        );
        let steps = red(vec![0], ReduceOp::Max, &[6]);
        assert!(matches!(
            &steps[0],
            Step::Launch {
                kernel: Kernel::Library("rlx_reduce"),
                ..
            }
        ));
        let steps = red(vec![1], ReduceOp::Sum, &[128]);
        let Step::Launch { kernel, p, .. } = &steps[0] else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_reduce"));
        assert_eq!((p.n, p.iv[1], p.st[2][0], p.st[3][0]), (128, 6, 6, 1));
    }

    /// Fused launches take four elements a thread only where every operand allows it.
    #[test]
    fn fused_kernels_take_quads_where_every_operand_allows() {
        // x + y * z over `shape`, reading y and z at the given dims (broadcast) and offsets.
        let quad = |shape: &[usize], ins: [(&[usize], usize); 3], target: Target| -> (i64, i64) {
            let f = Fused {
                shape: Shape::from(shape),
                n_inputs: 3,
                steps: vec![
                    FusedStep::Binary(BinaryOp::Mul, 1, 2),
                    FusedStep::Binary(BinaryOp::Add, 0, 3),
                ],
            };
            let prog = Program {
                instrs: vec![Instr::Op {
                    op: Op::Fused(std::sync::Arc::new(f)),
                    ins: ins.iter().map(|&(d, off)| t(off, d)).collect(),
                    out: t(4096, shape),
                }],
            };
            let pl = plan(&prog, &[8192], target).unwrap();
            let Step::Launch { p, .. } = &pl.steps[0] else {
                panic!()
            };
            (p.iv[7], p.n)
        };
        let cuda = Target::CUDA;
        // A contiguous operand, a row (bias) and a column broadcast, 16-byte aligned.
        let ok = [(&[6usize, 8][..], 0), (&[8][..], 1024), (&[6, 1][..], 2048)];
        assert_eq!(quad(&[6, 8], ok, cuda), (1, 48));
        // A scalar operand too.
        let scalar = [(&[6usize, 8][..], 0), (&[1][..], 1024), (&[8][..], 2048)];
        assert_eq!(quad(&[6, 8], scalar, cuda), (1, 48));
        // Rows of 6: a quad would cross rows of the broadcasts.
        let rows6 = [(&[8usize, 6][..], 0), (&[6][..], 1024), (&[8, 1][..], 2048)];
        assert_eq!(quad(&[8, 6], rows6, cuda).0, 0);
        // A contiguous operand 4 bytes past alignment.
        let skew = [(&[6usize, 8][..], 4), (&[8][..], 1024), (&[6, 1][..], 2048)];
        assert_eq!(quad(&[6, 8], skew, cuda).0, 0);
        // Other backends never.
        let metal_like = Target {
            fused_x4: false,
            ..cuda
        };
        assert_eq!(quad(&[6, 8], ok, metal_like).0, 0);
    }

    #[test]
    fn an_epilogue_reads_the_product_buffer_and_attention_gets_packed_strides() {
        let epi = Fused {
            shape: Shape::new([4, 5]),
            n_inputs: 2,
            steps: vec![
                FusedStep::Binary(BinaryOp::Add, 0, 1),
                FusedStep::Unary(UnaryOp::Relu, 2),
            ],
        };
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::MatMulEpilogue {
                    trans_a: false,
                    trans_b: true,
                    epilogue: std::sync::Arc::new(epi),
                },
                ins: vec![t(0, &[4, 3]), t(256, &[5, 3]), t(512, &[5])],
                out: t(768, &[4, 5]),
            }],
        };
        let pl = plan(&prog, &[1024], Target::CUDA).unwrap();
        assert_eq!(pl.product_bytes, 80);
        let Step::Gemm { c, .. } = &pl.steps[0] else {
            panic!("{:?}", pl.steps)
        };
        assert_eq!(c.buf, PRODUCT);
        let Step::Launch { operands, .. } = &pl.steps[1] else {
            panic!()
        };
        assert_eq!(operands[0].1.buf, PRODUCT);
        assert_eq!(
            operands[2].1,
            Loc {
                buf: 0,
                offset: 768
            }
        );

        // Packed qkv (B 2, T 8, 3 heads of 4): k of head 1 starts at column (3 + 1) * 4.
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Attention {
                    scale: 0.5,
                    causal: Some(0),
                    heads: Some(3),
                    lowp: None,
                },
                ins: vec![t(0, &[2, 8, 36])],
                out: t(4096, &[2, 8, 12]),
            }],
        };
        let pl = plan(&prog, &[8192], Target::CUDA).unwrap();
        let Step::Launch { p, .. } = &pl.steps[0] else {
            panic!()
        };
        assert_eq!(p.n, 2 * 3 * 8);
        assert_eq!(&p.iv[..8], &[2, 3, 8, 8, 4, 4, 1, 0]);
        assert_eq!(&p.st[1][..4], &[8 * 36, 4, 36, 12]);
        assert_eq!(&p.st[3][..4], &[8 * 12, 4, 12, 0]);
        // On CUDA: the tiled kernel, one block of 128 threads per (unit, head, 64 query rows).
        // (Smaller tiles for more blocks were slower on an H100 for the tiny GPT: 20 against
        // 12.5 us a forward launch.)
        let Step::Launch {
            kernel,
            grid,
            block,
            ..
        } = &pl.steps[0]
        else {
            panic!()
        };
        assert_eq!(
            (*kernel, *grid, *block),
            (Kernel::Library("rlx_att_fwd_32"), 2 * 3, 128)
        );
        // Without tiled kernels (Metal): one warp per query row.
        let metal = Target {
            backend: "metal",
            host_update: true,
            tiled_attention: false,
            low_precision: false,
            gemm_attention: None,
            gemm_attention_forward: false,
            fused_x4: false,
            update_end: false,
            normalize_grad_add: false,
            layer_norm_grad: false,
            cross_entropy_grad: false,
            layer_norm: false,
            gemm_grids: false,
            integer_edges: false,
            int_reduce: false,
        };
        let pl = plan(&prog, &[8192], metal).unwrap();
        let Step::Launch { kernel, .. } = &pl.steps[0] else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_attention"));
    }

    #[test]
    fn tiled_attention_gradient_is_a_dq_and_a_dkdv_launch_sharing_row_statistics() {
        // Separate q [2, 70, 40], k and v [2, 33, 40]: head size 40 takes the 64-wide kernels.
        let (q, kv) = (2 * 70 * 40 * 4, 2 * 33 * 40 * 4);
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::AttentionGrad {
                    scale: 0.25,
                    causal: None,
                    heads: None,
                    lowp: None,
                },
                ins: vec![
                    t(0, &[2, 70, 40]),
                    t(q, &[2, 33, 40]),
                    t(q + kv, &[2, 33, 40]),
                    t(q + 2 * kv, &[2, 70, 40]),
                    t(2 * q + 2 * kv, &[2, 70, 40]),
                ],
                out: t(3 * q + 2 * kv, &[q / 4 + 2 * kv / 4]),
            }],
        };
        let pl = plan(&prog, &[4 * q + 4 * kv], Target::CUDA).unwrap();
        let names: Vec<_> = pl
            .steps
            .iter()
            .map(|s| match s {
                Step::Launch {
                    kernel,
                    grid,
                    block,
                    operands,
                    ..
                } => {
                    assert_eq!(operands[6].1, scratch(ROWS_AT));
                    (*kernel, *grid, *block)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        // dQ: 32 query rows a block; dK/dV: 32 keys a block.
        assert_eq!(
            names,
            [
                (Kernel::Library("rlx_att_bwd_q_64"), 2 * 3, 128),
                (Kernel::Library("rlx_att_bwd_kv_64"), 2 * 2, 128)
            ]
        );
        assert!(pl.scratch_bytes >= ROWS_AT + 2 * 70 * 8);
    }

    /// Attention as GEMMs: separate head-major operands and gradients are used and written in
    /// place (no copies); packed ones are copied head-major into the product buffer and back.
    #[test]
    fn gemm_attention_reads_and_writes_in_place_where_head_major() {
        let gemm = Target {
            gemm_attention: Some(0),
            gemm_grids: true,
            ..Target::CUDA
        };
        let name = |s: &Step| match s {
            Step::Launch {
                kernel: Kernel::Library(k),
                ..
            } => k.to_string(),
            Step::Gemm { g, c, .. } => {
                format!("gemm m{} n{} k{} x{} -> {c:?}", g.m, g.n, g.k, g.batch)
            }
            other => panic!("{other:?}"),
        };
        let (q, kv) = (2 * 70 * 40 * 4, 2 * 33 * 40 * 4);
        let dout = 3 * q + 2 * kv;
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::AttentionGrad {
                    scale: 0.25,
                    causal: Some(1),
                    heads: None,
                    lowp: None,
                },
                ins: vec![
                    t(0, &[2, 70, 40]),
                    t(q, &[2, 33, 40]),
                    t(q + kv, &[2, 33, 40]),
                    t(q + 2 * kv, &[2, 70, 40]),
                    t(2 * q + 2 * kv, &[2, 70, 40]),
                ],
                out: t(dout, &[q / 4 + 2 * kv / 4]),
            }],
        };
        let pl = plan(&prog, &[4 * q + 4 * kv], gemm).unwrap();
        let names: Vec<String> = pl.steps.iter().map(name).collect();
        let loc = |buf: usize, offset: usize| format!("{:?}", Loc { buf, offset });
        // Column-major (cuBLAS) terms: m and n are our product's columns and rows.
        let probs = loc(PRODUCT, 0);
        let ds = loc(PRODUCT, (2 * 70 * 33 * 4usize).div_ceil(256) * 256);
        assert_eq!(
            names,
            [
                format!("gemm m33 n70 k40 x2 -> {probs}"),
                "rlx_att_softmax".into(),
                format!("gemm m40 n33 k70 x2 -> {}", loc(0, dout + q + kv)),
                format!("gemm m33 n70 k40 x2 -> {ds}"),
                "rlx_att_dscore".into(),
                format!("gemm m40 n70 k33 x2 -> {}", loc(0, dout)),
                format!("gemm m40 n33 k70 x2 -> {}", loc(0, dout + q)),
            ]
        );
        // The packed forward of a GPT block: q, k, v gathered, the output scattered.
        let (b, tt, hh, e) = (2, 5, 3, 4);
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Attention {
                    scale: 0.5,
                    causal: Some(0),
                    heads: Some(hh),
                    lowp: None,
                },
                ins: vec![t(0, &[b, tt, 3 * hh * e])],
                out: t(2048, &[b, tt, hh * e]),
            }],
        };
        // Without pointer-array products (the Metal target's choice).
        let copying = Target {
            gemm_grids: false,
            ..gemm
        };
        let pl = plan(&prog, &[4096], copying).unwrap();
        let names: Vec<String> = pl.steps.iter().map(name).collect();
        assert_eq!(names[..3], ["rlx_att_copy", "rlx_att_copy", "rlx_att_copy"]);
        assert_eq!(names[4], "rlx_att_softmax");
        assert_eq!(names[6], "rlx_att_copy");
        assert_eq!(names.len(), 7);
        let Step::Launch { p, .. } = &pl.steps[4] else {
            panic!()
        };
        assert_eq!((p.n, p.iv[0], p.iv[1], p.iv[2], p.iv[3]), (30, 5, 5, 1, 0));
        assert!(pl.product_bytes >= 4 * 6 * 5 * 4 * 4 + 6 * 5 * 5 * 4);
        // With them, each head is read and written where it is: no copies.
        let pl = plan(&prog, &[4096], gemm).unwrap();
        let grid = |buf: usize, offset: usize, su: usize, sh: usize| Grid {
            at: Loc { buf, offset },
            units: b,
            heads: hh,
            su,
            sh,
        };
        // q, k and v rows are 3 * hh * e = 36 floats apart, a block 5 rows, heads 4 floats.
        let (su, sh) = (tt * 36 * 4, e * 4);
        let mut scores = Gemm {
            dtype: DType::F32,
            ta: true,
            tb: false,
            m: tt,
            n: tt,
            k: e,
            lda: 36,
            ldb: 36,
            ldc: tt,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: b * hh,
        };
        let Step::GemmGrid { g, a: ka, b: qb, c } = pl.steps[0] else {
            panic!("{:?}", pl.steps[0])
        };
        assert_eq!(g, scores);
        assert_eq!(ka, grid(0, hh * e * 4, su, sh));
        assert_eq!(qb, grid(0, 0, su, sh));
        assert_eq!(c, grid(PRODUCT, 0, hh * tt * tt * 4, tt * tt * 4));
        assert!(matches!(
            pl.steps[1],
            Step::Launch {
                kernel: Kernel::Library("rlx_att_softmax"),
                ..
            }
        ));
        // The output o = p v, written into the [b, tt, hh * e] output: rows 12 floats apart.
        let Step::GemmGrid { g, a: va, b: pb, c } = pl.steps[2] else {
            panic!("{:?}", pl.steps[2])
        };
        (scores.ta, scores.m, scores.k, scores.ldb, scores.ldc) = (false, e, tt, tt, hh * e);
        assert_eq!(g, scores);
        assert_eq!(va, grid(0, 2 * hh * e * 4, su, sh));
        assert_eq!(pb, c_probs(pl.steps[0].clone()));
        assert_eq!(c, grid(0, 2048, tt * hh * e * 4, e * 4));
        assert_eq!(pl.steps.len(), 3);
        // Offsets in batch order: unit-major, then head.
        assert_eq!(
            va.offsets().collect::<Vec<_>>(),
            [96, 112, 128, 816, 832, 848]
        );
    }

    /// The probabilities' grid (the output of the scores product).
    fn c_probs(s: Step) -> Grid {
        match s {
            Step::GemmGrid { c, .. } => c,
            other => panic!("{other:?}"),
        }
    }

    /// Attention marked for low-precision products (mixed precision) on the GEMM path: every
    /// operand is cast into a head-major copy (even one already head-major), every product
    /// reads those dtypes, and the row kernels write the low-precision copies the next
    /// products read; a backend without mixed precision plans the float32 products.
    #[test]
    fn gemm_attention_with_low_precision_products() {
        let (q, kv) = (2 * 70 * 40 * 4, 2 * 33 * 40 * 4);
        let dout = 3 * q + 2 * kv;
        let prog = |lowp: Option<DType>| Program {
            instrs: vec![Instr::Op {
                op: Op::AttentionGrad {
                    scale: 0.25,
                    causal: Some(1),
                    heads: None,
                    lowp,
                },
                ins: vec![
                    t(0, &[2, 70, 40]),
                    t(q, &[2, 33, 40]),
                    t(q + kv, &[2, 33, 40]),
                    t(q + 2 * kv, &[2, 70, 40]),
                    t(2 * q + 2 * kv, &[2, 70, 40]),
                ],
                out: t(dout, &[q / 4 + 2 * kv / 4]),
            }],
        };
        let gemm = Target {
            gemm_attention: Some(0),
            ..Target::CUDA
        };
        for (dt, code) in [(DType::BF16, 1), (DType::F16, 2)] {
            let pl = plan(&prog(Some(dt)), &[4 * q + 4 * kv], gemm).unwrap();
            let (mut copies, mut gemms) = (0, 0);
            for step in &pl.steps {
                match step {
                    Step::Gemm { g, .. } => {
                        gemms += 1;
                        assert_eq!(g.dtype, dt);
                    }
                    Step::Launch {
                        kernel: Kernel::Library(k),
                        p,
                        operands,
                        ..
                    } => {
                        assert_eq!(p.iv[4], code, "{k}");
                        match *k {
                            "rlx_att_copy" => copies += 1,
                            // The gradient reads the float32 probabilities too.
                            "rlx_att_softmax" => assert_eq!((operands.len(), p.iv[5]), (2, 0)),
                            "rlx_att_dscore" => assert_eq!((operands.len(), p.iv[5]), (3, 1)),
                            other => panic!("{other}"),
                        }
                    }
                    other => panic!("{other:?}"),
                }
            }
            // q, k, v and g cast; the scores, dv, dp, dq and dk products.
            assert_eq!((copies, gemms), (4, 5));
            // Two float32 score matrices, their two low-precision copies, four operand copies.
            let half = |n: usize| (n * 2).div_ceil(256) * 256;
            let scores = (2 * 70 * 33 * 4usize).div_ceil(256) * 256;
            let min = 2 * scores + 2 * half(2 * 70 * 33) + 2 * half(2 * 70 * 40);
            assert!(pl.product_bytes >= min + 2 * half(2 * 33 * 40));
        }
        // A forward pass writes only the low-precision probabilities.
        let fwd = Program {
            instrs: vec![Instr::Op {
                op: Op::Attention {
                    scale: 0.25,
                    causal: Some(1),
                    heads: None,
                    lowp: Some(DType::BF16),
                },
                ins: vec![
                    t(0, &[2, 70, 40]),
                    t(q, &[2, 33, 40]),
                    t(q + kv, &[2, 33, 40]),
                ],
                out: t(q + 2 * kv, &[2, 70, 40]),
            }],
        };
        let pl = plan(&fwd, &[2 * q + 2 * kv], gemm).unwrap();
        let soft = pl.steps.iter().find_map(|s| match s {
            Step::Launch {
                kernel: Kernel::Library("rlx_att_softmax"),
                p,
                ..
            } => Some(p.iv[5]),
            _ => None,
        });
        assert_eq!(soft, Some(1));
        let metal_like = Target {
            low_precision: false,
            ..gemm
        };
        let pl = plan(&prog(Some(DType::BF16)), &[4 * q + 4 * kv], metal_like).unwrap();
        assert!(pl
            .steps
            .iter()
            .all(|s| !matches!(s, Step::Gemm { g, .. } if g.dtype != DType::F32)));
    }

    #[test]
    fn pooling_is_one_thread_per_output_with_the_window_in_the_record() {
        let w = rlx_ir::Window {
            kernel: [3, 2],
            stride: [2, 1],
            padding: [1, 0],
        };
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Pool2d {
                    window: w,
                    max: true,
                },
                ins: vec![t(0, &[1, 2, 5, 4])],
                out: t(256, &[1, 2, 3, 3]),
            }],
        };
        let pl = plan(&prog, &[512], Target::CUDA).unwrap();
        let Step::Launch { kernel, p, .. } = &pl.steps[0] else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_pool2d"));
        assert_eq!(p.n, 18);
        assert_eq!(&p.iv[..7], &[5, 4, 3, 3, 3, 2, 1]);
        assert_eq!(&p.st[0][..4], &[2, 1, 1, 0]);
    }

    #[test]
    fn transposes_walk_the_source_with_permuted_strides() {
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::Transpose { perm: vec![1, 0] },
                ins: vec![t(0, &[2, 3])],
                out: t(64, &[3, 2]),
            }],
        };
        let plan = plan(&prog, &[128], Target::CUDA).unwrap();
        let Step::Launch { p, .. } = &plan.steps[0] else {
            panic!()
        };
        assert_eq!((p.rank, p.dims[0], p.dims[1]), (2, 3, 2));
        assert_eq!((p.st[0][0], p.st[0][1]), (1, 3));
        assert_eq!((p.mode[0], p.mode[1]), (2, 1));
    }

    #[test]
    fn normalize_grad_add_is_one_launch_where_the_kernel_adds() {
        // x, g, acc and out of [6, 40]: one rlx_normalize_grad with the added tensor as
        // operand 3 where the target has it; normalize_grad into the product buffer plus an add
        // elsewhere.
        let n = 6 * 40 * 4;
        let prog = Program {
            instrs: vec![Instr::Op {
                op: Op::NormalizeGradAdd { eps: 1e-5 },
                ins: vec![t(0, &[6, 40]), t(n, &[6, 40]), t(2 * n, &[6, 40])],
                out: t(3 * n, &[6, 40]),
            }],
        };
        let with = Target {
            normalize_grad_add: true,
            ..Target::CUDA
        };
        let pl = plan(&prog, &[4 * n], with).unwrap();
        assert_eq!(pl.steps.len(), 1);
        let Step::Launch {
            kernel,
            p,
            operands,
            ..
        } = &pl.steps[0]
        else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_normalize_grad"));
        assert_eq!((p.n, p.iv[0], p.iv[1]), (6, 40, 1));
        let offsets: Vec<(usize, usize)> = operands.iter().map(|(k, l)| (*k, l.offset)).collect();
        assert_eq!(offsets, vec![(0, 0), (1, n), (2, 3 * n), (3, 2 * n)]);
        let without = Target {
            normalize_grad_add: false,
            ..Target::CUDA
        };
        let pl = plan(&prog, &[4 * n], without).unwrap();
        assert_eq!(pl.steps.len(), 2);
        let Step::Launch { kernel, p, .. } = &pl.steps[0] else {
            panic!()
        };
        assert_eq!(
            (*kernel, p.iv[1]),
            (Kernel::Library("rlx_normalize_grad"), 0)
        );
    }

    /// A layer norm's backward as the four instructions `fuse` leaves: `db = sum_to(dY)`,
    /// `t = dY * w`, `dw = sum_to(dY * r)`, `dx = normalize_grad_add(x, t, acc)`, rows of `c`.
    fn layer_norm_backward(rows: usize, c: usize, dx_at: usize) -> Program {
        let n = rows * c * 4;
        let (w, db, dw) = (6 * n, 6 * n + 4 * c, 6 * n + 8 * c);
        let m = |d: &[usize]| Shape::from(d);
        let mul = Fused {
            shape: m(&[rows, c]),
            n_inputs: 2,
            steps: vec![FusedStep::Binary(BinaryOp::Mul, 0, 1)],
        };
        let full = |at: usize| t(at, &[rows, c]);
        let op = |op: Op, ins: Vec<TRef>, out: TRef| Instr::Op { op, ins, out };
        Program {
            instrs: vec![
                op(Op::SumTo { shape: m(&[c]) }, vec![full(n)], t(db, &[c])),
                op(
                    Op::Binary(BinaryOp::Mul),
                    vec![full(n), t(w, &[c])],
                    full(3 * n),
                ),
                op(
                    Op::FusedSumTo {
                        expr: std::sync::Arc::new(mul),
                        shape: m(&[c]),
                    },
                    vec![full(2 * n), full(n)],
                    t(dw, &[c]),
                ),
                op(
                    Op::NormalizeGradAdd { eps: 1e-5 },
                    vec![full(0), full(3 * n), full(5 * n)],
                    full(dx_at),
                ),
            ],
        }
    }

    #[test]
    fn a_layer_norm_backward_is_one_launch_where_nothing_it_moves_is_observable() {
        // x 0, dY n, r 2n, t 3n, dx 4n, acc 5n, w 6n; 1000 rows: 125 blocks of 8, partial
        // sums and a counter in the scratch buffer.
        let (rows, c) = (1000, 40);
        let n = rows * c * 4;
        let lens = [7 * n];
        let pl = plan(&layer_norm_backward(rows, c, 4 * n), &lens, Target::CUDA).unwrap();
        assert_eq!(pl.steps.len(), 1, "{:?}", pl.steps);
        let Step::Launch {
            kernel,
            grid,
            p,
            operands,
            ..
        } = &pl.steps[0]
        else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_layer_norm_grad"));
        assert_eq!(
            (p.n, p.iv[0], p.iv[1], p.iv[2], *grid),
            (1000, 40, 1, 8, 125)
        );
        let find = |k: usize| operands.iter().find(|(s, _)| *s == k).map(|(_, l)| *l);
        let arena = |offset| Some(Loc { buf: 0, offset });
        assert_eq!(
            (0..9).map(find).collect::<Vec<_>>(),
            vec![
                arena(0),
                arena(n),
                arena(6 * n),
                arena(2 * n),
                arena(5 * n),
                arena(3 * n),
                arena(4 * n),
                arena(6 * n + 8 * c),
                arena(6 * n + 4 * c)
            ]
        );
        let (part, count) = (find(9).unwrap(), find(10).unwrap());
        assert_eq!((part.buf, count.buf), (SCRATCH, SCRATCH));
        assert!(
            part.offset >= count.offset + 4 && pl.scratch_bytes >= part.offset + 125 * 2 * c * 4
        );
        // A few rows: one chunk, the sums stored directly (no scratch operands).
        let small = plan(
            &layer_norm_backward(6, c, 4 * 6 * c * 4),
            &[7 * 6 * c * 4],
            Target::CUDA,
        )
        .unwrap();
        let Step::Launch { grid, operands, .. } = &small.steps[0] else {
            panic!()
        };
        assert_eq!((small.steps.len(), *grid, operands.len()), (1, 1, 9));
        // dx over half of dY and half of r (a place no planner gives it, rows the kernel
        // would overwrite before other rows read them) and without the kernel: the four
        // instructions lower one by one.
        for (prog, target) in [
            (layer_norm_backward(rows, c, n + n / 2), Target::CUDA),
            (
                layer_norm_backward(rows, c, 4 * n),
                Target {
                    layer_norm_grad: false,
                    cross_entropy_grad: false,
                    layer_norm: false,
                    gemm_grids: false,
                    ..Target::CUDA
                },
            ),
        ] {
            let pl = plan(&prog, &lens, target).unwrap();
            let kernels: Vec<Kernel> = pl
                .steps
                .iter()
                .filter_map(|s| match s {
                    Step::Launch { kernel, .. } => Some(*kernel),
                    _ => None,
                })
                .collect();
            assert!(kernels.len() >= 4, "{kernels:?}");
            assert!(!kernels.contains(&Kernel::Library("rlx_layer_norm_grad")));
        }
        // t over x (which normalize_grad would then read as t), dw over w: none.
        let mut t_over_x = layer_norm_backward(rows, c, 4 * n);
        let mut dw_over_w = layer_norm_backward(rows, c, 4 * n);
        if let (Instr::Op { out, .. }, Instr::Op { ins, .. }) = {
            let (b, d) = t_over_x.instrs.split_at_mut(3);
            (&mut b[1], &mut d[0])
        } {
            out.offset = 0;
            ins[1].offset = 0;
        }
        if let Instr::Op { out, .. } = &mut dw_over_w.instrs[2] {
            out.offset = 6 * n;
        }
        for p in [t_over_x, dw_over_w] {
            assert!(layer_norm_grads(&p).is_empty());
        }
        // dx in place over x, dY, r, t or acc is a group.
        for at in [0, n, 2 * n, 3 * n, 5 * n] {
            assert_eq!(layer_norm_grads(&layer_norm_backward(rows, c, at)).len(), 1);
        }
        // More rows, or more partial sums, than measured faster as one launch: separate
        // launches on CUDA.
        for (rows, c) in [(1025, 40), (1000, 520)] {
            let n = rows * c * 4;
            let prog = layer_norm_backward(rows, c, 4 * n);
            let gs = layer_norm_grads(&prog);
            assert!(gs.len() == 1 && !gs[0].one_launch());
            assert!(plan(&prog, &[7 * n], Target::CUDA).unwrap().steps.len() > 1);
        }
    }

    #[test]
    fn a_cross_entropy_and_its_gradient_are_one_launch() {
        // logits [64, 10] at 0, labels at 4096, g at 4352, loss at 4608, dL at 8192.
        let labels = TRef {
            dtype: DType::I32,
            ..t(4096, &[64])
        };
        let prog = |loss: usize| Program {
            instrs: vec![
                Instr::Op {
                    op: Op::SoftmaxCrossEntropy,
                    ins: vec![t(0, &[64, 10]), labels.clone()],
                    out: t(loss, &[]),
                },
                Instr::Op {
                    op: Op::SoftmaxCrossEntropyGrad,
                    ins: vec![t(0, &[64, 10]), labels.clone(), t(4352, &[])],
                    out: t(8192, &[64, 10]),
                },
            ],
        };
        let pl = plan(&prog(4608), &[16384], Target::CUDA).unwrap();
        assert_eq!(pl.steps.len(), 1);
        let Step::Launch {
            kernel,
            grid,
            p,
            operands,
            ..
        } = &pl.steps[0]
        else {
            panic!()
        };
        assert_eq!(*kernel, Kernel::Library("rlx_ce_loss_grad"));
        assert_eq!((*grid, p.n, p.iv[0]), (8, 64, 10));
        let arena = |offset| Loc { buf: 0, offset };
        assert_eq!(
            operands.clone(),
            vec![
                (0, arena(0)),
                (1, arena(4096)),
                (2, arena(4352)),
                (3, arena(4608)),
                (4, arena(8192)),
                (5, scratch(ERR_AT)),
                (6, scratch(ROWS_AT)),
                (7, scratch(CE_BLOCKS_AT)),
            ]
        );
        assert!(pl.scratch_bytes >= ROWS_AT + 64 * 4 && CE_BLOCKS_AT >= COUNT_AT + 4);
        // The loss over g (which the gradient reads after the loss is written: the kernel
        // would write it last), or a backend without the kernel: four launches.
        for (prog, target) in [
            (prog(4352), Target::CUDA),
            (
                prog(4608),
                Target {
                    cross_entropy_grad: false,
                    layer_norm: false,
                    gemm_grids: false,
                    ..Target::CUDA
                },
            ),
        ] {
            let pl = plan(&prog, &[16384], target).unwrap();
            let names: Vec<_> = pl
                .steps
                .iter()
                .map(|s| match s {
                    Step::Launch { kernel, .. } => *kernel,
                    other => panic!("{other:?}"),
                })
                .collect();
            assert_eq!(
                names,
                [
                    "rlx_ce_rows",
                    "rlx_mean_rows",
                    "rlx_count_labels",
                    "rlx_ce_grad"
                ]
                .map(Kernel::Library)
            );
        }
    }

    #[test]
    fn a_layer_norm_is_one_launch_writing_the_normalized_rows_and_the_affine_result() {
        // x [6, 40] at 0, xhat at n, y at 2n, w and b at 3n and 3n + 256.
        let n = 6 * 40 * 4;
        let (w, b) = (t(3 * n, &[40]), t(3 * n + 256, &[40]));
        let prog = |ins: Vec<TRef>, steps: Vec<FusedStep>, y: usize| Program {
            instrs: vec![
                Instr::Op {
                    op: Op::Normalize { eps: 1e-5 },
                    ins: vec![t(0, &[6, 40])],
                    out: t(n, &[6, 40]),
                },
                Instr::Op {
                    op: Op::Fused(std::sync::Arc::new(Fused {
                        shape: Shape::from(&[6, 40][..]),
                        n_inputs: 3,
                        steps,
                    })),
                    ins,
                    out: t(y, &[6, 40]),
                },
            ],
        };
        let mul_add = |p, q, s, t| {
            vec![
                FusedStep::Binary(BinaryOp::Mul, p, q),
                FusedStep::Binary(BinaryOp::Add, s, t),
            ]
        };
        let xhat = t(n, &[6, 40]);
        for (ins, steps) in [
            (
                vec![xhat.clone(), w.clone(), b.clone()],
                mul_add(0, 1, 3, 2),
            ),
            (
                vec![b.clone(), w.clone(), xhat.clone()],
                mul_add(1, 2, 0, 3),
            ),
        ] {
            let pl = plan(&prog(ins, steps, 2 * n), &[4 * n], Target::CUDA).unwrap();
            assert_eq!(pl.steps.len(), 1);
            let Step::Launch {
                kernel,
                p,
                operands,
                ..
            } = &pl.steps[0]
            else {
                panic!()
            };
            assert_eq!(*kernel, Kernel::Library("rlx_normalize_affine"));
            assert_eq!((p.n, p.iv[0], p.fv[0]), (6, 40, 1e-5));
            let offsets: Vec<(usize, usize)> =
                operands.iter().map(|(k, l)| (*k, l.offset)).collect();
            assert_eq!(
                offsets,
                vec![(0, 0), (1, 3 * n), (2, 3 * n + 256), (3, n), (4, 2 * n)]
            );
        }
        // y over half of x (rows another warp still reads), or an expression other than
        // xhat * w + b: two steps.
        let over_x = Program {
            instrs: vec![
                Instr::Op {
                    op: Op::Normalize { eps: 1e-5 },
                    ins: vec![t(n, &[6, 40])],
                    out: t(2 * n, &[6, 40]),
                },
                prog(
                    vec![t(2 * n, &[6, 40]), w.clone(), b.clone()],
                    mul_add(0, 1, 3, 2),
                    n / 2,
                )
                .instrs[1]
                    .clone(),
            ],
        };
        let other = prog(vec![xhat.clone(), w, b], mul_add(0, 1, 3, 0), 2 * n);
        for p in [over_x, other] {
            assert!(layer_norms(&p).is_empty());
            assert_eq!(plan(&p, &[4 * n], Target::CUDA).unwrap().steps.len(), 2);
        }
    }
}
