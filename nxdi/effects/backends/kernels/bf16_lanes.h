// The helpers nxdi's bf16 kernels share (bf16_pointwise.cpp, decode_attention.cpp, the SwiGLU of
// bf16_linear.cpp and quantized_linear.cpp): 16 bf16 lanes at a time as fp32 on AVX-512, with
// torch's rounding back, broadcast strides, and torch's silu and its product.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

// SLEEF's exp, exported by libtorch_cpu: the one torch's vectorized silu calls on AVX-512, so
// `swiglu_span` below gives torch's silu bits (equal to torch's silu on all 65536 bf16 inputs when
// measured; tests/unit/test_swiglu_kernel.py runs every finite one through the op). A torch build
// without the symbol fails the library's load, which `kernels.load()` reports.
extern "C" __m512 Sleef_expf16_u10(__m512);

namespace nxdi_lanes {

// The lanes of a 16-wide step that lie before the end, `left` values away.
inline __mmask16 tail(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// 16 bf16 values as fp32; lanes outside `mask` are zero.
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// fp32 -> bf16 (the low half of each 32-bit lane), round to nearest even, NaN kept a quiet NaN:
// torch's conversion.
inline __m512i round_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// The value a bf16 tensor would hold for f.
inline __m512 as_bf16(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(f), 16)); }

inline void store_bf16(uint16_t* p, __mmask16 mask, __m512 f) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(round_bf16(f)));
}

// The element strides of t read as a tensor of `sizes` (t's dims of size 1 broadcast: stride 0),
// without the torch dispatch `expand` would cost.
inline std::vector<int64_t> broadcast_strides(const at::Tensor& t, at::IntArrayRef sizes) {
  std::vector<int64_t> st(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) st[i] = t.size(i) == 1 ? 0 : t.stride(i);
  return st;
}

// y[i] = silu(g[i]) * u[i] over n bf16 values, rounded to bf16 where torch's two ops round: silu
// (x / (1 + exp(-x)) in fp32 with SLEEF's exp, as torch's), then the product.
inline void swiglu_span(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = tail(n - k);
    const __m512 gv = load_bf16(g + k, mask);
    const __m512 silu = as_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(gv, sign)))));
    store_bf16(y + k, mask, _mm512_mul_ps(silu, load_bf16(u + k, mask)));
  }
}

}  // namespace nxdi_lanes
