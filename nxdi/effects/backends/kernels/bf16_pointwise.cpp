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
// - add_rms_norm: s = bf16(a + b) (the decoder's residual sum) and rms_norm(s, w), both returned:
//   the sum feeds the next residual. One dispatch fewer per norm, and s normed while in L1.
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

// A decode step's few rows stay on this thread (waking another costs more than they take).
int64_t rows_grain(int64_t N) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "rms_norm: x and w must be bf16");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), "rms_norm: x [..., N] and w [N]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t N = w.size(0), rows = N ? xc.numel() / N : 0;
  at::Tensor y = at::empty_like(xc);
  const uint16_t *xp = bits(xc), *wp = bits(wc);
  uint16_t* yp = bits(y);
  at::parallel_for(0, rows, rows_grain(N), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * N, wp, yp + r * N, N, float(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                                                double eps) {
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "add_rms_norm: a, b and w must be bf16");
  TORCH_CHECK(a.sizes() == b.sizes(), "add_rms_norm: a and b must have one shape");
  TORCH_CHECK(a.dim() >= 1 && w.dim() == 1 && a.size(-1) == w.size(0), "add_rms_norm: a, b [..., N] and w [N]");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), wc = w.contiguous();
  const int64_t N = w.size(0), rows = N ? ac.numel() / N : 0;
  at::Tensor sum = at::empty_like(ac), y = at::empty_like(ac);
  const uint16_t *ap = bits(ac), *bp = bits(bc), *wp = bits(wc);
  uint16_t *sp = bits(sum), *yp = bits(y);
  at::parallel_for(0, rows, rows_grain(N), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * N;
      for (int64_t k = 0; k < N; k += 16) {  // torch's bf16 add: the fp32 sum, rounded
        const __mmask16 mask = tail(N - k);
        store_bf16(sp + o + k, mask, _mm512_add_ps(load_bf16(ap + o + k, mask), load_bf16(bp + o + k, mask)));
      }
      norm_row(sp + o, wp, yp + o, N, float(eps));
    }
  });
  return {sum, y};
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
  const uint16_t *xp = bits(xr), *cp = bits(cr), *sp = bits(sr);
  uint16_t* yp = bits(y);
  at::parallel_for(0, rows, rows_grain(D), [&](int64_t r0, int64_t r1) {
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
  m.def("add_rms_norm(Tensor a, Tensor b, Tensor w, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, &rope);
}
