// What the native kernels (rows.cc, attention.cc, cached_attention.cc) share: the 16-float vector, its loads
// and exponential, and the two-thread split.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

// 16 floats; GCC/Clang lower it to one AVX-512 register, two AVX ones, or four SSE ones.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

// 16 floats from and to memory. With AVX-512 the loads are named: GCC 12 lowered the 64-byte memcpy into a
// v16 to two 32-byte copies through the stack and a 64-byte reload, a store-forwarding stall on every load
// (bench/README.md, "Named AVX-512 loads"). With AVX2 only, GCC 12 keeps a v16 in two registers spilled
// through the stack whichever way it is loaded (two _mm256_loadu_ps and a union, or a shuffle of the two
// halves, compiled no better or worse than the memcpy), so the memcpy, the portable form, stays there.
static inline v16 load16(const float* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_loadu_ps(p);
#else
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

static inline void store16(float* p, v16 v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, (__m512)v);
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

// The first n (1..16) of v's floats to p: a masked store with AVX-512 (a memcpy of a variable length put v
// on the stack and called the library's memcpy, once per panel and row in rows.cc).
static inline void store_first(float* p, v16 v, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) return store16(p, v);
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), (__m512)v);
#else
  std::memcpy(p, &v, n * sizeof(float));
#endif
}

// 16 consecutive floats, or int8 values widened to floats (int8 weights, an int8 KV cache). For int8, GCC 12
// widens a generic vector element by element (__builtin_convertvector), so the AVX-512 and AVX2 widening
// instructions are named.
static inline v16 weights16(const float* p) { return load16(p); }
static inline v16 weights16(const int8_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  v16 v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#else
  v16 v;
  for (int j = 0; j < 16; ++j) v[j] = static_cast<float>(p[j]);
  return v;
#endif
}

typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

static inline v16 splat(float x) { return v16{} + x; }

// e^x lane by lane for x <= 0 (below -87 it gives e^-87, callers zero the masked lanes): x = n ln2 + r with
// |r| <= ln2/2, e^r by its Taylor polynomial to r^7 (relative error below 1e-8), 2^n built in the exponent.
static inline v16 exp_nonpositive(v16 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const v16 t = x * 1.44269504088896341f;
  const i16v n = __builtin_convertvector(t - 0.5f, i16v);  // t <= 0: rounds to nearest (truncation toward 0)
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // ln2 in two parts: r is exact to float
  v16 p = splat(1.f / 5040);
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i16v bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Runs work(lo, hi) over [0, n) in two halves: the calling thread takes the first, a task on XLA's intra-op
// pool the second, and whichever of the two comes to the second half first computes it (so a busy pool, or
// two of these calls waiting on each other, never stalls it).
template <typename Work>
static void in_two_halves(ffi::ThreadPool& pool, int64_t n, Work work) {
  const int64_t half = (n + 1) / 2;
  if (half == n) return work(0, n);
  struct Second {
    std::atomic<bool> claimed{false}, done{false};
  };
  auto second = std::make_shared<Second>();
  pool.Schedule([=] {
    if (second->claimed.exchange(true)) return;  // the caller took it
    work(half, n);
    second->done.store(true, std::memory_order_release);
  });
  work(0, half);
  if (!second->claimed.exchange(true))
    work(half, n);
  else
    while (!second->done.load(std::memory_order_acquire)) {
    }
}

// Runs work(next) on the calling thread and on one task of XLA's intra-op pool: each calls next() for the
// next unit of [0, n) to do until it returns n or more. A task that starts late (the pool busy with another
// op) still takes what is left, one that finds nothing left costs nothing; returns when all n are done.
template <typename Work>
static void in_turns(ffi::ThreadPool& pool, int64_t n, Work work) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto run = [=] {
    int64_t mine = 0;
    work([&] {
      const int64_t i = shared->next.fetch_add(1);
      mine += i < n;
      return i;
    });
    shared->done.fetch_add(mine, std::memory_order_release);
  };
  if (n > 1) pool.Schedule([run] { run(); });
  run();
  while (shared->done.load(std::memory_order_acquire) < n) {
  }
}
