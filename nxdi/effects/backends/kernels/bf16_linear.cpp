// nxdi's bf16 linear for decode on AVX-512 CPUs: y = x @ w.T (+ bias). Three paths: vdpbf16ps
// (AVX512-BF16), the AMX tiles (2-16 rows, where the CPU has them), and, without AVX512-BF16, bf16
// widened to fp32 and FMAs (`fma_rows`). And a decode MLP's SwiGLU over two of them in one call
// (`bf16_swiglu`, at the end). (Over 400 lines: the three paths and the SwiGLU share the row
// spans, the read order and the checks; apart, each file would repeat them.)
//
// x [M, K] bf16 (M <= 4 rows; 16 with AMX), w [N, K] bf16 as stored (row-major, not repacked),
// bias [N] or none; y [M, N] bf16. Products are summed in fp32 and rounded to bf16 once, after the
// bias: the result equals F.linear's up to fp32 summation order. Output rows are split over torch's
// intra-op (OpenMP) threads. Measurements: docs/cpu-backend.md, "bf16 decode linears" and "bf16
// linears at 2-16 rows".
//
// vdpbf16ps (two bf16 pairs per lane per instruction): R output rows are read at once, R
// sequential streams interleaved: a decode step is bound by how many weight bytes one core keeps
// in flight, and one stream per core measured 17-19 GB/s where eight reached 25-33 GB/s (torch's
// F.linear 13-20, oneDNN with a prepacked weight about 10, on the development machine), and the
// next block of rows is prefetched while one is read (a block's rows are short streams the
// hardware prefetcher restarts on; 1.3-1.7x more). A block's rows are read some rows apart, and the
// prefetch and that spacing are chosen per CPU (`read_order.h`).
//
// AMX (a CPU with AMX-BF16 whose OS grants the tile state, K a multiple of 32), for 2-16 rows: a
// 16 x 32 block of w, loaded as stored (16 rows at once, 64 bytes of each), times x packed as the
// tile's second operand (its M columns, pairs of K interleaved), per `tdpbf16ps`. vdpbf16ps does
// 32 products per instruction whatever M is, so at 4 rows it ran out of instruction throughput
// below the memory bandwidth (12 GB/s per core with w in L2, against 31 at one row); one tile
// product covers all M <= 16 columns and stays memory bound. One row keeps vdpbf16ps (alike there).
//
// Without AVX512-BF16 (Ice Lake, Cascade Lake, ...), the same interleaved streams and prefetch,
// each bf16 pair widened in registers (below: `fma_rows`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_lanes.h"
#include "read_order.h"

namespace nxdi_read_order {

namespace {
enum Preset : int { AUTO, INTEL, AMD };
const char* const NAMES[] = {"auto", "intel", "amd"};
std::atomic<int> preset{AUTO};

// CPUID vendor "AuthenticAMD".
bool amd_cpu() {
  static const bool is_amd = [] {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
  }();
  return is_amd;
}
}  // namespace

Order of(int64_t rows, int bytes) {
  const int p = preset.load(std::memory_order_relaxed);
  if (p == AMD || (p == AUTO && amd_cpu())) return {rows >= 3, bytes == 1 ? 16 : 8, rows >= 3 ? 0 : 2048};
  return {true, 4, 0};
}

// With `name` ("auto", "intel" or "amd") given, sets the preset and returns the previous one;
// otherwise the current one.
std::string set_preset(c10::optional<std::string> name) {
  if (!name.has_value()) return NAMES[preset.load()];
  for (int p = AUTO; p <= AMD; ++p)
    if (*name == NAMES[p]) return NAMES[preset.exchange(p)];
  TORCH_CHECK(false, "read_order: the preset must be 'auto', 'intel' or 'amd', not '", *name, "'");
}

}  // namespace nxdi_read_order

namespace {

// Output rows [n0, n1) of one thread's share (the callers split [0, N) over torch's intra-op
// threads, at least `GRAIN` rows per task, so two threads split a matrix into two long runs), in
// groups of spacing x R rows read as `spacing` blocks (`read_order.h`), `R` rows per call of
// `rows(n, R, step, next)` (rows n, n + step, ..., n + (R - 1) * step; `next`: the first row of the
// next block, to prefetch, or null), then blocks of R adjacent rows and the last few one per call
// (`rows(n, 1, 1, nullptr)`), in the caller's `order` (`nxdi_read_order::of(M, 2)`). Each output
// row is one sum whichever way the rows are grouped, so any split gives the same bits.
constexpr int64_t GRAIN = 64;

template <int R, typename Rows>
void span_rows(const nxdi_read_order::Order& order, int64_t n0, int64_t n1, int64_t K, const uint16_t* w,
               const Rows& rows) {
  const int64_t S = order.spacing;
  const int64_t G = S * R;
  int64_t n = n0;
  for (; n + G <= n1; n += G)
    for (int64_t j = 0; j < S; ++j)
      rows(n + j, R, S,
           !order.prefetch ? nullptr
           : j + 1 < S     ? w + (n + j + 1) * K
                           : (n + 2 * G <= n1 ? w + (n + G) * K : nullptr));
  for (; n + R <= n1; n += R) rows(n, R, 1, order.prefetch && n + 2 * R <= n1 ? w + (n + R) * K : nullptr);
  for (; n < n1; ++n) rows(n, 1, 1, nullptr);
}

// The kernel alone is built for AVX512-BF16; `bf16_dot_supported()` is asked before it is used.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

// The block's R rows are w's rows 0, step, ..., (R - 1) * step (y's likewise). `next`: the first
// row of the following block (or null; its rows `step` apart too): fetched into cache while this
// block is read; without it, each row's elements `ahead` on (if not 0) are fetched into L2.
template <int M, int R>
void dot_rows(const uint16_t* x, const uint16_t* w, const uint16_t* next, int64_t step, const float* bias,
              at::BFloat16* y, int64_t K, int64_t N, int64_t ahead = 0) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    // The last chunk of a K that is not a multiple of 32 loads zeros past the end.
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    if (next)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * step * K + k), _MM_HINT_T0);
    else if (ahead)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * step * K + k + ahead), _MM_HINT_T1);
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * step * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * N + r * step] = at::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[r * step] : 0.0f));
}

// Rows [n0, n1) of y by vdpbf16ps.
template <int M, int R>
void dot_span(const uint16_t* x, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const nxdi_read_order::Order order = nxdi_read_order::of(M, 2);
  span_rows<R>(order, n0, n1, K, w, [&](int64_t n, int64_t rows, int64_t step, const uint16_t* next) {
    if (rows == R)
      dot_rows<M, R>(x, w + n * K, next, step, bias ? bias + n : nullptr, y + n, K, N, order.ahead / 2);
    else
      dot_rows<M, 1>(x, w + n * K, nullptr, 1, bias ? bias + n : nullptr, y + n, K, N);
  });
}

#pragma GCC pop_options

bool bf16_dot_supported() { return __builtin_cpu_supports("avx512bf16"); }

// --- CPUs without AVX512-BF16 (AVX-512 F and BW) ---------------------------------------------------

// A bf16 is the upper half of an fp32: a 32-bit lane of w holds the pair (2i, 2i+1), whose values
// are the lane shifted left 16 bits (even) and the lane with its lower half cleared (odd). x is
// split once per call into its even and odd columns as fp32, so a chunk of 32 weights takes a shift,
// an and and two FMAs per row of x, exact products summed in fp32 (oneDNN's bf16 GEMM read the
// weights at 4-17 GB/s at 2-4 rows on such a CPU: docs/cpu-backend.md).
constexpr int64_t CHUNK = 32;

inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// `xs`: each row of x as [P even columns][P odd columns] fp32, P = 16 per chunk of K, zero past K.
// Rows `step` apart, as `dot_rows`.
template <int M, int R>
void fma_rows(const float* xs, int64_t P, const uint16_t* w, const uint16_t* next, int64_t step, const float* bias,
              at::BFloat16* y, int64_t K, int64_t N) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0, p = 0; k < K; k += CHUNK, p += CHUNK / 2) {
    const __mmask32 mask = K - k >= CHUNK ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    if (next)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * step * K + k), _MM_HINT_T0);
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) {
      even[m] = _mm512_loadu_ps(xs + 2 * m * P + p);
      odd[m] = _mm512_loadu_ps(xs + (2 * m + 1) * P + p);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i pairs = _mm512_maskz_loadu_epi16(mask, w + r * step * K + k);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(pairs, upper));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wo, odd[m], _mm512_fmadd_ps(we, even[m], acc[r][m]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      y[m * N + r * step] = at::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + (bias ? bias[r * step] : 0.0f));
}

// x's rows as `fma_rows` reads them: each as [P even columns][P odd columns] fp32, zero past K.
std::vector<float> split_columns(const uint16_t* x, int64_t M, int64_t K, int64_t P) {
  std::vector<float> xs(2 * M * P, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xs[(2 * m + k % 2) * P + k / 2] = bf16_value(x[m * K + k]);
  return xs;
}

// Rows [n0, n1) of y by `fma_rows`; `xs` from `split_columns`.
template <int M, int R>
void fma_span(const float* xs, int64_t P, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const nxdi_read_order::Order order = nxdi_read_order::of(M, 2);
  span_rows<R>(order, n0, n1, K, w, [&](int64_t n, int64_t rows, int64_t step, const uint16_t* next) {
    if (rows == R)
      fma_rows<M, R>(xs, P, w + n * K, next, step, bias ? bias + n : nullptr, y + n, K, N);
    else
      fma_rows<M, 1>(xs, P, w + n * K, nullptr, 1, bias ? bias + n : nullptr, y + n, K, N);
  });
}

// --- AMX -----------------------------------------------------------------------------------------

// The 64-byte operand of ldtilecfg (palette 1).
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// CPUID.(7,0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), and Linux's permission to use the tile
// data state, which a process must request once (arch_prctl ARCH_REQ_XCOMP_PERM) or fault.
bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok && bf16_dot_supported();
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")

constexpr int64_t AHEAD = 4;

// Rows [n0, n1) of y (a multiple of 16 of them), M <= 16 columns. `xt`: x packed as the tiles'
// second operand, K/32 blocks of [16 pairs of K][M] 32-bit pairs. Tiles: 0 the accumulator
// [16 rows of w][M], 1 the block of w [16 rows][32 of K], 2 the block of x.
void amx_rows(const uint32_t* xt, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t n0, int64_t n1,
              int64_t K, int64_t N, int M) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  cfg.rows[0] = 16, cfg.colsb[0] = M * 4;
  cfg.rows[1] = 16, cfg.colsb[1] = 64;
  cfg.rows[2] = 16, cfg.colsb[2] = M * 4;
  _tile_loadconfig(&cfg);  // per thread: the tile state is a thread's own
  alignas(64) float c[16 * 16];
  for (int64_t n = n0; n < n1; n += 16) {
    _tile_zero(0);
    const uint16_t* wn = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      // Fetch each row AHEAD blocks of K ahead (into the next 16 rows at the end): 5-19% faster
      // per call than no prefetch on the 1.1B shapes, and mostly faster than fetching the next 16
      // rows at k.
      const int64_t ahead = k + 32 * AHEAD;
      const uint16_t* next = ahead < K ? wn + ahead : (n + 16 < n1 ? wn + 16 * K + (ahead - K) : nullptr);
      if (next)
        for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K), _MM_HINT_T0);
      _tile_loadd(2, xt + (k / 32) * 16 * M, M * 4);
      _tile_loadd(1, wn + k, K * 2);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, M * 4);
    for (int r = 0; r < 16; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = at::BFloat16(c[r * M + m] + (bias ? bias[n + r] : 0.0f));
  }
  _tile_release();
}

#pragma GCC pop_options

// y [M, N] from the AMX tiles for N's whole blocks of 16 rows; the last N % 16 rows by vdpbf16ps,
// at most 4 rows of x at a time.
void amx_linear(const uint16_t* x, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t M, int64_t K,
                int64_t N) {
  std::vector<uint32_t> xt(K / 2 * M);
  const auto* pairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t b = 0; b < K / 32; ++b)
    for (int p = 0; p < 16; ++p)
      for (int64_t m = 0; m < M; ++m) xt[(b * 16 + p) * M + m] = pairs[m * (K / 2) + b * 16 + p];
  const int64_t blocks = N / 16;
  // Grain: at least 4 blocks (64 rows) per task, as the vdpbf16ps path.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    amx_rows(xt.data(), w, bias, y, b0 * 16, b1 * 16, K, N, static_cast<int>(M));
  });
  for (int64_t n = blocks * 16; n < N; ++n)
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m);
      const float* b = bias ? bias + n : nullptr;
      const uint16_t* xm = x + m * K;
      at::BFloat16* ym = y + m * N + n;
      switch (rows) {
        case 1: dot_rows<1, 1>(xm, w + n * K, nullptr, 1, b, ym, K, N); break;
        case 2: dot_rows<2, 1>(xm, w + n * K, nullptr, 1, b, ym, K, N); break;
        case 3: dot_rows<3, 1>(xm, w + n * K, nullptr, 1, b, ym, K, N); break;
        default: dot_rows<4, 1>(xm, w + n * K, nullptr, 1, b, ym, K, N); break;
      }
    }
}

int64_t max_rows(int64_t K) { return amx_supported() && K % 32 == 0 ? 16 : 4; }

// One call's x as the vdpbf16ps path, or the widened one (`fma_rows`), reads it; `span` computes
// rows [n0, n1) of y = x @ w.T (+ bias) for any w [N, K] of that call.
struct Streamed {
  const uint16_t* x;
  int64_t M, K, N;
  bool widened;
  int64_t P = 0;
  std::vector<float> xs;  // the widened path's split columns

  Streamed(const uint16_t* x_, int64_t M_, int64_t K_, int64_t N_, bool widened_)
      : x(x_), M(M_), K(K_), N(N_), widened(widened_) {
    if (widened) {
      P = (K + CHUNK - 1) / CHUNK * (CHUNK / 2);
      xs = split_columns(x, M, K, P);
    }
  }

  // R * M accumulators stay within the 32 vector registers with the loads beside them.
  void span(const uint16_t* w, const float* bias, at::BFloat16* y, int64_t n0, int64_t n1) const {
    if (widened) {
      switch (M) {
        case 1: fma_span<1, 8>(xs.data(), P, w, bias, y, K, N, n0, n1); break;
        case 2: fma_span<2, 8>(xs.data(), P, w, bias, y, K, N, n0, n1); break;
        case 3: fma_span<3, 4>(xs.data(), P, w, bias, y, K, N, n0, n1); break;
        default: fma_span<4, 4>(xs.data(), P, w, bias, y, K, N, n0, n1); break;
      }
      return;
    }
    switch (M) {
      case 1: dot_span<1, 8>(x, w, bias, y, K, N, n0, n1); break;
      case 2: dot_span<2, 8>(x, w, bias, y, K, N, n0, n1); break;
      case 3: dot_span<3, 4>(x, w, bias, y, K, N, n0, n1); break;
      default: dot_span<4, 4>(x, w, bias, y, K, N, n0, n1); break;
    }
  }
};

// `name`'s checks of x [M, K] and w [N, K]; the most rows of x it takes here.
int64_t checked(const char* name, const at::Tensor& x, const at::Tensor& w, bool widened) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, name, ": x and w must be bf16");
  TORCH_CHECK(w.is_contiguous(), name, ": w must be contiguous");  // a copy per call would cost more than it saves
  const int64_t limit = widened ? 4 : max_rows(x.size(1));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= limit, name, ": x must have 1 to ", limit, " rows here (bf16_max_rows)");
  return limit;
}

// y [M, N] = x [M, K] @ w [N, K].T (+ bias); `widened`: the AVX-512 FMA path whatever the CPU.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool widened) {
  const int64_t limit = checked("bf16_linear", x, w, widened);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "bf16_linear: bias must be [N]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  if (M > 1 && limit > 4) {  // one row streams as fast on vdpbf16ps (measured alike)
    amx_linear(xp, wp, bp, yp, M, K, N);
    return y;
  }
  const Streamed call(xp, M, K, N, widened || !bf16_dot_supported());
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) { call.span(wp, bp, yp, n0, n1); });
  return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear(x, w, bias, false);
}

// The FMA path on any AVX-512 CPU, so that it is tested where AVX512-BF16 takes bf16_linear's calls.
at::Tensor bf16_linear_widened(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return linear(x, w, bias, true);
}

// --- SwiGLU: silu(x @ w_gate.T) * (x @ w_up.T) ---------------------------------------------------
// A decode MLP's gate and up linears, torch's silu and its product in one call, where the graph
// dispatches four ops in two parallel regions, the pointwise ones just after a linear streamed its
// weights (docs/cpu-backend.md, "Decode steps outside the linears (AMD)"). Each thread computes the
// gate and up rows of its share of N, each row the same sum as `bf16_linear`'s (so the same bits),
// then their SwiGLU (`nxdi_lanes::swiglu_span`: torch's bits). With AMX at 2-16 rows of x the two
// linears are the tile path's, one after the other, and the SwiGLU a third region.
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up, bool widened) {
  const int64_t limit = checked("bf16_swiglu", x, w_gate, widened);
  checked("bf16_swiglu", x, w_up, widened);
  TORCH_CHECK(w_up.sizes() == w_gate.sizes(), "bf16_swiglu: w_gate and w_up must have one shape");
  const int64_t M = x.size(0), K = x.size(1), N = w_gate.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto mix = [&](const at::BFloat16* g, const at::BFloat16* u, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m)
      nxdi_lanes::swiglu_span(reinterpret_cast<const uint16_t*>(g + m * N + n0),
                              reinterpret_cast<const uint16_t*>(u + m * N + n0), yp + m * N + n0, n1 - n0);
  };
  if (M > 1 && limit > 4) {
    const at::Tensor g = linear(x, w_gate, c10::nullopt, false), u = linear(x, w_up, c10::nullopt, false);
    at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
      mix(g.data_ptr<at::BFloat16>(), u.data_ptr<at::BFloat16>(), n0, n1);
    });
    return y;
  }
  const at::Tensor xc = x.contiguous();
  const Streamed call(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K, N,
                      widened || !bf16_dot_supported());
  const auto* wg = reinterpret_cast<const uint16_t*>(w_gate.data_ptr<at::BFloat16>());
  const auto* wu = reinterpret_cast<const uint16_t*>(w_up.data_ptr<at::BFloat16>());
  thread_local std::vector<at::BFloat16> gate_up;  // the two linears' bf16 outputs, [2, M, N]
  gate_up.resize(2 * M * N);
  at::BFloat16 *g = gate_up.data(), *u = g + M * N;
  at::parallel_for(0, N, GRAIN, [&](int64_t n0, int64_t n1) {
    call.span(wg, nullptr, g, n0, n1);
    call.span(wu, nullptr, u, n0, n1);
    mix(g, u, n0, n1);
  });
  return y;
}

at::Tensor bf16_swiglu(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up) {
  return swiglu(x, w_gate, w_up, false);
}

at::Tensor bf16_swiglu_widened(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up) {
  return swiglu(x, w_gate, w_up, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.def("bf16_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, &bf16_linear);
  m.def("bf16_linear_widened(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.impl("bf16_linear_widened", c10::DispatchKey::CPU, &bf16_linear_widened);
  m.def("bf16_swiglu(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor");
  m.impl("bf16_swiglu", c10::DispatchKey::CPU, &bf16_swiglu);
  m.def("bf16_swiglu_widened(Tensor x, Tensor w_gate, Tensor w_up) -> Tensor");
  m.impl("bf16_swiglu_widened", c10::DispatchKey::CPU, &bf16_swiglu_widened);
  m.def("bf16_dot_supported() -> bool", &bf16_dot_supported);
  m.def("bf16_max_rows(int k) -> int", &max_rows);
  m.def("read_order(str? preset=None) -> str", &nxdi_read_order::set_preset);
}
