// The decode step's native matmul (see native.py): y = x @ W for a few rows of x.
//
// x float32 [R, in] (R <= 16), W packed in panels of 16 outputs, wp[p][i][j] = W[i, 16 p + j] (float32
// [ceil(out / 16), in, 16], zero past `out`), y float32 [R, out]. Each panel is read once, in order, and
// every row of x is multiplied with it while it is in registers: the weights stream from memory at the
// machine's bandwidth, which XLA:CPU's matmul and fusions do not reach at 1..16 rows (bench/README.md).
// The panels are split between the calling thread and one task on XLA's intra-op pool (in_two_halves).
// `JaxgptPack` makes the panels from a stored kernel once per generate call (XLA's transposes took ~0.3 s
// for GPT-2 124M's kernels on that machine).
//
// `JaxgptRowsMatmulInt8` is the same multiply over int8 panels of 64 outputs with a float scale per output
// (jaxgpt/quantize.py): each 16 weights are widened to float in registers, so the weights stream at a
// quarter of float32's bytes and x stays float32 (only the weights are rounded); the accumulators are
// scaled once at the end.

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
      for (int r = 0; r < R; ++r) std::memcpy(y + r * out + o, &acc[k][r], n * sizeof(float));
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

static ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != 16 || wd[1] != xd[1] || yd[0] != xd[0] ||
      (yd[1] + 15) / 16 != wd[0] || xd[0] < 1 || xd[0] > 16)
    return ffi::Error::InvalidArgument("jaxgpt_rows_matmul: x [R <= 16, in], panels [ceil(out/16), in, 16], y [R, out]");
  const int64_t r = xd[0], in = xd[1], out = yd[1];
  const float* xp = x.typed_data();
  const float* w = wp.typed_data();
  float* yp = y->typed_data();
  in_two_halves(pool, wd[0], [=](int64_t lo, int64_t hi) { run<float>(r, xp, in, w, nullptr, out, yp, lo, hi); });
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
          std::memcpy(y + r * out + o, &yr, n * sizeof(float));
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
