// nxdi's bf16 linear for decode on CPUs with AVX512-BF16: y = x @ w.T (+ bias).
//
// x [M, K] bf16 (M <= 4 rows), w [N, K] bf16 as stored (row-major, not repacked), bias [N] or none;
// y [M, N] bf16. Products are summed in fp32 by vdpbf16ps (two bf16 pairs per lane per
// instruction) and rounded to bf16 once, after the bias: the result equals F.linear's up to fp32
// summation order. R output rows are read at once, R sequential streams interleaved: a decode
// step is bound by how many weight bytes one core keeps in flight, and one stream per core
// measured 17-19 GB/s where eight reached 25-33 GB/s (torch's F.linear 13-20, oneDNN with a
// prepacked weight about 10, on the development machine), and the next block of rows is
// prefetched while one is read (a block's rows are short streams the hardware prefetcher restarts
// on; 1.3-1.7x more). Measurements: docs/cpu-backend.md, "bf16 decode linears". Output rows are
// split over torch's intra-op (OpenMP) threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

namespace {

// The kernel alone is built for AVX512-BF16; `bf16_dot_supported()` is asked before it is used.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

// `next`: the following block of R rows (or null): fetched into cache while this block is read.
template <int M, int R>
void dot_rows(const uint16_t* x, const uint16_t* w, const uint16_t* next, const float* bias, at::BFloat16* y,
              int64_t K, int64_t N) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    // The last chunk of a K that is not a multiple of 32 loads zeros past the end.
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    if (next)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T0);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * N + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[r] : 0.0f));
}

template <int M, int R>
void run(const uint16_t* x, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t K, int64_t N) {
  // Grain: at least 64 output rows per task, so two threads split a matrix into two long runs.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
      const uint16_t* next = n + 2 * R <= n1 ? w + (n + R) * K : nullptr;
      dot_rows<M, R>(x, w + n * K, next, bias ? bias + n : nullptr, y + n, K, N);
    }
    for (; n < n1; ++n) dot_rows<M, 1>(x, w + n * K, nullptr, bias ? bias + n : nullptr, y + n, K, N);
  });
}

#pragma GCC pop_options

bool bf16_dot_supported() { return __builtin_cpu_supports("avx512bf16"); }

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_dot_supported(), "bf16_linear: this CPU lacks AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_linear: x and w must be bf16");
  TORCH_CHECK(w.is_contiguous(), "bf16_linear: w must be contiguous");  // a copy per call would cost more than it saves
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 4, "bf16_linear: x must have 1 to 4 rows");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "bf16_linear: bias must be [N]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  // R * M accumulators stay within the 32 vector registers with the loads beside them.
  switch (M) {
    case 1: run<1, 8>(xp, wp, bp, yp, K, N); break;
    case 2: run<2, 8>(xp, wp, bp, yp, K, N); break;
    case 3: run<3, 4>(xp, wp, bp, yp, K, N); break;
    default: run<4, 4>(xp, wp, bp, yp, K, N); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, &bf16_linear);
  m.def("bf16_dot_supported() -> bool", &bf16_dot_supported);
}
