// nxdi's bf16 pointwise ops for decode steps on AVX-512 CPUs, each one op where torch dispatches
// several: in a decode step each op runs just after a linear has streamed megabytes of weights
// through the caches, where every torch dispatch costs tens of microseconds (100-190 us for an
// RMSNorm's seven at 4 rows of 2048, against 25 us alone; docs/cpu-backend.md, "Decode steps
// outside the linears"). Each rounds to bf16 where torch's ops do, so the results are torch's bits
// (up to fp32 summation order in the norm).
//
// - rms_norm: x [R, N] bf16 (rows contiguous), w [N] bf16; y [R, N] bf16. Per row: the mean of x^2
//   in fp32, r = 1 / sqrt(mean + eps), n = bf16(x * r) and y = bf16(w * n): what transformers'
//   Llama RMSNorm and `w * F.rms_norm(x)` compute (both round after the norm and again after the
//   weight). Seven torch dispatches.
// - rope: y = x * cos + roll(x, D / 2, -1) * sin for bf16 x [..., D] and cos, sin broadcast to it
//   (`programs.layers.apply_rope`, the "rotate half" layout with the sign folded into sin): each
//   product rounded to bf16, then the sum. Four torch dispatches (two products, the roll, the sum).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16_lanes.h"

namespace {

using namespace nxdi_lanes;


void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t N, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < N; k += 16) {
    const __m512 v = load_bf16(x + k, tail(N - k));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / float(N) + eps));
  for (int64_t k = 0; k < N; k += 16) {
    const __mmask16 mask = tail(N - k);
    const __m512 n = as_bf16(_mm512_mul_ps(load_bf16(x + k, mask), r));
    store_bf16(y + k, mask, _mm512_mul_ps(load_bf16(w + k, mask), n));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "rms_norm: x and w must be bf16");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: x [..., N] and w [N]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t N = w.size(0), rows = N ? xc.numel() / N : 0;
  at::Tensor y = at::empty_like(xc);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // A decode step's few rows stay on this thread (waking another costs more than they take).
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * N, wp, yp + r * N, N, float(eps));
  });
  return y;
}

// One row of rope: y[k] = x[k] c[k] + x[k + h] s[k] and y[h + k] = x[h + k] c[h + k] + x[k] s[h + k]
// for k < h = D / 2, each product and the sum rounded to bf16 as torch's three ops do.
void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* y, int64_t h) {
  for (int64_t k = 0; k < h; k += 16) {
    const __mmask16 mask = tail(h - k);
    const __m512 lo = load_bf16(x + k, mask), hi = load_bf16(x + h + k, mask);
    const __m512 y_lo = _mm512_add_ps(as_bf16(_mm512_mul_ps(lo, load_bf16(c + k, mask))),
                                      as_bf16(_mm512_mul_ps(hi, load_bf16(s + k, mask))));
    const __m512 y_hi = _mm512_add_ps(as_bf16(_mm512_mul_ps(hi, load_bf16(c + h + k, mask))),
                                      as_bf16(_mm512_mul_ps(lo, load_bf16(s + h + k, mask))));
    store_bf16(y + k, mask, y_lo);
    store_bf16(y + h + k, mask, y_hi);
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16,
              "rope: x, cos and sin must be bf16");
  const int64_t nd = x.dim(), D = nd ? x.size(-1) : 0;
  TORCH_CHECK(nd >= 1 && D % 2 == 0 && cos.dim() == nd && sin.dim() == nd, "rope: x [..., D] with D even, and cos, sin of x's rank");
  for (int64_t i = 0; i < nd; ++i)
    TORCH_CHECK((cos.size(i) == 1 || cos.size(i) == x.size(i)) && (sin.size(i) == 1 || sin.size(i) == x.size(i)),
                "rope: cos and sin must broadcast to x");
  TORCH_CHECK(cos.size(-1) == D && sin.size(-1) == D, "rope: cos and sin must have x's last dim");
  // Rows are read where they lie (a slice of the fused qkv output, say), each row contiguous.
  const at::Tensor xr = x.stride(-1) == 1 ? x : x.contiguous();
  const at::Tensor cr = cos.stride(-1) == 1 ? cos : cos.contiguous();
  const at::Tensor sr = sin.stride(-1) == 1 ? sin : sin.contiguous();
  const auto sizes = x.sizes();
  const std::vector<int64_t> xs = broadcast_strides(xr, sizes), cs = broadcast_strides(cr, sizes),
                             ss = broadcast_strides(sr, sizes);
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t rows = D ? x.numel() / D : 0;
  const auto* xp = reinterpret_cast<const uint16_t*>(xr.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cr.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sr.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // A decode step's rows (a few dozen heads) stay on this thread, as in rms_norm.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t xo = 0, co = 0, so = 0, rest = r;  // the offsets of row r, from its leading indices
      for (int64_t i = nd - 2; i >= 0; --i) {
        const int64_t idx = rest % sizes[i];
        rest /= sizes[i];
        xo += idx * xs[i], co += idx * cs[i], so += idx * ss[i];
      }
      rope_row(xp + xo, cp + co, sp + so, yp + r * D, D / 2);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, &rope);
}
