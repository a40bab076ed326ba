// What the native kernels (rows.cc, attention.cc) share: the 16-float vector and the two-thread split.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// 16 floats; GCC/Clang lower it to one AVX-512 register, two AVX ones, or four SSE ones.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

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
