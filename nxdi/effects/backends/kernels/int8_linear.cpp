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

}  // namespace

TORCH_LIBRARY(nxdi_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
