// The decode step's native matmul (see native.py): y = x @ W for a few rows of x.
//
// x float32 [R, in] (R <= 64), W packed in panels of 16 outputs, wp[p][i][j] = W[i, 16 p + j] (float32
// [ceil(out / 16), in, 16], zero past `out`), y float32 [R, out]. Each panel is read once, in order, and
// every row of x is multiplied with it while it is in registers: the weights stream from memory at the
// machine's bandwidth, which XLA:CPU's matmul and fusions do not reach at 1..16 rows (bench/README.md).
// The panels are split between the calling thread and one task on XLA's intra-op pool (in_two_halves).
// `JaxgptPack` makes the panels from a stored kernel once per generate call (XLA's transposes took ~0.3 s
// for GPT-2 124M's kernels on that machine). Past 16 rows (and on AVX2 CPUs, always) the rows are taken in
// blocks per panel, each block after the first reading the panel from cache.
//
// `JaxgptRowsMatmulInt8` is the same multiply over int8 panels of 64 outputs with a float scale per output
// (jaxgpt/quantize.py): each 16 weights are widened to float in registers, so the weights stream at a
// quarter of float32's bytes and x stays float32 (only the weights are rounded); the accumulators are
// scaled once at the end.
//
// `JaxgptRowsMatmulW8A8` multiplies the same int8 weights by int8 rows (quantize="w8a8"): each row of x is
// rounded to int8 with one scale (max |x| / 127, as quantize.quantize_rows), stored as unsigned bytes
// x + 128, and multiplied in integers: with AVX512-VNNI one vpdpbusd is 64 multiply-adds (16 outputs x 4
// inputs), against 16 for a float FMA on widened weights, which at 8 rows made the int8 kernel above
// compute-bound. The panels are 32 outputs wide and hold 4 consecutive inputs of each output together,
// wp[p][g][j][k] = q[4 g + k, 32 p + j], read as one stream (panels of 64 read in two passes of 32 each
// streamed strided and slower: bench/README.md, "int8 rows too"); the +128 comes out through
// corr[o] = 128 * sum_i q[i, o] (exact in int32).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"


// Panels [lo, hi), P at a time: P x R accumulators stay in registers for the whole `in` loop. With
// `scale` (int8 panels), output o of every row is multiplied by scale[o] at the end.
template <int R, int P, typename W>
static void panels(const float* x, int64_t in, const W* wp, const float* scale, int64_t out, float* y, int64_t lo,
                   int64_t hi) {
  for (int64_t p = lo; p < hi; p += P) {
    const int64_t np = hi - p < P ? hi - p : P;
    v16 acc[P][R];
    for (int k = 0; k < P; ++k)
      for (int r = 0; r < R; ++r) acc[k][r] = v16{};
    const W* w0 = wp + p * in * 16;
    for (int64_t i = 0; i < in; ++i) {
      v16 w[P];
      for (int k = 0; k < P; ++k)
        if (k < np) w[k] = weights16(w0 + (k * in + i) * 16);
      for (int r = 0; r < R; ++r) {
        const float xi = x[r * in + i];
        for (int k = 0; k < P; ++k)
          if (k < np) acc[k][r] += xi * w[k];
      }
    }
    for (int64_t k = 0; k < np; ++k) {
      const int64_t o = (p + k) * 16, n = out - o < 16 ? out - o : 16;
      if (scale != nullptr) {
        const v16 s = load16(scale + o);  // scale is padded to whole panels
        for (int r = 0; r < R; ++r) acc[k][r] *= s;
      }
      for (int r = 0; r < R; ++r) store_first(y + r * out + o, acc[k][r], n);
    }
  }
}

template <int R, typename W>
static void rows(const float* x, int64_t in, const W* wp, const float* scale, int64_t out, float* y, int64_t lo,
                 int64_t hi) {
  constexpr int P = R <= 2 ? 4 : (R <= 4 ? 3 : (R <= 8 ? 2 : 1));  // P * R + P registers of 32
  panels<R, P, W>(x, in, wp, scale, out, y, lo, hi);
}

template <typename W>
static void run(int64_t r, const float* x, int64_t in, const W* wp, const float* scale, int64_t out, float* y,
                int64_t lo, int64_t hi) {
  switch (r) {
#define JAXGPT_ROWS(n) \
  case n:              \
    return rows<n, W>(x, in, wp, scale, out, y, lo, hi);
    JAXGPT_ROWS(1) JAXGPT_ROWS(2) JAXGPT_ROWS(3) JAXGPT_ROWS(4) JAXGPT_ROWS(5) JAXGPT_ROWS(6) JAXGPT_ROWS(7)
    JAXGPT_ROWS(8) JAXGPT_ROWS(9) JAXGPT_ROWS(10) JAXGPT_ROWS(11) JAXGPT_ROWS(12) JAXGPT_ROWS(13)
    JAXGPT_ROWS(14) JAXGPT_ROWS(15) JAXGPT_ROWS(16)
#undef JAXGPT_ROWS
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXGPT_ROWS_AVX2 1
// AVX2 (16 registers of 8 floats; the generic forms above, in 16-float vectors, kept their accumulators on
// the stack there): a panel's 16 outputs are two registers, so the accumulators of up to 6 rows (12) stay in
// registers beside the panel's two weight vectors and a row's input; more rows in blocks of 6. Each output's
// sum runs in input order, one FMA an input, as the generic form's does: an AVX-512 build's bits.
// (Named accumulators: in an array GCC 12 stored all twelve to the stack on every input, 3x slower.)
#define JAXGPT_FMA_ROW(k)                                       \
  if constexpr (R > k) {                                        \
    const __m256 xi = _mm256_broadcast_ss(x + k * in + i);      \
    lo##k = _mm256_fmadd_ps(xi, wl, lo##k);                     \
    hi##k = _mm256_fmadd_ps(xi, wh, hi##k);                     \
  }
#define JAXGPT_STORE_ROW(k)                                     \
  if constexpr (R > k) {                                        \
    _mm256_store_ps(t, lo##k);                                  \
    _mm256_store_ps(t + 8, hi##k);                              \
    std::memcpy(y + k * out + o, t, n * sizeof(float));         \
  }
template <int R>
static void panel_avx2(const float* x, int64_t in, const float* w0, int64_t out, float* y, int64_t o) {
  __m256 lo0 = _mm256_setzero_ps(), lo1 = lo0, lo2 = lo0, lo3 = lo0, lo4 = lo0, lo5 = lo0;
  __m256 hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0;
  for (int64_t i = 0; i < in; ++i) {
    const __m256 wl = _mm256_loadu_ps(w0 + i * 16), wh = _mm256_loadu_ps(w0 + i * 16 + 8);
    JAXGPT_FMA_ROW(0) JAXGPT_FMA_ROW(1) JAXGPT_FMA_ROW(2) JAXGPT_FMA_ROW(3) JAXGPT_FMA_ROW(4) JAXGPT_FMA_ROW(5)
  }
  const int64_t n = out - o < 16 ? out - o : 16;
  alignas(32) float t[16];
  JAXGPT_STORE_ROW(0) JAXGPT_STORE_ROW(1) JAXGPT_STORE_ROW(2) JAXGPT_STORE_ROW(3) JAXGPT_STORE_ROW(4)
  JAXGPT_STORE_ROW(5)
}
#undef JAXGPT_FMA_ROW
#undef JAXGPT_STORE_ROW
#endif

// Panels [lo, hi) for any number of rows: in blocks of 16 per panel (6 with AVX2), so that a panel read from
// memory serves every block from cache.
static void run_float(int64_t r, const float* x, int64_t in, const float* wp, int64_t out, float* y, int64_t lo,
                      int64_t hi) {
#if defined(JAXGPT_ROWS_AVX2)
  for (int64_t p = lo; p < hi; ++p)
    for (int64_t b = 0; b < r; b += 6) {
      const float* xb = x + b * in;
      const float* w0 = wp + p * in * 16;
      float* yb = y + b * out;
      switch (r - b < 6 ? r - b : 6) {
        case 1: panel_avx2<1>(xb, in, w0, out, yb, p * 16); break;
        case 2: panel_avx2<2>(xb, in, w0, out, yb, p * 16); break;
        case 3: panel_avx2<3>(xb, in, w0, out, yb, p * 16); break;
        case 4: panel_avx2<4>(xb, in, w0, out, yb, p * 16); break;
        case 5: panel_avx2<5>(xb, in, w0, out, yb, p * 16); break;
        default: panel_avx2<6>(xb, in, w0, out, yb, p * 16); break;
      }
    }
#else
  if (r <= 16) return run<float>(r, x, in, wp, nullptr, out, y, lo, hi);
  for (int64_t p = lo; p < hi; ++p)
    for (int64_t b = 0; b < r; b += 16)
      run<float>(r - b < 16 ? r - b : 16, x + b * in, in, wp, nullptr, out, y + b * out, p, p + 1);
#endif
}

static ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != 16 || wd[1] != xd[1] || yd[0] != xd[0] ||
      (yd[1] + 15) / 16 != wd[0] || xd[0] < 1 || xd[0] > 64)
    return ffi::Error::InvalidArgument("jaxgpt_rows_matmul: x [R <= 64, in], panels [ceil(out/16), in, 16], y [R, out]");
  const int64_t r = xd[0], in = xd[1], out = yd[1];
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* yp = y->typed_data();
  in_two_halves(pool, wd[0], [=](int64_t lo, int64_t hi) { run_float(r, xp, in, w, out, yp, lo, hi); });
  return ffi::Error::Success();
}

// int8 panels are 64 outputs wide, wp[p][i][j] = q[i, 64 p + j]: each input's 64 weights of a panel are one
// cache line, read in one stream (in panels of 16, the four interleaved streams of a quarter line each
// measured slower). V vectors of 16 outputs are accumulated per pass over the inputs, V x R + V registers
// of 32: all 64 outputs in one pass up to 6 rows, in two passes (the second from L2) up to 14, else four.
template <int R, int V>
static void panels64(const float* x, int64_t in, const int8_t* wp, const float* scale, int64_t out, float* y,
                     int64_t lo, int64_t hi) {
  for (int64_t p = lo; p < hi; ++p) {
    const int8_t* w0 = wp + p * in * 64;
    for (int part = 0; part < 4; part += V) {
      if (p * 64 + part * 16 >= out) break;
      v16 acc[V][R];
      for (int v = 0; v < V; ++v)
        for (int r = 0; r < R; ++r) acc[v][r] = v16{};
      const int8_t* wq = w0 + part * 16;
      for (int64_t i = 0; i < in; ++i) {
        v16 w[V];
        for (int v = 0; v < V; ++v) w[v] = weights16(wq + i * 64 + v * 16);
        for (int r = 0; r < R; ++r) {
          const float xi = x[r * in + i];
          for (int v = 0; v < V; ++v) acc[v][r] += xi * w[v];
        }
      }
      for (int v = 0; v < V; ++v) {
        const int64_t o = p * 64 + (part + v) * 16, n = out - o < 16 ? out - o : 16;
        if (n <= 0) break;
        const v16 s = load16(scale + o);  // scale is padded to whole panels
        for (int r = 0; r < R; ++r) {
          const v16 yr = acc[v][r] * s;
          store_first(y + r * out + o, yr, n);
        }
      }
    }
  }
}

static void run_int8(int64_t r, const float* x, int64_t in, const int8_t* wp, const float* scale, int64_t out,
                     float* y, int64_t lo, int64_t hi) {
  switch (r) {
#define JAXGPT_ROWS8(n, v) \
  case n:                  \
    return panels64<n, v>(x, in, wp, scale, out, y, lo, hi);
    JAXGPT_ROWS8(1, 4) JAXGPT_ROWS8(2, 4) JAXGPT_ROWS8(3, 4) JAXGPT_ROWS8(4, 4) JAXGPT_ROWS8(5, 4)
    JAXGPT_ROWS8(6, 4) JAXGPT_ROWS8(7, 2) JAXGPT_ROWS8(8, 2) JAXGPT_ROWS8(9, 2) JAXGPT_ROWS8(10, 2)
    JAXGPT_ROWS8(11, 2) JAXGPT_ROWS8(12, 2) JAXGPT_ROWS8(13, 2) JAXGPT_ROWS8(14, 2) JAXGPT_ROWS8(15, 1)
    JAXGPT_ROWS8(16, 1)
#undef JAXGPT_ROWS8
  }
}

static ffi::Error RowsMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                                 ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 1 || yd.size() != 2 || wd[2] != 64 || wd[1] != xd[1] ||
      yd[0] != xd[0] || (yd[1] + 63) / 64 != wd[0] || sd[0] != wd[0] * 64 || xd[0] < 1 || xd[0] > 16)
    return ffi::Error::InvalidArgument(
        "jaxgpt_rows_matmul_int8: x [R <= 16, in], int8 panels [ceil(out/64), in, 64], scale [64 ceil(out/64)], "
        "y [R, out]");
  const int64_t r = xd[0], in = xd[1], out = yd[1];
  const float* xp = x.typed_data();
  const int8_t* w = wp.typed_data();
  const float* s = scale.typed_data();
  float* yp = y->typed_data();
  in_two_halves(pool, wd[0], [=](int64_t lo, int64_t hi) { run_int8(r, xp, in, w, s, out, yp, lo, hi); });
  return ffi::Error::Success();
}

// Sixteen outputs' int32 sums of four inputs each: acc[j] += sum_k x4[k] * w[4 j + k], x4 unsigned, w signed.
// (Without AVX512-VNNI the same integers, computed lane by lane.)
#if defined(__AVX512VNNI__)
typedef __m512i acc16;
static inline acc16 acc16_zero() { return _mm512_setzero_si512(); }
static inline acc16 load64(const int8_t* w) { return _mm512_loadu_si512(w); }
static inline acc16 dot4(acc16 acc, const uint8_t* x4, acc16 w) {
  int32_t b;
  std::memcpy(&b, x4, 4);
  // (as inline asm, accumulating in place: GCC 12 copied every accumulator through a second register, and
  // two through the stack, on each step of the intrinsic's loop)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(_mm512_set1_epi32(b)), "v"(w));
  return acc;
}
static inline i16v acc16_ints(acc16 a) { return (i16v)a; }
constexpr bool kSumsSigned = false;
#elif defined(__AVX2__)
// AVX2 without VNNI (AMD Zen 2 and 3, Intel before Ice Lake): a vpdpbusd in three instructions. As signed
// bytes (x ^ 0x80) the rows are x itself, |x| <= 127, and so are the weights (quantize clips them to 127):
// vpmaddubsw of |x| and the weights given x's sign adds pairs of products of at most 127 x 127, so never
// saturates, and vpmaddwd by ones adds the pairs. The sums are of x w, not (x + 128) w: corr is not taken
// off them (kSumsSigned), and the integers are the same.
struct acc16 {
  __m256i lo, hi;
};
static inline acc16 acc16_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline acc16 load64(const int8_t* w) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32))};
}
static inline acc16 dot4(acc16 acc, const uint8_t* x4, const acc16& w) {
  int32_t b;
  std::memcpy(&b, x4, 4);
  const __m256i x = _mm256_set1_epi32(b ^ int32_t(0x80808080u)), ax = _mm256_abs_epi8(x), one = _mm256_set1_epi16(1);
  acc.lo = _mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w.lo, x)), one));
  acc.hi = _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w.hi, x)), one));
  return acc;
}
static inline i16v acc16_ints(acc16 a) {
  i16v v;
  std::memcpy(&v, &a, sizeof v);
  return v;
}
constexpr bool kSumsSigned = true;
#else
typedef i16v acc16;
static inline acc16 acc16_zero() { return i16v{}; }
struct w64 {
  int8_t b[64];
};
static inline w64 load64(const int8_t* w) {
  w64 v;
  std::memcpy(v.b, w, 64);
  return v;
}
static inline acc16 dot4(acc16 acc, const uint8_t* x4, const w64& w) {
  for (int j = 0; j < 16; ++j)
    for (int k = 0; k < 4; ++k) acc[j] += int32_t(x4[k]) * int32_t(w.b[4 * j + k]);
  return acc;
}
static inline i16v acc16_ints(acc16 a) { return a; }
constexpr bool kSumsSigned = false;
#endif

// W8A8 panels [lo, hi) of 32 outputs (two vectors of 16) for R rows: 2 R accumulators and 2 weight vectors
// in registers, each panel's weights one contiguous stream (two panels at a time, two streams, measured
// slower at 1 row). xu holds the rows as bytes [R, 4 groups], xs their scales; scale and corr are per
// output (padded to whole panels).
#ifndef JAXGPT_W8A8_AHEAD
#define JAXGPT_W8A8_AHEAD 8  // groups (of 128 bytes) prefetched ahead of the hardware's prefetcher
#endif
template <int R>
static void panels_w8a8(const uint8_t* xu, const float* xs, int64_t groups, const int8_t* wp, const float* scale,
                        const int32_t* corr, int64_t out, float* y, int64_t lo, int64_t hi) {
  for (int64_t p = lo; p < hi; ++p) {
    acc16 acc[2][R];
    for (int v = 0; v < 2; ++v)
      for (int r = 0; r < R; ++r) acc[v][r] = acc16_zero();
    const int8_t* w0 = wp + p * groups * 128;
    for (int64_t g = 0; g < groups; ++g) {
      const auto w_lo = load64(w0 + g * 128), w_hi = load64(w0 + g * 128 + 64);
      __builtin_prefetch(w0 + (g + JAXGPT_W8A8_AHEAD) * 128);
      __builtin_prefetch(w0 + (g + JAXGPT_W8A8_AHEAD) * 128 + 64);
      for (int r = 0; r < R; ++r) {
        acc[0][r] = dot4(acc[0][r], xu + (r * groups + g) * 4, w_lo);
        acc[1][r] = dot4(acc[1][r], xu + (r * groups + g) * 4, w_hi);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const int64_t o = p * 32 + v * 16, n = out - o < 16 ? out - o : 16;
      if (n <= 0) break;
      i16v c{};
      if (!kSumsSigned) std::memcpy(&c, corr + o, sizeof c);
      const v16 s = load16(scale + o);
      for (int r = 0; r < R; ++r) {
        const v16 yr = __builtin_convertvector(acc16_ints(acc[v][r]) - c, v16) * (s * xs[r]);
        store_first(y + r * out + o, yr, n);
      }
    }
  }
}

// Up to 14 rows in one block; more (15 and 16 in a decode step, a prompt's chunk in a prefill) in blocks
// of W8A8_BLOCK rows per panel, each block after the first reading the panel from cache (a panel is 32 x
// `in` bytes: 24 KiB at 768 inputs, in L1).
#ifndef JAXGPT_W8A8_BLOCK
#define JAXGPT_W8A8_BLOCK 8
#endif
#ifndef JAXGPT_W8A8_ONE_BLOCK
#define JAXGPT_W8A8_ONE_BLOCK 14
#endif
static void block_w8a8(int64_t r, const uint8_t* xu, const float* xs, int64_t groups, const int8_t* wp,
                       const float* scale, const int32_t* corr, int64_t out, float* y, int64_t lo, int64_t hi) {
  switch (r) {
#define JAXGPT_ROWS8(n) \
  case n:               \
    return panels_w8a8<n>(xu, xs, groups, wp, scale, corr, out, y, lo, hi);
    JAXGPT_ROWS8(1) JAXGPT_ROWS8(2) JAXGPT_ROWS8(3) JAXGPT_ROWS8(4) JAXGPT_ROWS8(5) JAXGPT_ROWS8(6) JAXGPT_ROWS8(7)
    JAXGPT_ROWS8(8) JAXGPT_ROWS8(9) JAXGPT_ROWS8(10) JAXGPT_ROWS8(11) JAXGPT_ROWS8(12) JAXGPT_ROWS8(13)
    JAXGPT_ROWS8(14)
#undef JAXGPT_ROWS8
  }
}

// With AMX (Sapphire Rapids and later; `-march=native` defines __AMX_INT8__ there), blocks of 16 rows are
// multiplied in tiles: one tdpbusd is a [16 rows, 64 inputs] x [64 inputs, 16 outputs] product in int32,
// 16384 multiply-adds against a vpdpbusd's 64, so a prompt's chunk or a step of 32 decode rows is no longer
// bound by the multiply-adds. A weights tile is 16 groups of a panel's 32 x 4 bytes, half of each (its 16
// outputs), read in place (rows 128 bytes apart): the panels need no other layout. A rows tile is 16 rows
// of xu, 64 bytes each; xu has whole blocks of 32 rows (the last padded) and `groups` must be a multiple
// of 16 (64 inputs; GPT-2's 768 and 3072 are); otherwise, or under JAXGPT_AMX_MIN_ROWS rows, or where Linux
// refuses the tile state, or with JAXGPT_AMX=0 in the environment, the vpdpbusd kernel above runs. The
// int32 sums are the same integers either way and the scaling is the same float operations, so the two
// give the same bits.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define JAXGPT_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

#ifndef JAXGPT_AMX_MIN_ROWS
#define JAXGPT_AMX_MIN_ROWS 16
#endif

// Whether this process may use the tiles: Linux gives a process the tile state only when asked
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), once, for all its threads.
static bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("JAXGPT_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Palette 1, eight tiles of 16 rows x 64 bytes: 0-3 the sums (two blocks of rows x a panel's two halves),
// 4-5 the two blocks of rows, 6-7 the panel's two halves.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One tile of sums [16 rows][16 outputs] (its first `rows` rows real) scaled into y as panels_w8a8 does.
static void amx_scale(const int32_t* sums, int64_t rows, const float* xs, const float* scale, const int32_t* corr,
                      int64_t o, int64_t n, int64_t out, float* y) {
  i16v c;
  std::memcpy(&c, corr + o, sizeof c);
  const v16 s = load16(scale + o);
  for (int64_t r = 0; r < rows; ++r) {
    i16v a;
    std::memcpy(&a, sums + 16 * r, sizeof a);
    const v16 yr = __builtin_convertvector(a - c, v16) * (s * xs[r]);
    store_first(y + r * out + o, yr, n);
  }
}

// Blocks of 32 rows outside, panels inside: a block's rows (32 x `in` bytes, 24 KiB at 768 inputs) stay
// in L1 while the panels stream past them from L2, and each panel's sums are scaled into y as soon as they
// are whole. Past JAXGPT_AMX_SLAB groups of inputs (3072 inputs: 96 KiB of rows, more than L1) the inputs
// are taken in slabs, each panel's partial sums kept in `part` between them. With the panels outside (as
// before 2026-12-07) every panel read all the rows from L2: ~20% slower on GPT-2's shapes at 512 rows.
#ifndef JAXGPT_AMX_SLAB
#define JAXGPT_AMX_SLAB 192
#endif
static void panels_amx(int64_t r, const uint8_t* xu, const float* xs, int64_t groups, const int8_t* wp,
                       const float* scale, const int32_t* corr, int64_t out, float* y, int64_t lo, int64_t hi) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  const int64_t stride = groups * 4;
  alignas(64) int32_t sums[4][256];
  // (one block of rows, a decode step's, takes all the inputs at once: each panel then streams from memory in
  // one run, as the weights must)
  const int64_t slab = r > 32 ? JAXGPT_AMX_SLAB : groups;
  std::unique_ptr<int32_t[]> kept(groups > slab ? new int32_t[(hi - lo) * 1024 + 16] : nullptr);
  int32_t* part = kept ? kept.get() + (16 - reinterpret_cast<uintptr_t>(kept.get()) / 4 % 16) % 16 : nullptr;
  for (int64_t m = 0; m < r; m += 32) {
    const bool two = m + 16 < r;
    const uint8_t* a = xu + m * stride;
    for (int64_t k0 = 0; k0 < groups; k0 += slab) {
      const int64_t k1 = std::min<int64_t>(k0 + slab, groups);
      for (int64_t p = lo; p < hi; ++p) {
        const int8_t* w0 = wp + p * groups * 128;
        int32_t* c = part ? part + (p - lo) * 1024 : nullptr;  // (used only where there are slabs)
        if (k0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, 64);
          _tile_loadd(1, c + 256, 64);
          _tile_loadd(2, c + 512, 64);
          _tile_loadd(3, c + 768, 64);
        }
        for (int64_t g = k0; g < k1; g += 16) {
          _tile_loadd(6, w0 + g * 128, 128);
          _tile_loadd(7, w0 + g * 128 + 64, 128);
          _tile_loadd(4, a + g * 4, stride);
          _tile_dpbusd(0, 4, 6);
          _tile_dpbusd(1, 4, 7);
          if (two) {
            _tile_loadd(5, a + 16 * stride + g * 4, stride);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
          }
        }
        if (k1 < groups) {  // (a slab before the last: kept for the next)
          _tile_stored(0, c, 64);
          _tile_stored(1, c + 256, 64);
          _tile_stored(2, c + 512, 64);
          _tile_stored(3, c + 768, 64);
          continue;
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (two) {
          _tile_stored(2, sums[2], 64);
          _tile_stored(3, sums[3], 64);
        }
        for (int v = 0; v < 2; ++v) {
          const int64_t o = p * 32 + v * 16, n = out - o < 16 ? out - o : 16;
          if (n <= 0) break;
          amx_scale(sums[v], r - m < 16 ? r - m : 16, xs + m, scale, corr, o, n, out, y + m * out);
          if (two)
            amx_scale(sums[2 + v], r - m - 16 < 16 ? r - m - 16 : 16, xs + m + 16, scale, corr, o, n, out,
                      y + (m + 16) * out);
        }
      }
    }
  }
  _tile_release();
}

static bool use_amx(int64_t r, int64_t groups) { return r >= JAXGPT_AMX_MIN_ROWS && groups % 16 == 0 && amx_ready(); }
#define JAXGPT_W8A8_TILE_PROBE_ROWS JAXGPT_AMX_MIN_ROWS
#else
static bool use_amx(int64_t, int64_t) { return false; }
#define JAXGPT_W8A8_TILE_PROBE_ROWS 16
#endif

// Whether the w8a8 multiply runs on AMX tiles in this process (native.w8a8_tiles()).
extern "C" int jaxgpt_w8a8_tiles() { return use_amx(JAXGPT_W8A8_TILE_PROBE_ROWS, 16) ? 1 : 0; }

static void run_w8a8(int64_t r, const uint8_t* xu, const float* xs, int64_t groups, const int8_t* wp,
                     const float* scale, const int32_t* corr, int64_t out, float* y, int64_t lo, int64_t hi) {
#if defined(JAXGPT_HAVE_AMX)
  if (use_amx(r, groups)) return panels_amx(r, xu, xs, groups, wp, scale, corr, out, y, lo, hi);
#endif
  if (r <= JAXGPT_W8A8_ONE_BLOCK) return block_w8a8(r, xu, xs, groups, wp, scale, corr, out, y, lo, hi);
  const int64_t step = groups * 4;
  for (int64_t p = lo; p < hi; ++p)
    for (int64_t b = 0; b < r; b += JAXGPT_W8A8_BLOCK) {
      const int64_t n = r - b < JAXGPT_W8A8_BLOCK ? r - b : JAXGPT_W8A8_BLOCK;
      block_w8a8(n, xu + b * step, xs + b, groups, wp, scale, corr, out, y + b * out, p, p + 1);
    }
}

// A row of x rounded to int8 with its own scale s = max |x| / 127 (x / s to the nearest integer, halves to
// even), stored as bytes x + 128; inputs past `in` are 128 (zero weights). A row holding a NaN or an
// infinity (an overflowing row) is all 128 and its scale NaN or infinite: its products are NaN.
// Vectorized for AVX-512 and for AVX2 (16 and 8 lanes, the same bytes as the scalar loop, which divides
// each element; the figures are in bench/README.md).
static void round_row(const float* row, int64_t in, int64_t padded, uint8_t* d, float* xs) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (; k + 16 <= in; k += 16) {
    const __m512 v = _mm512_loadu_ps(row + k);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  amax = nan ? NAN : _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int nan = 0;
  for (; k + 8 <= in; k += 8) {
    const __m256 v = _mm256_loadu_ps(row + k);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, _mm256_and_ps(v, magnitude));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  amax = nan ? NAN : _mm_cvtss_f32(h);
#endif
  for (; k < in; ++k) {
    const float a = std::fabs(row[k]);
    amax = (a > amax || a != a) ? a : amax;
  }
  const float s = amax == 0.f ? 1.f : amax / 127.f;
  *xs = s;
  k = 0;
  if (!std::isfinite(amax)) {
    std::memset(d, 128, padded);
    return;
  }
#if defined(__AVX512F__)
  // x / s is a division (~10 cycles a vector); x * (1 / s) is within 2^-15 of it for |x / s| <= 127.0001, so
  // both round to the same integer unless x * (1 / s) lies within 2^-13 of a half: only such vectors (~0.2%
  // of them) are divided. The bytes are those of x / s (tests/test_quantize.py).
  const float s_inv = 1.f / s;
  const bool fast = std::isfinite(s_inv);  // (else a scale under 2^-128: every vector divided)
  const __m512 vs = _mm512_set1_ps(s), inv = _mm512_set1_ps(s_inv), lo = _mm512_set1_ps(-127.f),
               hi = _mm512_set1_ps(127.f), near = _mm512_set1_ps(0.5f - 0x1p-13f);
  for (; k + 16 <= in; k += 16) {
    const __m512 x = _mm512_loadu_ps(row + k), t = _mm512_mul_ps(x, inv);
    __m512 q = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 tie = fast ? _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, q)), near, _CMP_GT_OQ)
                               : __mmask16(0xffff);
    if (tie)
      q = _mm512_mask_roundscale_ps(q, tie, _mm512_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k), _mm512_cvtepi32_epi8(u));
  }
#elif defined(__AVX2__)
  // (the same rounding, 8 lanes at a time; `magnitude` from the maximum's loop above)
  const float s_inv = 1.f / s;
  const bool fast = std::isfinite(s_inv);
  const __m256 vs = _mm256_set1_ps(s), inv = _mm256_set1_ps(s_inv), lo = _mm256_set1_ps(-127.f),
               hi = _mm256_set1_ps(127.f), near = _mm256_set1_ps(0.5f - 0x1p-13f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; k + 8 <= in; k += 8) {
    const __m256 x = _mm256_loadu_ps(row + k), t = _mm256_mul_ps(x, inv);
    __m256 q = _mm256_round_ps(t, kNearest);
    const __m256 tie = fast ? _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(t, q), magnitude), near, _CMP_GT_OQ)
                            : _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    if (_mm256_movemask_ps(tie)) q = _mm256_blendv_ps(q, _mm256_round_ps(_mm256_div_ps(x, vs), kNearest), tie);
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    const __m256i u = _mm256_add_epi32(_mm256_cvtps_epi32(q), _mm256_set1_epi32(128));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(d + k), _mm_packus_epi16(w, w));
  }
#endif
  for (; k < in; ++k) {
    const float q = std::nearbyint(row[k] / s);
    d[k] = uint8_t(int32_t(q < -127.f ? -127.f : (q > 127.f ? 127.f : q)) + 128);
  }
  for (k = in; k < padded; ++k) d[k] = 128;
}

static ffi::Error RowsMatmulW8A8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> wp,
                                 ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> corr,
                                 ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), sd = scale.dimensions(), cd = corr.dimensions(),
             yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 1 || cd.size() != 1 || yd.size() != 2 || wd[2] != 128 ||
      wd[1] != (xd[1] + 3) / 4 || yd[0] != xd[0] || (yd[1] + 31) / 32 != wd[0] || sd[0] != wd[0] * 32 ||
      cd[0] != sd[0] || xd[0] < 1)
    return ffi::Error::InvalidArgument(
        "jaxgpt_rows_matmul_w8a8: x [R, in], int8 panels [ceil(out/32), ceil(in/4), 128], scale and corr "
        "[32 ceil(out/32)], y [R, out]");
  const int64_t r = xd[0], in = xd[1], groups = wd[1], out = yd[1];
  const float* xp = x.typed_data();
  // (whole blocks of 32 rows for the tiles: the padding rows' sums are computed and dropped)
  const int64_t padded_rows = use_amx(r, groups) ? (r + 31) / 32 * 32 : r;
  // (64-byte aligned: a tile's rows each one cache line; from new[], 16 bytes past a line, the tiles ran
  // ~35% slower)
  std::unique_ptr<uint8_t[]> bytes(new uint8_t[padded_rows * groups * 4 + 64]);
  uint8_t* xb = bytes.get() + (64 - reinterpret_cast<uintptr_t>(bytes.get()) % 64) % 64;
  if (padded_rows > r) std::memset(xb + r * groups * 4, 128, (padded_rows - r) * groups * 4);
  std::unique_ptr<float[]> row_scales(new float[r]);
  float* xsp = row_scales.get();
  if (r * in < (1 << 16))
    for (int64_t i = 0; i < r; ++i) round_row(xp + i * in, in, groups * 4, xb + i * groups * 4, xsp + i);
  else  // a prefill's rows: rounded by both threads
    in_two_halves(pool, r, [=](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) round_row(xp + i * in, in, groups * 4, xb + i * groups * 4, xsp + i);
    });
  const int8_t* w = wp.typed_data();
  const float* s = scale.typed_data();
  const int32_t* c = corr.typed_data();
  float* yp = y->typed_data();
  in_two_halves(pool, wd[0], [=](int64_t lo, int64_t hi) { run_w8a8(r, xb, xsp, groups, w, s, c, out, yp, lo, hi); });
  return ffi::Error::Success();
}

// Packs a kernel w [in, out] (or [out, in] with out_in) into panels wp [ceil(out/16), in, 16], zero past out.
static ffi::Error Pack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> wp, int32_t out_in) {
  const auto wd = w.dimensions(), pd = wp->dimensions();
  if (wd.size() != 2 || pd.size() != 3)
    return ffi::Error::InvalidArgument("jaxgpt_pack: w [in, out] (or [out, in]) -> panels [ceil(out/16), in, 16]");
  const int64_t in = out_in ? wd[1] : wd[0], out = out_in ? wd[0] : wd[1];
  if (pd[0] != (out + 15) / 16 || pd[1] != in || pd[2] != 16)
    return ffi::Error::InvalidArgument("jaxgpt_pack: w [in, out] (or [out, in]) -> panels [ceil(out/16), in, 16]");
  const float* src = w.typed_data();
  float* dst = wp->typed_data();
  const int64_t panels = pd[0];
  if (!out_in)  // rows of w read in order, each cut into its panels' 16-float pieces
    in_two_halves(pool, in, [=](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t o = p * 16, n = out - o < 16 ? out - o : 16;
          float* d = dst + (p * in + i) * 16;
          std::memcpy(d, src + i * out + o, n * sizeof(float));
          for (int64_t j = n; j < 16; ++j) d[j] = 0.f;
        }
    });
  else  // each panel's 16 rows of w (contiguous) transposed into it
    in_two_halves(pool, panels, [=](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t o = p * 16, n = out - o < 16 ? out - o : 16;
        float* d = dst + p * in * 16;
        for (int64_t i = 0; i < in; ++i) {
          for (int64_t j = 0; j < n; ++j) d[i * 16 + j] = src[(o + j) * in + i];
          for (int64_t j = n; j < 16; ++j) d[i * 16 + j] = 0.f;
        }
      }
    });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptPack, Pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("out_in"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptRowsMatmulInt8, RowsMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptRowsMatmulW8A8, RowsMatmulW8A8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
