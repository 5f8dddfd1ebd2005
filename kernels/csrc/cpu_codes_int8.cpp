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
//
// On AVX-512 VNNI CPUs (with VBMI: Ice Lake and later Xeons, Zen 4) the same arithmetic runs on vpdpbusd,
// which sums 4 byte products per 32-bit lane (64 per instruction, twice vdpbf16ps's 32), and also takes
// bf16 rows (bf16 models): x is widened to fp32 before it is rounded, and the sums are rounded once to the
// output's dtype. The arithmetic is the AVX2 tiles' (the same xq and dx, exact integer block sums, the same
// fp32 FMAs in k order) except the order in which each block's fp32 sum of x (the min term) is added up.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_codes_int8.h"
#include "cpu_common.h"
#include "cpu_tile.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define TOKENMILL_INT8X_VNNI 1  // the VNNI tiles below; else the AVX2 ones
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // rows per register tile
constexpr int64_t kPanelGroup = 8;  // panels a tile of rows passes over together (below)

// The panel loop both tile kinds share. Threads split the panels, so each weight byte is read by one
// thread. A tile of rows passes over a group of kPanelGroup panels before the next tile starts: the group's
// codes stay in L2 while every tile reads them, and a tile's x stays in L1 across the group (for the AVX2
// tiles' nibbles 8 bytes per k and row: 18 KB for 4 rows of k = 576). Over one panel at a time, the whole x
// pattern of a large batch (2.4 MB for 512 rows) streamed from L3 once per panel (512 rows of 3072 x 576
// nibbles, 2-vCPU AVX2 EPYC: 10.7 -> 7.7 ms with groups). fn(group, group_end, end, scale, min) runs the
// tiles of panels [group, group_end) of this thread's [.., end), their scales and mins ready.
template <typename F>
void for_panel_groups(int64_t panels, int64_t nb, tokenmill_cpu::PanelScales panel_scales, const void* ctx, F&& fn) {
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
      fn(group, group_end, end, scale, min);
    }
  });
}

#if defined(TOKENMILL_LINEAR_AVX2) && !defined(TOKENMILL_INT8X_VNNI)
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

#if defined(TOKENMILL_INT8X_VNNI)
using tokenmill_cpu::load16;
using tokenmill_cpu::PanelScales;
using tokenmill_cpu::store_tile;
using tokenmill_cpu::with_tile_rows;
constexpr int kVnniRows = 6;    // rows per tile: 12 integer and 12 fp32 sums in registers with two panels
constexpr int kVnniPanels = 2;  // panels per tile: each x broadcast feeds two panels' vpdpbusd

// vpermb indices for 64 code bytes = four rows of a panel (16 columns each): lane c of the result holds
// byte c of each row, in row order, so one vpdpbusd multiplies column c's 4 codes with 4 bytes of x.
inline __m512i code_transpose() {
  alignas(64) uint8_t idx[64];
  for (int c = 0; c < 16; ++c)
    for (int row = 0; row < 4; ++row) idx[4 * c + row] = static_cast<uint8_t>(16 * row + c);
  return _mm512_load_si512(idx);
}

// Rows of x [m, K] (fp32 or bf16) rounded per 32 k as quantize_rows does (same dx, xq), vectorized, into
// the order the VNNI tiles read: for nibbles each 8 k as (x0, x2, x4, x6, x1, x3, x5, x7) (a transposed
// 64-byte load holds k = 8t + 2i in its low nibbles, 8t + 2i + 1 in its high ones), for int8 codes k order.
// sq: each block's sum of xq (the int8 codes' correction below).
template <typename T>
void quantize_rows_vnni(const T* x, int64_t ldx, int64_t m, int64_t k, bool q4, int8_t* xq, float* dx, float* sx,
                        int32_t* sq) {
  const int64_t nb = k / kBlock;
  alignas(32) int8_t order[32];
  const int8_t pairs[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int i = 0; i < 32; ++i) order[i] = static_cast<int8_t>(q4 ? (i / 8) % 2 * 8 + pairs[i % 8] : i % 16);
  const __m256i shuffle = _mm256_load_si256(reinterpret_cast<const __m256i*>(order));
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  // Split over the rows: on one thread it took ~15 ns a block, 3 of the ~32 ms the bundled model's 30
  // layers' linears take at 64 rows (AVX-512 BF16 EPYC, 2 threads).
  at::parallel_for(0, m, 8, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 a = load16(x + r * ldx + b * kBlock), c = load16(x + r * ldx + b * kBlock + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(c, sign)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        // cvtps rounds to nearest even (the default MXCSR mode, as nearbyint); |x * inv| <= 127 after it
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
        const __m256i q = _mm256_set_m128i(_mm512_cvtsepi32_epi8(qc), _mm512_cvtsepi32_epi8(qa));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + b * kBlock), _mm256_shuffle_epi8(q, shuffle));
        dx[r * nb + b] = amax / 127.0f;
        sx[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
        sq[r * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
      }
  });
}

// R rows x P panels (16 columns each) of out = the int8-rounded x times the codes, P <= 2. Per block of 32
// k, integer sums: nibbles take 64 code bytes (8 k) at a time, transposed, split into low and high nibbles
// (0..15, vpdpbusd's unsigned operand) against x's even and odd k; int8 codes take 64 bytes (4 k) with
// the sign bit flipped (q + 128, unsigned), and the block's sum starts at -128 * sum(xq) to take the 128
// back out. Then the fp32 epilogue of the AVX2 tile: y += (d * dx) * sum, y += m * sum(x).
template <int R, int P, bool Q4, typename TOut>
void tile_vnni(const int8_t* xq, int64_t k, const float* dx, const float* sx, const int32_t* sq, const int8_t* codes,
               int64_t kb, const float* const* scales, const float* const* mins, TOut* out, int64_t ldo, int64_t cols,
               const float* bias, __m512i transpose) {
  const int64_t nb = k / kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][P];
    for (int r = 0; r < R; ++r) {
      const __m512i start = Q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * sq[r * nb + b]);
      for (int p = 0; p < P; ++p) isum[r][p] = start;
    }
    const int8_t* cb = codes + b * kBlock * kPanel / (Q4 ? 2 : 1);
#pragma GCC unroll 8
    for (int s = 0; s < (Q4 ? 4 : 8); ++s) {
      if (Q4) {
        __m512i lo[P], hi[P];
        for (int p = 0; p < P; ++p) {
          const __m512i t = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(cb + p * kb + 64 * s));
          lo[p] = _mm512_and_si512(t, low4);
          hi[p] = _mm512_and_si512(_mm512_srli_epi16(t, 4), low4);
        }
        const int8_t* xb = xq + b * kBlock + 8 * s;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t even, odd;
          std::memcpy(&even, xb + r * k, 4);
          std::memcpy(&odd, xb + r * k + 4, 4);
          const __m512i x0 = _mm512_set1_epi32(even), x1 = _mm512_set1_epi32(odd);
          for (int p = 0; p < P; ++p) {
            isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], lo[p], x0);
            isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], hi[p], x1);
          }
        }
      } else {
        __m512i u[P];
        for (int p = 0; p < P; ++p)
          u[p] = _mm512_xor_si512(_mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(cb + p * kb + 64 * s)), flip);
        const int8_t* xb = xq + b * kBlock + 4 * s;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xb + r * k, 4);
          const __m512i x0 = _mm512_set1_epi32(four);
          for (int p = 0; p < P; ++p) isum[r][p] = _mm512_dpbusd_epi32(isum[r][p], u[p], x0);
        }
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const __m512 d = _mm512_loadu_ps(scales[p] + b * kPanel), mn = _mm512_loadu_ps(mins[p] + b * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][p]), step, acc[r][p]);
        acc[r][p] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * nb + b]), acc[r][p]);
      }
    }
  }
  store_tile<R, P>(acc, out, ldo, cols, bias);
}

// The VNNI form of linear_int8x_panels (below): x fp32 or bf16, out fp32 or bf16.
template <typename TX, typename TOut>
void int8x_panels_vnni(const TX* x, int64_t ldx, int64_t m, int64_t k, TOut* op, int64_t ldo, int64_t n,
                       const int8_t* codes, bool q4, int64_t panels, const float* bias, PanelScales panel_scales,
                       const void* ctx) {
  const int64_t nb = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  std::vector<int32_t> sq(m * nb);
  quantize_rows_vnni(x, ldx, m, k, q4, xq.data(), dx.data(), sx.data(), sq.data());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;
  const __m512i transpose = code_transpose();
  for_panel_groups(panels, nb, panel_scales, ctx, [&](int64_t group, int64_t group_end, int64_t end,
                                                     const float* const* scale, const float* const* min) {
    // Each row tile also prefetches its share of the next group's codes into L2, so the next group's first
    // tile does not wait on memory: the bundled model's 30 layers' linears at 64 rows, 26.8 -> 25.4 ms.
    const int64_t next_end = std::min(end, group_end + kPanelGroup);
    const int64_t pf_bytes = (next_end - group_end) * kb, tiles = (m + kVnniRows - 1) / kVnniRows;
    const int64_t pf_chunk = ((pf_bytes + tiles - 1) / tiles + 63) / 64 * 64;
    for (int64_t r = 0; r < m; r += kVnniRows) {
      const int64_t from = r / kVnniRows * pf_chunk, to = std::min(pf_bytes, from + pf_chunk);
      for (int64_t o = from; o < to; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(codes + group_end * kb + o), _MM_HINT_T1);
      for (int64_t p = group; p < group_end; p += kVnniPanels) {
        const int64_t rows = std::min<int64_t>(kVnniRows, m - r);
        with_tile_rows<kVnniRows>(rows, [&](auto rc) {
          constexpr int R = decltype(rc)::value;
          const auto run = [&](auto pc, auto q4c) {
            constexpr int P = decltype(pc)::value;
            const int64_t cols = std::min(kPanel, n - (p + P - 1) * kPanel);  // of the tile's last panel
            tile_vnni<R, P, decltype(q4c)::value>(
                xq.data() + r * k, k, dx.data() + r * nb, sx.data() + r * nb, sq.data() + r * nb, codes + p * kb, kb,
                scale + (p - group), min + (p - group), op + r * ldo + p * kPanel, ldo, cols,
                bias != nullptr ? bias + p * kPanel : nullptr, transpose);
          };
          using One = std::integral_constant<int, 1>;
          using Two = std::integral_constant<int, 2>;
          const bool pair = p + 1 < group_end;
          if (q4)
            pair ? run(Two{}, std::true_type{}) : run(One{}, std::true_type{});
          else
            pair ? run(Two{}, std::false_type{}) : run(One{}, std::false_type{});
        });
      }
    }
  });
}
#endif
}  // namespace

namespace tokenmill_cpu {

bool int8x_vnni_built() {
#if defined(TOKENMILL_INT8X_VNNI)
  return true;
#else
  return false;
#endif
}

void linear_int8x_panels(at::Tensor& out, const at::Tensor& x, const int8_t* codes, bool q4, int64_t panels,
                         const float* bias, PanelScales panel_scales, const void* ctx) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), ldo = out.stride(0);
  if (m == 0) return;
#if defined(TOKENMILL_INT8X_VNNI)
  const auto run = [&](auto* xp, auto* op) {
    int8x_panels_vnni(xp, x.stride(0), m, k, op, ldo, n, codes, q4, panels, bias, panel_scales, ctx);
  };
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  if (x.scalar_type() == at::kBFloat16)
    bf16_out ? run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>())
             : run(x.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
  else
    bf16_out ? run(x.data_ptr<float>(), out.data_ptr<c10::BFloat16>()) : run(x.data_ptr<float>(), out.data_ptr<float>());
#elif defined(TOKENMILL_LINEAR_AVX2)
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "int8 activations on bfloat16 rows need a kernel build with AVX-512 VNNI and VBMI (this one has AVX2)");
  const int64_t nb = k / kBlock;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  quantize_rows(x.data_ptr<float>(), x.stride(0), m, k, xq.data(), dx.data(), sx.data());
  std::vector<int8_t> pattern(q4 ? m * k * 8 : 0);
  if (q4) pair_pattern(xq.data(), m, k, pattern.data());
  const int8_t* xs = q4 ? pattern.data() : xq.data();
  const int64_t ldq = q4 ? k * 8 : k;  // bytes per row of xs
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;
  float* op = out.data_ptr<float>();
  for_panel_groups(panels, nb, panel_scales, ctx, [&](int64_t group, int64_t group_end, int64_t,
                                                     const float* const* scale, const float* const* min) {
    for (int64_t r = 0; r < m; r += kTile)
      for (int64_t p = group; p < group_end; ++p)
        (q4 ? rows_tile<true> : rows_tile<false>)(
            std::min(kTile, m - r), xs + r * ldq, k, dx.data() + r * nb, sx.data() + r * nb, codes + p * kb,
            scale[p - group], min[p - group], op + r * ldo + p * kPanel, ldo, std::min(kPanel, n - p * kPanel),
            bias != nullptr ? bias + p * kPanel : nullptr);
  });
#else
  (void)k, (void)n, (void)ldo;
  TORCH_CHECK(false, "int8 activations need a kernel build with AVX2 (this CPU's has none)");
#endif
}

namespace {
struct CodesScales {
  const float* scales;  // fp32 scales and mins (the fp32 kernels' codes) ...
  const float* mins;
  const c10::Half* half_scales;  // ... or fp16 ones (the bf16 kernels' codes), widened per panel
  const c10::Half* half_mins;
  int64_t per_panel;  // K / 32 * 16
};

void codes_scales(const void* ctx, int64_t p, float* scratch, const float** scale, const float** min) {
  const auto* c = static_cast<const CodesScales*>(ctx);
  if (c->scales != nullptr) {
    *scale = c->scales + p * c->per_panel;
    *min = c->mins + p * c->per_panel;
    return;
  }
  const int64_t n = c->per_panel;  // a multiple of 16
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    store16(scratch + i, load16(c->half_scales + p * n + i));
    store16(scratch + n + i, load16(c->half_mins + p * n + i));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = static_cast<float>(c->half_scales[p * n + i]);
    scratch[n + i] = static_cast<float>(c->half_mins[p * n + i]);
  }
#endif
  *scale = scratch;
  *min = scratch + n;
}
}  // namespace

// out [M, N] = x [M, K] @ W^T (+ bias) with x rounded to int8 per 32 k (above), W as linear_packed_q8 takes
// it (fp32 scales and mins) or as the bf16 kernels do (fp16 ones). x and out fp32; with the VNNI tiles also
// bf16 x with bf16 or fp32 out (logits).
void linear_codes_int8x(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const char* op = "linear_codes_int8x";
  const bool bf16_ok = int8x_vnni_built();
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D ", bf16_ok ? "float32 or bfloat16" : "float32", " with contiguous rows");
  const int64_t k = x.size(1);
  check_codes(op, codes, scales, mins, k, true, true);
  const int64_t panels = codes.size(0);
  const float* bp = check_linear_args(op, out, x, panels, "the codes", bias, bf16_ok, bf16_ok);
  const bool half = scales.scalar_type() == at::kHalf;
  const CodesScales ctx{half ? nullptr : scales.data_ptr<float>(), half ? nullptr : mins.data_ptr<float>(),
                        half ? scales.data_ptr<c10::Half>() : nullptr, half ? mins.data_ptr<c10::Half>() : nullptr,
                        k / kBlock * kPanel};
  linear_int8x_panels(out, x, static_cast<const int8_t*>(codes.data_ptr()), codes.scalar_type() == at::kByte,
                      panels, bp, codes_scales, &ctx);
}

}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_codes_int8x(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_int8x", c10::DispatchKey::CPU, &tokenmill_cpu::linear_codes_int8x);
  m.def("linear_int8x_bf16_supported() -> bool", &tokenmill_cpu::int8x_vnni_built);
}
