// rlx-metal kernel library (MSL). Every kernel takes one launch record at buffer index 0 whose
// pointers are 64-bit GPU addresses of shared buffers (Metal 3; the encoder makes them resident
// with useResource:usage:), and is dispatched on a 1-D grid of exactly the threads it needs
// (bounds-checked anyway). No threadgroup memory or barriers: the host emulation runs thread
// indices one after another. The backend prepends the dialect's prelude (metal_stdlib or the host
// compat header); this text is shared by both.

// Element-wise binary op over n elements; op: 0 add, 1 sub, 2 mul, 3 div, 4 max, 5 min.
struct Binary {
    device float* out;
    device const float* a;
    device const float* b;
    uint n;
    uint op;
};

kernel void rlx_binary_f32(constant Binary& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if (i >= p.n) return;
    float x = p.a[i];
    float y = p.b[i];
    float r;
    switch (p.op) {
        case 0: r = x + y; break;
        case 1: r = x - y; break;
        case 2: r = x * y; break;
        case 3: r = x / y; break;
        case 4: r = max(x, y); break;
        default: r = min(x, y); break;
    }
    p.out[i] = r;
}

// Element-wise unary op; op: 0 neg, 1 relu, 2 exp, 3 tanh, 4 sigmoid, 5 sqrt, 6 abs.
struct Unary {
    device float* out;
    device const float* a;
    uint n;
    uint op;
};

kernel void rlx_unary_f32(constant Unary& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if (i >= p.n) return;
    float x = p.a[i];
    float r;
    switch (p.op) {
        case 0: r = -x; break;
        case 1: r = max(x, 0.0f); break;
        case 2: r = exp(x); break;
        case 3: r = tanh(x); break;
        case 4: r = 1.0f / (1.0f + exp(-x)); break;
        case 5: r = sqrt(x); break;
        default: r = fabs(x); break;
    }
    p.out[i] = r;
}

// out[i] = value for i < n.
struct Fill {
    device float* out;
    float value;
    uint n;
};

kernel void rlx_fill_f32(constant Fill& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if (i < p.n) p.out[i] = p.value;
}

// y[i] += alpha * x[i] (the in-place parameter update of plain SGD: alpha = -lr).
struct Axpy {
    device float* y;
    device const float* x;
    float alpha;
    uint n;
};

kernel void rlx_axpy_f32(constant Axpy& p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
    if (i < p.n) p.y[i] += p.alpha * p.x[i];
}

// C[m,n] = alpha * sum_k A[m,k] B[k,n] + beta * C[m,n], with element strides for every operand
// (so transposed operands are strides, not copies). Each thread computes a 4x4 register tile of C;
// the grid has ceil(m/4) * ceil(n/4) threads, tile (ti, tj) = (t / ceil(n/4), t % ceil(n/4)).
struct Gemm {
    device const float* a;
    device const float* b;
    device float* c;
    uint m;
    uint n;
    uint k;
    uint a_row;
    uint a_col;
    uint b_row;
    uint b_col;
    uint c_row;
    float alpha;
    float beta;
};

kernel void rlx_gemm_f32(constant Gemm& p [[buffer(0)]], uint t [[thread_position_in_grid]]) {
    uint tiles_n = (p.n + 3) / 4;
    uint i0 = (t / tiles_n) * 4;
    uint j0 = (t % tiles_n) * 4;
    if (i0 >= p.m) return;
    float acc[4][4];
    for (uint r = 0; r < 4; r++)
        for (uint c = 0; c < 4; c++) acc[r][c] = 0.0f;
    uint rows = min(4u, p.m - i0);
    uint cols = min(4u, p.n - j0);
    for (uint q = 0; q < p.k; q++) {
        float av[4];
        float bv[4];
        for (uint r = 0; r < 4; r++)
            av[r] = r < rows ? p.a[(ulong)(i0 + r) * p.a_row + (ulong)q * p.a_col] : 0.0f;
        for (uint c = 0; c < 4; c++)
            bv[c] = c < cols ? p.b[(ulong)q * p.b_row + (ulong)(j0 + c) * p.b_col] : 0.0f;
        for (uint r = 0; r < 4; r++)
            for (uint c = 0; c < 4; c++) acc[r][c] += av[r] * bv[c];
    }
    for (uint r = 0; r < rows; r++) {
        for (uint c = 0; c < cols; c++) {
            device float* dst = p.c + (ulong)(i0 + r) * p.c_row + (j0 + c);
            float prev = p.beta == 0.0f ? 0.0f : p.beta * *dst;
            *dst = p.alpha * acc[r][c] + prev;
        }
    }
}
