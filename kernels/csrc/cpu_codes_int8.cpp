// Integer-code linears with int8 activations, for AVX2 CPUs: an opt-in mode (`--int8-activations`) that
// trades the exact kernels' bit-for-bit sums for llama.cpp's arithmetic.
//
// Why: the exact codes tiles (cpu_linear.cpp) rebuild every weight in fp32 with an FMA before using it, so
// an AVX2 decode step is bound by instructions, not by the 0.75 bytes per weight it reads: the bundled
// model's batch-1 step took ~11 ms on a 2-vCPU AVX2 EPYC against a ~3 ms memory roofline, while llama.cpp,
// which rounds each row's activations to 8 bits per 32 and multiplies them with the 4-bit codes in integer
// dot products, took 7.6 ms a token (docs/benchmarks.md). This kernel does that on the same code panels
// (int8 [panels, K, 16] or nibbles [panels, K / 2, 16], w = d * q + m per 32 k and column): no second copy.
//
// Numerics, per row and per block b of 32 k: dx = max|x| / 127 and xq = round(x * (127 / max|x|)) in
// -127..127 (fp32, ties to even); per column, y += d * dx * sum(q * xq) (an exact integer sum) and
// y += m * sum(x) (the block's fp32 sum of x, so a Q4_1 min keeps x's precision), blocks in k order with
// fp32 FMAs, then the bias. Each x differs from xq * dx by at most dx / 2, so an output moves by at most
// sum_k |d q_k| dx_b / 2 from the exact kernel's. tests/test_codes_int8.py checks the kernel against this
// arithmetic done in torch, and the engine's logprobs against the exact engine's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_codes_int8.h"
#include "cpu_common.h"

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // rows per register tile
constexpr int64_t kPanelGroup = 8;  // panels a tile of rows passes over together (below)

// x [m, K] fp32 -> xq int8 [m, K], dx and sx [m, K / 32] (scale and fp32 sum of each block).
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * ldx + b * kBlock;
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = xq + r * k + b * kBlock;
      for (int i = 0; i < kBlock; ++i)
        q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(v[i] * inv), -127.0f), 127.0f));
      dx[r * nb + b] = amax / 127.0f;
      sx[r * nb + b] = sum;
    }
  }
}

// Nibble codes' x pattern: per 4 k, 32 bytes, (xq[i], xq[i + 1]) x 8 then (xq[i + 2], xq[i + 3]) x 8 (the
// two 128-bit lanes of the tile's weight registers), laid out once per call so the tile's inner loop reads
// it as one operand instead of broadcasting and shuffling it for every panel.
void pair_pattern(const int8_t* xq, int64_t m, int64_t k, int8_t* out) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; i += 4) {
      int8_t* o = out + r * k * 8 + i * 8;
      for (int j = 0; j < 16; j += 2) {
        o[j] = xq[r * k + i];
        o[j + 1] = xq[r * k + i + 1];
        o[16 + j] = xq[r * k + i + 2];
        o[16 + j + 1] = xq[r * k + i + 3];
      }
    }
}

#if defined(TOKENMILL_LINEAR_AVX2)
// 16 columns of one panel for R rows. A step takes 4 k: the weights are laid out so each 16-bit lane holds
// two k of one column, and the x pattern holds the matching two xq, for _mm256_maddubs_epi16 (unsigned
// weight bytes times signed x bytes, pairs added). Nibbles (0..15): lane 0 of a register pairs k, k+1 and
// lane 1 pairs k+2, k+3 of the same 8 columns; their int16 sums stay below 2 * 15 * 127 * 8 < 2^15 over a
// block, and the two lanes are added when the block ends. int8 codes (-128..127): the 4 k of a column are
// transposed into one 32-bit lane, the sign moved onto x (|q| * sign(xq, q) <= 128 * 127 per pair), and
// each step's pairs widened to int32 with _mm256_madd_epi16. xq: for nibbles the pair pattern (8 k bytes
// per k and row), else the int8 x (k bytes per row).
template <int R, bool Q4>
void tile(const int8_t* xq, int64_t k, const float* dx, const float* sx, const int8_t* codes, const float* scales,
          const float* mins, float* out, int64_t ldo, int64_t cols, const float* bias) {
  const int64_t nb = k / kBlock;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int64_t i = b * kBlock; i < (b + 1) * kBlock; i += 4) {
      __m256i w0, w1;
      if (Q4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i / 2 * kPanel));
        const __m256i even = _mm256_and_si256(raw, low4);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        w0 = _mm256_unpacklo_epi8(even, odd);  // columns 0..7
        w1 = _mm256_unpackhi_epi8(even, odd);  // columns 8..15
      } else {
        const int8_t* c = codes + i * kPanel;
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + kPanel));
        const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 2 * kPanel));
        const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 3 * kPanel));
        const __m128i a0 = _mm_unpacklo_epi8(r0, r1), a1 = _mm_unpackhi_epi8(r0, r1);
        const __m128i b0 = _mm_unpacklo_epi8(r2, r3), b1 = _mm_unpackhi_epi8(r2, r3);
        w0 = _mm256_set_m128i(_mm_unpackhi_epi16(a0, b0), _mm_unpacklo_epi16(a0, b0));  // columns 0..7
        w1 = _mm256_set_m128i(_mm_unpackhi_epi16(a1, b1), _mm_unpacklo_epi16(a1, b1));  // columns 8..15
      }
      const __m256i u0 = Q4 ? w0 : _mm256_abs_epi8(w0), u1 = Q4 ? w1 : _mm256_abs_epi8(w1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        if (Q4) {
          const __m256i xp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (r * k + i) * 8));
          isum[r][0] = _mm256_add_epi16(isum[r][0], _mm256_maddubs_epi16(u0, xp));
          isum[r][1] = _mm256_add_epi16(isum[r][1], _mm256_maddubs_epi16(u1, xp));
        } else {
          int32_t four;
          std::memcpy(&four, xq + r * k + i, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(xb, w0));
          const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(xb, w1));
          isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(p0, ones));
          isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_madd_epi16(p1, ones));
        }
      }
    }
    const __m256 d0 = _mm256_loadu_ps(scales + b * kPanel), d1 = _mm256_loadu_ps(scales + b * kPanel + 8);
    const __m256 m0 = _mm256_loadu_ps(mins + b * kPanel), m1 = _mm256_loadu_ps(mins + b * kPanel + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i s0 = isum[r][0], s1 = isum[r][1];
      if (Q4) {  // add the two lanes' int16 sums of the same 8 columns, widened
        s0 = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s0)),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s0, 1)));
        s1 = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s1)),
                              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s1, 1)));
      }
      const __m256 step = _mm256_set1_ps(dx[r * nb + b]), total = _mm256_set1_ps(sx[r * nb + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, step), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, step), acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(m0, total, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(m1, total, acc[r][1]);
    }
  }
  alignas(32) float tmp[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
  }
}

template <bool Q4>
void rows_tile(int64_t rows, const int8_t* xq, int64_t k, const float* dx, const float* sx, const int8_t* codes,
               const float* scales, const float* mins, float* out, int64_t ldo, int64_t cols, const float* bias) {
  switch (rows) {
    case 1: tile<1, Q4>(xq, k, dx, sx, codes, scales, mins, out, ldo, cols, bias); break;
    case 2: tile<2, Q4>(xq, k, dx, sx, codes, scales, mins, out, ldo, cols, bias); break;
    case 3: tile<3, Q4>(xq, k, dx, sx, codes, scales, mins, out, ldo, cols, bias); break;
    default: tile<4, Q4>(xq, k, dx, sx, codes, scales, mins, out, ldo, cols, bias); break;
  }
}
#endif

}  // namespace

namespace tokenmill_cpu {

void linear_int8x_panels(at::Tensor& out, const at::Tensor& x, const int8_t* codes, bool q4, int64_t panels,
                         const float* bias, PanelScales panel_scales, const void* ctx) {
#if defined(TOKENMILL_LINEAR_AVX2)
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), nb = k / kBlock, ldo = out.stride(0);
  if (m == 0) return;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, xq.data(), dx.data(), sx.data());
  std::vector<int8_t> pattern(q4 ? m * k * 8 : 0);
  if (q4) pair_pattern(xq.data(), m, k, pattern.data());
  const int8_t* xs = q4 ? pattern.data() : xq.data();
  const int64_t ldq = q4 ? k * 8 : k;  // bytes per row of xs
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;
  float* op = out.data_ptr<float>();
  // Threads split the panels, so each weight byte is read by one thread. A tile of rows passes over a group
  // of kPanelGroup panels before the next tile starts: the group's codes stay in L2 while every tile reads
  // them, and a tile's x (for nibbles 8 bytes per k and row: 18 KB for 4 rows of k = 576) stays in L1 across
  // the group. Over one panel at a time, the whole x pattern of a large batch (2.4 MB for 512 rows) streamed
  // from L3 once per panel (512 rows of 3072 x 576 nibbles, 2-vCPU AVX2 EPYC: 10.7 -> 7.7 ms with groups).
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // Reused across calls: a decode step makes ~120 of them, and the codes layout never writes it.
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(2 * kPanelGroup * nb * kPanel)) scratch.resize(2 * kPanelGroup * nb * kPanel);
    const float* scale[kPanelGroup];
    const float* min[kPanelGroup];
    for (int64_t group = begin; group < end; group += kPanelGroup) {
      const int64_t group_end = std::min(end, group + kPanelGroup);
      for (int64_t p = group; p < group_end; ++p)
        panel_scales(ctx, p, scratch.data() + 2 * (p - group) * nb * kPanel, &scale[p - group], &min[p - group]);
      for (int64_t r = 0; r < m; r += kTile)
        for (int64_t p = group; p < group_end; ++p)
          (q4 ? rows_tile<true> : rows_tile<false>)(
              std::min(kTile, m - r), xs + r * ldq, k, dx.data() + r * nb, sx.data() + r * nb, codes + p * kb,
              scale[p - group], min[p - group], op + r * ldo + p * kPanel, ldo, std::min(kPanel, n - p * kPanel),
              bias != nullptr ? bias + p * kPanel : nullptr);
    }
  });
#else
  TORCH_CHECK(false, "int8 activations need a kernel build with AVX2 (this CPU's has none)");
#endif
}

namespace {
struct CodesScales {
  const float* scales;
  const float* mins;
  int64_t per_panel;  // K / 32 * 16
};

void codes_scales(const void* ctx, int64_t p, float*, const float** scale, const float** min) {
  const auto* c = static_cast<const CodesScales*>(ctx);
  *scale = c->scales + p * c->per_panel;
  *min = c->mins + p * c->per_panel;
}
}  // namespace

// out [M, N] = x [M, K] @ W^T (+ bias) for fp32 x and out, W as linear_packed_q8 takes it, with x rounded
// to int8 per 32 k (above).
void linear_codes_int8x(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "linear_codes_int8x: x must be 2-D float32 with contiguous rows");
  const int64_t k = x.size(1);
  check_codes("linear_codes_int8x", codes, scales, mins, k, true);
  const int64_t panels = codes.size(0);
  const float* bp = check_linear_args("linear_codes_int8x", out, x, panels, "the codes", bias);
  const CodesScales ctx{scales.data_ptr<float>(), mins.data_ptr<float>(), k / kBlock * kPanel};
  linear_int8x_panels(out, x, static_cast<const int8_t*>(codes.data_ptr()), codes.scalar_type() == at::kByte,
                      panels, bp, codes_scales, &ctx);
}

}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_codes_int8x(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_int8x", c10::DispatchKey::CPU, &tokenmill_cpu::linear_codes_int8x);
}
