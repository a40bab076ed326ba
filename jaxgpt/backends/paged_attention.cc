// Attention of a ragged step's queries over a paged KV cache (jaxgpt/paged.py), for the CPU backend.
//
// q [T, N H]; each layer's keys and values a pool [P, K, page, H] (float32, or int8 with a float32 scale per
// page, kv head and offset: [P, K, page]); token t's row token_rows[t] and limit limits[t]; each row's pages
// in order, block_tables [R, M]. Query t of head n sees its row's positions s < limits[t], position s in page
// block_tables[row][s / page] at offset s % page, of kv head n / (N / K); scores scaled by 1/sqrt(H), a
// softmax -> out [T, N H]. A query that sees nothing (limit 0: padding) gets zeros. Only the visible
// positions are read.
//
// The tokens are grouped by row (a stable counting sort), and each row's tokens cut into blocks of up to
// kBlock: one unit of work is (a block, a kv head), or, for a block of few queries (decode), the block with
// all its kv heads, so that a page's keys of every head are read as one run of memory. A unit walks its
// row's positions up to the block's largest limit a tile of kTile positions at a time; each tile's keys and
// values stay in L1 while every query of the block (its tokens times the kv head's N / K query heads) takes
// its scores, a running (online) softmax, and its weighted values from them: a prompt chunk's keys come from
// memory once per block, not once per token. A decode token is a block of one. Over an int8 pool a block of
// several queries first widens each tile into float32, its keys transposed (gather_tile), so that each
// query's scores take 16 positions in a few multiply-adds and no sums across a vector, four queries sharing
// each load (attend_gathered, Gathered); otherwise the pools
// are read in place, 16 positions' products summed across their vectors together (sums16). Units are taken
// in turns by the calling thread and a task on XLA's intra-op pool (in_turns, common.h). On CPUs with AVX2
// but not AVX-512 the innermost loops have forms of their own (JAXGPT_PAGED_AVX2, below).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXGPT_PAGED_AVX2 1  // (the AVX2 forms below)
#endif

namespace {

constexpr const char* kUsage =
    "jaxgpt_paged_attention(_int8): q [T, N H], k and v pools [P, K, page, H] (float32, or int8 with scales "
    "[P, K, page]), token_rows [T] int32, limits [T] int32, block_tables [R, M] int32 -> out [T, N H]; H a "
    "multiple of 16 up to 128, N a multiple of K";

// tokens of one row that share a walk over its keys: an int8 tile widened once serves them all (16 measured
// ~10% slower on a 512-token prompt step: its tiles were widened four times as often)
constexpr int64_t kBlock = 64;
constexpr int64_t kTile = 64;   // positions whose keys and values are read at once
// queries of a block from which an int8 pool's tile is first widened into float32 (gather_tile): float32
// tiles are read in place with AVX-512 (copying them measured no faster), gathered too with AVX2 only (their
// scores in place were the stack-bound loop; gathered, a 512-token prompt step's attention took 1/4 the time)
constexpr int64_t kGatherQueries = 4;
#if defined(JAXGPT_PAGED_AVX2)
constexpr bool kGatherFloat = true;
#else
constexpr bool kGatherFloat = false;
#endif

static inline float hsum(v16 x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
#endif
}

// The largest of x's first n lanes (n >= 1; all 16 from n = 16 on).
static inline float max_first(v16 x, int64_t n) {
#if defined(__AVX512F__)
  const __mmask16 lanes = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  return _mm512_mask_reduce_max_ps(lanes, reinterpret_cast<__m512>(x));
#else
  float m = -INFINITY;
  for (int i = 0; i < 16 && i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

// 16 floats loaded (a float32 pool's, or widened from an int8 pool's). (These named AVX-512 loads here
// first, before common.h's load16 and store16 were made the same: bench/README.md, "Named AVX-512 loads".)
static inline v16 load(const float* p) { return load16(p); }
static inline v16 load(const int8_t* p) { return weights16(p); }

static inline void store(float* p, v16 x) { store16(p, x); }

// AVX2 without AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP): a v16 is two of AVX2's 16 registers, so
// the loops below that hold 8 to 32 of them at once (a gathered tile's scores and weighted values for four
// queries, the 16 x 16 transpose, a decode tile's 16 positions) kept them on the stack: 3-4 G multiply-adds
// a second on a Zen 3 core. Their AVX2 forms (JAXGPT_PAGED_AVX2) hold at most 12 registers; a gathered
// tile's do each element's operations in the same order as the generic forms (the same bits). Figures:
// bench/README.md, "Paged attention on AVX2".
#if defined(JAXGPT_PAGED_AVX2)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// r[0..8) as an 8 x 8 matrix, transposed in registers.
static inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // (a0 b0 a1 b1 | a4 b4 a5 b5) and (a2 b2 a3 b3 | a6 b6 a7 b7)
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // (a0 b0 c0 d0 | a4 b4 c4 d4), then columns 1, 2, 3 likewise
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

template <typename E>
struct Pool {
  const E* k;
  const E* v;
  const float* k_scale;  // nullptr for float32 pools
  const float* v_scale;
  int64_t P, K, page;
};

struct Step {
  const float* q;
  const int32_t* limits;
  const int32_t* tables;
  int64_t N, M;
  float* out;
};

// One query's running softmax over the tiles seen so far.
template <int H>
struct alignas(64) Running {
  v16 o[H / 16] = {};
  float m = -INFINITY, l = 0.f;
};

// The running softmax of one query brought up to date with a tile's scores sc[0, count) (count >= 1; sc
// padded to a multiple of 16, turned into the tile's weights e^(score - max)); returns the factor that the
// values summed so far are to be multiplied by.
template <int H>
inline float update(Running<H>& r, float* sc, int64_t count, float mt) {
  const float m = std::max(r.m, mt);
  const float fade = std::isinf(r.m) ? 0.f : std::exp(r.m - m);
  v16 total{};
  for (int64_t s = 0; s < count; s += 16) {
    v16 e = exp_nonpositive(load(sc + s) - m);
    for (int i = 0; i < 16; ++i)
      if (s + i >= count) e[i] = 0.f;
    store(sc + s, e);
    total += e;
  }
  r.l = r.l * fade + hsum(total);
  r.m = m;
  return fade;
}

// Two vectors' lanes halved into one: chunks of W lanes taken from x and y in turns, each chunk the sum of
// a chunk of 2 W lanes' two halves (lo and hi pick them; W = 8, 4, 2, 1).
template <int W>
inline v16 fold(v16 x, v16 y) {
  typedef int32_t i16 __attribute__((vector_size(64)));
  static_assert(W == 8 || W == 4 || W == 2 || W == 1, "W: 8, 4, 2 or 1");
  constexpr i16 lo = W == 8   ? i16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
                     : W == 4 ? i16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
                     : W == 2 ? i16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
                              : i16{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, lo + W);
}

// Lane s: the sum of a[s]'s 16 lanes. Four rounds of folds, 15 adds and 30 shuffles for the 16 sums, where
// summing each vector across its lanes alone took about ten dependent instructions apiece.
inline v16 sums16(v16* a) {
  for (int i = 0; i < 8; ++i) a[i] = fold<8>(a[i], a[i + 8]);
  for (int i = 0; i < 4; ++i) a[i] = fold<4>(a[i], a[i + 4]);
  for (int i = 0; i < 2; ++i) a[i] = fold<2>(a[i], a[i + 2]);
  return fold<1>(a[0], a[1]);
}

#if defined(JAXGPT_PAGED_AVX2)
// Lane s: the sum of a[s]'s 8 lanes (six horizontal adds, two lane swaps, one add).
static inline __m256 sums8(const __m256* a) {
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // a0..a3 per half
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// o[0, 8 N) faded, then plus each position's weight times its value's dimensions [c, c + 8 N): N vectors in
// registers over the tile.
template <int N, int H, typename E>
inline void weigh(float* o, float fade, const float* sc, int64_t count, const int64_t* at, const Pool<E>& p, int c) {
  __m256 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm256_mul_ps(load8(o + 8 * i), _mm256_set1_ps(fade));
  for (int64_t s = 0; s < count; ++s) {
    const __m256 w = _mm256_set1_ps(p.v_scale ? sc[s] * p.v_scale[at[s]] : sc[s]);
    const E* vs = p.v + at[s] * H + c;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(w, load8(vs + 8 * i), acc[i]);
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

// Query (token, head) qn over one tile of positions [0, count) read in place from the pools (at[s]: position
// s's vector), for blocks of few queries (decode); the AVX2 form: 8 positions' products at a time, each
// position's in one vector, the 8 vectors summed across together (sums8); the values weighed 64 dimensions
// at a time, each in its own register (8 chains of multiply-adds). Its sums are in another order than the
// AVX-512 form's (below), so its bits differ from those of an AVX-512 build.
template <int H, typename E>
void attend_tile(const float* qn, Running<H>& r, int64_t count, const int64_t* at, const Pool<E>& p,
                 float* sc) {
  constexpr int NV = H / 8;
  const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(static_cast<float>(H)));
  alignas(32) float qs[H];
  for (int i = 0; i < NV; ++i) _mm256_store_ps(qs + 8 * i, _mm256_mul_ps(load8(qn + 8 * i), scale));
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (int64_t s0 = 0; s0 < count; s0 += 8) {
    const int64_t m = std::min<int64_t>(8, count - s0);
    __m256 part[8];
    for (int s = 0; s < 8; ++s) {
      if (s >= m) {
        part[s] = _mm256_setzero_ps();
        continue;
      }
      const E* ks = p.k + at[s0 + s] * H;
      __m256 acc = _mm256_mul_ps(_mm256_load_ps(qs), load8(ks));
#pragma GCC unroll 16
      for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(_mm256_load_ps(qs + 8 * i), load8(ks + 8 * i), acc);
      part[s] = acc;
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sums8(part));
    for (int s = 0; s < 8; ++s)
      sums[s] = s >= m ? -INFINITY : p.k_scale ? sums[s] * p.k_scale[at[s0 + s]] : sums[s];
    const __m256 v = _mm256_load_ps(sums);
    _mm256_storeu_ps(sc + s0, v);
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float most[8];
  _mm256_store_ps(most, best);
  const float mt = *std::max_element(most, most + 8);
  const float fade = update<H>(r, sc, count, mt);
  float* o = reinterpret_cast<float*>(r.o);
  if constexpr (H <= 64) {
    weigh<H / 8, H>(o, fade, sc, count, at, p, 0);
  } else {
    weigh<8, H>(o, fade, sc, count, at, p, 0);
    weigh<(H - 64) / 8, H>(o + 64, fade, sc, count, at, p, 64);
  }
}
#else
// Query (token, head) qn over one tile of positions [0, count) read in place from the pools (at[s]: position
// s's vector): 16 positions' products at a time, summed across their vectors together (sums16). For blocks
// of few queries (decode). The values are summed into two sets of accumulators, even and odd positions, so
// that each multiply-add waits on the one two positions back.
template <int H, typename E>
void attend_tile(const float* qn, Running<H>& r, int64_t count, const int64_t* at, const Pool<E>& p,
                 float* sc) {
  constexpr int NV = H / 16;
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  v16 qv[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) qv[i] = load(qn + 16 * i) * scale;
  v16 best = splat(-INFINITY);
  for (int64_t s0 = 0; s0 < count; s0 += 16) {
    const int64_t m = std::min<int64_t>(16, count - s0);
    v16 part[16];
    for (int s = 0; s < 16; ++s) {
      if (s >= m) {
        part[s] = v16{};
        continue;
      }
      const E* ks = p.k + at[s0 + s] * H;
      v16 acc = qv[0] * load(ks);
#pragma GCC unroll 8
      for (int i = 1; i < NV; ++i) acc += qv[i] * load(ks + 16 * i);
      part[s] = acc;
    }
    v16 sums = sums16(part);
    if (p.k_scale)
      for (int s = 0; s < m; ++s) sums[s] *= p.k_scale[at[s0 + s]];
    for (int s = m; s < 16; ++s) sums[s] = -INFINITY;
    store(sc + s0, sums);
    best = best > sums ? best : sums;
  }
  float mt = -INFINITY;
  for (int i = 0; i < 16; ++i) mt = std::max(mt, best[i]);
  const float fade = update<H>(r, sc, count, mt);
  v16 o[2][NV];  // (in registers over the tile)
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) o[0][i] = r.o[i] * fade, o[1][i] = v16{};
  int64_t s = 0;
  for (; s + 2 <= count; s += 2)
    for (int e = 0; e < 2; ++e) {
      const v16 w = splat(p.v_scale ? sc[s + e] * p.v_scale[at[s + e]] : sc[s + e]);
      const E* vs = p.v + at[s + e] * H;
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) o[e][i] += w * load(vs + 16 * i);
    }
  if (s < count) {
    const v16 w = splat(p.v_scale ? sc[s] * p.v_scale[at[s]] : sc[s]);
    const E* vs = p.v + at[s] * H;
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) o[0][i] += w * load(vs + 16 * i);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) r.o[i] = o[0][i] + o[1][i];
}
#endif

// r[0..16) as a 16 x 16 matrix, transposed in registers: four rounds, each swapping the off-diagonal
// blocks of size d within every 2d x 2d block (d = 8, 4, 2, 1).
template <int D>
inline void swap_blocks(v16* r) {
  typedef int32_t i16 __attribute__((vector_size(64)));
  constexpr i16 lo = {(0 & D) ? 16 + 0 - D : 0,    (1 & D) ? 16 + 1 - D : 1,    (2 & D) ? 16 + 2 - D : 2,
                      (3 & D) ? 16 + 3 - D : 3,    (4 & D) ? 16 + 4 - D : 4,    (5 & D) ? 16 + 5 - D : 5,
                      (6 & D) ? 16 + 6 - D : 6,    (7 & D) ? 16 + 7 - D : 7,    (8 & D) ? 16 + 8 - D : 8,
                      (9 & D) ? 16 + 9 - D : 9,    (10 & D) ? 16 + 10 - D : 10, (11 & D) ? 16 + 11 - D : 11,
                      (12 & D) ? 16 + 12 - D : 12, (13 & D) ? 16 + 13 - D : 13, (14 & D) ? 16 + 14 - D : 14,
                      (15 & D) ? 16 + 15 - D : 15};
  constexpr i16 hi = {(0 & D) ? 16 : D,      (1 & D) ? 17 : 1 + D,   (2 & D) ? 18 : 2 + D,   (3 & D) ? 19 : 3 + D,
                      (4 & D) ? 20 : 4 + D,  (5 & D) ? 21 : 5 + D,   (6 & D) ? 22 : 6 + D,   (7 & D) ? 23 : 7 + D,
                      (8 & D) ? 24 : 8 + D,  (9 & D) ? 25 : 9 + D,   (10 & D) ? 26 : 10 + D, (11 & D) ? 27 : 11 + D,
                      (12 & D) ? 28 : 12 + D, (13 & D) ? 29 : 13 + D, (14 & D) ? 30 : 14 + D, (15 & D) ? 31 : 15 + D};
  for (int i = 0; i < 16; ++i)
    if (!(i & D)) {
      const v16 a = r[i], b = r[i + D];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + D] = __builtin_shuffle(a, b, hi);
    }
}

inline void transpose16(v16* r) {
  swap_blocks<8>(r);
  swap_blocks<4>(r);
  swap_blocks<2>(r);
  swap_blocks<1>(r);
}

// The tile's keys transposed, kt [H][kTile] (scaled; zero past the tile), and values vt [kTile][H]
// (scaled), as float32: copied once for a block of many queries, whose scores then take 16 positions at a
// time with no sums across a vector.
template <int H, typename E>
void gather_tile(int64_t span, const int64_t* at, const Pool<E>& p, float* kt, float* vt) {
#if defined(JAXGPT_PAGED_AVX2)
  for (int64_t s = 0; s < span; ++s) {
    const E* vs = p.v + at[s] * H;
    const __m256 vscale = _mm256_set1_ps(p.v_scale ? p.v_scale[at[s]] : 1.f);
    for (int i = 0; i < H / 8; ++i) _mm256_storeu_ps(vt + s * H + 8 * i, _mm256_mul_ps(load8(vs + 8 * i), vscale));
  }
  for (int64_t c = 0; c < kTile / 8; ++c)  // 8 positions by 8 of the head's dimensions at a time
    for (int i = 0; i < H / 8; ++i) {
      __m256 r[8];
      for (int64_t s = 0; s < 8; ++s) {
        const int64_t pos = 8 * c + s;
        r[s] = pos < span ? _mm256_mul_ps(load8(p.k + at[pos] * H + 8 * i),
                                          _mm256_set1_ps(p.k_scale ? p.k_scale[at[pos]] : 1.f))
                          : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kt + (8 * i + d) * kTile + 8 * c, r[d]);
    }
#else
  for (int64_t s = 0; s < span; ++s) {
    const E* vs = p.v + at[s] * H;
    const float vscale = p.v_scale ? p.v_scale[at[s]] : 1.f;
#pragma GCC unroll 8
    for (int i = 0; i < H / 16; ++i) store(vt + s * H + 16 * i, load(vs + 16 * i) * vscale);
  }
  for (int64_t c = 0; c < kTile / 16; ++c)
    for (int i = 0; i < H / 16; ++i) {
      v16 r[16];
      for (int64_t s = 0; s < 16; ++s) {
        const int64_t pos = 16 * c + s;
        r[s] = pos < span ? load(p.k + at[pos] * H + 16 * i) * (p.k_scale ? p.k_scale[at[pos]] : 1.f) : v16{};
      }
      transpose16(r);
      for (int d = 0; d < 16; ++d) store(kt + (16 * i + d) * kTile + 16 * c, r[d]);
    }
#endif
}

// As attend_tile, over a tile copied by gather_tile, for Q queries at once (query q seeing its first
// counts[q] positions): each key and value loaded serves all Q. Each query's operations are the same, in the
// same order, whatever Q: past its own count a query's weights are zeros, and adding zero times a value
// leaves its sums as they were (an int8 pool's values are never -0), so its bits are those of Q = 1.
// Scores of Q queries (scaled: qsc) over the first U groups of 16 positions of a gathered tile, into acc.
template <int H, int Q, int U>
inline void scores(const float (*qsc)[H], const float* kt, v16 (*acc)[kTile / 16]) {
#if defined(JAXGPT_PAGED_AVX2)
  for (int c = 0; c < U; ++c) {  // a group of 16 positions (two vectors) for the Q queries: 2 Q sums
    __m256 a[Q][2];
    for (int q = 0; q < Q; ++q) a[q][0] = a[q][1] = _mm256_setzero_ps();
    for (int h = 0; h < H; ++h) {
      const __m256 k0 = load8(kt + h * kTile + 16 * c), k1 = load8(kt + h * kTile + 16 * c + 8);
      for (int q = 0; q < Q; ++q) {
        const __m256 x = _mm256_broadcast_ss(&qsc[q][h]);
        a[q][0] = _mm256_fmadd_ps(x, k0, a[q][0]);
        a[q][1] = _mm256_fmadd_ps(x, k1, a[q][1]);
      }
    }
    for (int q = 0; q < Q; ++q) {
      std::memcpy(&acc[q][c], &a[q][0], 32);
      std::memcpy(reinterpret_cast<char*>(&acc[q][c]) + 32, &a[q][1], 32);
    }
  }
#else
  for (int h = 0; h < H; ++h) {
    v16 qh[Q];
    for (int q = 0; q < Q; ++q) qh[q] = splat(qsc[q][h]);
#pragma GCC unroll 4
    for (int c = 0; c < U; ++c) {
      const v16 k = load(kt + h * kTile + 16 * c);
      for (int q = 0; q < Q; ++q) acc[q][c] += qh[q] * k;
    }
  }
#endif
}

template <int H, int Q>
void attend_gathered(const float* const* qs, Running<H>* const* rs, const int64_t* counts, const float* kt,
                     const float* vt, float* sc) {
  constexpr int NV = H / 16, G = kTile / 16;
  static_assert(G == 4, "scores' cases below are kTile / 16 = 4 groups");
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  int64_t most = 0;
  float fade[Q];
  for (int q = 0; q < Q; ++q) most = std::max(most, counts[q]);
  // the queries scaled once (the same products as scaling each element where it is used), then the scores
  // of the groups of 16 positions that some query sees: a tile on the diagonal computes no group past them
  // (a fixed count per case keeps acc in registers; the groups skipped stay zero, as kt is past the tile)
  alignas(64) float qsc[Q][H];
  for (int q = 0; q < Q; ++q)
    for (int i = 0; i < NV; ++i) store(qsc[q] + 16 * i, load(qs[q] + 16 * i) * scale);
  v16 acc[Q][G] = {};
  switch ((most + 15) / 16) {
    case 1: scores<H, Q, 1>(qsc, kt, acc); break;
    case 2: scores<H, Q, 2>(qsc, kt, acc); break;
    case 3: scores<H, Q, 3>(qsc, kt, acc); break;
    default: scores<H, Q, G>(qsc, kt, acc); break;
  }
  for (int q = 0; q < Q; ++q) {
    float* sq = sc + q * kTile;
    float mt = -INFINITY;
    for (int c = 0; c < G; ++c) {
      store(sq + 16 * c, acc[q][c]);
      if (16 * c < counts[q]) mt = std::max(mt, max_first(acc[q][c], counts[q] - 16 * c));
    }
    fade[q] = update<H>(*rs[q], sq, counts[q], mt);
    std::fill(sq + counts[q], sq + most, 0.f);
  }
#if defined(JAXGPT_PAGED_AVX2)
  for (int i = 0; i < NV; ++i) {  // 16 of the head's dimensions (two vectors) for the Q queries at a time
    __m256 o[Q][2];
    for (int q = 0; q < Q; ++q) {
      float* r = reinterpret_cast<float*>(&rs[q]->o[i]);
      o[q][0] = _mm256_mul_ps(load8(r), _mm256_set1_ps(fade[q]));
      o[q][1] = _mm256_mul_ps(load8(r + 8), _mm256_set1_ps(fade[q]));
    }
    for (int64_t s = 0; s < most; ++s) {
      const __m256 v0 = load8(vt + s * H + 16 * i), v1 = load8(vt + s * H + 16 * i + 8);
      for (int q = 0; q < Q; ++q) {
        const __m256 w = _mm256_broadcast_ss(sc + q * kTile + s);
        o[q][0] = _mm256_fmadd_ps(w, v0, o[q][0]);
        o[q][1] = _mm256_fmadd_ps(w, v1, o[q][1]);
      }
    }
    for (int q = 0; q < Q; ++q) {
      float* r = reinterpret_cast<float*>(&rs[q]->o[i]);
      _mm256_storeu_ps(r, o[q][0]);
      _mm256_storeu_ps(r + 8, o[q][1]);
    }
  }
#else
  v16 o[Q][NV];
  for (int q = 0; q < Q; ++q)
    for (int i = 0; i < NV; ++i) o[q][i] = rs[q]->o[i] * fade[q];
  for (int64_t s = 0; s < most; ++s) {
    v16 w[Q];
    for (int q = 0; q < Q; ++q) w[q] = splat(sc[q * kTile + s]);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const v16 v = load(vt + s * H + 16 * i);
      for (int q = 0; q < Q; ++q) o[q][i] += w[q] * v;
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int i = 0; i < NV; ++i) rs[q]->o[i] = o[q][i];
#endif
}

// A gathered tile's queries four at a time (a block's last one to three one at a time).
template <int H>
struct Gathered {
  const float* kt;
  const float* vt;
  float* sc;
  const float* qs[4];
  Running<H>* rs[4];
  int64_t counts[4];
  int n = 0;

  void add(const float* qn, Running<H>* r, int64_t count) {
    qs[n] = qn, rs[n] = r, counts[n] = count;
    if (++n == 4) flush();
  }
  void flush() {
    if (n == 4)
      attend_gathered<H, 4>(qs, rs, counts, kt, vt, sc);
    else
      for (int q = 0; q < n; ++q) attend_gathered<H, 1>(qs + q, rs + q, counts + q, kt, vt, sc);
    n = 0;
  }
};

// The unit (tokens toks[0..n), all of row `row`; kv heads [j0, j1)). A block of few queries (decode) takes
// all its row's kv heads in one unit, tile by tile: a page's keys of every head lie together ([P, K, page,
// H]), so the unit reads each page's keys, then its values, as one run of K x page x H values instead of K
// runs of page x H apart in time (short runs that the hardware's prefetcher does not follow).
template <int H, typename E>
void unit(const int32_t* toks, int64_t n, int64_t row, int64_t j0, int64_t j1, const Pool<E>& p, const Step& st,
          std::vector<Running<H>>& run, float* sc, float* kt, float* vt) {
  const int64_t g = st.N / p.K;
  const int64_t cap = st.M * p.page;
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) most = std::max<int64_t>(most, std::min<int64_t>(st.limits[toks[i]], cap));
  run.assign(static_cast<size_t>((j1 - j0) * n * g), Running<H>{});
  const int32_t* table = st.tables + row * st.M;
  const bool gathered = (std::is_same<E, int8_t>::value || kGatherFloat) && n * g >= kGatherQueries;
  int64_t first[kTile], at[kTile];  // each position's index in the pools' [P K page] vectors: head 0, head j
  for (int64_t t0 = 0; t0 < most; t0 += kTile) {
    const int64_t span = std::min(kTile, most - t0);
    for (int64_t s = 0; s < span; ++s) {
      const int64_t pos = t0 + s;
      const int64_t page = std::clamp<int64_t>(table[pos / p.page], 0, p.P - 1);
      first[s] = page * p.K * p.page + pos % p.page;
    }
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t s = 0; s < span; ++s) at[s] = first[s] + j * p.page;
      if (gathered) gather_tile<H>(span, at, p, kt, vt);
      Gathered<H> batch{kt, vt, sc};
      for (int64_t i = 0; i < n; ++i) {
        const int64_t count = std::min<int64_t>(std::min<int64_t>(st.limits[toks[i]], cap) - t0, span);
        if (count <= 0) continue;
        for (int64_t h = 0; h < g; ++h) {
          const float* qn = st.q + (toks[i] * st.N + j * g + h) * H;
          Running<H>& r = run[((j - j0) * n + i) * g + h];
          if (gathered)
            batch.add(qn, &r, count);
          else
            attend_tile<H>(qn, r, count, at, p, sc);
        }
      }
      batch.flush();
    }
  }
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < g; ++h) {
        const Running<H>& r = run[((j - j0) * n + i) * g + h];
        float* on = st.out + (toks[i] * st.N + j * g + h) * H;
        const float inv = r.l > 0.f ? 1.f / r.l : 0.f;
        for (int v = 0; v < H / 16; ++v) store(on + 16 * v, r.o[v] * inv);
      }
}

template <typename F>
bool with_head_dim(int64_t h, F f) {
  switch (h) {
    case 16: f(std::integral_constant<int, 16>{}); return true;
    case 32: f(std::integral_constant<int, 32>{}); return true;
    case 48: f(std::integral_constant<int, 48>{}); return true;
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 80: f(std::integral_constant<int, 80>{}); return true;
    case 96: f(std::integral_constant<int, 96>{}); return true;
    case 112: f(std::integral_constant<int, 112>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    default: return false;
  }
}

// The step's tokens that see something, grouped by row in their order (a stable counting sort), and the
// blocks they are cut into: block b is order[starts[b] .. starts[b + 1]) of row rows[b].
struct Blocks {
  std::vector<int32_t> order, starts, rows;
};

Blocks make_blocks(const int32_t* token_rows, const int32_t* limits, int64_t T, int64_t R) {
  Blocks b;
  std::vector<int32_t> first(static_cast<size_t>(R + 1), 0);
  auto row_of = [&](int64_t t) { return std::clamp<int64_t>(token_rows[t], 0, R - 1); };
  for (int64_t t = 0; t < T; ++t)
    if (limits[t] > 0) ++first[row_of(t) + 1];
  for (int64_t r = 0; r < R; ++r) first[r + 1] += first[r];
  b.order.resize(first[R]);
  std::vector<int32_t> fill(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (limits[t] > 0) b.order[fill[row_of(t)]++] = static_cast<int32_t>(t);
  for (int64_t r = 0; r < R; ++r)
    for (int32_t s = first[r]; s < first[r + 1]; s += kBlock) {
      b.starts.push_back(s);
      b.rows.push_back(static_cast<int32_t>(r));
    }
  b.starts.push_back(first[R]);
  return b;
}

}  // namespace

// The checks, the zeros of the tokens that see nothing and the split into units, for both entry points.
template <typename E>
static ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, const ffi::Span<const int64_t>& kd,
                      const ffi::Span<const int64_t>& vd, Pool<E> p, ffi::Buffer<ffi::S32>& token_rows,
                      ffi::Buffer<ffi::S32>& limits, ffi::Buffer<ffi::S32>& tables, ffi::ResultBuffer<ffi::F32>& out) {
  const auto qd = q.dimensions(), bd = tables.dimensions();
  if (qd.size() != 2 || kd.size() != 4 || bd.size() != 2 || token_rows.dimensions().size() != 1 ||
      limits.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(kUsage);
  const int64_t T = qd[0], P = kd[0], K = kd[1], page = kd[2], H = kd[3], R = bd[0], M = bd[1];
  if (H < 1 || K < 1 || qd[1] % H != 0) return ffi::Error::InvalidArgument(kUsage);
  const int64_t N = qd[1] / H;
  if (N % K != 0 || P < 1 || page < 1 || R < 1 || M < 1 || vd.size() != 4 || vd[0] != P || vd[1] != K ||
      vd[2] != page || vd[3] != H || token_rows.dimensions()[0] != T || limits.dimensions()[0] != T ||
      out->element_count() != static_cast<size_t>(T * N * H))
    return ffi::Error::InvalidArgument(kUsage);
  p.P = P, p.K = K, p.page = page;
  const int32_t* lp = limits.typed_data();
  const Step st{q.typed_data(), lp, tables.typed_data(), N, M, out->typed_data()};
  for (int64_t t = 0; t < T; ++t)
    if (lp[t] <= 0) std::fill(st.out + t * N * H, st.out + (t + 1) * N * H, 0.f);
  const Blocks blocks = make_blocks(token_rows.typed_data(), lp, T, R);
  // the units: (block, first kv head, last + 1), a block of few queries all its heads at once (unit)
  std::vector<int64_t> work;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(blocks.starts.size()); ++b) {
    const int64_t queries = (blocks.starts[b + 1] - blocks.starts[b]) * (N / K);
    for (int64_t j = 0; j < K; j = queries < kGatherQueries ? K : j + 1)
      work.insert(work.end(), {b, j, queries < kGatherQueries ? K : j + 1});
  }
  const int64_t units = static_cast<int64_t>(work.size()) / 3;
  const Blocks* bp = &blocks;
  const int64_t* wk = work.data();
  const bool ok = with_head_dim(H, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    if (units == 0) return;
    in_turns(pool, units, [=](auto next) {
      std::vector<Running<HD>> run;
      alignas(64) float sc[4 * kTile] = {};  // (zeroed: a short tile's tail lanes are loaded, then masked)
      std::vector<float> kt(static_cast<size_t>(HD * kTile)), vt(static_cast<size_t>(HD * kTile));
      for (int64_t u = next(); u < units; u = next()) {
        const int64_t b = wk[3 * u];
        const int32_t lo = bp->starts[b], hi = bp->starts[b + 1];
        unit<HD>(bp->order.data() + lo, hi - lo, bp->rows[b], wk[3 * u + 1], wk[3 * u + 2], p, st, run, sc,
                 kt.data(), vt.data());
      }
    });
  });
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(kUsage);
}

static ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> token_rows,
                                 ffi::Buffer<ffi::S32> limits, ffi::Buffer<ffi::S32> tables,
                                 ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k.dimensions(), v.dimensions(), Pool<float>{k.typed_data(), v.typed_data(), nullptr, nullptr},
             token_rows, limits, tables, out);
}

static ffi::Error PagedAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                                     ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale,
                                     ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> token_rows,
                                     ffi::Buffer<ffi::S32> limits, ffi::Buffer<ffi::S32> tables,
                                     ffi::ResultBuffer<ffi::F32> out) {
  const auto kd = k.dimensions(), sd = k_scale.dimensions(), vsd = v_scale.dimensions();
  if (kd.size() != 4 || sd.size() != 3 || vsd.size() != 3)
    return ffi::Error::InvalidArgument(kUsage);
  for (int i = 0; i < 3; ++i)
    if (sd[i] != kd[i] || vsd[i] != kd[i]) return ffi::Error::InvalidArgument(kUsage);
  return Run(pool, q, kd, v.dimensions(),
             Pool<int8_t>{k.typed_data(), v.typed_data(), k_scale.typed_data(), v_scale.typed_data()}, token_rows,
             limits, tables, out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptPagedAttentionInt8, PagedAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
