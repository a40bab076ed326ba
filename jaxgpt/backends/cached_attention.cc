// Attention of a few new queries over a KV cache, for decoding under the CPU kernels (see native.py).
//
// q [B, T, N H] (T small: one token per step, or a speculative step's k + 1); the cache's keys and values
// [R K, S, H] as the CPU backend stores them (cpu.RowsCacheLayout: row b's kv head j at b K + j; R >= B, the
// rows past B unread: a decode step over the first B slots reads the whole cache's buffers in place); each
// query's absolute position q_pos [B, T] and each row's filled length kv_len [B]. Query (b, t) of head n sees
// keys s <= q_pos[b, t] and s < kv_len[b] of kv head n / (N / K), scores scaled by 1/sqrt(H) -> out [B, T, N H].
//
// XLA's form multiplies every query by all S positions of the buffer, masked; this reads only the visible
// ones: a decode step over slots whose texts are short reads a fraction of the cache. `JaxgptCachedAttentionInt8`
// reads an int8 cache (cache.py: a float32 scale per row, kv head and position, [B K, S]) the same way,
// widening each key and value to float in registers: a quarter of float32's bytes, where XLA's form first
// writes the whole cache out dequantized. One unit of work is a
// (batch row, kv head); each of its queries takes its scores in one pass over the keys, a vectorised
// exponential, and a pass over the values. The units are taken in turns by the calling thread and a task on
// XLA's intra-op pool (in_turns, common.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr const char* kUsage =
    "jaxgpt_cached_attention(_int8): q [B, T, N H], k and v [R K, S, H] with R >= B (float32, or int8 with "
    "scales [R K, S]), q_pos [B, T] int32, kv_len [B] int32 -> out [B, T, N H]; H a multiple of 16 up to 128, "
    "N a multiple of K";

static inline float hsum(v16 x) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

// Keys and values as stored: float32, or int8 with a scale per position (nullptr for float32).
template <typename E>
struct Cache {
  const E* k;
  const E* v;
  const float* k_scale;
  const float* v_scale;
};

template <int H, typename E>
void unit(int64_t b, int64_t j, int64_t T, int64_t N, int64_t K, int64_t S, const float* q, Cache<E> c,
          const int32_t* q_pos, const int32_t* kv_len, float* out, std::vector<float>& sc) {
  constexpr int NV = H / 16;
  const int64_t g = N / K;
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  const E* kj = c.k + (b * K + j) * S * H;
  const E* vj = c.v + (b * K + j) * S * H;
  const float* ksj = c.k_scale ? c.k_scale + (b * K + j) * S : nullptr;
  const float* vsj = c.v_scale ? c.v_scale + (b * K + j) * S : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t len = std::min<int64_t>({static_cast<int64_t>(q_pos[b * T + t]) + 1,
                                           static_cast<int64_t>(kv_len[b]), S});
    for (int64_t n = j * g; n < (j + 1) * g; ++n) {
      const float* qn = q + (b * T + t) * N * H + n * H;
      float* on = out + (b * T + t) * N * H + n * H;
      if (len <= 0) {
        std::fill(on, on + H, 0.f);
        continue;
      }
      v16 qv[NV];
      for (int i = 0; i < NV; ++i) qv[i] = load16(qn + 16 * i) * scale;
      const int64_t padded = (len + 15) / 16 * 16;
      float m = -INFINITY;
      for (int64_t s = 0; s < len; ++s) {
        const E* ks = kj + s * H;
        v16 acc = qv[0] * weights16(ks);
        for (int i = 1; i < NV; ++i) acc += qv[i] * weights16(ks + 16 * i);
        sc[s] = ksj ? hsum(acc) * ksj[s] : hsum(acc);
        m = std::max(m, sc[s]);
      }
      v16 total{};
      for (int64_t s = 0; s < padded; s += 16) {
        v16 e = exp_nonpositive(load16(sc.data() + s) - m);
        for (int i = 0; i < 16; ++i)
          if (s + i >= len) e[i] = 0.f;  // past the visible keys
        store16(sc.data() + s, e);
        total += e;
      }
      const float inv = 1.f / hsum(total);
      v16 o[NV] = {};
      for (int64_t s = 0; s < len; ++s) {
        const v16 p = splat(vsj ? sc[s] * vsj[s] : sc[s]);
        const E* vs = vj + s * H;
        for (int i = 0; i < NV; ++i) o[i] += p * weights16(vs + 16 * i);
      }
      for (int i = 0; i < NV; ++i) store16(on + 16 * i, o[i] * inv);
    }
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

}  // namespace

// The checks and the split into units shared by both entry points; `scales`: whether k and v are int8.
template <typename E>
static ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, const ffi::Span<const int64_t>& kd,
                      const ffi::Span<const int64_t>& vd, Cache<E> c, ffi::Buffer<ffi::S32>& q_pos,
                      ffi::Buffer<ffi::S32>& kv_len, ffi::ResultBuffer<ffi::F32>& out, int64_t heads,
                      int64_t kv_heads) {
  const auto qd = q.dimensions(), pd = q_pos.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || pd.size() != 2 || kv_len.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(kUsage);
  const int64_t B = qd[0], T = qd[1], N = heads, K = kv_heads, S = kd[1], H = kd[2];
  if (N < 1 || K < 1 || N % K != 0 || qd[2] != N * H || kd[0] < B * K || kd[0] % K != 0 || vd[0] != kd[0] || vd[1] != S ||
      vd[2] != H || pd[0] != B || pd[1] != T || kv_len.dimensions()[0] != B ||
      out->element_count() != static_cast<size_t>(B * T * N * H))
    return ffi::Error::InvalidArgument(kUsage);
  const float* qp = q.typed_data();
  const int32_t *pp = q_pos.typed_data(), *lp = kv_len.typed_data();
  float* op = out->typed_data();
  const bool ok = with_head_dim(H, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    in_turns(pool, B * K, [=](auto next) {
      std::vector<float> sc(static_cast<size_t>((S + 15) / 16 * 16));
      for (int64_t u = next(); u < B * K; u = next()) unit<HD>(u / K, u % K, T, N, K, S, qp, c, pp, lp, op, sc);
    });
  });
  return ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(kUsage);
}

static ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_len,
                                  ffi::ResultBuffer<ffi::F32> out, int64_t heads, int64_t kv_heads) {
  return Run(pool, q, k.dimensions(), v.dimensions(), Cache<float>{k.typed_data(), v.typed_data(), nullptr, nullptr},
             q_pos, kv_len, out, heads, kv_heads);
}

static ffi::Error CachedAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                                      ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale,
                                      ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> q_pos,
                                      ffi::Buffer<ffi::S32> kv_len, ffi::ResultBuffer<ffi::F32> out, int64_t heads,
                                      int64_t kv_heads) {
  const auto kd = k.dimensions(), sd = k_scale.dimensions(), vsd = v_scale.dimensions();
  if (kd.size() != 3 || sd.size() != 2 || vsd.size() != 2 || sd[0] != kd[0] || sd[1] != kd[1] || vsd[0] != kd[0] ||
      vsd[1] != kd[1])
    return ffi::Error::InvalidArgument(kUsage);
  return Run(pool, q, kd, v.dimensions(),
             Cache<int8_t>{k.typed_data(), v.typed_data(), k_scale.typed_data(), v_scale.typed_data()}, q_pos, kv_len,
             out, heads, kv_heads);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCachedAttentionInt8, CachedAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads"));
