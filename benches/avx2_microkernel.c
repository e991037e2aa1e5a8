/* The AVX2 GEMM micro-kernel against the CPU's FMA throughput (issue 11): the 6 x 16 register
 * tile's inner loop as rlx's `crates/rlx-cpu/src/sgemm/avx2.rs` runs it (per depth index two
 * loads of packed B, six broadcasts of A, twelve FMAs), on operands that stay in L1; beside it the
 * same loop with A held in registers (twelve FMAs per two loads: the FMA ceiling of twelve
 * independent accumulators) and a 3 x 32 tile (seven loads per twelve FMAs). Where all three
 * agree, the tile runs at the FMA ceiling and the broadcasts cost nothing.
 *
 *     gcc -O3 -mavx2 -mfma -o /tmp/avx2_microkernel benches/avx2_microkernel.c && /tmp/avx2_microkernel
 *
 * One thread; GFLOP/s = 2 * 96 * KC per call / time. Results in BENCHMARKS.md. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define KC 256
static float A[KC * 8] __attribute__((aligned(64)));
static float B[KC * 32] __attribute__((aligned(64)));
static float C[12 * 8] __attribute__((aligned(64)));

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define F(acc, x, b) acc = _mm256_fmadd_ps(x, b, acc)
#define STORE12(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)                            \
  do {                                                                                        \
    __m256 r[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};                        \
    for (int i = 0; i < 12; i++) _mm256_store_ps(c + 8 * i, r[i]);                            \
  } while (0)

/* rlx's tile: 6 rows x 16 columns, A broadcast from the packed panel. */
__attribute__((noinline)) static void tile6x16(const float *a, const float *b, float *c) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int p = 0; p < KC; p++) {
    __m256 b0 = _mm256_load_ps(b + p * 16), b1 = _mm256_load_ps(b + p * 16 + 8), x;
    x = _mm256_broadcast_ss(a + p * 6 + 0); F(c00, x, b0); F(c01, x, b1);
    x = _mm256_broadcast_ss(a + p * 6 + 1); F(c10, x, b0); F(c11, x, b1);
    x = _mm256_broadcast_ss(a + p * 6 + 2); F(c20, x, b0); F(c21, x, b1);
    x = _mm256_broadcast_ss(a + p * 6 + 3); F(c30, x, b0); F(c31, x, b1);
    x = _mm256_broadcast_ss(a + p * 6 + 4); F(c40, x, b0); F(c41, x, b1);
    x = _mm256_broadcast_ss(a + p * 6 + 5); F(c50, x, b0); F(c51, x, b1);
  }
  STORE12(c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51);
}

/* The same loop with A held in registers: twelve FMAs per two loads (the FMA ceiling). */
__attribute__((noinline)) static void tile6x16_no_broadcast(const float *a, const float *b, float *c) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  __m256 x0 = _mm256_set1_ps(a[0]), x1 = _mm256_set1_ps(a[1]), x2 = _mm256_set1_ps(a[2]),
         x3 = _mm256_set1_ps(a[3]), x4 = _mm256_set1_ps(a[4]), x5 = _mm256_set1_ps(a[5]);
  for (int p = 0; p < KC; p++) {
    __m256 b0 = _mm256_load_ps(b + p * 16), b1 = _mm256_load_ps(b + p * 16 + 8);
    F(c00, x0, b0); F(c01, x0, b1); F(c10, x1, b0); F(c11, x1, b1); F(c20, x2, b0); F(c21, x2, b1);
    F(c30, x3, b0); F(c31, x3, b1); F(c40, x4, b0); F(c41, x4, b1); F(c50, x5, b0); F(c51, x5, b1);
  }
  STORE12(c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51);
}

/* 3 rows x 32 columns: four loads of B and three broadcasts per twelve FMAs. */
__attribute__((noinline)) static void tile3x32(const float *a, const float *b, float *c) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00,
         c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00;
  for (int p = 0; p < KC; p++) {
    __m256 b0 = _mm256_load_ps(b + p * 32), b1 = _mm256_load_ps(b + p * 32 + 8),
           b2 = _mm256_load_ps(b + p * 32 + 16), b3 = _mm256_load_ps(b + p * 32 + 24), x;
    x = _mm256_broadcast_ss(a + p * 3 + 0); F(c00, x, b0); F(c01, x, b1); F(c02, x, b2); F(c03, x, b3);
    x = _mm256_broadcast_ss(a + p * 3 + 1); F(c10, x, b0); F(c11, x, b1); F(c12, x, b2); F(c13, x, b3);
    x = _mm256_broadcast_ss(a + p * 3 + 2); F(c20, x, b0); F(c21, x, b1); F(c22, x, b2); F(c23, x, b3);
  }
  STORE12(c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23);
}

int main(void) {
  for (int i = 0; i < KC * 8; i++) A[i] = 1e-3f * (float)(i % 7);
  for (int i = 0; i < KC * 32; i++) B[i] = 1e-3f * (float)(i % 5);
  struct { const char *name; void (*f)(const float *, const float *, float *); } k[] = {
      {"6x16 (rlx's tile)", tile6x16}, {"6x16 without broadcasts", tile6x16_no_broadcast},
      {"3x32", tile3x32}};
  for (int round = 0; round < 3; round++)
    for (int i = 0; i < 3; i++) {
      const long calls = 300000;
      double t = now();
      for (long n = 0; n < calls; n++) k[i].f(A, B, C);
      t = now() - t;
      printf("%-26s %6.1f GFLOP/s\n", k[i].name, calls * 2.0 * 96 * KC / t * 1e-9);
    }
  return 0;
}
