// nxdi's decode attention for bf16 on AVX-512 CPUs: `F.scaled_dot_product_attention(q, k, v, mask)`
// for the few query rows of a decode step, as one compact op.
//
// q [B, H, L, D], k and v [B, H, T, D] (bf16, each row contiguous; the decoder folds a GQA group's
// query heads into L), mask bool broadcasting to [B, H, L, T] (true: may attend); out [B, H, L, D]
// bf16. Per query row, as torch's CPU flash attention computes it for bf16: scores q.k in fp32
// times 1 / sqrt(D), -inf where the mask hides a slot, p = exp(score - max) in fp32, the sum of p,
// p rounded to bf16 for the product with v (fp32 sums), divided by the sum and rounded once. The
// results differ from torch's by summation order and exp's last bits (within a bf16 step);
// a row that sees no slot gives zeros, as torch's does. Slots the mask hides are not read, so a
// short sequence in a long cache bucket costs its length.
//
// Why: each op of a decode step runs just after a linear has streamed megabytes of weights through
// the caches, where torch's attention (its dispatch, mask conversion and GEMM set-up) costs
// 140-230 us per call against 50 us alone (docs/cpu-backend.md, "Decode steps outside the linears").
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "bf16_lanes.h"

namespace {

using namespace nxdi_lanes;

constexpr int MAX_VECTORS = 16;  // D up to 256

// exp of 16 fp32 lanes for x <= 0: 2^n 2^f with n = round(x log2 e), a degree-6 polynomial of the
// remainder (within 2 ulp of expf); lanes below -87.3 (exp under fp32's smallest normal) give 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // x - n ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

struct Rows {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const bool* mask;
  uint16_t* out;
  int64_t q_row, k_row, v_row, mask_row, mask_col;  // element strides
};

// One (sequence, head): its L query rows against T slots; `s` holds T floats.
void attend(const Rows& a, int64_t L, int64_t T, int64_t D, float scale, float* s) {
  const int64_t V = D / 16;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < L; ++l) {
    __m512 qv[MAX_VECTORS];
    for (int64_t j = 0; j < V; ++j) qv[j] = load_bf16(a.q + l * a.q_row + 16 * j, 0xFFFF);
    const bool* seen = a.mask + l * a.mask_row;
    float top = NEG_INF;
    for (int64_t t = 0; t < T; ++t) {
      if (!seen[t * a.mask_col]) {
        s[t] = NEG_INF;
        continue;
      }
      const uint16_t* kr = a.k + t * a.k_row;
      __m512 acc = _mm512_mul_ps(qv[0], load_bf16(kr, 0xFFFF));
      for (int64_t j = 1; j < V; ++j) acc = _mm512_fmadd_ps(qv[j], load_bf16(kr + 16 * j, 0xFFFF), acc);
      s[t] = _mm512_reduce_add_ps(acc) * scale;
      top = std::max(top, s[t]);
    }
    __m512 out[MAX_VECTORS];
    for (int64_t j = 0; j < V; ++j) out[j] = _mm512_setzero_ps();
    uint16_t* o = a.out + l * D;
    if (top == NEG_INF) {  // no slot visible: zeros, as torch gives
      for (int64_t j = 0; j < V; ++j) store_bf16(o + 16 * j, 0xFFFF, out[j]);
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t += 16) {
      const __mmask16 m = tail(T - t);
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), _mm512_set1_ps(top)));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, p));
      _mm512_mask_storeu_ps(s + t, m, as_bf16(p));  // v is multiplied by p rounded to bf16, as torch's GEMM does
    }
    for (int64_t t = 0; t < T; ++t) {
      if (!seen[t * a.mask_col]) continue;
      const __m512 p = _mm512_set1_ps(s[t]);
      const uint16_t* vr = a.v + t * a.v_row;
      for (int64_t j = 0; j < V; ++j) out[j] = _mm512_fmadd_ps(p, load_bf16(vr + 16 * j, 0xFFFF), out[j]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < V; ++j) store_bf16(o + 16 * j, 0xFFFF, _mm512_mul_ps(out[j], inv));
  }
}

// The stride of t's dim i read as a dim of `size` (a broadcast dim of size 1: 0).
int64_t stride_as(const at::Tensor& t, int64_t i, int64_t size) { return t.size(i) == 1 && size != 1 ? 0 : t.stride(i); }

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "decode_attention: q, k and v must be bf16");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "decode_attention: mask must be bool");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "decode_attention: q [B, H, L, D], k and v [B, H, T, D], mask [B or 1, H or 1, L or 1, T or 1]");
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(),
              "decode_attention: k and v must be [B, H, T, D] with q's B, H and D");
  TORCH_CHECK(D % 16 == 0 && D > 0 && D <= 16 * MAX_VECTORS, "decode_attention: head dim must be a multiple of 16, at most ",
              16 * MAX_VECTORS);
  const int64_t want[4] = {B, H, L, T};
  for (int64_t i = 0; i < 4; ++i)
    TORCH_CHECK(mask.size(i) == 1 || mask.size(i) == want[i], "decode_attention: mask must broadcast to [B, H, L, T]");
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({B, H, L, D}, q.options());
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));  // torch's default
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const bool* mp = mask.data_ptr<bool>();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores;
    scores.resize(T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      const Rows rows{qp + b * qc.stride(0) + h * qc.stride(1),
                      kp + b * kc.stride(0) + h * kc.stride(1),
                      vp + b * vc.stride(0) + h * vc.stride(1),
                      mp + b * stride_as(mask, 0, B) + h * stride_as(mask, 1, H),
                      op + i * L * D,
                      qc.stride(2),
                      kc.stride(2),
                      vc.stride(2),
                      stride_as(mask, 2, L),
                      stride_as(mask, 3, T)};
      attend(rows, L, T, D, scale, scores.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
