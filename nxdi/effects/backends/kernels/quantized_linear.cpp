// nxdi's weight-only int8 linear for decode on AVX-512 CPUs: y = (x @ w.T) * scale (+ bias).
//
// x [M, K] (bf16, fp16 or fp32; M <= 4 rows), w [N, K] int8, scale [N] float32, bias [N] or none.
// Each weight byte is read once, in order, and widened to fp32 in registers (vpmovsxbd +
// vcvtdq2ps); the rows of x are multiplied with fp32 FMAs, so the result equals
// dequantize-then-multiply up to fp32 summation order. R output rows are read at once, R
// sequential streams interleaved: on the development machine with AMX one stream per core read
// 13 GB/s of int8 and eight 15-20 GB/s (on an earlier Zen 5 machine one stream with unrolled
// accumulators had measured best; the interleaved loop was chosen on the machine it runs on now),
// and the next block of rows is prefetched while one is read (30 GB/s of int8 then). Output rows are split over torch's intra-op (OpenMP) threads. Measurements: docs/cpu-backend.md,
// "Quantized weights".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <type_traits>

namespace {


// `next`: the following block of R rows (or null): fetched into cache while this block is read.
template <int M, int R, typename Out>
void dot_rows(const float* x, const int8_t* w, const int8_t* next, const float* scale, const float* bias, Out* y,
              int64_t K, int64_t N) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (next && k % 64 == 0)  // one cache line per row
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T0);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k));
      const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wf, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * static_cast<float>(w[r * K + t]);
      y[m * N + r] = static_cast<Out>(s * scale[r] + (bias ? bias[r] : 0.0f));
    }
}

template <int M, int R, typename Out>
void run_rows(const float* x, const int8_t* w, const float* scale, const float* bias, Out* y, int64_t K, int64_t N) {
  // Grain: at least 64 output rows (a few KB of weights) per task.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
      const int8_t* next = n + 2 * R <= n1 ? w + (n + R) * K : nullptr;
      dot_rows<M, R>(x, w + n * K, next, scale + n, bias ? bias + n : nullptr, y + n, K, N);
    }
    for (; n < n1; ++n) dot_rows<M, 1>(x, w + n * K, nullptr, scale + n, bias ? bias + n : nullptr, y + n, K, N);
  });
}

template <typename Out>
void run(const float* x, const int8_t* w, const float* scale, const float* bias, Out* y, int64_t M, int64_t K,
         int64_t N) {
  // R * M accumulators stay within the 32 vector registers with the loads beside them.
  switch (M) {
    case 1: run_rows<1, 8>(x, w, scale, bias, y, K, N); break;
    case 2: run_rows<2, 8>(x, w, scale, bias, y, K, N); break;
    case 3: run_rows<3, 4>(x, w, scale, bias, y, K, N); break;
    default: run_rows<4, 4>(x, w, scale, bias, y, K, N); break;
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_linear: w must be int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0), "int8_linear: scale must be [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4, "int8_linear: x must have 1 to 4 rows");
  // x is at most 4 rows: widened to fp32 once, here, rather than per weight vector.
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = w.contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());  // written in x's dtype: no conversion pass after
  switch (x.scalar_type()) {
    case at::kBFloat16:
      run(xf.data_ptr<float>(), wc.data_ptr<int8_t>(), sf.data_ptr<float>(), bp, y.data_ptr<at::BFloat16>(), M, K, N);
      break;
    case at::kHalf:
      run(xf.data_ptr<float>(), wc.data_ptr<int8_t>(), sf.data_ptr<float>(), bp, y.data_ptr<at::Half>(), M, K, N);
      break;
    case at::kFloat:
      run(xf.data_ptr<float>(), wc.data_ptr<int8_t>(), sf.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
      break;
    default:
      TORCH_CHECK(false, "int8_linear: x must be bf16, fp16 or fp32");
  }
  return y;
}

// --- dequantize, for prefill ------------------------------------------------------------------
// Prefill's linears (more rows than the decode kernel takes) stay on oneDNN's bf16 GEMM, which
// needs the float weight: built here in one pass, y[n, k] = dtype(float(values[n, k]) * scale[n]),
// the bits of `programs.linear.dequantize` (float32 product, rounded to nearest even), where its
// three torch ops wrote a float32 weight twice and a third copy (2.3 s of a 1.1B int8 prefill).

// float32 -> bf16 bits, round to nearest even, NaN kept a (quiet) NaN: c10's rounding, 16 lanes.
__m256i to_bf16_bits(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

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

template <typename Out>
void dequantize_rows(const int8_t* v, const float* scale, Out* y, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const __m512 s = _mm512_set1_ps(scale[n]);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        const __m128i bytes = _mm_maskz_loadu_epi8(mask, v + n * K + k);
        store16(y + n * K + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s), mask);
      }
    }
  });
}

at::Tensor int8_dequantize(const at::Tensor& values, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar, "int8_dequantize: values must be [N, K] int8");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == values.size(0), "int8_dequantize: scale must be [N]");
  const at::Tensor vc = values.contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  const int64_t N = values.size(0), K = values.size(1);
  at::Tensor y = at::empty({N, K}, values.options().dtype(dtype));
  switch (dtype) {
    case at::kBFloat16: dequantize_rows(vc.data_ptr<int8_t>(), sf.data_ptr<float>(), y.data_ptr<at::BFloat16>(), N, K); break;
    case at::kHalf: dequantize_rows(vc.data_ptr<int8_t>(), sf.data_ptr<float>(), y.data_ptr<at::Half>(), N, K); break;
    case at::kFloat: dequantize_rows(vc.data_ptr<int8_t>(), sf.data_ptr<float>(), y.data_ptr<float>(), N, K); break;
    default: TORCH_CHECK(false, "int8_dequantize: dtype must be bf16, fp16 or fp32");
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(nxdi_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.def("int8_dequantize(Tensor values, Tensor scale, ScalarType dtype) -> Tensor");
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
}
