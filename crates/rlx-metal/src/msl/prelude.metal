// rlx-metal kernel prelude (MSL; shared by the kernel library and the generated fused kernels):
// the launch record `P` (the layout of rlx_runtime::gpu_plan::P), operand indexing, and the
// scalar helpers every kernel calls, each computing what the CPU kernel computes in float32.
// Pointers in the record are 64-bit GPU addresses of shared buffers (Metal 3), made resident by
// the encoder. The dialect's own lines come first: metal_stdlib plus `rx_atomic_add` and
// `rx_fail` on Metal, msl/compat.h on the host emulation.
#define MAXOP 16
#define MAXR 8
struct P {
    device uint* ptr[MAXOP];
    long n;
    long rank;
    long dims[MAXR];
    long st[MAXOP][MAXR];
    long iv[8];
    float fv[8];
    int mode[MAXOP];
};
// mode 0: a scalar (every index reads element 0); 1: contiguous (element i); 2: strided.
inline long off(constant P& p, int k, long i) {
    int m = p.mode[k];
    if (m == 0) return 0;
    if (m == 1) return i;
    long o = 0;
    for (int d = (int)p.rank - 1; d >= 0; --d) {
        long q = i / p.dims[d];
        o += (i - q * p.dims[d]) * p.st[k][d];
        i = q;
    }
    return o;
}
#define F(k) ((device float*)p.ptr[k])
#define I(k) ((device int*)p.ptr[k])
#define U(k) ((device uint*)p.ptr[k])
#define rx_bits(x) as_type<float>((uint)(x))
#define RX_INF as_type<float>(0x7f800000u)
#define RX_NAN as_type<float>(0x7fc00000u)
#define RX_ISNAN(x) ((x) != (x))
#define RX_FINITE(x) (((x) - (x)) == 0.0f)
inline float rx_relu(float x) { return x < 0.0f ? 0.0f : x; }
inline float rx_sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }
// erf from its complementary function's Chebyshev fit (fractional error below 1.2e-7).
inline float rx_erf(float x) {
    float z = fabs(x);
    float t = 1.0f / (1.0f + 0.5f * z);
    float poly = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f +
        t * (-0.18628806f + t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f +
        t * (-0.82215223f + t * 0.17087277f))))))));
    float erfc = t * exp(-z * z + poly);
    return x >= 0.0f ? 1.0f - erfc : erfc - 1.0f;
}
inline float rx_gelu(float x) { return 0.5f * x * (1.0f + rx_erf(x * 0.70710678118654752f)); }
inline float rx_gelu_deriv(float x) {
    float e = exp(-0.5f * x * x);
    return 0.5f * (1.0f + rx_erf(x * 0.70710678118654752f)) + x * 0.3989422804014327f * e;
}
inline float rx_gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanh(u));
}
inline float rx_gelu_tanh_deriv(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    float t = tanh(u);
    float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
// x^y for every sign of x: a negative base with an integral exponent keeps its sign rule.
inline float rx_pow(float x, float y) {
    if (x < 0.0f && y == floor(y)) {
        float r = pow(-x, y);
        return fmod(fabs(y), 2.0f) == 1.0f ? -r : r;
    }
    return pow(x, y);
}
inline float rx_log1p(float x) {
    float u = 1.0f + x;
    if (u == 1.0f) return x;
    if (!RX_FINITE(u)) return log(u);
    return log(u) * (x / (u - 1.0f));
}
inline float rx_floor_div(float a, float b) {
    if (b == 0.0f) return a / b;
    float m = fmod(a, b);
    float div = (a - m) / b;
    if (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) div -= 1.0f;
    if (div == 0.0f) return copysign(0.0f, a / b);
    float f = floor(div);
    return (div - f > 0.5f) ? f + 1.0f : f;
}
inline float rx_rem(float a, float b) {
    float m = fmod(a, b);
    return (m != 0.0f && ((b < 0.0f) != (m < 0.0f))) ? m + b : m;
}
inline float rx_max(float a, float b) { return (a > b || RX_ISNAN(a)) ? a : b; }
// float32 -> int32 as Rust's `as`: truncation, saturating, NaN -> 0.
inline int rx_f2i(float x) {
    if (RX_ISNAN(x)) return 0;
    if (x >= 2147483647.0f) return 2147483647;
    if (x <= -2147483648.0f) return (-2147483647 - 1);
    return (int)x;
}
// A running float sum with Neumaier compensation (MSL has no double).
struct RxSum {
    float s;
    float c;
};
inline void rx_add(thread RxSum& a, float v) {
    float t = a.s + v;
    if (fabs(a.s) >= fabs(v)) a.c += (a.s - t) + v;
    else a.c += (v - t) + a.s;
    a.s = t;
}
inline float rx_total(thread RxSum& a) { return a.s + a.c; }
