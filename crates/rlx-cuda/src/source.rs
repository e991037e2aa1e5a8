//! CUDA C source of every kernel: the fixed library (layout, reductions, nn, the update) and the
//! generated elementwise kernels, one per `Fused` expression. Pure string building, so the code
//! generation is tested without a GPU.
//!
//! Every kernel takes one argument, the launch record `P` (mirrored by `rlx_runtime::gpu_plan::P`): the
//! operand pointers, an iteration shape with per-operand element strides, and a few integer and
//! float settings. Operand `k`'s element for iteration index `i` is at `off(p, k, i)`.
use rlx_ir::Fused;
use rlx_runtime::expr_source::Dialect;

pub use rlx_runtime::gpu_plan::{MAX_OPS, MAX_RANK};

/// Declarations every module starts with: the launch record, indexing, and the scalar functions
/// the elementwise kernels call (each computes what the CPU kernel computes, in float32).
pub const PRELUDE: &str = r#"
#define RX_INF __int_as_float(0x7f800000)
#define RX_NAN __int_as_float(0x7fffffff)
#define RX_ISNAN(x) ((x) != (x))
#define RX_FINITE(x) (((x) - (x)) == 0)
#define MAXOP 16
#define MAXR 8
struct P {
  unsigned long long ptr[MAXOP];
  long long n;
  long long rank;
  long long dims[MAXR];
  long long st[MAXOP][MAXR];
  long long iv[8];
  float fv[8];
  int mode[MAXOP];
};
/* mode 0: a scalar (every index reads element 0); 1: contiguous (element i); 2: strided.
   The index is split into coordinates with 32-bit divisions when the launch has fewer than 2^31
   iterations (64-bit division is a long software routine on the GPU); the outermost
   coordinate is what is left, with no division. */
__device__ __forceinline__ long long off(const P& p, int k, long long i) {
  int m = p.mode[k];
  if (m == 0) return 0;
  if (m == 1) return i;
  long long o = 0;
  if (p.n <= 0x7fffffffLL) {
    unsigned int u = (unsigned int)i;
    for (int d = (int)p.rank - 1; d > 0; --d) {
      unsigned int dim = (unsigned int)p.dims[d], q = u / dim;
      o += (long long)(u - q * dim) * p.st[k][d];
      u = q;
    }
    return o + (long long)u * p.st[k][0];
  }
  for (int d = (int)p.rank - 1; d > 0; --d) {
    long long q = i / p.dims[d];
    o += (i - q * p.dims[d]) * p.st[k][d];
    i = q;
  }
  return o + i * p.st[k][0];
}
#define F(k) ((float*)p.ptr[k])
/* Four consecutive elements i..i+3 of operand k (i a multiple of 4) under the plan's `fused_x4`
   conditions: a scalar, a contiguous run, or a broadcast whose innermost stride is 0 (one value)
   or 1 (a run: the innermost dim is a multiple of 4). */
__device__ __forceinline__ float4 rx_ld4(const P& p, int k, long long i) {
  int m = p.mode[k];
  const float* x = (const float*)p.ptr[k];
  if (m == 0) { float v = x[0]; return make_float4(v, v, v, v); }
  if (m == 1) return *(const float4*)(x + i);
  long long o = off(p, k, i);
  if (p.st[k][p.rank - 1] == 0) { float v = x[o]; return make_float4(v, v, v, v); }
  return *(const float4*)(x + o);
}
#define I(k) ((int*)p.ptr[k])
#define U(k) ((unsigned int*)p.ptr[k])
#define GRID_LOOP(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)
__device__ __forceinline__ float rx_relu(float x) { return x < 0.0f ? 0.0f : x; }
__device__ __forceinline__ float rx_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float rx_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float rx_gelu_deriv(float x) {
  float e = expf(-0.5f * x * x);
  return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.3989422804014327f * e;
}
__device__ __forceinline__ float rx_gelu_tanh(float x) {
  float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float rx_gelu_tanh_deriv(float x) {
  float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  float t = tanhf(u);
  float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
__device__ __forceinline__ float rx_floor_div(float a, float b) {
  if (b == 0.0f) return a / b;
  float m = fmodf(a, b);
  float div = (a - m) / b;
  if (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) div -= 1.0f;
  if (div == 0.0f) return copysignf(0.0f, a / b);
  float f = floorf(div);
  return (div - f > 0.5f) ? f + 1.0f : f;
}
__device__ __forceinline__ float rx_rem(float a, float b) {
  float m = fmodf(a, b);
  return (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) ? m + b : m;
}
__device__ __forceinline__ float rx_max(float a, float b) { return (a > b || RX_ISNAN(a)) ? a : b; }
/* Reports the first failure of a run (read back by the host after the run). */
__device__ __forceinline__ void rx_fail(int* err, int code, int value) {
  if (atomicCAS(err, 0, code) == 0) err[1] = value;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = rx_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
"#;

pub use rlx_runtime::gpu_plan::{err, int_op_code};

/// The fixed kernels (compiled once per process and device).
pub const LIBRARY: &str = r#"
/* ---- layout: strided 4-byte copies (broadcast, transpose, slice, pad, concat, i32 where) ---- */
extern "C" __global__ void rlx_copy32(const P p) {
  GRID_LOOP(i, p.n) { U(1)[off(p, 1, i)] = U(0)[off(p, 0, i)]; }
}
extern "C" __global__ void rlx_cast_f2i(const P p) {
  GRID_LOOP(i, p.n) { float x = F(0)[off(p, 0, i)]; I(1)[off(p, 1, i)] = RX_ISNAN(x) ? 0 : __float2int_rz(x); }
}
extern "C" __global__ void rlx_cast_i2f(const P p) {
  GRID_LOOP(i, p.n) { F(1)[off(p, 1, i)] = (float)I(0)[off(p, 0, i)]; }
}
/* The integer edges of a narrowed program: bool (one byte, non-zero is true) <-> int32 0/1,
   int32 -> int64 (sign-extended). */
extern "C" __global__ void rlx_cast_b2i(const P p) {
  GRID_LOOP(i, p.n) { I(1)[off(p, 1, i)] = ((const unsigned char*)p.ptr[0])[off(p, 0, i)] != 0; }
}
extern "C" __global__ void rlx_cast_i2b(const P p) {
  GRID_LOOP(i, p.n) { ((unsigned char*)p.ptr[1])[off(p, 1, i)] = I(0)[off(p, 0, i)] != 0; }
}
extern "C" __global__ void rlx_cast_i2l(const P p) {
  GRID_LOOP(i, p.n) { ((long long*)p.ptr[1])[off(p, 1, i)] = (long long)I(0)[off(p, 0, i)]; }
}
/* float32 <-> bfloat16/float16 (mixed precision), rounding to nearest even as the CPU casts do. */
#define H(k) ((unsigned short*)p.ptr[k])
__device__ __forceinline__ unsigned short rx_f2bf(float x) {
  unsigned int b = __float_as_uint(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
  return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
extern "C" __global__ void rlx_cast_f2bf(const P p) {
  GRID_LOOP(i, p.n) { H(1)[off(p, 1, i)] = rx_f2bf(F(0)[off(p, 0, i)]); }
}
extern "C" __global__ void rlx_cast_bf2f(const P p) {
  GRID_LOOP(i, p.n) { F(1)[off(p, 1, i)] = __uint_as_float(((unsigned int)H(0)[off(p, 0, i)]) << 16); }
}
__device__ __forceinline__ unsigned short rx_f2h(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
extern "C" __global__ void rlx_cast_f2h(const P p) {
  GRID_LOOP(i, p.n) { H(1)[off(p, 1, i)] = rx_f2h(F(0)[off(p, 0, i)]); }
}
/* Contiguous, 16-byte aligned casts four at a time (p.n counts quadruples). */
extern "C" __global__ void rlx_cast_f2bf_x4(const P p) {
  GRID_LOOP(i, p.n) {
    float4 x = ((const float4*)F(0))[i];
    uint2 o;
    o.x = rx_f2bf(x.x) | ((unsigned int)rx_f2bf(x.y) << 16);
    o.y = rx_f2bf(x.z) | ((unsigned int)rx_f2bf(x.w) << 16);
    ((uint2*)p.ptr[1])[i] = o;
  }
}
extern "C" __global__ void rlx_cast_f2h_x4(const P p) {
  GRID_LOOP(i, p.n) {
    float4 x = ((const float4*)F(0))[i];
    uint2 o;
    o.x = rx_f2h(x.x) | ((unsigned int)rx_f2h(x.y) << 16);
    o.y = rx_f2h(x.z) | ((unsigned int)rx_f2h(x.w) << 16);
    ((uint2*)p.ptr[1])[i] = o;
  }
}
extern "C" __global__ void rlx_cast_h2f(const P p) {
  GRID_LOOP(i, p.n) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(H(0)[off(p, 0, i)]));
    F(1)[off(p, 1, i)] = x;
  }
}
#undef H
/* cond (f32 when iv[0]==0, else i32) ? a : b over 4-byte values. */
extern "C" __global__ void rlx_where32(const P p) {
  GRID_LOOP(i, p.n) {
    long long c = off(p, 0, i);
    bool t = p.iv[0] == 0 ? (F(0)[c] != 0.0f) : (I(0)[c] != 0);
    U(3)[off(p, 3, i)] = t ? U(1)[off(p, 1, i)] : U(2)[off(p, 2, i)];
  }
}
/* int32 a (op) b; Div gives a float32 quotient, comparisons float32 masks. */
extern "C" __global__ void rlx_ibinary(const P p) {
  int op = (int)p.iv[0];
  GRID_LOOP(i, p.n) {
    int a = I(0)[off(p, 0, i)], b = I(1)[off(p, 1, i)];
    long long o = off(p, 2, i);
    unsigned int ua = (unsigned int)a, ub = (unsigned int)b;
    switch (op) {
      case 0: I(2)[o] = (int)(ua + ub); break;
      case 1: I(2)[o] = (int)(ua - ub); break;
      case 2: I(2)[o] = (int)(ua * ub); break;
      case 3: F(2)[o] = (float)((double)a / (double)b); break;
      case 4: case 5: {
        if (b == 0) { rx_fail((int*)p.ptr[3], 3, 0); I(2)[o] = 0; break; }
        int q, r;
        if (a == (int)0x80000000 && b == -1) { q = a; r = 0; } else { q = a / b; r = a % b; }
        if (r != 0 && ((r < 0) != (b < 0))) { q -= 1; r += b; }
        I(2)[o] = op == 4 ? q : r;
        break;
      }
      case 6: F(2)[o] = a < b ? 1.0f : 0.0f; break;
      case 7: F(2)[o] = a <= b ? 1.0f : 0.0f; break;
      case 8: F(2)[o] = a > b ? 1.0f : 0.0f; break;
      case 9: F(2)[o] = a >= b ? 1.0f : 0.0f; break;
      case 10: F(2)[o] = a == b ? 1.0f : 0.0f; break;
      default: F(2)[o] = a != b ? 1.0f : 0.0f; break;
    }
  }
}
/* ---- reductions: one block per output; kept dims in dims/st[0], reduced dims in st[2] (sizes)
   and st[3] (strides), iv[1] elements, iv[2] reduced rank; iv[0] 0 sum, 1 max; fv[0] scale. ---- */
/* The element `r` of the reduced dims (sizes p.st[2], strides p.st[3], `rr` of them) from `base`. */
__device__ __forceinline__ long long rx_reduced_at(const P& p, long long base, long long r, int rr) {
  long long rem = r, at = base;
  for (int d = rr - 1; d >= 0; --d) {
    long long q = rem / p.st[2][d];
    at += (rem - q * p.st[2][d]) * p.st[3][d];
    rem = q;
  }
  return at;
}
/* rlx_reduce over int32: sums wrap at int32's range (as the narrowed program's int64 does),
   computed in unsigned arithmetic where wrapping is defined. */
__device__ __forceinline__ unsigned int warp_usum(unsigned int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ int warp_imax(int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
extern "C" __global__ void rlx_reduce_i32(const P p) {
  __shared__ int sh[32];
  bool mx = p.iv[0] == 1;
  long long count = p.iv[1];
  int rr = (int)p.iv[2];
  const int lowest = (int)0x80000000u;
  for (long long o = blockIdx.x; o < p.n; o += gridDim.x) {
    long long base = off(p, 0, o);
    unsigned int sum = 0u;
    int top = lowest;
    for (long long r = threadIdx.x; r < count; r += blockDim.x) {
      int v = I(0)[rx_reduced_at(p, base, r, rr)];
      sum += (unsigned int)v;
      top = max(top, v);
    }
    int a = mx ? warp_imax(top) : (int)warp_usum(sum);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) sh[w] = a;
    __syncthreads();
    if (w == 0) {
      int nw = (blockDim.x + 31) >> 5;
      int v = lane < nw ? sh[lane] : (mx ? lowest : 0);
      v = mx ? warp_imax(v) : (int)warp_usum((unsigned int)v);
      if (lane == 0) I(1)[o] = v;
    }
    __syncthreads();
  }
}
extern "C" __global__ void rlx_reduce(const P p) {
  __shared__ float sh[32];
  bool mx = p.iv[0] == 1;
  long long count = p.iv[1];
  int rr = (int)p.iv[2];
  for (long long o = blockIdx.x; o < p.n; o += gridDim.x) {
    long long base = off(p, 0, o);
    float acc = mx ? (-RX_INF) : 0.0f;
    for (long long r = threadIdx.x; r < count; r += blockDim.x) {
      float v = F(0)[rx_reduced_at(p, base, r, rr)];
      acc = mx ? rx_max(acc, v) : acc + v;
    }
    acc = mx ? warp_max(acc) : warp_sum(acc);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) sh[w] = acc;
    __syncthreads();
    if (w == 0) {
      int nw = (blockDim.x + 31) >> 5;
      float v = lane < nw ? sh[lane] : (mx ? (-RX_INF) : 0.0f);
      v = mx ? warp_max(v) : warp_sum(v);
      if (lane == 0) F(1)[o] = mx ? v : v * p.fv[0];
    }
    __syncthreads();
  }
}
/* Sums over leading rows (bias gradients): x is [iv[0] rows, iv[1] cols]. A block of 256
   threads takes 32 adjacent columns (a warp reads one row's 32 floats, coalesced) of a chunk of
   iv[2] rows, its 8 warps taking every 8th row; the warps' sums meet in shared memory. One chunk
   of every row: the block stores its sums times fv[0]. More chunks: each block writes its
   partial sums to ptr2 (chunks x cols floats) and counts itself in ptr3 (one u32 a 32-column
   block, 0 between launches); the block counted last for its columns adds up every chunk's
   partials in chunk order, stores them times fv[0] and resets the count. No zeroing pass, no
   float atomics, and the same sum on every run. */
/* The 8 warps' sums of column `lane` (warp 0's result; every thread passes the barrier). */
__device__ __forceinline__ float rows_meet(float (*sh)[33], float acc, int w, int lane) {
  sh[w][lane] = acc;
  __syncthreads();
  float t = 0.0f;
  if (w == 0) {
#pragma unroll
    for (int k = 0; k < 8; ++k) t += sh[k][lane];
  }
  return t;
}
extern "C" __global__ void rlx_reduce_rows(const P p) {
  __shared__ float sh[8][33];
  __shared__ bool last;
  long long rows = p.iv[0], cols = p.iv[1], chunk = p.iv[2];
  long long colblocks = (cols + 31) / 32, chunks = (rows + chunk - 1) / chunk;
  long long cb = blockIdx.x % colblocks, rb = blockIdx.x / colblocks;
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  long long c = cb * 32 + lane;
  long long r0 = rb * chunk, r1 = min(rows, r0 + chunk);
  float acc = 0.0f;
  if (c < cols) {
    const float* x = F(0) + c;
#pragma unroll 4
    for (long long r = r0 + w; r < r1; r += 8) acc += x[r * cols];
  }
  float t = rows_meet(sh, acc, w, lane);
  if (w == 0 && c < cols) {
    if (chunks == 1) F(1)[c] = t * p.fv[0];
    else F(2)[rb * cols + c] = t;
  }
  if (chunks == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(U(3) + cb, 1u) == (unsigned int)(chunks - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  acc = 0.0f;
  if (c < cols)
    for (long long k = w; k < chunks; k += 8) acc += __ldcg(F(2) + k * cols + c);
  t = rows_meet(sh, acc, w, lane);
  if (w == 0 && c < cols) F(1)[c] = t * p.fv[0];
  if (threadIdx.x == 0) U(3)[cb] = 0u;
}
/* ---- softmax / log-softmax: one warp per row; iv[0] len, iv[1] inner, iv[2] log. ---- */
extern "C" __global__ void rlx_softmax(const P p) {
  long long len = p.iv[0], inner = p.iv[1];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    long long o = r / inner, in = r - o * inner;
    const float* x = F(0) + o * len * inner + in;
    float* y = F(1) + o * len * inner + in;
    float m = (-RX_INF);
    for (long long j = lane; j < len; j += 32) m = rx_max(m, x[j * inner]);
    m = warp_max(m);
    if (m == (-RX_INF)) m = 0.0f;
    float s = 0.0f;
    for (long long j = lane; j < len; j += 32) s += expf(x[j * inner] - m);
    s = warp_sum(s);
    if (p.iv[2]) {
      float lse = m + logf(s);
      for (long long j = lane; j < len; j += 32) y[j * inner] = x[j * inner] - lse;
    } else {
      float inv = 1.0f / s;
      for (long long j = lane; j < len; j += 32) y[j * inner] = expf(x[j * inner] - m) * inv;
    }
  }
}
/* ---- attention as GEMMs: head-major copies, and the score rows between the products ---- */
/* Rows of iv[2] contiguous floats: row r = (block, head, row) of [*, iv[0], iv[1]] at
   st[0] (source) / st[1] (destination) strides [block, head, row]; float4 moves when iv[3].
   iv[4] (rx_low): the destination is float32 (0), bfloat16 (1) or float16 (2). */
__device__ __forceinline__ unsigned short rx_low(long long code, float x) {
  return code == 1 ? rx_f2bf(x) : rx_f2h(x);
}
extern "C" __global__ void rlx_att_copy(const P p) {
  long long H = p.iv[0], R = p.iv[1], C = p.iv[2], v = p.iv[3] ? 4 : 1, n = p.n * (C / v);
  long long lo = p.iv[4];
  /* 32-bit index arithmetic below 2^31 moves (64-bit division is slow on the GPU). */
  bool small = n <= 0x7fffffffLL;
  unsigned int cv = (unsigned int)(C / v), hr = (unsigned int)(H * R), ur = (unsigned int)R;
  GRID_LOOP(i, n) {
    long long c, u, h, w;
    if (small) {
      unsigned int ui = (unsigned int)i, r32 = ui / cv, u32 = r32 / hr, rem = r32 - u32 * hr;
      unsigned int h32 = rem / ur;
      c = (long long)(ui - r32 * cv) * v; u = u32; h = h32; w = rem - h32 * ur;
    } else {
      long long r = i / (C / v); c = (i - r * (C / v)) * v;
      u = r / (H * R); long long rem = r - u * H * R; h = rem / R; w = rem - h * R;
    }
    long long so = u * p.st[0][0] + h * p.st[0][1] + w * p.st[0][2] + c;
    long long d = u * p.st[1][0] + h * p.st[1][1] + w * p.st[1][2] + c;
    if (lo == 0) {
      if (v == 4) *(float4*)(F(1) + d) = *(const float4*)(F(0) + so);
      else F(1)[d] = F(0)[so];
    } else if (v == 4) {
      float4 x = *(const float4*)(F(0) + so);
      uint2 o;
      o.x = rx_low(lo, x.x) | ((unsigned int)rx_low(lo, x.y) << 16);
      o.y = rx_low(lo, x.z) | ((unsigned int)rx_low(lo, x.w) << 16);
      *(uint2*)((unsigned short*)p.ptr[1] + d) = o;
    } else {
      ((unsigned short*)p.ptr[1])[d] = rx_low(lo, F(0)[so]);
    }
  }
}
/* In place: p = softmax(scale * s) over the keys a causal mask leaves (key j of query i when
   j <= i + iv[3], iv[2] set), 0 for the others; a row with no key is NaN, as the fused kernels give.
   With iv[4] (rx_low) the probabilities are also written in that low precision to ptr1, and
   with iv[5] only there (a forward pass reads nothing else). */
extern "C" __global__ void rlx_att_softmax(const P p) {
  long long L = p.iv[0], S = p.iv[1];
  float sc = p.fv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    long long i = r % L, vis = S;
    if (p.iv[2]) vis = max(0LL, min(S, i + p.iv[3] + 1));
    float* x = F(0) + r * S;
    float m = (-RX_INF);
    for (long long j = lane; j < vis; j += 32) m = rx_max(m, x[j] * sc);
    m = warp_max(m);
    float t = 0.0f;
    for (long long j = lane; j < vis; j += 32) t += expf(x[j] * sc - m);
    t = warp_sum(t);
    float inv = 1.0f / t;
    unsigned short* xl = (unsigned short*)p.ptr[1] + r * S;
    for (long long j = lane; j < S; j += 32) {
      float y = vis == 0 ? RX_NAN : (j < vis ? expf(x[j] * sc - m) * inv : 0.0f);
      if (!p.iv[5]) x[j] = y;
      if (p.iv[4]) xl[j] = rx_low(p.iv[4], y);
    }
  }
}
/* In place over dp (ptr1): ds = scale * p * (dp - sum_j p_j dp_j), p the probabilities (ptr0);
   with iv[4] (rx_low) also written in that low precision to ptr2, and with iv[5] only there. */
extern "C" __global__ void rlx_att_dscore(const P p) {
  long long S = p.iv[1];
  float sc = p.fv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* pr = F(0) + r * S;
    float* d = F(1) + r * S;
    float t = 0.0f;
    for (long long j = lane; j < S; j += 32) t += pr[j] * d[j];
    t = warp_sum(t);
    unsigned short* dl = (unsigned short*)p.ptr[2] + r * S;
    for (long long j = lane; j < S; j += 32) {
      float y = sc * pr[j] * (d[j] - t);
      if (!p.iv[5]) d[j] = y;
      if (p.iv[4]) dl[j] = rx_low(p.iv[4], y);
    }
  }
}
/* ---- cross-entropy: per-row losses into scratch (ptr2: n losses, then n 0/1 counted flags),
   then their mean over the counted rows (rlx_mean_rows). Label -100 rows are ignored. ---- */
extern "C" __global__ void rlx_ce_rows(const P p) {
  long long c = p.iv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* x = F(0) + r * c;
    int y = I(1)[r];
    if (y == -100) { if (lane == 0) { F(2)[r] = 0.0f; F(2)[p.n + r] = 0.0f; } continue; }
    float m = (-RX_INF);
    for (long long j = lane; j < c; j += 32) m = rx_max(m, x[j]);
    m = warp_max(m);
    float s = 0.0f;
    for (long long j = lane; j < c; j += 32) s += expf(x[j] - m);
    s = warp_sum(s);
    if (lane == 0) {
      F(2)[p.n + r] = 1.0f;
      if (y < 0 || y >= c) { rx_fail((int*)p.ptr[3], 1, y); F(2)[r] = 0.0f; }
      else F(2)[r] = m + logf(s) - x[y];
    }
  }
}
/* The sum of n floats at ptr0 over the count of n flags after them (ptr0 + n), into ptr1[0],
   in double (NaN for no counted row). */
extern "C" __global__ void rlx_mean_rows(const P p) {
  __shared__ double sh[32];
  __shared__ double shc[32];
  double acc = 0.0, cnt = 0.0;
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) { acc += (double)F(0)[i]; cnt += (double)F(0)[p.n + i]; }
  for (int o = 16; o > 0; o >>= 1) { acc += __shfl_xor_sync(0xffffffffu, acc, o); cnt += __shfl_xor_sync(0xffffffffu, cnt, o); }
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) { sh[w] = acc; shc[w] = cnt; }
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0, k = 0.0;
    for (int q = 0; q < (int)((blockDim.x + 31) >> 5); ++q) { t += sh[q]; k += shc[q]; }
    F(1)[0] = k == 0.0 ? RX_NAN : (float)(t / k);
  }
}
/* Rows not labelled -100 among n int labels (ptr0), into ((int*)ptr1)[0]. One block. */
extern "C" __global__ void rlx_count_labels(const P p) {
  __shared__ int sh[32];
  int cnt = 0;
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) cnt += I(0)[i] != -100;
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) sh[w] = cnt;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int q = 0; q < (int)((blockDim.x + 31) >> 5); ++q) t += sh[q];
    I(1)[0] = t;
  }
}
/* (softmax - onehot) * g / N: ptr0 logits, ptr1 labels, ptr2 g (scalar), ptr3 out, ptr4 err,
   ptr5 the count N of rows not labelled -100 (those rows get 0). */
extern "C" __global__ void rlx_ce_grad(const P p) {
  long long c = p.iv[0];
  int counted = I(5)[0];
  float scale = F(2)[0] / (float)(counted > 0 ? counted : 1);
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* x = F(0) + r * c;
    float* out = F(3) + r * c;
    int y = I(1)[r];
    if (y == -100) { for (long long j = lane; j < c; j += 32) out[j] = 0.0f; continue; }
    if (y < 0 || y >= c) { if (lane == 0) rx_fail((int*)p.ptr[4], 1, y); continue; }
    float m = (-RX_INF);
    for (long long j = lane; j < c; j += 32) m = rx_max(m, x[j]);
    m = warp_max(m);
    if (m == (-RX_INF)) m = 0.0f;
    float s = 0.0f;
    for (long long j = lane; j < c; j += 32) s += expf(x[j] - m);
    s = warp_sum(s);
    float inv = 1.0f / s;
    for (long long j = lane; j < c; j += 32) {
      float v = expf(x[j] - m) * inv;
      if (j == y) v -= 1.0f;
      out[j] = v * scale;
    }
  }
}
/* Cross-entropy and its gradient in one launch (gpu_plan's CrossEntropyGrad): logits ptr0
   (n rows of iv[0] classes), int labels ptr1, g ptr2 (a scalar), into the mean loss ptr3[0] and
   (softmax - onehot) * g / N ptr4, N the rows not labelled -100 (those rows: loss 0, gradient
   0); ptr5 the error word, ptr6 the rows' losses (n floats), ptr7 a u32 count of finished blocks
   (0 between launches). Every block counts N itself, a warp takes a row (the formulas of
   rlx_ce_rows and rlx_ce_grad); the block counted last sums the rows' losses in double and
   resets the count. */
extern "C" __global__ void rlx_ce_loss_grad(const P p) {
  __shared__ int shi[32];
  __shared__ double shd[32];
  __shared__ bool last;
  long long c = p.iv[0];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  int cnt = 0;
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) cnt += I(1)[i] != -100;
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  if (lane == 0) shi[w] = cnt;
  __syncthreads();
  int counted = 0;
  for (int q = 0; q < nw; ++q) counted += shi[q];
  float scale = F(2)[0] / (float)(counted > 0 ? counted : 1);
  long long warps = (long long)gridDim.x * nw;
  for (long long r = blockIdx.x * (long long)nw + w; r < p.n; r += warps) {
    const float* x = F(0) + r * c;
    float* out = F(4) + r * c;
    int y = I(1)[r];
    if (y == -100) {
      if (lane == 0) F(6)[r] = 0.0f;
      for (long long j = lane; j < c; j += 32) out[j] = 0.0f;
      continue;
    }
    if (y < 0 || y >= c) { if (lane == 0) { rx_fail((int*)p.ptr[5], 1, y); F(6)[r] = 0.0f; } continue; }
    float m = (-RX_INF);
    for (long long j = lane; j < c; j += 32) m = rx_max(m, x[j]);
    m = warp_max(m);
    float s = 0.0f;
    for (long long j = lane; j < c; j += 32) s += expf(x[j] - m);
    s = warp_sum(s);
    if (lane == 0) F(6)[r] = m + logf(s) - x[y];
    if (m == (-RX_INF)) {
      m = 0.0f;
      s = 0.0f;
      for (long long j = lane; j < c; j += 32) s += expf(x[j] - m);
      s = warp_sum(s);
    }
    float inv = 1.0f / s;
    for (long long j = lane; j < c; j += 32) {
      float v = expf(x[j] - m) * inv;
      if (j == y) v -= 1.0f;
      out[j] = v * scale;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(U(7), 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  double acc = 0.0;
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) acc += (double)__ldcg(F(6) + i);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __syncthreads();
  if (lane == 0) shd[w] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int q = 0; q < nw; ++q) t += shd[q];
    F(3)[0] = counted == 0 ? RX_NAN : (float)(t / (double)counted);
    U(7)[0] = 0u;
  }
}
/* Mean squared error of n elements (ptr0, ptr1) into ptr2[0], in double. */
extern "C" __global__ void rlx_mse(const P p) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (long long i = threadIdx.x; i < p.n; i += blockDim.x) {
    double d = (double)(F(0)[i] - F(1)[i]);
    acc += d * d;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) sh[w] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int k = 0; k < (int)((blockDim.x + 31) >> 5); ++k) t += sh[k];
    F(2)[0] = p.n == 0 ? RX_NAN : (float)(t / (double)p.n);
  }
}
/* ---- embedding: iv[0] rows, iv[1] width; n = ids * width. ---- */
extern "C" __global__ void rlx_gather(const P p) {
  long long w = p.iv[1];
  GRID_LOOP(i, p.n) {
    long long k = i / w, j = i - k * w;
    int id = I(1)[k];
    if (id < 0 || id >= p.iv[0]) { rx_fail((int*)p.ptr[3], 2, id); F(2)[i] = 0.0f; }
    else F(2)[i] = F(0)[(long long)id * w + j];
  }
}
extern "C" __global__ void rlx_scatter_add(const P p) {
  long long w = p.iv[1];
  GRID_LOOP(i, p.n) {
    long long k = i / w, j = i - k * w;
    int id = I(0)[k];
    if (id < 0 || id >= p.iv[0]) rx_fail((int*)p.ptr[3], 2, id);
    else atomicAdd(F(2) + (long long)id * w + j, F(1)[i]);
  }
}
/* ---- layer norm over the last axis: one warp per row; iv[0] width, fv[0] eps. ---- */
__device__ __forceinline__ void row_stats(const float* x, long long w, float eps, int lane, float* mean, float* rstd) {
  float s = 0.0f;
  for (long long j = lane; j < w; j += 32) s += x[j];
  float m = warp_sum(s) / (float)w;
  float v = 0.0f;
  for (long long j = lane; j < w; j += 32) { float d = x[j] - m; v += d * d; }
  v = warp_sum(v) / (float)w;
  *mean = m;
  *rstd = 1.0f / sqrtf(v + eps);
}
extern "C" __global__ void rlx_normalize(const P p) {
  long long w = p.iv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* x = F(0) + r * w;
    float* y = F(1) + r * w;
    float m, rs;
    row_stats(x, w, p.fv[0], lane, &m, &rs);
    for (long long j = lane; j < w; j += 32) y[j] = (x[j] - m) * rs;
  }
}
/* A layer norm in one launch (gpu_plan's LayerNorm): x ptr0, w ptr1 and b ptr2 (iv[0] floats
   each) into xhat = normalize(x) ptr3 and xhat * w + b ptr4, a warp a row (each may be x). */
extern "C" __global__ void rlx_normalize_affine(const P p) {
  long long w = p.iv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* x = F(0) + r * w;
    float* h = F(3) + r * w;
    float* y = F(4) + r * w;
    float m, rs;
    row_stats(x, w, p.fv[0], lane, &m, &rs);
    for (long long j = lane; j < w; j += 32) {
      float v = (x[j] - m) * rs;
      h[j] = v;
      y[j] = v * F(1)[j] + F(2)[j];
    }
  }
}
/* normalize_grad(x ptr0, g ptr1) into ptr2, a warp a row of iv[0]; with iv[1] (NormalizeGradAdd)
   plus ptr3, a tensor of the same shape, added to each result. */
extern "C" __global__ void rlx_normalize_grad(const P p) {
  long long w = p.iv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < p.n; r += warps) {
    const float* x = F(0) + r * w;
    const float* g = F(1) + r * w;
    float* y = F(2) + r * w;
    const float* a = p.iv[1] ? F(3) + r * w : 0;
    float m, rs;
    row_stats(x, w, p.fv[0], lane, &m, &rs);
    float sg = 0.0f, sgx = 0.0f;
    for (long long j = lane; j < w; j += 32) { sg += g[j]; sgx += g[j] * (x[j] - m) * rs; }
    float mg = warp_sum(sg) / (float)w, mgx = warp_sum(sgx) / (float)w;
    for (long long j = lane; j < w; j += 32) {
      float v = rs * (g[j] - mg - (x[j] - m) * rs * mgx);
      y[j] = a ? v + a[j] : v;
    }
  }
}
/* A layer norm's backward in one launch (gpu_plan's LayerNormGrad): x ptr0, dY ptr1, w ptr2
   (iv[0] = C floats), r ptr3, with iv[1] acc ptr4; writes t = dY * w ptr5,
   dx = normalize_grad(x, t) (+ acc) ptr6, dw = the column sums of dY * r ptr7 and db = those of
   dY ptr8. n rows of C; a block of 8 warps takes a chunk of iv[2] rows. First its threads sum
   the chunk's rows column by column, in row order; then, past a barrier, a warp takes a row
   (dx may be written in place over x, acc, t, dY or r: each row's reads come first). One chunk:
   the sums are stored. More: each block writes its partial sums to ptr9 (chunks x 2C floats)
   and counts itself in ptr10 (one u32, 0 between launches); the block counted last adds the
   chunks' partials in chunk order and resets the count. */
extern "C" __global__ void rlx_layer_norm_grad(const P p) {
  __shared__ bool last;
  long long C = p.iv[0], rows = p.n, chunk = p.iv[2];
  long long chunks = (rows + chunk - 1) / chunk;
  long long r0 = (long long)blockIdx.x * chunk, r1 = min(rows, r0 + chunk);
  for (long long c = threadIdx.x; c < C; c += blockDim.x) {
    float sw = 0.0f, sb = 0.0f;
    for (long long r = r0; r < r1; ++r) { float d = F(1)[r * C + c]; sw += d * F(3)[r * C + c]; sb += d; }
    if (chunks == 1) { F(7)[c] = sw; F(8)[c] = sb; }
    else { F(9)[blockIdx.x * 2 * C + c] = sw; F(9)[blockIdx.x * 2 * C + C + c] = sb; }
  }
  __syncthreads();
  int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const float* wt = F(2);
  for (long long r = r0 + (threadIdx.x >> 5); r < r1; r += nw) {
    const float* x = F(0) + r * C;
    const float* dy = F(1) + r * C;
    const float* a = p.iv[1] ? F(4) + r * C : 0;
    float* t = F(5) + r * C;
    float* y = F(6) + r * C;
    float m, rs;
    row_stats(x, C, p.fv[0], lane, &m, &rs);
    float sg = 0.0f, sgx = 0.0f;
    for (long long j = lane; j < C; j += 32) { float g = dy[j] * wt[j]; sg += g; sgx += g * (x[j] - m) * rs; }
    float mg = warp_sum(sg) / (float)C, mgx = warp_sum(sgx) / (float)C;
    for (long long j = lane; j < C; j += 32) {
      float g = dy[j] * wt[j];
      float v = rs * (g - mg - (x[j] - m) * rs * mgx);
      if (a) v += a[j];
      t[j] = g;
      y[j] = v;
    }
  }
  if (chunks == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(U(10), 1u) == (unsigned int)(chunks - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  /* Eight running sums a column (chunk k into sum k % 8), so eight loads are in flight at a
     time, added in a fixed order at the end. */
  for (long long c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    long long k = 0;
    for (; k + 8 <= chunks; k += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) s[u] += __ldcg(F(9) + (k + u) * 2 * C + c);
    }
    for (int u = 0; k < chunks; ++k, ++u) s[u] += __ldcg(F(9) + k * 2 * C + c);
    float v = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    if (c < C) F(7)[c] = v; else F(8)[c - C] = v;
  }
  if (threadIdx.x == 0) U(10)[0] = 0u;
}
/* ---- convolution patches and pooling over [N*C planes of H x W]: iv H, W, Ho, Wo, kh, kw,
   max, C; st[0] stride h, w, padding h, w; fv[0] 1/(kh*kw). ---- */
#define WINDOW \
  long long H = p.iv[0], W = p.iv[1], Ho = p.iv[2], Wo = p.iv[3], KH = p.iv[4], KW = p.iv[5]; \
  long long SH = p.st[0][0], SW = p.st[0][1], PH = p.st[0][2], PW = p.st[0][3];
/* Patches [N, Ho*Wo, C*kh*kw] (iv[7] = C): row oy*Wo + ox, column (c*kh + i)*kw + j; with
   iv[6] (k-major) [N, C*kh*kw, Ho*Wo]. */
extern "C" __global__ void rlx_im2col(const P p) {
  WINDOW
  long long C = p.iv[7], K = C * KH * KW, PP = Ho * Wo;
  bool KM = p.iv[6] != 0;
  GRID_LOOP(i, p.n) {
    long long kk = KM ? (i / PP) % K : i % K, col = KM ? i % PP : (i / K) % PP;
    long long n = i / (K * PP);
    long long kj = kk % KW, r = kk / KW, ki = r % KH, c = r / KH;
    long long y = (col / Wo) * SH + ki - PH, x = (col % Wo) * SW + kj - PW;
    F(1)[i] = (y >= 0 && y < H && x >= 0 && x < W) ? F(0)[((n * C + c) * H + y) * W + x] : 0.0f;
  }
}
extern "C" __global__ void rlx_col2im(const P p) {
  WINDOW
  long long C = p.iv[7], K = C * KH * KW, PP = Ho * Wo;
  bool KM = p.iv[6] != 0;
  GRID_LOOP(i, p.n) {
    long long x = i % W, t = i / W, y = t % H, nc = t / H, n = nc / C, c = nc % C;
    float acc = 0.0f;
    for (long long ki = 0; ki < KH; ++ki) {
      long long a = y + PH - ki;
      if (a < 0 || a % SH != 0 || a / SH >= Ho) continue;
      for (long long kj = 0; kj < KW; ++kj) {
        long long b = x + PW - kj;
        if (b < 0 || b % SW != 0 || b / SW >= Wo) continue;
        long long col = (a / SH) * Wo + b / SW, kk = (c * KH + ki) * KW + kj;
        acc += F(0)[KM ? (n * K + kk) * PP + col : (n * PP + col) * K + kk];
      }
    }
    F(1)[i] = acc;
  }
}
/* The first maximal element (row-major, NaN counts as maximal) of window (oy, ox) of plane
   `img`, as an index into the plane; -1 for a window wholly in the padding. */
__device__ long long pool_argmax(const float* img, const P& p, long long oy, long long ox) {
  WINDOW
  (void)Ho; (void)Wo;
  long long y0 = max(oy * SH - PH, 0LL), y1 = min(oy * SH - PH + KH, H);
  long long x0 = max(ox * SW - PW, 0LL), x1 = min(ox * SW - PW + KW, W);
  if (y1 <= y0 || x1 <= x0) return -1;
  long long at = y0 * W + x0;
  float best = img[at];
  if (RX_ISNAN(best)) return at;
  for (long long y = y0; y < y1; ++y)
    for (long long x = x0; x < x1; ++x) {
      float v = img[y * W + x];
      if (RX_ISNAN(v)) return y * W + x;
      if (v > best) { best = v; at = y * W + x; }
    }
  return at;
}
extern "C" __global__ void rlx_pool2d(const P p) {
  WINDOW
  GRID_LOOP(i, p.n) {
    long long ox = i % Wo, t = i / Wo, oy = t % Ho, nc = t / Ho;
    const float* img = F(0) + nc * H * W;
    if (p.iv[6]) {
      long long at = pool_argmax(img, p, oy, ox);
      F(1)[i] = at < 0 ? (-RX_INF) : img[at];
    } else {
      long long y0 = max(oy * SH - PH, 0LL), y1 = min(oy * SH - PH + KH, H);
      long long x0 = max(ox * SW - PW, 0LL), x1 = min(ox * SW - PW + KW, W);
      float s = 0.0f;
      for (long long y = y0; y < y1; ++y)
        for (long long x = x0; x < x1; ++x) s += img[y * W + x];
      F(1)[i] = s * p.fv[0];
    }
  }
}
/* ptr0 x, ptr1 g (N, C, Ho, Wo), ptr2 dx: each input element gathers from the windows holding it. */
extern "C" __global__ void rlx_pool2d_grad(const P p) {
  WINDOW
  GRID_LOOP(i, p.n) {
    long long x = i % W, t = i / W, y = t % H, nc = t / H;
    const float* img = F(0) + nc * H * W;
    const float* g = F(1) + nc * Ho * Wo;
    long long oy0 = max((y + PH - KH + SH) / SH, 0LL), oy1 = min((y + PH) / SH, Ho - 1);
    long long ox0 = max((x + PW - KW + SW) / SW, 0LL), ox1 = min((x + PW) / SW, Wo - 1);
    if (y + PH - KH + 1 <= 0) oy0 = 0;
    if (x + PW - KW + 1 <= 0) ox0 = 0;
    float acc = 0.0f;
    for (long long oy = oy0; oy <= oy1; ++oy) {
      if (y < oy * SH - PH || y >= oy * SH - PH + KH) continue;
      for (long long ox = ox0; ox <= ox1; ++ox) {
        if (x < ox * SW - PW || x >= ox * SW - PW + KW) continue;
        if (p.iv[6]) { if (pool_argmax(img, p, oy, ox) == y * W + x) acc += g[oy * Wo + ox]; }
        else acc += g[oy * Wo + ox] * p.fv[0];
      }
    }
    F(2)[i] = acc;
  }
}
/* ---- dropout, log1p ---- */
extern "C" __global__ void rlx_dropout(const P p) {
  unsigned long long sw = ((unsigned long long)(unsigned int)I(1)[0] << 32) | (unsigned long long)(unsigned int)I(1)[1];
  GRID_LOOP(i, p.n) {
    unsigned long long z = (sw * 0x9E3779B97F4A7C15ull) ^ (unsigned long long)i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    F(2)[i] = u >= p.fv[0] ? F(0)[i] * p.fv[1] : 0.0f;
  }
}
extern "C" __global__ void rlx_log1p(const P p) {
  GRID_LOOP(i, p.n) { F(1)[i] = log1pf(F(0)[i]); }
}
/* ---- attention: one warp per query row. iv: units, heads, L, S, E, Ev, causal?, offset;
   fv[0] scale. Element offsets of row `r` of head `j` in unit `u` of tensor X (st[X]):
   u*st[X][0] + j*st[X][1] + r*st[X][2] + st[X][3]; X: 0 q, 1 k, 2 v, 3 out / g, 4..6 dq dk dv.
   ptr0 q, ptr1 k, ptr2 v (all the packed qkv when packed), ptr3 out (forward result),
   ptr4 g, ptr5 the gradient output. Ev <= 256 (8 values per lane). ---- */
__device__ __forceinline__ long long att_at(const P& p, int x, long long u, long long j, long long r) {
  return u * p.st[x][0] + j * p.st[x][1] + r * p.st[x][2] + p.st[x][3];
}
__device__ __forceinline__ float att_dot(const float* a, const float* b, long long e, int lane) {
  float s = 0.0f;
  for (long long d = lane; d < e; d += 32) s += a[d] * b[d];
  return warp_sum(s);
}
extern "C" __global__ void rlx_attention(const P p) {
  long long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); row < p.n; row += warps) {
    long long u = row / (H * L), rem = row - u * H * L, j = rem / L, i = rem - j * L;
    const float* q = F(0) + att_at(p, 0, u, j, i);
    long long last = S - 1;
    if (p.iv[6]) last = min(last, i + p.iv[7]);
    float m = (-RX_INF), l = 0.0f, acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = 0.0f;
    for (long long k = 0; k <= last; ++k) {
      float s = att_dot(q, F(1) + att_at(p, 1, u, j, k), E, lane) * p.fv[0];
      float mn = rx_max(m, s);
      float corr = expf(m - mn), w = expf(s - mn);
      l = l * corr + w;
      const float* v = F(2) + att_at(p, 2, u, j, k);
      for (int t = 0; t < 8; ++t) { long long d = lane + 32 * t; if (d < Ev) acc[t] = acc[t] * corr + w * v[d]; }
      m = mn;
    }
    float* o = F(3) + att_at(p, 3, u, j, i);
    for (int t = 0; t < 8; ++t) { long long d = lane + 32 * t; if (d < Ev) o[d] = acc[t] / l; }
  }
}
extern "C" __global__ void rlx_attention_grad(const P p) {
  long long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
  float sc = p.fv[0];
  int lane = threadIdx.x & 31;
  long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); row < p.n; row += warps) {
    long long u = row / (H * L), rem = row - u * H * L, j = rem / L, i = rem - j * L;
    const float* q = F(0) + att_at(p, 0, u, j, i);
    const float* g = F(4) + att_at(p, 3, u, j, i);
    long long last = S - 1;
    if (p.iv[6]) last = min(last, i + p.iv[7]);
    float m = (-RX_INF), l = 0.0f;
    for (long long k = 0; k <= last; ++k) {
      float s = att_dot(q, F(1) + att_at(p, 1, u, j, k), E, lane) * sc;
      float mn = rx_max(m, s);
      l = l * expf(m - mn) + expf(s - mn);
      m = mn;
    }
    float D = att_dot(g, F(3) + att_at(p, 3, u, j, i), Ev, lane);
    float dq[8];
    for (int t = 0; t < 8; ++t) dq[t] = 0.0f;
    for (long long k = 0; k <= last; ++k) {
      const float* kk = F(1) + att_at(p, 1, u, j, k);
      const float* v = F(2) + att_at(p, 2, u, j, k);
      float pr = expf(att_dot(q, kk, E, lane) * sc - m) / l;
      float ds = pr * (att_dot(g, v, Ev, lane) - D) * sc;
      float* dk = F(5) + att_at(p, 5, u, j, k);
      float* dv = F(5) + att_at(p, 6, u, j, k);
      for (int t = 0; t < 8; ++t) {
        long long d = lane + 32 * t;
        if (d < E) { dq[t] += ds * kk[d]; atomicAdd(dk + d, ds * q[d]); }
        if (d < Ev) atomicAdd(dv + d, pr * g[d]);
      }
    }
    float* dqo = F(5) + att_at(p, 4, u, j, i);
    for (int t = 0; t < 8; ++t) { long long d = lane + 32 * t; if (d < E) dqo[d] = dq[t]; }
  }
}
/* ---- tiled attention for head sizes up to EM (32 or 64), 128 threads a block. Tiles of queries
   and keys go to shared memory transposed (feature-major), and each thread computes a small
   register block of every tile product (scores, probabilities x values, gradients), as a GEMM
   would; key tiles a causal mask hides are never loaded. Same record as the warp kernels above;
   the gradient kernels also take ptr6, two floats per query row (log-sum-exp, D = g.out),
   written by the dQ kernel and read by the dK/dV kernel. ---- */
#define ATT_BK 32
#define ATT_LD 36
/* rows r0..r0+n-1 of tensor x (record slot x, pointer slot ptr) transposed into dst[d * ld + r]
   (or, with ld 0, copied row-major into dst[r * EM + d]), zero outside the tensor. Each thread
   has ATT_LOADS global loads in flight before it stores any (a loop that stored each load
   before issuing the next waited one memory latency per element). */
#define ATT_LOADS 8
template <int EM>
__device__ __forceinline__ void att_load_t(const P& p, int x, int ptr, long long u, long long j,
                                          long long r0, int n, long long R, long long E,
                                          float* dst, int ld) {
  const float* src = (const float*)p.ptr[ptr] + att_at(p, x, u, j, 0);
  long long rs = p.st[x][2];
  int total = n * EM, step = (int)blockDim.x;
  for (int base = threadIdx.x; base < total; base += ATT_LOADS * step) {
    float v[ATT_LOADS];
#pragma unroll
    for (int q = 0; q < ATT_LOADS; ++q) {
      int idx = base + q * step, r = idx / EM, d = idx % EM;
      long long i = r0 + r;
      v[q] = (idx < total && i < R && d < E) ? __ldg(src + i * rs + d) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < ATT_LOADS; ++q) {
      int idx = base + q * step;
      if (idx < total) dst[ld ? (idx % EM) * ld + idx / EM : idx] = v[q];
    }
  }
}
__device__ __forceinline__ long long att_key_end(const P& p, long long q0, long long rows, long long S) {
  if (!p.iv[6]) return S;
  long long e = q0 + rows + p.iv[7];
  return e < 0 ? 0 : min(S, e);
}
__device__ __forceinline__ bool att_sees(const P& p, long long key, long long i, long long S) {
  return key < S && (!p.iv[6] || key <= i + p.iv[7]);
}
/* Reductions over the `w` consecutive lanes that share a row group. */
__device__ __forceinline__ float grp_max(float v, int w) {
  for (int o = 1; o < w; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float grp_sum(float v, int w) {
  for (int o = 1; o < w; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/* Forward: a block per (unit, head, 64 query rows); thread (rg, cg) = (t / 8, t % 8) owns rows
   4rg..4rg+3, keys 4cg..4cg+3 of a score tile and features cg*EM/8.. of the output. */
template <int EM>
__device__ void att_fwd(const P& p) {
  const int BQ = 64, QLD = BQ + 4, DT = EM / 8;
  __shared__ __align__(16) float qT[EM * QLD];
  __shared__ __align__(16) float kT[EM * ATT_LD];
  __shared__ __align__(16) float vs[ATT_BK * EM];
  __shared__ __align__(16) float pT[ATT_BK * QLD];
  long long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
  long long tiles = (L + BQ - 1) / BQ, b = blockIdx.x, uj = b / tiles, q0 = (b - uj * tiles) * BQ;
  long long u = uj / H, j = uj - u * H;
  int t = threadIdx.x, rg = t >> 3, cg = t & 7, r0 = rg * 4;
  float sc = p.fv[0];
  att_load_t<EM>(p, 0, 0, u, j, q0, BQ, L, E, qT, QLD);
  float m[4], l[4], acc[4][DT];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -RX_INF; l[i] = 0.0f;
#pragma unroll
    for (int d = 0; d < DT; ++d) acc[i][d] = 0.0f;
  }
  long long kend = att_key_end(p, q0, BQ, S);
  for (long long k0 = 0; k0 < kend; k0 += ATT_BK) {
    __syncthreads();
    att_load_t<EM>(p, 1, 1, u, j, k0, ATT_BK, S, E, kT, ATT_LD);
    att_load_t<EM>(p, 2, 2, u, j, k0, ATT_BK, S, Ev, vs, 0);
    __syncthreads();
    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[i][c] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < EM; ++d) {
      float4 a = *(const float4*)&qT[d * QLD + r0];
      float4 k = *(const float4*)&kT[d * ATT_LD + cg * 4];
      float av[4] = {a.x, a.y, a.z, a.w}, kv[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[i][c] += av[i] * kv[c];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      long long row = q0 + r0 + i;
      float mx = -RX_INF;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[i][c] = att_sees(p, k0 + cg * 4 + c, row, S) ? s[i][c] * sc : -RX_INF;
        mx = fmaxf(mx, s[i][c]);
      }
      float mn = fmaxf(m[i], grp_max(mx, 8));
      float base = mn == -RX_INF ? 0.0f : mn;
      float corr = expf(m[i] - base), sum = 0.0f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[i][c] = expf(s[i][c] - base);
        sum += s[i][c];
      }
      l[i] = l[i] * corr + grp_sum(sum, 8);
      m[i] = mn;
#pragma unroll
      for (int d = 0; d < DT; ++d) acc[i][d] *= corr;
#pragma unroll
      for (int c = 0; c < 4; ++c) pT[(cg * 4 + c) * QLD + r0 + i] = s[i][c];
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < ATT_BK; ++k) {
      float4 a = *(const float4*)&pT[k * QLD + r0];
      float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int d4 = 0; d4 < DT; d4 += 4) {
        float4 v = *(const float4*)&vs[k * EM + cg * DT + d4];
        float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][d4 + e] += av[i] * vv[e];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    long long row = q0 + r0 + i;
    if (row < L) {
      float* o = F(3) + att_at(p, 3, u, j, row);
#pragma unroll
      for (int d = 0; d < DT; ++d) { int f = cg * DT + d; if (f < Ev) o[f] = acc[i][d] / l[i]; }
    }
  }
}
/* Scores (times scale, masked to -inf) of the 32x32 tile: rows 4rg.., keys 2cg.. of thread
   (rg, cg) = (t / 16, t % 16), from feature-major tiles aT (rows) and bT (keys). */
template <int EM>
__device__ __forceinline__ void att_tile32(const float* aT, const float* bT, int r0, int c0,
                                           float s[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) { s[i][0] = 0.0f; s[i][1] = 0.0f; }
#pragma unroll 8
  for (int d = 0; d < EM; ++d) {
    float4 a = *(const float4*)&aT[d * ATT_LD + r0];
    float2 k = *(const float2*)&bT[d * ATT_LD + c0];
    float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { s[i][0] += av[i] * k.x; s[i][1] += av[i] * k.y; }
  }
}
/* Gradient, part 1: a block per (unit, head, 32 query rows). Per row: the log-sum-exp (first
   sweep over the key tiles) and D = g.out, then dQ = dS K (second sweep). */
template <int EM>
__device__ void att_bwd_q(const P& p) {
  const int BQ = 32, DT = EM / 16;
  __shared__ __align__(16) float qT[EM * ATT_LD];
  __shared__ __align__(16) float gT[EM * ATT_LD];
  __shared__ __align__(16) float kT[EM * ATT_LD];
  __shared__ __align__(16) float vT[EM * ATT_LD];
  __shared__ __align__(16) float dsT[ATT_BK * ATT_LD];
  long long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
  long long tiles = (L + BQ - 1) / BQ, b = blockIdx.x, uj = b / tiles, q0 = (b - uj * tiles) * BQ;
  long long u = uj / H, j = uj - u * H;
  int t = threadIdx.x, rg = t >> 4, cg = t & 15, r0 = rg * 4, c0 = cg * 2;
  float sc = p.fv[0];
  att_load_t<EM>(p, 0, 0, u, j, q0, BQ, L, E, qT, ATT_LD);
  att_load_t<EM>(p, 3, 4, u, j, q0, BQ, L, Ev, gT, ATT_LD);
  float m[4], l[4], dsum[4], dq[4][DT];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = -RX_INF; l[i] = 0.0f;
    long long row = q0 + r0 + i;
    float part = 0.0f;
    if (row < L) {
      const float* o = F(3) + att_at(p, 3, u, j, row);
      const float* g = F(4) + att_at(p, 3, u, j, row);
      for (long long d = cg; d < Ev; d += 16) part += g[d] * o[d];
    }
    dsum[i] = grp_sum(part, 16);
#pragma unroll
    for (int d = 0; d < DT; ++d) dq[i][d] = 0.0f;
  }
  long long kend = att_key_end(p, q0, BQ, S);
  float s[4][2];
  for (long long k0 = 0; k0 < kend; k0 += ATT_BK) {
    __syncthreads();
    att_load_t<EM>(p, 1, 1, u, j, k0, ATT_BK, S, E, kT, ATT_LD);
    __syncthreads();
    att_tile32<EM>(qT, kT, r0, c0, s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      long long row = q0 + r0 + i;
      float mx = -RX_INF;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        s[i][c] = att_sees(p, k0 + c0 + c, row, S) ? s[i][c] * sc : -RX_INF;
        mx = fmaxf(mx, s[i][c]);
      }
      float mn = fmaxf(m[i], grp_max(mx, 16));
      float base = mn == -RX_INF ? 0.0f : mn;
      l[i] = l[i] * expf(m[i] - base) + grp_sum(expf(s[i][0] - base) + expf(s[i][1] - base), 16);
      m[i] = mn;
    }
  }
  float lse[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) lse[i] = m[i] + logf(l[i]);
  for (long long k0 = 0; k0 < kend; k0 += ATT_BK) {
    __syncthreads();
    att_load_t<EM>(p, 1, 1, u, j, k0, ATT_BK, S, E, kT, ATT_LD);
    att_load_t<EM>(p, 2, 2, u, j, k0, ATT_BK, S, Ev, vT, ATT_LD);
    __syncthreads();
    float dp[4][2];
    att_tile32<EM>(qT, kT, r0, c0, s);
    att_tile32<EM>(gT, vT, r0, c0, dp);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      long long row = q0 + r0 + i;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float ds = att_sees(p, k0 + c0 + c, row, S)
                       ? expf(s[i][c] * sc - lse[i]) * (dp[i][c] - dsum[i]) * sc : 0.0f;
        dsT[(c0 + c) * ATT_LD + r0 + i] = ds;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < ATT_BK; ++k) {
      float4 a = *(const float4*)&dsT[k * ATT_LD + r0];
      float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        float kv = kT[(cg * DT + d) * ATT_LD + k];
#pragma unroll
        for (int i = 0; i < 4; ++i) dq[i][d] += av[i] * kv;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    long long row = q0 + r0 + i;
    if (row < L) {
      float* o = F(5) + att_at(p, 4, u, j, row);
#pragma unroll
      for (int d = 0; d < DT; ++d) { int f = cg * DT + d; if (f < E) o[f] = dq[i][d]; }
      if (cg == 0) {
        long long at = (u * H + j) * L + row;
        F(6)[2 * at] = lse[i];
        F(6)[2 * at + 1] = dsum[i];
      }
    }
  }
}
/* Gradient, part 2: a block per (unit, head, 32 keys), over every 32-row query tile that sees
   them: dV += P^T g, dK += dS^T Q. Thread (kg, fg) = (t / 16, t % 16) owns keys 4kg.. and
   features fg*EM/16.. of dK and dV. */
template <int EM>
__device__ void att_bwd_kv(const P& p) {
  const int BQ = 32, DT = EM / 16;
  __shared__ __align__(16) float qT[EM * ATT_LD];
  __shared__ __align__(16) float gT[EM * ATT_LD];
  __shared__ __align__(16) float kT[EM * ATT_LD];
  __shared__ __align__(16) float vT[EM * ATT_LD];
  __shared__ __align__(16) float ps[BQ * ATT_LD];
  __shared__ __align__(16) float dss[BQ * ATT_LD];
  __shared__ float stat[BQ * 2];
  long long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
  long long tiles = (S + ATT_BK - 1) / ATT_BK, b = blockIdx.x, uj = b / tiles, k0 = (b - uj * tiles) * ATT_BK;
  long long u = uj / H, j = uj - u * H;
  int t = threadIdx.x, rg = t >> 4, cg = t & 15, r0 = rg * 4, c0 = cg * 2;
  float sc = p.fv[0];
  att_load_t<EM>(p, 1, 1, u, j, k0, ATT_BK, S, E, kT, ATT_LD);
  att_load_t<EM>(p, 2, 2, u, j, k0, ATT_BK, S, Ev, vT, ATT_LD);
  float dk[4][DT], dv[4][DT];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int d = 0; d < DT; ++d) { dk[i][d] = 0.0f; dv[i][d] = 0.0f; }
  long long first = 0;
  if (p.iv[6]) first = max(0LL, k0 - p.iv[7]) / BQ * BQ;
  float s[4][2], dp[4][2];
  for (long long q0 = first; q0 < L; q0 += BQ) {
    __syncthreads();
    att_load_t<EM>(p, 0, 0, u, j, q0, BQ, L, E, qT, ATT_LD);
    att_load_t<EM>(p, 3, 4, u, j, q0, BQ, L, Ev, gT, ATT_LD);
    if (t < BQ) {
      long long row = q0 + t;
      long long at = (u * H + j) * L + row;
      stat[2 * t] = row < L ? F(6)[2 * at] : RX_INF;
      stat[2 * t + 1] = row < L ? F(6)[2 * at + 1] : 0.0f;
    }
    __syncthreads();
    att_tile32<EM>(qT, kT, r0, c0, s);
    att_tile32<EM>(gT, vT, r0, c0, dp);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      long long row = q0 + r0 + i;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        bool ok = row < L && att_sees(p, k0 + c0 + c, row, S);
        float pr = ok ? expf(s[i][c] * sc - stat[2 * (r0 + i)]) : 0.0f;
        ps[(r0 + i) * ATT_LD + c0 + c] = pr;
        dss[(r0 + i) * ATT_LD + c0 + c] = pr * (dp[i][c] - stat[2 * (r0 + i) + 1]) * sc;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int r = 0; r < BQ; ++r) {
      float4 pa = *(const float4*)&ps[r * ATT_LD + r0];
      float4 da = *(const float4*)&dss[r * ATT_LD + r0];
      float pv[4] = {pa.x, pa.y, pa.z, pa.w}, dv4[4] = {da.x, da.y, da.z, da.w};
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        float g = gT[(cg * DT + d) * ATT_LD + r], q = qT[(cg * DT + d) * ATT_LD + r];
#pragma unroll
        for (int i = 0; i < 4; ++i) { dv[i][d] += pv[i] * g; dk[i][d] += dv4[i] * q; }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    long long key = k0 + r0 + i;
    if (key < S) {
      float* ko = F(5) + att_at(p, 5, u, j, key);
      float* vo = F(5) + att_at(p, 6, u, j, key);
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        int f = cg * DT + d;
        if (f < E) ko[f] = dk[i][d];
        if (f < Ev) vo[f] = dv[i][d];
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(128) rlx_att_fwd_32(const P p) { att_fwd<32>(p); }
extern "C" __global__ void __launch_bounds__(128) rlx_att_fwd_64(const P p) { att_fwd<64>(p); }
extern "C" __global__ void __launch_bounds__(128) rlx_att_bwd_q_32(const P p) { att_bwd_q<32>(p); }
extern "C" __global__ void __launch_bounds__(128) rlx_att_bwd_q_64(const P p) { att_bwd_q<64>(p); }
extern "C" __global__ void __launch_bounds__(128) rlx_att_bwd_kv_32(const P p) { att_bwd_kv<32>(p); }
extern "C" __global__ void __launch_bounds__(128) rlx_att_bwd_kv_64(const P p) { att_bwd_kv<64>(p); }
/* ---- the training update. ctrl (ptr to struct Ctrl) carries the decisions between kernels. ---- */
struct Ctrl { double sq1; double sq2; float go; float noskip; float scale; float micro; };
/* Sum of squares of n floats (ptr0) added to ((double*)ptr1)[iv[0]]. */
extern "C" __global__ void rlx_sumsq(const P p) {
  __shared__ double sh[32];
  double acc = 0.0;
  GRID_LOOP(i, p.n) { double v = (double)F(0)[i]; acc += v * v; }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (lane == 0) sh[w] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int k = 0; k < (int)((blockDim.x + 31) >> 5); ++k) t += sh[k];
    atomicAdd(((double*)p.ptr[1]) + p.iv[0], t);
  }
}
/* One thread. ptr0 ctrl, ptr1 stats, ptr2 loss. Phases iv[0]..=iv[6] in order, iv[1]
   skip_nonfinite, iv[2] accumulate, iv[3] need_norm, iv[4] norm from sq1, iv[5] clip on;
   fv[0] clip. */
extern "C" __global__ void rlx_update_ctrl(const P p) {
  Ctrl* c = (Ctrl*)p.ptr[0];
  float* st = F(1);
  long long k = p.iv[2];
  for (int phase = (int)p.iv[0]; phase <= (int)p.iv[6]; ++phase) switch (phase) {
    case 0: {
      st[3] = 0.0f;
      c->go = 1.0f; c->noskip = 1.0f; c->scale = 1.0f; c->micro = st[2];
      if (p.iv[1]) {
        float loss = F(2)[0];
        if (!(RX_FINITE(loss) && RX_FINITE(c->sq1))) { st[1] += 1.0f; c->go = 0.0f; c->noskip = 0.0f; }
      }
      break;
    }
    case 1: {
      if (c->go != 0.0f && k > 1) {
        long long micro = (long long)c->micro;
        if (micro + 1 < k) { st[2] = (float)(micro + 1); c->go = 0.0f; }
        else { st[2] = 0.0f; c->scale = 1.0f / (float)k; }
      }
      break;
    }
    case 2: {
      if (c->go == 0.0f) break;
      if (!p.iv[3]) { st[0] = RX_NAN; break; }
      double total = p.iv[4] ? c->sq1 : c->sq2;
      float norm = (float)(sqrt(total) * (double)c->scale);
      st[0] = norm;
      if (p.iv[1] && !RX_FINITE(norm)) { st[1] += 1.0f; c->go = 0.0f; c->noskip = 0.0f; break; }
      if (p.iv[5]) { float coef = p.fv[0] / (norm + 1e-6f); if (coef < 1.0f) c->scale *= coef; }
      break;
    }
    default:
      if (c->go != 0.0f) st[3] = 1.0f;
  }
}
/* Gradient accumulation: ptr0 g, ptr1 acc, ptr2 ctrl. */
extern "C" __global__ void rlx_accumulate(const P p) {
  const Ctrl* c = (const Ctrl*)p.ptr[2];
  if (c->go == 0.0f) return;
  bool first = c->micro == 0.0f;
  GRID_LOOP(i, p.n) { F(1)[i] = first ? F(0)[i] : F(1)[i] + F(0)[i]; }
}
/* Buffer updates when the run was not skipped: ptr0 src, ptr1 dst, ptr2 ctrl. */
extern "C" __global__ void rlx_copy_unless_skipped(const P p) {
  const Ctrl* c = (const Ctrl*)p.ptr[2];
  if (c->noskip == 0.0f) return;
  GRID_LOOP(i, p.n) { F(1)[i] = F(0)[i]; }
}
/* The update rules (0 sgd, 1 adam, 2 adamw, 3 rmsprop, 4 adagrad) of one parameter tensor: its
   settings from the hyper row `h` (14 floats) and the run's control block, then one element. The
   step count is read here and incremented by rlx_update_end. */
struct Upd {
  float lr, wd, mom, nesterov, b1, b2, eps, alpha, c_alpha, c_damp, c1, c2, scale, bc1, ibc2, clr;
  int rule; bool first;
};
__device__ __forceinline__ Upd upd_settings(const float* h, const Ctrl* c, int step, bool first, int rule) {
  Upd u;
  u.lr = h[0]; u.wd = h[1]; u.mom = h[2]; u.nesterov = h[4]; u.b1 = h[5]; u.b2 = h[6]; u.eps = h[7];
  u.alpha = h[8]; u.c_alpha = h[10]; u.c_damp = h[11]; u.c1 = h[12]; u.c2 = h[13];
  u.scale = c->scale; u.rule = rule; u.first = first;
  float t = (float)(step > 1 ? step : 1);
  u.bc1 = 1.0f - powf(u.b1, t);
  u.ibc2 = 1.0f / sqrtf(1.0f - powf(u.b2, t));
  u.clr = u.lr / (1.0f + (float)(step - 1) * h[9]);
  return u;
}
__device__ __forceinline__ void upd_one(const Upd& u, float* w, const float* g, float* s0, float* s1, long long i) {
  float pi = w[i];
  float gs = u.scale == 1.0f ? g[i] : g[i] * u.scale;
  if (u.rule == 1 || u.rule == 2) {
    bool adamw = u.rule == 2;
    float pd = pi * (adamw ? 1.0f - u.lr * u.wd : 1.0f);
    float gi = (adamw || u.wd == 0.0f) ? gs : gs + u.wd * pd;
    float mi = u.b1 * s0[i] + u.c1 * gi;
    float vi = u.b2 * s1[i] + u.c2 * gi * gi;
    s0[i] = mi; s1[i] = vi;
    w[i] = pd - (u.lr / u.bc1) * mi / (sqrtf(vi) * u.ibc2 + u.eps);
    return;
  }
  float gi = u.wd != 0.0f ? gs + u.wd * pi : gs;
  if (u.rule == 0) {
    if (u.mom == 0.0f) { w[i] = pi - u.lr * gi; return; }
    float b = u.first ? gi : u.mom * s0[i] + u.c_damp * gi;
    s0[i] = b;
    float d = u.nesterov != 0.0f ? gi + u.mom * b : b;
    w[i] = pi - u.lr * d;
  } else if (u.rule == 3) {
    float sq = u.alpha * s0[i] + u.c_alpha * gi * gi;
    s0[i] = sq;
    float avg = sqrtf(sq) + u.eps;
    if (u.mom > 0.0f) { float b = u.mom * s1[i] + gi / avg; s1[i] = b; w[i] = pi - u.lr * b; }
    else w[i] = pi - u.lr * (gi / avg);
  } else {
    float sq = s0[i] + gi * gi;
    s0[i] = sq;
    w[i] = pi - u.clr * (gi / (sqrtf(sq) + u.eps));
  }
}
/* Every parameter tensor in one launch. ptr0..ptr5 the run's buffer bases, ptr6 the table,
   ptr7 ctrl; iv[0] rule, iv[1] tensors, iv[2] chunks, iv[3] elements a chunk. The table (u64
   words) holds 8 words a tensor -- where its parameter, gradient, state 0, state 1, step count,
   started flag and hyper row are (buffer << 56 | byte offset, all ones for none), then its
   element count -- and then one word a chunk: tensor << 40 | first element. */
__device__ __forceinline__ void* upd_at(const P& p, unsigned long long w) {
  if (w == ~0ull) return 0;
  return (void*)(p.ptr[w >> 56] + (w & ((1ull << 56) - 1)));
}
extern "C" __global__ void rlx_update_multi(const P p) {
  const Ctrl* c = (const Ctrl*)p.ptr[7];
  if (c->go == 0.0f) return;
  const unsigned long long* tab = (const unsigned long long*)p.ptr[6];
  long long tensors = p.iv[1], chunks = p.iv[2], per = p.iv[3];
  for (long long k = blockIdx.x; k < chunks; k += gridDim.x) {
    unsigned long long ch = tab[8 * tensors + k];
    const unsigned long long* d = tab + 8 * (ch >> 40);
    long long start = (long long)(ch & ((1ull << 40) - 1)), n = (long long)d[7];
    const int* started = (const int*)upd_at(p, d[5]);
    Upd u = upd_settings((const float*)upd_at(p, d[6]), c, ((const int*)upd_at(p, d[4]))[0] + 1,
                         started != 0 && started[0] == 0, (int)p.iv[0]);
    float* w = (float*)upd_at(p, d[0]);
    const float* g = (const float*)upd_at(p, d[1]);
    float* s0 = (float*)upd_at(p, d[2]);
    float* s1 = (float*)upd_at(p, d[3]);
    long long end = min(n, start + per);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) upd_one(u, w, g, s0, s1, i);
  }
}
/* The end of an update, one block: every tensor of rlx_update_multi's table (same operands,
   iv[1] tensors) counts the step and marks SGD momentum as started; then phase 3 of
   rlx_update_ctrl (ptr8 stats: the run was applied). */
extern "C" __global__ void rlx_update_end(const P p) {
  const Ctrl* c = (const Ctrl*)p.ptr[7];
  if (c->go == 0.0f) return;
  const unsigned long long* tab = (const unsigned long long*)p.ptr[6];
  for (long long k = threadIdx.x; k < p.iv[1]; k += blockDim.x) {
    const unsigned long long* d = tab + 8 * k;
    atomicAdd((int*)upd_at(p, d[4]), 1);
    int* started = (int*)upd_at(p, d[5]);
    if (started != 0 && ((const float*)upd_at(p, d[6]))[2] != 0.0f) started[0] = 1;
  }
  if (threadIdx.x == 0) F(8)[3] = 1.0f;
}
/* One thread, up to 5 parameters: ptr0 ctrl; for i < iv[0]: ptr[1+3i] step, ptr[2+3i] started
   (or 0), ptr[3+3i] hyper row. Counts the update and marks SGD momentum as started. */
extern "C" __global__ void rlx_update_finish(const P p) {
  const Ctrl* c = (const Ctrl*)p.ptr[0];
  if (c->go == 0.0f) return;
  for (int i = 0; i < (int)p.iv[0]; ++i) {
    I(1 + 3 * i)[0] += 1;
    if (p.ptr[2 + 3 * i] != 0 && F(3 + 3 * i)[2] != 0.0f) I(2 + 3 * i)[0] = 1;
  }
}
"#;

/// A kernel evaluating `f` elementwise: operands `0..n_inputs` are the inputs, operand
/// `n_inputs` the output; every register is one float32 local. With `iv[7]` set (the plan's
/// `fused_x4`: every operand a scalar, contiguous and 16-byte aligned, or broadcast along rows
/// of a multiple of four) each thread takes four consecutive elements with 16-byte loads and
/// stores (`rx_ld4`), the expression evaluated once per lane.
pub fn fused_kernel(name: &str, f: &Fused) -> String {
    let (body, last) = Dialect::CUDA.body(f, |k| format!("F({k})[off(p, {k}, i)]"));
    let o = f.n_inputs;
    let mut quad = String::new();
    for k in 0..f.n_inputs {
        quad.push_str(&format!("      float4 v{k} = rx_ld4(p, {k}, i);\n"));
    }
    quad.push_str("      float4 res;\n");
    for lane in ["x", "y", "z", "w"] {
        let (b, l) = Dialect::CUDA.body(f, |k| format!("v{k}.{lane}"));
        quad.push_str(&format!("      {{\n{b}      res.{lane} = {l};\n      }}\n"));
    }
    format!(
        "extern \"C\" __global__ void {name}(const P p) {{\n  if (p.iv[7]) {{\n    GRID_LOOP(q, p.n / 4) {{\n      long long i = q * 4;\n{quad}      *(float4*)(F({o}) + i) = res;\n    }}\n    return;\n  }}\n  GRID_LOOP(i, p.n) {{\n{body}    F({o})[off(p, {o}, i)] = {last};\n  }}\n}}\n"
    )
}

pub use rlx_runtime::expr_source::hash;

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{BinaryOp, FusedStep, Shape, UnaryOp};

    #[test]
    fn fused_kernel_reads_inputs_and_writes_the_last_register() {
        let f = Fused {
            shape: Shape::new([4]),
            n_inputs: 2,
            steps: vec![
                FusedStep::Binary(BinaryOp::Add, 0, 1),
                FusedStep::Unary(UnaryOp::Relu, 2),
                FusedStep::Unary(UnaryOp::PowScalar(3.0), 3),
            ],
        };
        let src = fused_kernel("k1", &f);
        assert!(src.contains("float r2 = (r0 + r1);"), "{src}");
        assert!(src.contains("float r3 = rx_relu(r2);"), "{src}");
        assert!(
            src.contains("powf(r3, __int_as_float(0x40400000))"),
            "{src}"
        );
        assert!(src.contains("F(2)[off(p, 2, i)] = r4;"), "{src}");
        // The four-a-thread path: both inputs loaded as quads, each lane evaluated.
        assert!(src.contains("float4 v1 = rx_ld4(p, 1, i);"), "{src}");
        assert!(src.contains("res.w = r4;") && src.contains("*(float4*)(F(2) + i) = res;"));
    }

    /// Every kernel compiles for Hopper where NVRTC is installed (no GPU needed); elsewhere
    /// the test says it was skipped.
    #[test]
    fn the_kernel_library_and_a_fused_kernel_compile_with_nvrtc() {
        if !crate::driver::nvrtc_available() {
            eprintln!("SKIPPED: NVRTC not found (set RLX_CUDA_LIB_DIR to check the CUDA C)");
            return;
        }
        let f = Fused {
            shape: Shape::new([4]),
            n_inputs: 3,
            steps: vec![
                FusedStep::Binary(BinaryOp::FloorDiv, 0, 1),
                FusedStep::Unary(UnaryOp::GeluTanhDeriv, 3),
                FusedStep::Where(2, 4, 0),
                FusedStep::Unary(UnaryOp::PowScalar(1.5), 5),
            ],
        };
        let src = format!("{PRELUDE}{LIBRARY}{}", fused_kernel("k0", &f));
        let ptx = crate::driver::compile_only(&src, "sm_90").unwrap();
        for name in [
            "rlx_copy32",
            "rlx_cast_b2i",
            "rlx_cast_i2b",
            "rlx_cast_i2l",
            "rlx_reduce_i32",
            "rlx_cast_f2bf",
            "rlx_cast_h2f",
            "rlx_cast_f2bf_x4",
            "rlx_cast_f2h_x4",
            "rlx_att_softmax",
            "rlx_att_dscore",
            "rlx_att_copy",
            "rlx_attention_grad",
            "rlx_att_fwd_64",
            "rlx_att_bwd_q_32",
            "rlx_att_bwd_kv_64",
            "rlx_im2col",
            "rlx_update_multi",
            "rlx_update_end",
            "k0",
        ] {
            assert!(ptx.contains(name), "{name} missing from the PTX");
        }
    }
}
