// rlx-metal kernel library (MSL, after prelude.metal): one kernel per name the shared GPU plan
// (rlx_runtime::gpu_plan) launches, each with the record contract written there and in the
// CUDA library. Every kernel is dispatched on a 1-D grid: one thread per element, row or output
// (`p.n` threads, bounds-checked), or one thread for the few serial kernels (see
// `crate::kernels::threads`). No threadgroup memory or barriers: the host emulation runs thread
// indices one after another; concurrent sums into one place use `rx_atomic_add`.
inline long rx_lmax(long a, long b) { return a > b ? a : b; }
inline long rx_lmin(long a, long b) { return a < b ? a : b; }

// ---- GEMM: C = A B (row-major terms; element strides for every operand, so transposes are
// strides), `batch` products with element strides between them. One thread per 4x4 tile of C,
// tile t = (b, ti, tj) with ti over ceil(m/4) and tj over ceil(n/4).
struct Gemm {
    device const float* a;
    device const float* b;
    device float* c;
    ulong a_batch;
    ulong b_batch;
    ulong c_batch;
    uint m;
    uint n;
    uint k;
    uint batch;
    uint a_row;
    uint a_col;
    uint b_row;
    uint b_col;
    uint c_row;
    uint pad;
};

kernel void rlx_gemm_f32(constant Gemm& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    uint tiles_n = (p.n + 3) / 4;
    uint tiles = ((p.m + 3) / 4) * tiles_n;
    if (tiles == 0 || t >= tiles * p.batch) return;
    ulong bi = t / tiles;
    uint tt = t % tiles;
    uint i0 = (tt / tiles_n) * 4;
    uint j0 = (tt % tiles_n) * 4;
    device const float* a = p.a + bi * p.a_batch;
    device const float* b = p.b + bi * p.b_batch;
    device float* c = p.c + bi * p.c_batch;
    float acc[4][4];
    for (uint r = 0; r < 4; r++)
        for (uint q = 0; q < 4; q++) acc[r][q] = 0.0f;
    uint rows = min(4u, p.m - i0);
    uint cols = min(4u, p.n - j0);
    for (uint q = 0; q < p.k; q++) {
        float av[4];
        float bv[4];
        for (uint r = 0; r < 4; r++)
            av[r] = r < rows ? a[(ulong)(i0 + r) * p.a_row + (ulong)q * p.a_col] : 0.0f;
        for (uint s = 0; s < 4; s++)
            bv[s] = s < cols ? b[(ulong)q * p.b_row + (ulong)(j0 + s) * p.b_col] : 0.0f;
        for (uint r = 0; r < 4; r++)
            for (uint s = 0; s < 4; s++) acc[r][s] += av[r] * bv[s];
    }
    for (uint r = 0; r < rows; r++)
        for (uint s = 0; s < cols; s++) c[(ulong)(i0 + r) * p.c_row + (j0 + s)] = acc[r][s];
}

// ---- fill: the first iv[0] 32-bit words at ptr0 become zero.
kernel void rlx_zero32(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i < p.n) U(0)[i] = 0u;
}

// ---- layout: strided 4-byte copies (broadcast, transpose, slice, pad, concat, i32 where).
kernel void rlx_copy32(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    U(1)[off(p, 1, i)] = U(0)[off(p, 0, i)];
}
kernel void rlx_cast_f2i(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    I(1)[off(p, 1, i)] = rx_f2i(F(0)[off(p, 0, i)]);
}
kernel void rlx_cast_i2f(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    F(1)[off(p, 1, i)] = (float)I(0)[off(p, 0, i)];
}
// cond (f32 when iv[0]==0, else i32) ? a : b over 4-byte values.
kernel void rlx_where32(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    long c = off(p, 0, i);
    bool t = p.iv[0] == 0 ? (F(0)[c] != 0.0f) : (I(0)[c] != 0);
    U(3)[off(p, 3, i)] = t ? U(1)[off(p, 1, i)] : U(2)[off(p, 2, i)];
}
// int32 a (op iv[0]) b; Div gives a float32 quotient, comparisons float32 masks; ptr3 the
// error word (division by zero).
kernel void rlx_ibinary(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    int op = (int)p.iv[0];
    int a = I(0)[off(p, 0, i)];
    int b = I(1)[off(p, 1, i)];
    long o = off(p, 2, i);
    uint ua = (uint)a;
    uint ub = (uint)b;
    switch (op) {
        case 0: I(2)[o] = (int)(ua + ub); break;
        case 1: I(2)[o] = (int)(ua - ub); break;
        case 2: I(2)[o] = (int)(ua * ub); break;
        case 3: F(2)[o] = (float)a / (float)b; break;
        case 4:
        case 5: {
            if (b == 0) {
                rx_fail(I(3), 3, 0);
                I(2)[o] = 0;
                break;
            }
            int q;
            int r;
            if (a == (-2147483647 - 1) && b == -1) {
                q = a;
                r = 0;
            } else {
                q = a / b;
                r = a % b;
            }
            if (r != 0 && ((r < 0) != (b < 0))) {
                q -= 1;
                r += b;
            }
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

// ---- reductions: one thread per output; kept dims in dims/st[0], reduced dims in st[2]
// (sizes) and st[3] (strides), iv[1] elements, iv[2] reduced rank; iv[0] 0 sum, 1 max;
// fv[0] scale.
kernel void rlx_reduce(constant P& p [[buffer(0)]], uint o [[thread_position_in_grid]]) {
    if ((long)o >= p.n) return;
    bool mx = p.iv[0] == 1;
    long count = p.iv[1];
    int rr = (int)p.iv[2];
    long base = off(p, 0, o);
    float best = -RX_INF;
    RxSum acc = {0.0f, 0.0f};
    for (long r = 0; r < count; ++r) {
        long rem = r;
        long at = base;
        for (int d = rr - 1; d >= 0; --d) {
            long q = rem / p.st[2][d];
            at += (rem - q * p.st[2][d]) * p.st[3][d];
            rem = q;
        }
        float v = F(0)[at];
        if (mx) best = rx_max(best, v);
        else rx_add(acc, v);
    }
    F(1)[o] = mx ? best : rx_total(acc) * p.fv[0];
}
// Sums over leading rows: x is [iv[0] rows, iv[1] cols]; one thread per column stores its sum
// times fv[0] (operands 2 and 3, the CUDA kernel's partial sums and counters, go unused).
kernel void rlx_reduce_rows(constant P& p [[buffer(0)]], uint c [[thread_position_in_grid]]) {
    long rows = p.iv[0];
    long cols = p.iv[1];
    if ((long)c >= cols) return;
    RxSum acc = {0.0f, 0.0f};
    for (long r = 0; r < rows; ++r) rx_add(acc, F(0)[r * cols + c]);
    F(1)[c] = rx_total(acc) * p.fv[0];
}

// ---- softmax / log-softmax: one thread per row; iv[0] len, iv[1] inner, iv[2] log.
kernel void rlx_softmax(constant P& p [[buffer(0)]], uint r [[thread_position_in_grid]]) {
    if ((long)r >= p.n) return;
    long len = p.iv[0];
    long inner = p.iv[1];
    long o = r / inner;
    long inn = r - o * inner;
    device const float* x = F(0) + o * len * inner + inn;
    device float* y = F(1) + o * len * inner + inn;
    float m = -RX_INF;
    for (long j = 0; j < len; ++j) m = rx_max(m, x[j * inner]);
    if (m == -RX_INF) m = 0.0f;
    float s = 0.0f;
    for (long j = 0; j < len; ++j) s += exp(x[j * inner] - m);
    if (p.iv[2]) {
        float lse = m + log(s);
        for (long j = 0; j < len; ++j) y[j * inner] = x[j * inner] - lse;
    } else {
        float inv = 1.0f / s;
        for (long j = 0; j < len; ++j) y[j * inner] = exp(x[j * inner] - m) * inv;
    }
}

// ---- cross-entropy: per-row losses into scratch (ptr2: n losses, then n 0/1 counted flags),
// then their mean over the counted rows (rlx_mean_rows). Label -100 rows are ignored; ptr3
// the error word (label out of range).
kernel void rlx_ce_rows(constant P& p [[buffer(0)]], uint r [[thread_position_in_grid]]) {
    if ((long)r >= p.n) return;
    long c = p.iv[0];
    device const float* x = F(0) + r * c;
    int y = I(1)[r];
    if (y == -100) {
        F(2)[r] = 0.0f;
        F(2)[p.n + r] = 0.0f;
        return;
    }
    F(2)[p.n + r] = 1.0f;
    if (y < 0 || y >= c) {
        rx_fail(I(3), 1, y);
        F(2)[r] = 0.0f;
        return;
    }
    float m = -RX_INF;
    for (long j = 0; j < c; ++j) m = rx_max(m, x[j]);
    float s = 0.0f;
    for (long j = 0; j < c; ++j) s += exp(x[j] - m);
    F(2)[r] = m + log(s) - x[y];
}
// One thread: the sum of n floats at ptr0 over the count of the n flags after them, into
// ptr1[0] (NaN for no counted row).
kernel void rlx_mean_rows(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    if (t != 0) return;
    RxSum acc = {0.0f, 0.0f};
    float cnt = 0.0f;
    for (long i = 0; i < p.n; ++i) {
        rx_add(acc, F(0)[i]);
        cnt += F(0)[p.n + i];
    }
    F(1)[0] = cnt == 0.0f ? RX_NAN : rx_total(acc) / cnt;
}
// One thread: rows not labelled -100 among n int labels (ptr0), into ((int*)ptr1)[0].
kernel void rlx_count_labels(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    if (t != 0) return;
    int cnt = 0;
    for (long i = 0; i < p.n; ++i) cnt += I(0)[i] != -100 ? 1 : 0;
    I(1)[0] = cnt;
}
// (softmax - onehot) * g / N: ptr0 logits, ptr1 labels, ptr2 g (scalar), ptr3 out, ptr4 err,
// ptr5 the count N of rows not labelled -100 (those rows get 0). One thread per row.
kernel void rlx_ce_grad(constant P& p [[buffer(0)]], uint r [[thread_position_in_grid]]) {
    if ((long)r >= p.n) return;
    long c = p.iv[0];
    int counted = I(5)[0];
    float scale = F(2)[0] / (float)(counted > 0 ? counted : 1);
    device const float* x = F(0) + r * c;
    device float* out = F(3) + r * c;
    int y = I(1)[r];
    if (y == -100) {
        for (long j = 0; j < c; ++j) out[j] = 0.0f;
        return;
    }
    if (y < 0 || y >= c) {
        rx_fail(I(4), 1, y);
        return;
    }
    float m = -RX_INF;
    for (long j = 0; j < c; ++j) m = rx_max(m, x[j]);
    if (m == -RX_INF) m = 0.0f;
    float s = 0.0f;
    for (long j = 0; j < c; ++j) s += exp(x[j] - m);
    float inv = 1.0f / s;
    for (long j = 0; j < c; ++j) {
        float v = exp(x[j] - m) * inv;
        if (j == y) v -= 1.0f;
        out[j] = v * scale;
    }
}
// One thread: the mean squared error of n elements (ptr0, ptr1) into ptr2[0].
kernel void rlx_mse(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    if (t != 0) return;
    RxSum acc = {0.0f, 0.0f};
    for (long i = 0; i < p.n; ++i) {
        float d = F(0)[i] - F(1)[i];
        rx_add(acc, d * d);
    }
    F(2)[0] = p.n == 0 ? RX_NAN : rx_total(acc) / (float)p.n;
}

// ---- embedding: iv[0] rows, iv[1] width; n = ids * width; ptr3 the error word (bad id).
kernel void rlx_gather(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    long w = p.iv[1];
    long k = i / w;
    long j = i - k * w;
    int id = I(1)[k];
    if (id < 0 || id >= p.iv[0]) {
        rx_fail(I(3), 2, id);
        F(2)[i] = 0.0f;
    } else {
        F(2)[i] = F(0)[(long)id * w + j];
    }
}
kernel void rlx_scatter_add(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    long w = p.iv[1];
    long k = i / w;
    long j = i - k * w;
    int id = I(0)[k];
    if (id < 0 || id >= p.iv[0]) rx_fail(I(3), 2, id);
    else rx_atomic_add(F(2) + (long)id * w + j, F(1)[i]);
}

// ---- layer norm over the last axis: one thread per row; iv[0] width, fv[0] eps.
inline void rx_row_stats(device const float* x, long w, float eps, thread float& mean,
                         thread float& rstd) {
    float s = 0.0f;
    for (long j = 0; j < w; ++j) s += x[j];
    float m = s / (float)w;
    float v = 0.0f;
    for (long j = 0; j < w; ++j) {
        float d = x[j] - m;
        v += d * d;
    }
    v = v / (float)w;
    mean = m;
    rstd = 1.0f / sqrt(v + eps);
}
kernel void rlx_normalize(constant P& p [[buffer(0)]], uint r [[thread_position_in_grid]]) {
    if ((long)r >= p.n) return;
    long w = p.iv[0];
    device const float* x = F(0) + r * w;
    device float* y = F(1) + r * w;
    float m;
    float rs;
    rx_row_stats(x, w, p.fv[0], m, rs);
    for (long j = 0; j < w; ++j) y[j] = (x[j] - m) * rs;
}
kernel void rlx_normalize_grad(constant P& p [[buffer(0)]], uint r [[thread_position_in_grid]]) {
    if ((long)r >= p.n) return;
    long w = p.iv[0];
    device const float* x = F(0) + r * w;
    device const float* g = F(1) + r * w;
    device float* y = F(2) + r * w;
    float m;
    float rs;
    rx_row_stats(x, w, p.fv[0], m, rs);
    float sg = 0.0f;
    float sgx = 0.0f;
    for (long j = 0; j < w; ++j) {
        sg += g[j];
        sgx += g[j] * (x[j] - m) * rs;
    }
    float mg = sg / (float)w;
    float mgx = sgx / (float)w;
    for (long j = 0; j < w; ++j) y[j] = rs * (g[j] - mg - (x[j] - m) * rs * mgx);
}

// ---- convolution patches and pooling over [N*C planes of H x W]: iv H, W, Ho, Wo, kh, kw,
// max, C; st[0] stride h, w, padding h, w; fv[0] 1/(kh*kw). One thread per output element.
#define WINDOW                                                                           \
    long H = p.iv[0], W = p.iv[1], Ho = p.iv[2], Wo = p.iv[3], KH = p.iv[4], KW = p.iv[5]; \
    long SH = p.st[0][0], SW = p.st[0][1], PH = p.st[0][2], PW = p.st[0][3];
// Patches [N, Ho*Wo, C*kh*kw] (iv[7] = C): row oy*Wo + ox, column (c*kh + i)*kw + j; with
// iv[6] (k-major) [N, C*kh*kw, Ho*Wo].
kernel void rlx_im2col(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    WINDOW
    long C = p.iv[7];
    long K = C * KH * KW;
    long PP = Ho * Wo;
    bool KM = p.iv[6] != 0;
    long kk = KM ? ((long)i / PP) % K : (long)i % K;
    long col = KM ? (long)i % PP : ((long)i / K) % PP;
    long n = (long)i / (K * PP);
    long kj = kk % KW, r = kk / KW, ki = r % KH, c = r / KH;
    long y = (col / Wo) * SH + ki - PH, x = (col % Wo) * SW + kj - PW;
    F(1)[i] = (y >= 0 && y < H && x >= 0 && x < W) ? F(0)[((n * C + c) * H + y) * W + x] : 0.0f;
}
kernel void rlx_col2im(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    WINDOW
    long C = p.iv[7];
    long K = C * KH * KW;
    long PP = Ho * Wo;
    bool KM = p.iv[6] != 0;
    long x = i % W, t = i / W, y = t % H, nc = t / H, n = nc / C, c = nc % C;
    float acc = 0.0f;
    for (long ki = 0; ki < KH; ++ki) {
        long a = y + PH - ki;
        if (a < 0 || a % SH != 0 || a / SH >= Ho) continue;
        for (long kj = 0; kj < KW; ++kj) {
            long b = x + PW - kj;
            if (b < 0 || b % SW != 0 || b / SW >= Wo) continue;
            long col = (a / SH) * Wo + b / SW, kk = (c * KH + ki) * KW + kj;
            acc += F(0)[KM ? (n * K + kk) * PP + col : (n * PP + col) * K + kk];
        }
    }
    F(1)[i] = acc;
}
// The first maximal element (row-major, NaN counts as maximal) of window (oy, ox) of plane
// `img`, as an index into the plane; -1 for a window wholly in the padding.
inline long rx_pool_argmax(device const float* img, constant P& p, long oy, long ox) {
    WINDOW
    (void)Ho;
    (void)Wo;
    long y0 = rx_lmax(oy * SH - PH, 0), y1 = rx_lmin(oy * SH - PH + KH, H);
    long x0 = rx_lmax(ox * SW - PW, 0), x1 = rx_lmin(ox * SW - PW + KW, W);
    if (y1 <= y0 || x1 <= x0) return -1;
    long at = y0 * W + x0;
    float best = img[at];
    if (RX_ISNAN(best)) return at;
    for (long y = y0; y < y1; ++y)
        for (long x = x0; x < x1; ++x) {
            float v = img[y * W + x];
            if (RX_ISNAN(v)) return y * W + x;
            if (v > best) {
                best = v;
                at = y * W + x;
            }
        }
    return at;
}
kernel void rlx_pool2d(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    WINDOW
    long ox = i % Wo, t = i / Wo, oy = t % Ho, nc = t / Ho;
    device const float* img = F(0) + nc * H * W;
    if (p.iv[6]) {
        long at = rx_pool_argmax(img, p, oy, ox);
        F(1)[i] = at < 0 ? -RX_INF : img[at];
    } else {
        long y0 = rx_lmax(oy * SH - PH, 0), y1 = rx_lmin(oy * SH - PH + KH, H);
        long x0 = rx_lmax(ox * SW - PW, 0), x1 = rx_lmin(ox * SW - PW + KW, W);
        float s = 0.0f;
        for (long y = y0; y < y1; ++y)
            for (long x = x0; x < x1; ++x) s += img[y * W + x];
        F(1)[i] = s * p.fv[0];
    }
}
// ptr0 x, ptr1 g (N, C, Ho, Wo), ptr2 dx: each input element gathers from the windows holding it.
kernel void rlx_pool2d_grad(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    WINDOW
    long x = i % W, t = i / W, y = t % H, nc = t / H;
    device const float* img = F(0) + nc * H * W;
    device const float* g = F(1) + nc * Ho * Wo;
    long oy0 = rx_lmax((y + PH - KH + SH) / SH, 0), oy1 = rx_lmin((y + PH) / SH, Ho - 1);
    long ox0 = rx_lmax((x + PW - KW + SW) / SW, 0), ox1 = rx_lmin((x + PW) / SW, Wo - 1);
    if (y + PH - KH + 1 <= 0) oy0 = 0;
    if (x + PW - KW + 1 <= 0) ox0 = 0;
    float acc = 0.0f;
    for (long oy = oy0; oy <= oy1; ++oy) {
        if (y < oy * SH - PH || y >= oy * SH - PH + KH) continue;
        for (long ox = ox0; ox <= ox1; ++ox) {
            if (x < ox * SW - PW || x >= ox * SW - PW + KW) continue;
            if (p.iv[6]) {
                if (rx_pool_argmax(img, p, oy, ox) == y * W + x) acc += g[oy * Wo + ox];
            } else {
                acc += g[oy * Wo + ox] * p.fv[0];
            }
        }
    }
    F(2)[i] = acc;
}

// ---- dropout (ptr1: the two int32 seed words), log1p.
kernel void rlx_dropout(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    ulong sw = ((ulong)(uint)I(1)[0] << 32) | (ulong)(uint)I(1)[1];
    ulong z = (sw * 0x9E3779B97F4A7C15ul) ^ (ulong)i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ul;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBul;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    F(2)[i] = u >= p.fv[0] ? F(0)[i] * p.fv[1] : 0.0f;
}
kernel void rlx_log1p(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i < p.n) F(1)[i] = rx_log1p(F(0)[i]);
}

// ---- attention: one thread per query row. iv: units, heads, L, S, E, Ev, causal?, offset;
// fv[0] scale. Element offsets of row `r` of head `j` in unit `u` of tensor X (st[X]):
// u*st[X][0] + j*st[X][1] + r*st[X][2] + st[X][3]; X: 0 q, 1 k, 2 v, 3 out / g, 4..6 dq dk dv.
// ptr0 q, ptr1 k, ptr2 v (all the packed qkv when packed), ptr3 out (forward result), ptr4 g,
// ptr5 the gradient output (zeroed first: dk and dv are sums over query rows). E, Ev <= 256.
inline long rx_att_at(constant P& p, int x, long u, long j, long r) {
    return u * p.st[x][0] + j * p.st[x][1] + r * p.st[x][2] + p.st[x][3];
}
inline float rx_dot(device const float* a, device const float* b, long e) {
    float s = 0.0f;
    for (long d = 0; d < e; ++d) s += a[d] * b[d];
    return s;
}
kernel void rlx_attention(constant P& p [[buffer(0)]], uint row [[thread_position_in_grid]]) {
    if ((long)row >= p.n) return;
    long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
    long u = row / (H * L), rem = row - u * H * L, j = rem / L, i = rem - j * L;
    device const float* q = F(0) + rx_att_at(p, 0, u, j, i);
    long last = S - 1;
    if (p.iv[6]) last = rx_lmin(last, i + p.iv[7]);
    float m = -RX_INF;
    float l = 0.0f;
    float acc[256];
    for (long d = 0; d < Ev; ++d) acc[d] = 0.0f;
    for (long k = 0; k <= last; ++k) {
        float s = rx_dot(q, F(1) + rx_att_at(p, 1, u, j, k), E) * p.fv[0];
        float mn = rx_max(m, s);
        float corr = exp(m - mn);
        float w = exp(s - mn);
        l = l * corr + w;
        device const float* v = F(2) + rx_att_at(p, 2, u, j, k);
        for (long d = 0; d < Ev; ++d) acc[d] = acc[d] * corr + w * v[d];
        m = mn;
    }
    device float* o = F(3) + rx_att_at(p, 3, u, j, i);
    for (long d = 0; d < Ev; ++d) o[d] = acc[d] / l;
}
kernel void rlx_attention_grad(constant P& p [[buffer(0)]], uint row [[thread_position_in_grid]]) {
    if ((long)row >= p.n) return;
    long H = p.iv[1], L = p.iv[2], S = p.iv[3], E = p.iv[4], Ev = p.iv[5];
    float sc = p.fv[0];
    long u = row / (H * L), rem = row - u * H * L, j = rem / L, i = rem - j * L;
    device const float* q = F(0) + rx_att_at(p, 0, u, j, i);
    device const float* g = F(4) + rx_att_at(p, 3, u, j, i);
    long last = S - 1;
    if (p.iv[6]) last = rx_lmin(last, i + p.iv[7]);
    float m = -RX_INF;
    float l = 0.0f;
    for (long k = 0; k <= last; ++k) {
        float s = rx_dot(q, F(1) + rx_att_at(p, 1, u, j, k), E) * sc;
        float mn = rx_max(m, s);
        l = l * exp(m - mn) + exp(s - mn);
        m = mn;
    }
    float D = rx_dot(g, F(3) + rx_att_at(p, 3, u, j, i), Ev);
    float dq[256];
    for (long d = 0; d < E; ++d) dq[d] = 0.0f;
    for (long k = 0; k <= last; ++k) {
        device const float* kk = F(1) + rx_att_at(p, 1, u, j, k);
        device const float* v = F(2) + rx_att_at(p, 2, u, j, k);
        float pr = exp(rx_dot(q, kk, E) * sc - m) / l;
        float ds = pr * (rx_dot(g, v, Ev) - D) * sc;
        device float* dk = F(5) + rx_att_at(p, 5, u, j, k);
        device float* dv = F(5) + rx_att_at(p, 6, u, j, k);
        for (long d = 0; d < E; ++d) {
            dq[d] += ds * kk[d];
            rx_atomic_add(dk + d, ds * q[d]);
        }
        for (long d = 0; d < Ev; ++d) rx_atomic_add(dv + d, pr * g[d]);
    }
    device float* dqo = F(5) + rx_att_at(p, 4, u, j, i);
    for (long d = 0; d < E; ++d) dqo[d] = dq[d];
}

// ---- the training update on the device (the plan's multi-tensor update; the host update is
// the alternative, crate::UpdateMode). The control block (ptr to RxCtrl, 32 bytes at the plan's
// CTRL_AT, zeroed by the plan where a norm adds into it; phase 0 sets the rest) carries the decisions between the kernels. MSL has no double, so a sum of
// squares is two floats: sq[2s] sums the squares of elements below 2^32 in magnitude, sq[2s+1]
// those of the others scaled by 2^-64 (so a norm overflows only where float32 does).
#define RX_SUMSQ_CHUNK 1024
#define RX_UPDATE_LANES 256
struct RxCtrl {
    float sq[4];
    float go;
    float noskip;
    float scale;
    float micro;
};
#define RX_2P64 rx_bits(0x5f800000u)
#define RX_2M64 rx_bits(0x1f800000u)
// The norm of sum-of-squares slot s, times scale (as the CPU's (sqrt(total) * scale) in f64).
inline float rx_ctrl_norm(device const RxCtrl* c, int s, float scale) {
    float small = c->sq[2 * s];
    float big = c->sq[2 * s + 1];
    if (big == 0.0f) return sqrt(small) * scale;
    return sqrt(big + (small * RX_2M64) * RX_2M64) * scale * RX_2P64;
}
// Sum of squares of the n floats at ptr0 added to slot iv[0] of the control block at ptr1; a
// thread per RX_SUMSQ_CHUNK elements.
kernel void rlx_sumsq(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    long start = (long)t * RX_SUMSQ_CHUNK;
    if (start >= p.n) return;
    long end = rx_lmin(p.n, start + RX_SUMSQ_CHUNK);
    RxSum small = {0.0f, 0.0f};
    RxSum big = {0.0f, 0.0f};
    float bad = 0.0f;
    for (long i = start; i < end; ++i) {
        float v = F(0)[i];
        if (!RX_FINITE(v)) {
            bad += v * v;
        } else if (fabs(v) >= 4294967296.0f) {
            float s = v * RX_2M64;
            rx_add(big, s * s);
        } else {
            rx_add(small, v * v);
        }
    }
    device RxCtrl* c = (device RxCtrl*)p.ptr[1];
    int s = (int)p.iv[0];
    rx_atomic_add(&c->sq[2 * s], rx_total(small));
    float b = rx_total(big) + bad;
    if (b != 0.0f) rx_atomic_add(&c->sq[2 * s + 1], b);
}
// One thread. ptr0 ctrl, ptr1 stats, ptr2 loss. iv[0] phase, iv[1] skip_nonfinite,
// iv[2] accumulate, iv[3] need_norm, iv[4] norm from slot 0, iv[5] clip on; fv[0] clip.
kernel void rlx_update_ctrl(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    if (t != 0) return;
    device RxCtrl* c = (device RxCtrl*)p.ptr[0];
    device float* st = F(1);
    long k = p.iv[2];
    switch ((int)p.iv[0]) {
    case 0: {
        st[3] = 0.0f;
        c->go = 1.0f;
        c->noskip = 1.0f;
        c->scale = 1.0f;
        c->micro = st[2];
        if (p.iv[1]) {
            float loss = F(2)[0];
            if (!(RX_FINITE(loss) && RX_FINITE(rx_ctrl_norm(c, 0, 1.0f)))) {
                st[1] += 1.0f;
                c->go = 0.0f;
                c->noskip = 0.0f;
            }
        }
        break;
    }
    case 1: {
        if (c->go != 0.0f && k > 1) {
            long micro = (long)c->micro;
            if (micro + 1 < k) {
                st[2] = (float)(micro + 1);
                c->go = 0.0f;
            } else {
                st[2] = 0.0f;
                c->scale = 1.0f / (float)k;
            }
        }
        break;
    }
    case 2: {
        if (c->go == 0.0f) break;
        if (!p.iv[3]) {
            st[0] = RX_NAN;
            break;
        }
        float norm = rx_ctrl_norm(c, p.iv[4] ? 0 : 1, c->scale);
        st[0] = norm;
        if (p.iv[1] && !RX_FINITE(norm)) {
            st[1] += 1.0f;
            c->go = 0.0f;
            c->noskip = 0.0f;
            break;
        }
        if (p.iv[5]) {
            float coef = p.fv[0] / (norm + 1e-6f);
            if (coef < 1.0f) c->scale *= coef;
        }
        break;
    }
    default:
        if (c->go != 0.0f) st[3] = 1.0f;
    }
}
// Gradient accumulation: ptr0 g, ptr1 acc, ptr2 ctrl.
kernel void rlx_accumulate(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    device const RxCtrl* c = (device const RxCtrl*)p.ptr[2];
    if (c->go == 0.0f) return;
    F(1)[i] = c->micro == 0.0f ? F(0)[i] : F(1)[i] + F(0)[i];
}
// Buffer updates when the run was not skipped: ptr0 src, ptr1 dst, ptr2 ctrl.
kernel void rlx_copy_unless_skipped(constant P& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if ((long)i >= p.n) return;
    device const RxCtrl* c = (device const RxCtrl*)p.ptr[2];
    if (c->noskip == 0.0f) return;
    F(1)[i] = F(0)[i];
}
// The rules (0 sgd, 1 adam, 2 adamw, 3 rmsprop, 4 adagrad) of one parameter tensor: its
// settings from its hyper row h (the plan's hyper columns) and the run's control block.
struct RxUpd {
    float lr, wd, mom, nesterov, b1, b2, eps, alpha, c_alpha, c_damp, c1, c2, scale, bc1, ibc2, clr;
    int rule;
    bool first;
};
inline RxUpd rx_upd_settings(device const float* h, float scale, int step, bool first, int rule) {
    RxUpd u;
    u.lr = h[0];
    u.wd = h[1];
    u.mom = h[2];
    u.nesterov = h[4];
    u.b1 = h[5];
    u.b2 = h[6];
    u.eps = h[7];
    u.alpha = h[8];
    u.c_alpha = h[10];
    u.c_damp = h[11];
    u.c1 = h[12];
    u.c2 = h[13];
    u.scale = scale;
    u.rule = rule;
    u.first = first;
    float t = (float)(step > 1 ? step : 1);
    u.bc1 = 1.0f - pow(u.b1, t);
    u.ibc2 = 1.0f / sqrt(1.0f - pow(u.b2, t));
    u.clr = u.lr / (1.0f + (float)(step - 1) * h[9]);
    return u;
}
inline void rx_upd_one(thread const RxUpd& u, device float* w, device const float* g,
                       device float* s0, device float* s1, long i) {
    float pi = w[i];
    float gs = u.scale == 1.0f ? g[i] : g[i] * u.scale;
    if (u.rule == 1 || u.rule == 2) {
        bool adamw = u.rule == 2;
        float pd = pi * (adamw ? 1.0f - u.lr * u.wd : 1.0f);
        float gi = (adamw || u.wd == 0.0f) ? gs : gs + u.wd * pd;
        float mi = u.b1 * s0[i] + u.c1 * gi;
        float vi = u.b2 * s1[i] + u.c2 * gi * gi;
        s0[i] = mi;
        s1[i] = vi;
        w[i] = pd - (u.lr / u.bc1) * mi / (sqrt(vi) * u.ibc2 + u.eps);
        return;
    }
    float gi = u.wd != 0.0f ? gs + u.wd * pi : gs;
    if (u.rule == 0) {
        if (u.mom == 0.0f) {
            w[i] = pi - u.lr * gi;
            return;
        }
        float b = u.first ? gi : u.mom * s0[i] + u.c_damp * gi;
        s0[i] = b;
        float d = u.nesterov != 0.0f ? gi + u.mom * b : b;
        w[i] = pi - u.lr * d;
    } else if (u.rule == 3) {
        float sq = u.alpha * s0[i] + u.c_alpha * gi * gi;
        s0[i] = sq;
        float avg = sqrt(sq) + u.eps;
        if (u.mom > 0.0f) {
            float b = u.mom * s1[i] + gi / avg;
            s1[i] = b;
            w[i] = pi - u.lr * b;
        } else {
            w[i] = pi - u.lr * (gi / avg);
        }
    } else {
        float sq = s0[i] + gi * gi;
        s0[i] = sq;
        w[i] = pi - u.clr * (gi / (sqrt(sq) + u.eps));
    }
}
// Where a table word points: buffer (top 8 bits) base plus byte offset; all ones for none.
inline device char* rx_upd_at(constant P& p, ulong w) {
    if (w == ~0ul) return (device char*)0;
    return (device char*)p.ptr[w >> 56] + (w & ((1ul << 56) - 1));
}
// Every parameter tensor in one dispatch. ptr0..ptr5 the run's buffer bases, ptr6 the table,
// ptr7 ctrl; iv[0] rule, iv[1] tensors, iv[2] chunks, iv[3] elements a chunk. The table (u64
// words) holds 8 words a tensor -- where its parameter, gradient, state 0, state 1, step count,
// started flag and hyper row are, then its element count -- then one word a chunk:
// tensor << 40 | first element. RX_UPDATE_LANES threads a chunk (iv[2] * lanes threads).
kernel void rlx_update_multi(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    long k = (long)(t / RX_UPDATE_LANES);
    long lane = (long)(t % RX_UPDATE_LANES);
    if (k >= p.iv[2]) return;
    device const RxCtrl* c = (device const RxCtrl*)p.ptr[7];
    if (c->go == 0.0f) return;
    device const ulong* tab = (device const ulong*)p.ptr[6];
    ulong ch = tab[8 * p.iv[1] + k];
    device const ulong* d = tab + 8 * (ch >> 40);
    long start = (long)(ch & ((1ul << 40) - 1));
    long end = rx_lmin((long)d[7], start + p.iv[3]);
    bool first = d[5] != ~0ul && ((device const int*)rx_upd_at(p, d[5]))[0] == 0;
    int step = ((device const int*)rx_upd_at(p, d[4]))[0] + 1;
    RxUpd u = rx_upd_settings((device const float*)rx_upd_at(p, d[6]), c->scale, step, first,
                              (int)p.iv[0]);
    device float* w = (device float*)rx_upd_at(p, d[0]);
    device const float* g = (device const float*)rx_upd_at(p, d[1]);
    device float* s0 = (device float*)rx_upd_at(p, d[2]);
    device float* s1 = (device float*)rx_upd_at(p, d[3]);
    for (long i = start + lane; i < end; i += RX_UPDATE_LANES) rx_upd_one(u, w, g, s0, s1, i);
}
// One thread, up to 5 parameters: ptr0 ctrl; for i < iv[0]: ptr[1+3i] step, ptr[2+3i] started
// (or none), ptr[3+3i] hyper row. Counts the update and marks SGD momentum as started.
kernel void rlx_update_finish(constant P& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    if (t != 0) return;
    device const RxCtrl* c = (device const RxCtrl*)p.ptr[0];
    if (c->go == 0.0f) return;
    for (int i = 0; i < (int)p.iv[0]; ++i) {
        I(1 + 3 * i)[0] += 1;
        if (p.ptr[2 + 3 * i] != 0 && F(3 + 3 * i)[2] != 0.0f) I(2 + 3 * i)[0] = 1;
    }
}
