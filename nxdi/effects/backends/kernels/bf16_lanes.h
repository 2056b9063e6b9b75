// The helpers nxdi's bf16 kernels share (bf16_pointwise.cpp, decode_attention.cpp): 16 bf16 lanes
// at a time as fp32 on AVX-512, with torch's rounding back, and broadcast strides.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

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

}  // namespace nxdi_lanes
