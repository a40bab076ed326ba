// Causal self-attention for training under the CPU kernels (see native.py): forward and backward.
//
// Queries, keys and values are read as rows of H floats out of [B, T, C] arrays: query head n of row (b, t)
// at column q_off + n H, key/value head j at k_off + j H / v_off + j H (one fused [B, T, (N + 2K) H]
// projection passed three times, or three arrays of their own); query head n uses key/value head n / (N / K).
// Positions 0..T-1, query t sees keys 0..t, scores scaled by 1/sqrt(H). The forward gives the output
// [B, T, N H] and each query's log-sum-exp of its scores [B, N, T]; the backward recomputes the
// probabilities from those and writes dq, dk, dv (into three arrays, or one fused like the input).
//
// One unit of work is a (batch row, key/value head): its keys and values are copied once into padded
// scratch (transposed where a matmul wants them so), then its query heads run in blocks of MB queries.
// Block [lo, lo + MB) needs keys [0, lo + MB) only, and within it each tile of RT rows only the key columns
// up to its last row (rounded up to CT): about half of the T x T work, as the masked part is skipped. Two
// register-tiled matmuls do the work: scores = rows x columns (abt) and rows of probabilities x rows of
// values (ab); the softmax's exponential is a vectorised polynomial. The units are taken in turns by the
// calling thread and a task on XLA's intra-op pool (in_turns, common.h). The tiles assume 32 vector registers
// (AVX-512); native.py uses this kernel only on such CPUs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t MB = 64;  // queries per block
constexpr int64_t RT = 8;   // score rows per abt tile
constexpr int64_t CT = 32;  // score columns per abt tile (two vectors)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }


// s[0..RT)[c0..c0+CT) = a[0..RT)[0..H) . bt[0..H)[c0..c0+CT): a's rows contiguous (H floats), bt row h
// holds column h of every key (stride ldb), s rows of stride lds.
template <int H>
void abt_tile(const float* a, const float* bt, int64_t ldb, float* s, int64_t lds) {
  v16 acc[RT][2];
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = v16{};
  for (int h = 0; h < H; ++h) {
    const v16 b0 = load16(bt + h * ldb), b1 = load16(bt + h * ldb + 16);
    for (int r = 0; r < RT; ++r) {
      const float x = a[r * H + h];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
  for (int r = 0; r < RT; ++r) {
    store16(s + r * lds, acc[r][0]);
    store16(s + r * lds + 16, acc[r][1]);
  }
}

// c[0..R)[0..H) (+)= alpha * sum_{j in [j0, j1)} p(r, j) b[j][0..H), p(r, j) = p[r * rs + j * js] (rows of
// probabilities, or with rs = 1 their columns: no transposed copy), b rows contiguous.
template <int H, int R>
void ab_tile(const float* p, int64_t rs, int64_t js, const float* b, int64_t j0, int64_t j1, float* c, bool add,
             float alpha) {
  constexpr int NV = H / 16;
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = v16{};
  for (int64_t j = j0; j < j1; ++j) {
    v16 bj[NV];
    for (int v = 0; v < NV; ++v) bj[v] = load16(b + j * H + 16 * v);
    for (int r = 0; r < R; ++r) {
      const float x = p[r * rs + j * js];
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bj[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      float* dst = c + r * H + 16 * v;
      store16(dst, add ? load16(dst) + alpha * acc[r][v] : alpha * acc[r][v]);
    }
}

// Rows of ab_tile per tile: NV * R accumulators of 32 registers, R dividing RT.
template <int H>
constexpr int ab_rows() {
  return H / 16 <= 2 ? 8 : (H / 16 <= 4 ? 4 : 2);
}

// Lane masks for a score row: lanes c0 + i < visible.
i16v visible_lanes(int64_t c0, int64_t visible) {
  const i16v iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (iota + (int32_t)c0) < (int32_t)visible;
}

// The shapes of one call.
struct Dims {
  int64_t b, t, n, k, h, g, tp;  // tp: keys padded to CT
  float scale;
};

// A [B, T, C] array seen a head's row at a time: row (b, t) of head x at base + (b T + t) stride + off + x H.
template <typename F>
struct View {
  F* base;
  int64_t stride, off;
  F* row(const Dims& d, int64_t b, int64_t t, int64_t head) const {
    return base + (b * d.t + t) * stride + off + head * d.h;
  }
};
using In = View<const float>;
using Out = View<float>;

// Copies the keys (or values) of unit (bi, kh) into [tp, H] rows and/or the transposed [H, tp], zero past t.
template <int H>
void gather_kv(const Dims& d, In src, int64_t bi, int64_t kh, float* rows, float* cols) {
  if (rows) {
    for (int64_t j = 0; j < d.t; ++j) {
      const float* x = src.row(d, bi, j, kh);
      for (int64_t i = 0; i < H; i += 16) store16(rows + j * H + i, load16(x + i));
    }
    std::memset(rows + d.t * H, 0, sizeof(float) * (d.tp - d.t) * H);
  }
  if (cols) {  // in 16 x 16 tiles, so that reads and writes each touch 16 cache lines at a time
    for (int64_t j0 = 0; j0 < d.t; j0 += 16)
      for (int64_t i0 = 0; i0 < H; i0 += 16)
        for (int64_t j = j0; j < std::min(j0 + 16, d.t); ++j) {
          const float* x = src.row(d, bi, j, kh);
          for (int64_t i = i0; i < i0 + 16; ++i) cols[i * d.tp + j] = x[i];
        }
    for (int64_t i = 0; i < H; ++i) std::memset(cols + i * d.tp + d.t, 0, sizeof(float) * (d.tp - d.t));
  }
}

// Copies the mb rows of head n starting at lo, times `mul`, into [MB, H], zero past mb.
template <int H>
void gather_rows(const Dims& d, In src, int64_t bi, int64_t n, int64_t lo, int64_t mb, float mul, float* dst) {
  for (int64_t r = 0; r < mb; ++r) {
    const float* x = src.row(d, bi, lo + r, n);
    for (int64_t i = 0; i < H; i += 16) store16(dst + r * H + i, load16(x + i) * mul);
  }
  std::memset(dst + mb * H, 0, sizeof(float) * (MB - mb) * H);
}

// Key columns the RT-row tile starting at block row rt needs (its last query, rounded up to CT).
int64_t tile_columns(const Dims& d, int64_t lo, int64_t rt) { return std::min(round_up(lo + rt + RT, CT), d.tp); }

template <int H>
struct Attention {
  static constexpr int R = ab_rows<H>();

  // Scores of the block's rows [0, mbp) against keys (kt: [H, tp]) into s [MB, tp], RT rows at a time.
  static void scores(const Dims& d, const float* a, const float* kt, int64_t lo, int64_t mbp, float* s) {
    for (int64_t rt = 0; rt < mbp; rt += RT)
      for (int64_t c0 = 0, ext = tile_columns(d, lo, rt); c0 < ext; c0 += CT)
        abt_tile<H>(a + rt * H, kt + c0, d.tp, s + rt * d.tp + c0, d.tp);
  }

  // Units (b, kv head) as `next` gives them, until it gives b k or more.
  template <typename Next>
  static void forward(const Dims& d, In q, In k, In v, Out o, float* lse, Next next) {
    int64_t u = next();
    if (u >= d.b * d.k) return;
    std::vector<float> kt(d.tp * H), vr(d.tp * H), qs(MB * H), s(MB * d.tp), os(MB * H), inv(MB);
    for (; u < d.b * d.k; u = next()) {
      const int64_t bi = u / d.k, kh = u % d.k;
      gather_kv<H>(d, k, bi, kh, nullptr, kt.data());
      gather_kv<H>(d, v, bi, kh, vr.data(), nullptr);
      for (int64_t g = 0; g < d.g; ++g) {
        const int64_t n = kh * d.g + g;
        for (int64_t lo = 0; lo < d.t; lo += MB) {
          const int64_t mb = std::min(MB, d.t - lo), mbp = round_up(mb, RT);
          gather_rows<H>(d, q, bi, n, lo, mb, d.scale, qs.data());
          scores(d, qs.data(), kt.data(), lo, mbp, s.data());
          for (int64_t r = 0; r < mbp; ++r) {  // softmax of each row over its visible keys, 0 past them
            float* row = s.data() + r * d.tp;
            const int64_t ext = tile_columns(d, lo, r / RT * RT), visible = r < mb ? lo + r + 1 : 0;
            v16 mx = splat(-INFINITY);
            for (int64_t c0 = 0; c0 < ext; c0 += 16) {
              const v16 x = load16(row + c0);
              const i16v m = visible_lanes(c0, visible);
              mx = (m & (x > mx)) ? x : mx;
            }
            float m = -INFINITY;
            for (int i = 0; i < 16; ++i) m = std::max(m, mx[i]);
            v16 sum = v16{};
            for (int64_t c0 = 0; c0 < ext; c0 += 16) {
              const v16 e = visible_lanes(c0, visible) ? exp_nonpositive(load16(row + c0) - m) : v16{};
              sum += e;
              store16(row + c0, e);
            }
            float total = 0.f;
            for (int i = 0; i < 16; ++i) total += sum[i];
            if (r < mb) {  // the rows stay unnormalised: the output row is divided by the sum instead
              inv[r] = 1.f / total;
              lse[(bi * d.n + n) * d.t + lo + r] = m + std::log(total);
            }
          }
          for (int64_t r0 = 0; r0 < mbp; r0 += R)
            ab_tile<H, R>(s.data() + r0 * d.tp, d.tp, 1, vr.data(), 0, std::min(lo + r0 + R, d.t), os.data() + r0 * H,
                          false, 1.f);
          for (int64_t r = 0; r < mb; ++r) {
            float* y = o.row(d, bi, lo + r, n);
            for (int64_t i = 0; i < H; i += 16) store16(y + i, load16(os.data() + r * H + i) * inv[r]);
          }
        }
      }
    }
  }

  template <typename Next>
  static void backward(const Dims& d, In q, In k, In v, In o, const float* lse, In dout, Out dq, Out dk, Out dv,
                       Next next) {
    int64_t u = next();
    if (u >= d.b * d.k) return;
    std::vector<float> kt(d.tp * H), vt(d.tp * H), kr(d.tp * H), qs(MB * H), dos(MB * H), dd(MB),
        p(MB * d.tp), ds(MB * d.tp), dqs(MB * H), dka(d.tp * H), dva(d.tp * H);
    for (; u < d.b * d.k; u = next()) {
      const int64_t bi = u / d.k, kh = u % d.k;
      gather_kv<H>(d, k, bi, kh, kr.data(), kt.data());
      gather_kv<H>(d, v, bi, kh, nullptr, vt.data());
      std::fill(dka.begin(), dka.end(), 0.f);
      std::fill(dva.begin(), dva.end(), 0.f);
      for (int64_t g = 0; g < d.g; ++g) {
        const int64_t n = kh * d.g + g;
        for (int64_t lo = 0; lo < d.t; lo += MB) {
          const int64_t mb = std::min(MB, d.t - lo), mbp = round_up(mb, RT);
          gather_rows<H>(d, q, bi, n, lo, mb, d.scale, qs.data());
          gather_rows<H>(d, dout, bi, n, lo, mb, 1.f, dos.data());
          for (int64_t r = 0; r < MB; ++r) {  // D_r = dout_r . out_r, the softmax's backward term
            v16 acc = v16{};
            if (r < mb) {
              const float* y = o.row(d, bi, lo + r, n);
              for (int64_t i = 0; i < H; i += 16) acc += load16(dos.data() + r * H + i) * load16(y + i);
            }
            float sum = 0.f;
            for (int i = 0; i < 16; ++i) sum += acc[i];
            dd[r] = sum;
          }
          scores(d, qs.data(), kt.data(), lo, mbp, p.data());   // scores, made probabilities below
          scores(d, dos.data(), vt.data(), lo, mbp, ds.data());  // dP = dout . v, made dS below
          for (int64_t r = 0; r < mbp; ++r) {
            float* pr = p.data() + r * d.tp;
            float* dr = ds.data() + r * d.tp;
            const int64_t ext = tile_columns(d, lo, r / RT * RT), visible = r < mb ? lo + r + 1 : 0;
            const float l = r < mb ? lse[(bi * d.n + n) * d.t + lo + r] : 0.f;
            for (int64_t c0 = 0; c0 < ext; c0 += 16) {
              const v16 pv = visible_lanes(c0, visible) ? exp_nonpositive(load16(pr + c0) - l) : v16{};
              store16(pr + c0, pv);
              store16(dr + c0, pv * (load16(dr + c0) - dd[r]));
            }
          }
          // dq = scale * dS . k
          for (int64_t r0 = 0; r0 < mbp; r0 += R)
            ab_tile<H, R>(ds.data() + r0 * d.tp, d.tp, 1, kr.data(), 0, std::min(lo + r0 + R, d.t), dqs.data() + r0 * H,
                          false, d.scale);
          for (int64_t r = 0; r < mb; ++r)
            for (int64_t i = 0; i < H; i += 16)
              store16(dq.row(d, bi, lo + r, n) + i, load16(dqs.data() + r * H + i));
          // dk += dS^T . (scale q), dv += P^T . dout, R key rows at a time over the block's rows that see
          // them (row r sees key j when lo + r >= j; every (r, j) read lies in r's tile columns)
          for (int64_t j0 = 0, keys = tile_columns(d, lo, mbp - RT); j0 < keys; j0 += R) {
            const int64_t r0 = std::max<int64_t>(0, j0 - lo);
            ab_tile<H, R>(ds.data() + j0, 1, d.tp, qs.data(), r0, mbp, dka.data() + j0 * H, true, 1.f);
            ab_tile<H, R>(p.data() + j0, 1, d.tp, dos.data(), r0, mbp, dva.data() + j0 * H, true, 1.f);
          }
        }
      }
      for (int64_t j = 0; j < d.t; ++j)
        for (int64_t i = 0; i < H; i += 16) {
          store16(dk.row(d, bi, j, kh) + i, load16(dka.data() + j * H + i));
          store16(dv.row(d, bi, j, kh) + i, load16(dva.data() + j * H + i));
        }
    }
  }
};

// Checks a [B, T, C] buffer holding `heads` heads of H from column `off`.
bool holds(ffi::Span<const int64_t> dims, const Dims& d, int64_t heads, int64_t off) {
  return dims.size() == 3 && dims[0] == d.b && dims[1] == d.t && off >= 0 && off + heads * d.h <= dims[2];
}

struct Call {
  Dims d;
  int64_t q_off, k_off, v_off;
};

// The call's shapes from q's [B, T, C] and the attributes, checked against q, k, v.
bool read_call(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k, ffi::Span<const int64_t> v, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t q_off, int64_t k_off, int64_t v_off, Call* c) {
  if (q.size() != 3 || heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 1) return false;
  c->d = Dims{q[0], q[1], heads, kv_heads, head_dim, heads / kv_heads, round_up(q[1], CT),
              1.f / std::sqrt((float)head_dim)};
  c->q_off = q_off, c->k_off = k_off, c->v_off = v_off;
  return holds(q, c->d, heads, q_off) && holds(k, c->d, kv_heads, k_off) && holds(v, c->d, kv_heads, v_off);
}

In in(const ffi::Buffer<ffi::F32>& b, int64_t off) { return In{b.typed_data(), b.dimensions()[2], off}; }
Out out(ffi::Result<ffi::Buffer<ffi::F32>>& b, int64_t off) { return Out{b->typed_data(), b->dimensions()[2], off}; }

// Head sizes with a compiled kernel: multiples of 16 up to 128 (native.py checks before calling).
template <typename F>
bool with_head_size(int64_t h, F f) {
  switch (h) {
#define JAXGPT_HEAD(n)    \
  case n:                 \
    f(Attention<n>{});    \
    return true;
    JAXGPT_HEAD(16) JAXGPT_HEAD(32) JAXGPT_HEAD(48) JAXGPT_HEAD(64) JAXGPT_HEAD(80) JAXGPT_HEAD(96)
    JAXGPT_HEAD(112) JAXGPT_HEAD(128)
#undef JAXGPT_HEAD
  }
  return false;
}

const char* kUsage =
    "jaxgpt_causal_attention: q, k, v [B, T, C] holding heads (kv_heads) of head_dim from q_off (k_off, v_off), "
    "heads % kv_heads == 0, head_dim in 16..128 by 16; o [B, T, heads head_dim], lse [B, heads, T]";

ffi::Error Backward(ffi::ThreadPool& pool, const Call& c, In q, In k, In v, In o, const float* lse, In dout, Out dq,
                    Out dk, Out dv) {
  const Dims d = c.d;
  const bool ok = with_head_size(d.h, [&](auto a) {
    in_turns(pool, d.b * d.k, [=](auto next) { decltype(a)::backward(d, q, k, v, o, lse, dout, dq, dk, dv, next); });
  });
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(kUsage);
}

bool backward_args_ok(const Call& c, const ffi::Buffer<ffi::F32>& o, const ffi::Buffer<ffi::F32>& lse,
                      const ffi::Buffer<ffi::F32>& dout) {
  return holds(o.dimensions(), c.d, c.d.n, 0) && holds(dout.dimensions(), c.d, c.d.n, 0) &&
         lse.element_count() == (size_t)(c.d.b * c.d.n * c.d.t);
}

}  // namespace

static ffi::Error CausalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                  ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                                  ffi::ResultBuffer<ffi::F32> lse, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                  int64_t q_off, int64_t k_off, int64_t v_off) {
  Call c;
  if (!read_call(q.dimensions(), k.dimensions(), v.dimensions(), heads, kv_heads, head_dim, q_off, k_off, v_off, &c) ||
      !holds(o->dimensions(), c.d, c.d.n, 0) || lse->element_count() != (size_t)(c.d.b * c.d.n * c.d.t))
    return ffi::Error::InvalidArgument(kUsage);
  const Dims d = c.d;
  const In qv = in(q, q_off), kv = in(k, k_off), vv = in(v, v_off);
  const Out ov = out(o, 0);
  float* lp = lse->typed_data();
  const bool ok = with_head_size(d.h, [&](auto a) {
    in_turns(pool, d.b * d.k, [=](auto next) { decltype(a)::forward(d, qv, kv, vv, ov, lp, next); });
  });
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(kUsage);
}

// The gradients into three arrays: dq [B, T, heads H], dk and dv [B, T, kv_heads H].
static ffi::Error CausalAttentionBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                                          ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                                          ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, int64_t heads,
                                          int64_t kv_heads, int64_t head_dim, int64_t q_off, int64_t k_off,
                                          int64_t v_off) {
  Call c;
  if (!read_call(q.dimensions(), k.dimensions(), v.dimensions(), heads, kv_heads, head_dim, q_off, k_off, v_off, &c) ||
      !backward_args_ok(c, o, lse, dout) || !holds(dq->dimensions(), c.d, c.d.n, 0) ||
      !holds(dk->dimensions(), c.d, c.d.k, 0) || !holds(dv->dimensions(), c.d, c.d.k, 0))
    return ffi::Error::InvalidArgument(kUsage);
  return Backward(pool, c, in(q, q_off), in(k, k_off), in(v, v_off), in(o, 0), lse.typed_data(), in(dout, 0),
                  out(dq, 0), out(dk, 0), out(dv, 0));
}

// The gradients into one array laid out like a fused input: dq, dk, dv at q_off, k_off, v_off of [B, T, C].
static ffi::Error CausalAttentionBackwardFused(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o,
                                               ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                                               ffi::ResultBuffer<ffi::F32> dqkv, int64_t heads, int64_t kv_heads,
                                               int64_t head_dim, int64_t q_off, int64_t k_off, int64_t v_off) {
  Call c;
  if (!read_call(q.dimensions(), k.dimensions(), v.dimensions(), heads, kv_heads, head_dim, q_off, k_off, v_off, &c) ||
      !backward_args_ok(c, o, lse, dout) || !holds(dqkv->dimensions(), c.d, c.d.n, q_off) ||
      !holds(dqkv->dimensions(), c.d, c.d.k, k_off) || !holds(dqkv->dimensions(), c.d, c.d.k, v_off) ||
      dqkv->dimensions()[2] != (heads + 2 * kv_heads) * head_dim)  // every column written
    return ffi::Error::InvalidArgument(kUsage);
  return Backward(pool, c, in(q, q_off), in(k, k_off), in(v, v_off), in(o, 0), lse.typed_data(), in(dout, 0),
                  out(dqkv, q_off), out(dqkv, k_off), out(dqkv, v_off));
}

// One float32 buffer argument or result; the attributes every handler takes.
#define JAXGPT_IN .Arg<ffi::Buffer<ffi::F32>>()
#define JAXGPT_OUT .Ret<ffi::Buffer<ffi::F32>>()
#define JAXGPT_ATTRS                                                                                          \
  .Attr<int64_t>("heads").Attr<int64_t>("kv_heads").Attr<int64_t>("head_dim").Attr<int64_t>("q_off")          \
      .Attr<int64_t>("k_off").Attr<int64_t>("v_off")

// q, k, v -> o, lse
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttention, CausalAttention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() JAXGPT_IN JAXGPT_IN JAXGPT_IN JAXGPT_OUT
                                  JAXGPT_OUT JAXGPT_ATTRS);

// q, k, v, o, lse, dout -> dq, dk, dv
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttentionBackward, CausalAttentionBackward,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() JAXGPT_IN JAXGPT_IN JAXGPT_IN JAXGPT_IN
                                  JAXGPT_IN JAXGPT_IN JAXGPT_OUT JAXGPT_OUT JAXGPT_OUT JAXGPT_ATTRS);

// q, k, v, o, lse, dout -> dqkv
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttentionBackwardFused, CausalAttentionBackwardFused,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() JAXGPT_IN JAXGPT_IN JAXGPT_IN JAXGPT_IN
                                  JAXGPT_IN JAXGPT_IN JAXGPT_OUT JAXGPT_ATTRS);
