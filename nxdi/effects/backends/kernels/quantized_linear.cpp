// nxdi's weight-only quantized linear for decode on AVX-512 CPUs: y = (x @ w.T) * scale (+ bias),
// and the one-pass dequantize its prefill uses.
//
// x [M, K] (bf16, fp16 or fp32; M <= 4 rows), w [N, K] int8, float8_e4m3fn or float8_e5m2, scale
// float32 [N] (one per row) or [N / bn, K / bk] (blockwise: each chunk of weights is scaled before
// its FMAs), bias [N] or none. Each weight byte is read once, in order, and widened to fp32 in
// registers (int8: vpmovsxbd + vcvtdq2ps; float8: a few integer ops make float16 bits, then
// vcvtph2ps, below); the rows of x are multiplied with fp32 FMAs, so the result equals
// dequantize-then-multiply up to fp32 summation order. R output rows are read at once, R
// sequential streams interleaved: on the development machine with AMX one stream per core read
// 13 GB/s of int8 and eight 15-20 GB/s (on an earlier Zen 5 machine one stream with unrolled
// accumulators had measured best; the interleaved loop was chosen on the machine it runs on now),
// and the next block of rows is prefetched while one is read (30 GB/s of int8 then). A block's rows
// are S rows apart, not adjacent (`run_rows`: 1.03-1.4x per call at one row of x). Both choices
// are per CPU (`read_order.h`). Output rows are split over torch's intra-op (OpenMP) threads.
// Measurements: docs/cpu-backend.md, "Quantized weights". (Over 400 lines: the three stored
// formats share one templated row kernel, its scales and the SwiGLU; the dequantize for prefill
// reads the same formats.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "bf16_lanes.h"
#include "read_order.h"

namespace {

// How a chunk of `step` weight bytes becomes step / 16 vectors of 16 fp32 lanes, per stored format
// (`mask`: the bytes to read, the rest zeros). `unit`: what the lanes are multiplied by to give the
// weights' values (a power of two, so exact).
template <int Step>
using Mask = std::conditional_t<Step == 16, __mmask16, __mmask32>;

struct Int8 {
  using T = int8_t;
  static constexpr int step = 16;  // vpmovsxbd reads 16 bytes, straight from memory when whole
  static constexpr float unit = 1.0f;
  static void load(const T* w, __mmask16 mask, __m512* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
  }
  static void load(const T* w, __m512* out) {  // vpmovsxbd with a memory operand: no separate load
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  }
};

// float16 bits (32 lanes) to two vectors of fp32 (vcvtph2ps is exact and ignores DAZ: float16
// subnormals stay values).
inline void widen_halves(__m512i half, __m512* out) {
  out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

// float8_e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits) placed in float16's bit
// fields reads as the value times 2^-8, subnormals included: float16's bias is 15. Its one NaN
// code (all seven magnitude bits set) would read as 480 there, so it is made a float16 NaN.
struct Fp8E4m3 {
  using T = uint8_t;
  static constexpr int step = 32;  // the integer ops work on 32 16-bit lanes at once
  static constexpr float unit = 256.0f;
  static void load(const T* w, __mmask32 mask, __m512* out) {
    // Sign-extended to 16 bits and shifted left by 7: the sign lands in bit 15 (and a copy in bit
    // 14, cleared), the exponent in bits 13-10 and the mantissa in bits 9-7.
    const __m512i wide = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w));
    const __m512i half = _mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(int16_t(0xBF80)));
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(half, _mm512_set1_epi16(0x7FFF)),
                                                  _mm512_set1_epi16(0x3F80));
    widen_halves(_mm512_mask_mov_epi16(half, nan, _mm512_set1_epi16(0x7E00)), out);
  }
  static void load(const T* w, __m512* out) { load(w, ~__mmask32(0), out); }
};

// float8_e5m2 is float16's upper byte: the same exponent bias, inf and NaN.
struct Fp8E5m2 {
  using T = uint8_t;
  static constexpr int step = 32;
  static constexpr float unit = 1.0f;
  static void load(const T* w, __mmask32 mask, __m512* out) {
    widen_halves(_mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, w)), 8), out);
  }
  static void load(const T* w, __m512* out) { load(w, ~__mmask32(0), out); }
};

// The first n of `Step` lanes.
template <int Step>
Mask<Step> first(int64_t n) {
  return n >= Step ? Mask<Step>(~Mask<Step>(0)) : Mask<Step>((Mask<Step>(1) << n) - 1);
}

// The scales of a [N, K] weight: one per row ([N]: bn = 1, bk = K), or one per block of bn rows and
// bk columns ([N / bn, K / bk], blockwise quantization), row-major.
struct Scales {
  const float* data;
  int64_t bn, bk, per_row;  // per_row: scales per block row (K / bk)
  const float* row(int64_t n) const { return data + (n / bn) * per_row; }
};

// The scales from a [N] or [N / bn, K / bk] float32 tensor (its shape checked by `blocks_fit`).
Scales scales_of(const at::Tensor& s, int64_t N, int64_t K) {
  if (s.dim() == 1) return {s.data_ptr<float>(), 1, K, 1};
  return {s.data_ptr<float>(), N / s.size(0), K / s.size(1), s.size(1)};
}

// Whether `scale` is [N], or a grid of blocks that tile [N, K] with whole multiples of `step`
// columns (so no chunk a kernel reads straddles two blocks).
bool blocks_fit(const at::Tensor& scale, int64_t N, int64_t K, int64_t step) {
  if (scale.dim() == 1) return scale.size(0) == N;
  return scale.dim() == 2 && scale.size(0) > 0 && scale.size(1) > 0 && N % scale.size(0) == 0 &&
         K % scale.size(1) == 0 && (K / scale.size(1)) % step == 0;
}

// The block's R output rows are n, n + step, ..., n + (R - 1) * step (below: `run_rows`).
// `next`: the following block's first row (or null; its rows `step` apart too): fetched into cache
// while this block is read; without it, each row's bytes `ahead` on (if not 0) are fetched into
// L2. Blocked: each chunk of weights is multiplied by its block's scale before the FMAs; otherwise
// the row's one scale multiplies the sum.
template <typename W, bool Blocked, int M, int R, typename Out>
void dot_rows(const float* x, const typename W::T* w, const typename W::T* next, int64_t step, const Scales& scales,
              int64_t n, const float* bias, Out* y, int64_t K, int64_t Kp, int64_t N, int64_t ahead = 0) {
  __m512 acc[R][M];
  const float* srow[R];
  const int64_t stride = step * K;  // between the block's rows
  for (int r = 0; r < R; ++r) {
    srow[r] = scales.row(n + r * step);
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  int64_t block = 0, block_end = scales.bk;  // the column block of chunk k (no division per chunk)
  constexpr int V = W::step / 16;  // fp32 vectors per chunk
  // One chunk of `step` columns at k; `mask...`: none for a whole chunk, else the columns left
  // (zeros are loaded past the end).
  auto chunk = [&](int64_t k, auto... mask) __attribute__((always_inline)) {
    if (k % 64 == 0) {  // one cache line per row
      if (next)
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * stride + k), _MM_HINT_T0);
      else if (ahead)
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * stride + k + ahead), _MM_HINT_T1);
    }
    __m512 xv[M][V];  // x is padded with zero columns to a multiple of 32 (quantized_linear)
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) xv[m][v] = _mm512_loadu_ps(x + m * Kp + k + 16 * v);
    if constexpr (Blocked) {
      if (k >= block_end) ++block, block_end += scales.bk;
    }
    for (int r = 0; r < R; ++r) {
      __m512 wv[V];
      W::load(w + r * stride + k, mask..., wv);
      if constexpr (Blocked) {
        const __m512 s = _mm512_set1_ps(srow[r][block]);
        for (int v = 0; v < V; ++v) wv[v] = _mm512_mul_ps(wv[v], s);
      }
      for (int m = 0; m < M; ++m)
        for (int v = 0; v < V; ++v) acc[r][m] = _mm512_fmadd_ps(wv[v], xv[m][v], acc[r][m]);
    }
  };
  int64_t k = 0;
  for (; k + W::step <= K; k += W::step) chunk(k);
  if (k < K) chunk(k, first<W::step>(K - k));
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * N + r * step] = static_cast<Out>(_mm512_reduce_add_ps(acc[r][m]) * W::unit *
                                                 (Blocked ? 1.0f : srow[r][0]) +
                                             (bias ? bias[r * step] : 0.0f));
}

// Rows are read in groups of S * R (S: `read_order.h`'s spacing): the group's block j is its rows
// j, j + S, ..., j + (R - 1) * S, so the R streams read at once lie in different 4 KB pages, and
// the hardware prefetcher, running on past a row to its page's end, fetches rows the next blocks
// read. On the 1.1B shapes at one row of x, R adjacent rows (of 2 KB at K = 2048: two streams per
// page) read 18-25 GB/s of int8 and S = 4 22-30 on the Ice Lake machine (docs/cpu-backend.md,
// "Int8 decode against bf16"); on Zen 4, S = 16 (rows 32 KB apart) was faster still.
// Output rows [n0, n1) of y (one thread's share).
template <typename W, bool Blocked, int M, int R, typename Out>
void run_rows(const float* x, const typename W::T* w, const Scales& scales, const float* bias, Out* y, int64_t K,
              int64_t Kp, int64_t N, int64_t n0, int64_t n1) {
  const nxdi_read_order::Order order = nxdi_read_order::of(M, 1);
  auto block = [&](int64_t n, int64_t step, const typename W::T* next) __attribute__((always_inline)) {
    dot_rows<W, Blocked, M, R>(x, w + n * K, next, step, scales, n, bias ? bias + n : nullptr, y + n, K, Kp, N,
                               order.ahead);
  };
  const int64_t S = order.spacing, G = S * R;
  int64_t n = n0;
  for (; n + G <= n1; n += G)
    for (int64_t j = 0; j < S; ++j)
      block(n + j, S,
            !order.prefetch ? nullptr
            : j + 1 < S     ? w + (n + j + 1) * K
                            : (n + 2 * G <= n1 ? w + (n + G) * K : nullptr));
  for (; n + R <= n1; n += R) block(n, 1, order.prefetch && n + 2 * R <= n1 ? w + (n + R) * K : nullptr);
  for (; n < n1; ++n)
    dot_rows<W, Blocked, M, 1>(x, w + n * K, nullptr, 1, scales, n, bias ? bias + n : nullptr, y + n, K, Kp, N);
}

// Blocked or not, the row-count template for M rows of x; output rows [n0, n1).
template <typename W, bool Blocked, typename Out>
void run_scaled(const float* x, const typename W::T* w, const Scales& scales, const float* bias, Out* y, int64_t M,
                int64_t K, int64_t Kp, int64_t N, int64_t n0, int64_t n1) {
  // R * M accumulators stay within the 32 vector registers with the loads beside them.
  switch (M) {
    case 1: run_rows<W, Blocked, 1, 8>(x, w, scales, bias, y, K, Kp, N, n0, n1); break;
    case 2: run_rows<W, Blocked, 2, 8>(x, w, scales, bias, y, K, Kp, N, n0, n1); break;
    case 3: run_rows<W, Blocked, 3, 4>(x, w, scales, bias, y, K, Kp, N, n0, n1); break;
    default: run_rows<W, Blocked, 4, 4>(x, w, scales, bias, y, K, Kp, N, n0, n1); break;
  }
}

// y[:, n0:n1] = x @ w[n0:n1].T * scale (+ bias), on the calling thread.
template <typename W, typename Out>
void run(const float* x, const typename W::T* w, const Scales& scales, const float* bias, Out* y, int64_t M, int64_t K,
         int64_t Kp, int64_t N, int64_t n0, int64_t n1) {
  if (scales.bk == K && scales.bn == 1)
    run_scaled<W, false>(x, w, scales, bias, y, M, K, Kp, N, n0, n1);
  else
    run_scaled<W, true>(x, w, scales, bias, y, M, K, Kp, N, n0, n1);
}

// Output rows are split over torch's threads, at least 64 rows (a few KB of weights) per task.
constexpr int64_t GRAIN = 64;

// x [M, K] (bf16, fp16 or fp32, contiguous) as fp32 rows of Kp >= K columns, zeros past K. Exact:
// each 16-bit value is a float32 value.
void widen_rows(const at::Tensor& x, float* out, int64_t M, int64_t K, int64_t Kp) {
  for (int64_t m = 0; m < M; ++m) {
    float* o = out + m * Kp;
    if (x.scalar_type() == at::kFloat) {
      std::copy_n(x.data_ptr<float>() + m * K, K, o);
    } else {
      const auto* r = static_cast<const uint16_t*>(x.data_ptr()) + m * K;
      const bool bf16 = x.scalar_type() == at::kBFloat16;
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = first<16>(K - k);
        const __m256i h = _mm256_maskz_loadu_epi16(mask, r + k);
        const __m512 f = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
        _mm512_mask_storeu_ps(o + k, mask, f);
      }
    }
    std::fill(o + K, o + Kp, 0.0f);
  }
}

// Columns of x once widened: a multiple of 32, so every chunk a kernel reads is whole.
int64_t padded(int64_t K) { return (K + 31) / 32 * 32; }

// x's M rows widened to fp32 (Kp columns each, zeros past K) in the calling thread's buffer, valid
// until its next call.
const float* widened(const at::Tensor& x, int64_t M, int64_t K, int64_t Kp) {
  thread_local std::vector<float> xf;
  xf.resize(M * Kp);
  widen_rows(x.contiguous(), xf.data(), M, K, Kp);
  return xf.data();
}

// t as float32 and contiguous, without a torch dispatch when it already is.
at::Tensor as_f32(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

// A [N, K] weight of format W with its scale, checked and read where they lie (float32 scales as
// they are: no dispatch).
template <typename W>
struct Weight {
  at::Tensor values, scale;  // contiguous; float32
  Scales scales;             // points into `scale`
  const typename W::T* data() const { return static_cast<const typename W::T*>(values.data_ptr()); }
};

template <typename W>
Weight<W> weight_of(const char* name, const char* label, const at::Tensor& w, const at::Tensor& scale, int64_t K) {
  const int64_t N = w.size(0);
  TORCH_CHECK(blocks_fit(scale, N, K, W::step), name, ": ", label,
              " must be [N], or [N / bn, K / bk] with bk a multiple of ", W::step);
  Weight<W> out{w.contiguous(), as_f32(scale), {}};
  out.scales = scales_of(out.scale, N, K);
  return out;
}

template <typename W>
at::Tensor quantized_linear(const char* name, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [M, K] and w [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const Weight<W> weight = weight_of<W>(name, "scale", w, scale, K);
  TORCH_CHECK(M >= 1 && M <= 4, name, ": x must have 1 to 4 rows");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), name, ": bias must be [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat, name,
              ": x must be bf16, fp16 or fp32");
  // x is at most 4 rows: widened to fp32 once, here, rather than per weight vector, and padded
  // with zero columns to a multiple of 32 (the weights' last chunk is read masked). Widened by
  // `widen_rows` into this thread's buffer, and the scale and bias read as they are when already
  // float32: in a decode step each op runs after a linear has streamed its weights through the
  // caches, where every extra torch dispatch (a conversion is four) costs tens of microseconds
  // (docs/cpu-backend.md, "Decode steps outside the linears (Ice Lake)").
  const int64_t Kp = padded(K);
  const float* xf = widened(x, M, K, Kp);
  const auto* wp = weight.data();
  const Scales& scales = weight.scales;
  const at::Tensor bf = bias.has_value() ? as_f32(*bias) : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());  // written in x's dtype: no conversion pass after
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
    switch (x.scalar_type()) {
      case at::kBFloat16: run<W>(xf, wp, scales, bp, y.data_ptr<at::BFloat16>(), M, K, Kp, N, n0, n1); break;
      case at::kHalf: run<W>(xf, wp, scales, bp, y.data_ptr<at::Half>(), M, K, Kp, N, n0, n1); break;
      default: run<W>(xf, wp, scales, bp, y.data_ptr<float>(), M, K, Kp, N, n0, n1); break;
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_linear: w must be int8");
  return quantized_linear<Int8>("int8_linear", x, w, scale, bias);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  if (w.scalar_type() == at::kFloat8_e4m3fn) return quantized_linear<Fp8E4m3>("fp8_linear", x, w, scale, bias);
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e5m2, "fp8_linear: w must be float8_e4m3fn or float8_e5m2");
  return quantized_linear<Fp8E5m2>("fp8_linear", x, w, scale, bias);
}

// --- SwiGLU: silu(x @ w_gate.T * gate_scale) * (x @ w_up.T * up_scale) -----------------------
// The MLP's two linears, torch's silu and its product in one call (four dispatches and two
// parallel regions before, each just after a linear streamed its weights; docs/cpu-backend.md,
// "Decode steps outside the linears (Ice Lake)"). bf16 x only. Each thread computes the gate and
// up rows of its share of N (the same bits as `quantized_linear`'s), then their SwiGLU, rounded to
// bf16 where torch's ops round: the linears' outputs, silu (x / (1 + exp(-x)) in fp32 with SLEEF's
// exp, as torch's), and the product.

template <typename W>
at::Tensor quantized_swiglu(const char* name, const at::Tensor& x, const at::Tensor& w_gate,
                            const at::Tensor& gate_scale, const at::Tensor& w_up, const at::Tensor& up_scale) {
  TORCH_CHECK(x.dim() == 2 && w_gate.dim() == 2 && w_up.sizes() == w_gate.sizes() && x.size(1) == w_gate.size(1), name,
              ": x [M, K], w_gate and w_up [N, K]");
  TORCH_CHECK(w_up.scalar_type() == w_gate.scalar_type(), name, ": w_gate and w_up must have one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w_gate.size(0);
  const Weight<W> gate = weight_of<W>(name, "gate_scale", w_gate, gate_scale, K);
  const Weight<W> up = weight_of<W>(name, "up_scale", w_up, up_scale, K);
  TORCH_CHECK(M >= 1 && M <= 4, name, ": x must have 1 to 4 rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": x must be bf16");
  const int64_t Kp = padded(K);
  const float* xf = widened(x, M, K, Kp);
  thread_local std::vector<at::BFloat16> gate_up;  // the two linears' bf16 outputs, [2, M, N]
  gate_up.resize(2 * M * N);
  at::BFloat16 *g = gate_up.data(), *u = g + M * N;
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
    run<W>(xf, gate.data(), gate.scales, nullptr, g, M, K, Kp, N, n0, n1);
    run<W>(xf, up.data(), up.scales, nullptr, u, M, K, Kp, N, n0, n1);
    for (int64_t m = 0; m < M; ++m)
      nxdi_lanes::swiglu_span(reinterpret_cast<const uint16_t*>(g + m * N + n0), reinterpret_cast<const uint16_t*>(u + m * N + n0),
                  yp + m * N + n0, n1 - n0);
  });
  return y;
}

at::Tensor int8_swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& gate_scale,
                       const at::Tensor& w_up, const at::Tensor& up_scale) {
  TORCH_CHECK(w_gate.scalar_type() == at::kChar, "int8_swiglu: w_gate must be int8");
  return quantized_swiglu<Int8>("int8_swiglu", x, w_gate, gate_scale, w_up, up_scale);
}

at::Tensor fp8_swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& gate_scale,
                      const at::Tensor& w_up, const at::Tensor& up_scale) {
  if (w_gate.scalar_type() == at::kFloat8_e4m3fn)
    return quantized_swiglu<Fp8E4m3>("fp8_swiglu", x, w_gate, gate_scale, w_up, up_scale);
  TORCH_CHECK(w_gate.scalar_type() == at::kFloat8_e5m2, "fp8_swiglu: w_gate must be float8_e4m3fn or float8_e5m2");
  return quantized_swiglu<Fp8E5m2>("fp8_swiglu", x, w_gate, gate_scale, w_up, up_scale);
}

// --- dequantize, for prefill ------------------------------------------------------------------
// Prefill's linears (more rows than the decode kernel takes) stay on oneDNN's bf16 GEMM, which
// needs the float weight: built here in one pass, y[n, k] = dtype(float(values[n, k]) * s), s the
// scale of row n (or of the block holding (n, k)), the bits of `programs.linear.dequantize`
// (float32 product, rounded to nearest even), where its
// three torch ops wrote a float32 weight twice and a third copy (2.3 s of a 1.1B int8 prefill).

// float32 -> bf16 bits, round to nearest even, NaN kept a (quiet) NaN: c10's rounding, 16 lanes.
__m256i to_bf16_bits(__m512 f) { return _mm512_cvtepi32_epi16(nxdi_lanes::round_bf16(f)); }

template <typename Out>
void store16(Out* y, __m512 f, __mmask16 mask) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_mask_storeu_ps(y, mask, f);
  } else if constexpr (std::is_same_v<Out, at::BFloat16>) {
    _mm256_mask_storeu_epi16(y, mask, to_bf16_bits(f));
  } else {
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <typename W, typename Out>
void dequantize_rows(const typename W::T* v, const Scales& scales, Out* y, int64_t N, int64_t K) {
  const __m512 unit = _mm512_set1_ps(W::unit);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* srow = scales.row(n);
      int64_t block = 0, block_end = scales.bk;
      for (int64_t k = 0; k < K; k += W::step) {
        if (k >= block_end) ++block, block_end += scales.bk;
        const __m512 s = _mm512_set1_ps(srow[block]);
        const auto mask = first<W::step>(K - k);
        __m512 wv[W::step / 16];
        W::load(v + n * K + k, mask, wv);
        for (int j = 0; j < W::step / 16; ++j)  // the value (exact), then one float32 product: the pure bits
          store16(y + n * K + k + 16 * j, _mm512_mul_ps(_mm512_mul_ps(wv[j], unit), s), __mmask16(mask >> (16 * j)));
      }
    }
  });
}

template <typename W, typename Out>
void dequantize_as(const at::Tensor& v, const at::Tensor& s, at::Tensor& y) {
  dequantize_rows<W>(static_cast<const typename W::T*>(v.data_ptr()), scales_of(s, v.size(0), v.size(1)),
                     y.data_ptr<Out>(), v.size(0), v.size(1));
}

template <typename W>
void dequantize_from(const at::Tensor& v, const at::Tensor& s, at::Tensor& y) {
  TORCH_CHECK(blocks_fit(s, v.size(0), v.size(1), W::step),
              "weight_dequantize: scale must be [N], or [N / bn, K / bk] with bk a multiple of ", W::step);
  switch (y.scalar_type()) {
    case at::kBFloat16: dequantize_as<W, at::BFloat16>(v, s, y); break;
    case at::kHalf: dequantize_as<W, at::Half>(v, s, y); break;
    case at::kFloat: dequantize_as<W, float>(v, s, y); break;
    default: TORCH_CHECK(false, "weight_dequantize: dtype must be bf16, fp16 or fp32");
  }
}

at::Tensor weight_dequantize(const at::Tensor& values, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(values.dim() == 2, "weight_dequantize: values must be [N, K]");
  const at::Tensor vc = values.contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty(values.sizes(), values.options().dtype(dtype));
  switch (values.scalar_type()) {
    case at::kChar: dequantize_from<Int8>(vc, sf, y); break;
    case at::kFloat8_e4m3fn: dequantize_from<Fp8E4m3>(vc, sf, y); break;
    case at::kFloat8_e5m2: dequantize_from<Fp8E5m2>(vc, sf, y); break;
    default: TORCH_CHECK(false, "weight_dequantize: values must be int8, float8_e4m3fn or float8_e5m2");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(nxdi_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("fp8_linear", c10::DispatchKey::CPU, &fp8_linear);
  m.def("int8_swiglu(Tensor x, Tensor w_gate, Tensor gate_scale, Tensor w_up, Tensor up_scale) -> Tensor");
  m.impl("int8_swiglu", c10::DispatchKey::CPU, &int8_swiglu);
  m.def("fp8_swiglu(Tensor x, Tensor w_gate, Tensor gate_scale, Tensor w_up, Tensor up_scale) -> Tensor");
  m.impl("fp8_swiglu", c10::DispatchKey::CPU, &fp8_swiglu);
  m.def("weight_dequantize(Tensor values, Tensor scale, ScalarType dtype) -> Tensor");
  m.impl("weight_dequantize", c10::DispatchKey::CPU, &weight_dequantize);
}
