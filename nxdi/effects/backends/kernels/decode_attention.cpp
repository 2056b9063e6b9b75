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
// short sequence in a long cache bucket costs its length. Scores are taken 16 slots at a time
// (the block's k rows widened once for all rows, 16 dot products finished together by `sum16`),
// and each widened row of v serves several query rows.
//
// Why: each op of a decode step runs just after a linear has streamed megabytes of weights through
// the caches, where torch's attention (its dispatch, mask conversion and GEMM set-up) cost 120-230
// us per call at 1 x 144 slots, against 40-70 us alone; this one 70-105 against 28-37
// (docs/cpu-backend.md, "Decode steps outside the linears (Ice Lake)").
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
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
  bool seen(int64_t l, int64_t t) const { return mask[l * mask_row + t * mask_col]; }
};

// Lane i of the result: the sum of a[i]'s 16 lanes (16 dot products finished at once: 45 shuffles
// and adds, where a horizontal sum each costs 8 in a chain).
inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit block: a[2j] in lanes 0 and 2, a[2j + 1] in 1 and 3
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per block: lane k holds a[4j + k]'s partial sum
    const __m512d x = _mm512_castps_pd(t[2 * j]), y = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Blocks summed across: block j of the result holds a[4j .. 4j + 3].
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
}

// One (sequence, head): its L query rows against T slots of D = 16 * V (VT: V known when compiled,
// so the vectors of a row stay in registers; 0: V = `v_count`). `s`: L * T + L floats (p, then
// each row's 1 / sum); `kf`: 16 * D.
template <int VT>
void attend(const Rows& a, int64_t L, int64_t T, int64_t v_count, float scale, float* s, float* kf) {
  const int64_t V = VT ? VT : v_count, D = 16 * V;
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  // Scores, 16 slots at a time: the block's k rows widened to fp32 once for all L rows.
  for (int64_t t0 = 0; t0 < T; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, T - t0);
    __mmask16 any = 0;  // the block's slots some row sees; a block no row sees is not read
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < n; ++i) any |= __mmask16(a.seen(l, t0 + i)) << i;
    if (!any) {
      for (int64_t l = 0; l < L; ++l) std::fill_n(s + l * T + t0, n, NEG_INF);
      continue;
    }
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t j = 0; j < V; ++j)
        _mm512_storeu_ps(kf + i * D + 16 * j, load_bf16(a.k + (t0 + i) * a.k_row + 16 * j, (any >> i) & 1 ? 0xFFFF : 0));
    for (int64_t l = 0; l < L; ++l) {
      __m512 qv[MAX_VECTORS], acc[16];
      for (int64_t j = 0; j < V; ++j) qv[j] = load_bf16(a.q + l * a.q_row + 16 * j, 0xFFFF);
      for (int64_t i = 0; i < 16; ++i) {
        acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kf + i * D));
        for (int64_t j = 1; j < V; ++j) acc[i] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kf + i * D + 16 * j), acc[i]);
      }
      __mmask16 seen = 0;
      for (int64_t i = 0; i < n; ++i) seen |= __mmask16(a.seen(l, t0 + i)) << i;
      const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), seen, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
      _mm512_mask_storeu_ps(s + l * T + t0, tail(n), scores);
    }
  }
  // Per row: p = exp(score - max), its sum, and p rounded to bf16 in place.
  float* inv = s + L * T;
  for (int64_t l = 0; l < L; ++l) {
    float* sl = s + l * T;
    __m512 top = _mm512_set1_ps(NEG_INF);
    for (int64_t t = 0; t < T; t += 16) top = _mm512_mask_max_ps(top, tail(T - t), top, _mm512_loadu_ps(sl + t));
    const float m = _mm512_reduce_max_ps(top);
    if (m == NEG_INF) {  // no slot visible: zeros, as torch gives
      std::fill_n(sl, T, 0.0f);
      inv[l] = 0.0f;
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t += 16) {
      const __mmask16 mask = tail(T - t);
      const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sl + t), _mm512_set1_ps(m)));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, p));
      _mm512_mask_storeu_ps(sl + t, mask, as_bf16(p));  // v is multiplied by p rounded to bf16, as torch's GEMM does
    }
    inv[l] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // p v, R rows at a time sharing each widened row of v (their R x V accumulators: 16 of the 32
  // vector registers); a slot none of them sees is not read. Rows past L read p = 0 from `none`.
  constexpr int64_t R = VT ? (VT >= 16 ? 1 : 16 / VT) : 1;
  for (int64_t l0 = 0; l0 < L; l0 += R) {
    const float* p_row[R];
    bool live[R];
    for (int64_t r = 0; r < R; ++r) {
      live[r] = l0 + r < L;
      p_row[r] = live[r] ? s + (l0 + r) * T : s + l0 * T;  // a dead row's p is never used
    }
    __m512 out[R][MAX_VECTORS];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < V; ++j) out[r][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; ++t) {
      bool any = false;
      for (int64_t r = 0; r < R; ++r) any |= live[r] && a.seen(l0 + r, t);
      if (!any) continue;
      __m512 vv[MAX_VECTORS];
      for (int64_t j = 0; j < V; ++j) vv[j] = load_bf16(a.v + t * a.v_row + 16 * j, 0xFFFF);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(p_row[r][t]);
        for (int64_t j = 0; j < V; ++j) out[r][j] = _mm512_fmadd_ps(p, vv[j], out[r][j]);
      }
    }
    for (int64_t r = 0; r < R && l0 + r < L; ++r)
      for (int64_t j = 0; j < V; ++j)
        store_bf16(a.out + (l0 + r) * D + 16 * j, 0xFFFF, _mm512_mul_ps(out[r][j], _mm512_set1_ps(inv[l0 + r])));
  }
}

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
  const std::vector<int64_t> ms = broadcast_strides(mask, {B, H, L, T});
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores, widened_k;
    scores.resize(L * T + L);  // the rows' p, then their 1 / sum
    widened_k.resize(16 * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      const Rows rows{qp + b * qc.stride(0) + h * qc.stride(1),
                      kp + b * kc.stride(0) + h * kc.stride(1),
                      vp + b * vc.stride(0) + h * vc.stride(1),
                      mp + b * ms[0] + h * ms[1],
                      op + i * L * D,
                      qc.stride(2),
                      kc.stride(2),
                      vc.stride(2),
                      ms[2],
                      ms[3]};
      switch (D / 16) {  // the 1.1B and 7-8B shapes' head dims: their own code
        case 4: attend<4>(rows, L, T, 4, scale, scores.data(), widened_k.data()); break;
        case 8: attend<8>(rows, L, T, 8, scale, scores.data(), widened_k.data()); break;
        default: attend<0>(rows, L, T, D / 16, scale, scores.data(), widened_k.data()); break;
      }
    }
  });
  return out;
}

// `cache.scatter_(2, index, rows.transpose(1, 2))` for a bf16 cache [B, H, S, D] and rows [B, T, H, D]
// (on the values' bits, as the graph's scatters are). When `index` [B, H, T, D] is one slot per
// token broadcast over the heads and the head dim (the decoder's form), each row is copied to its
// slot directly, without torch's scatter set-up; otherwise torch's scatter runs.
void write_rows(at::Tensor& cache, const at::Tensor& index, const at::Tensor& rows) {
  const int64_t B = rows.size(0), T = rows.size(1), H = rows.size(2), D = rows.size(3), S = cache.size(2);
  const bool direct = index.scalar_type() == at::kLong && index.dim() == 4 && index.size(0) == B &&
                      index.size(1) == H && index.size(2) == T && index.size(3) == D &&
                      (index.stride(1) == 0 || H == 1) && (index.stride(3) == 0 || D == 1) && rows.stride(3) == 1 &&
                      cache.dim() == 4 && cache.size(0) == B && cache.size(1) == H && cache.size(3) == D &&
                      cache.stride(3) == 1;
  if (!direct) {
    cache.view(at::kShort).scatter_(2, index, rows.transpose(1, 2).view(at::kShort));
    return;
  }
  const int64_t* slots = index.data_ptr<int64_t>();
  const auto* src = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(cache.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slots[b * index.stride(0) + t * index.stride(2)];
      TORCH_CHECK(slot >= 0 && slot < S, "attention_block: cache slot ", slot, " is out of range for a cache of ", S,
                  " slots");
      for (int64_t h = 0; h < H; ++h)
        std::copy_n(src + b * rows.stride(0) + t * rows.stride(1) + h * rows.stride(2), D,
                    dst + b * cache.stride(0) + h * cache.stride(1) + slot * cache.stride(2));
    }
}

// The decoder's attention between its qkv and o projections in a decode step, as one op: the ops
// `cpu_attention_blocks.fused_attention_blocks` replaces, called in the same order from here (the
// cache writes as row copies where the index allows, `write_rows`), so the results and cache
// writes are theirs bit for bit. qkv [B * T, (Hq + 2 Hkv) * D] (the fused
// projection's output), cos and sin as the rope op takes them, the caches [B, Hkv, S, D] bf16
// (written in place at `index`, as the graph's int16 scatters write them), the bool mask; the
// result is [B, T, Hq * D], or [B * T, Hq * D] when `flat`.
//
// Why: in Python the same work is about 18 graph nodes a layer, each a torch dispatch through the
// interpreter that runs just after a linear has streamed its weights (several microseconds each,
// docs/cpu-backend.md, "Decode steps outside the linears (AMD)"); from C++ each view costs well
// under a microsecond.
at::Tensor attention_block(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& index, const at::Tensor& mask, int64_t batch,
                           int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool flat) {
  static const auto rope = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("nxdi_kernels::rope", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "attention_block: q_heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "attention_block: the caches must be bf16");
  const int64_t group = q_heads / kv_heads;
  const at::Tensor x = qkv.view({batch, tokens, q_heads + 2 * kv_heads, head_dim});
  const at::Tensor turned = rope.call(x.slice(2, 0, q_heads + kv_heads), cos, sin);
  write_rows(k_cache, index, turned.slice(2, q_heads));
  write_rows(v_cache, index, x.slice(2, q_heads + kv_heads));
  const at::Tensor q = turned.slice(2, 0, q_heads)
                           .view({batch, tokens, kv_heads, group, head_dim})
                           .permute({0, 2, 3, 1, 4})
                           .reshape({batch, kv_heads, group * tokens, head_dim});
  const at::Tensor out = decode_attention(q, k_cache, v_cache, mask)
                             .view({batch, kv_heads, group, tokens, head_dim})
                             .permute({0, 3, 1, 2, 4})
                             .reshape({batch, tokens, q_heads * head_dim});
  return flat ? out.view({-1, q_heads * head_dim}) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def(
      "attention_block(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor index, "
      "Tensor mask, int batch, int tokens, int q_heads, int kv_heads, int head_dim, bool flat) -> Tensor");
  m.impl("attention_block", c10::DispatchKey::CPU, &attention_block);
}
