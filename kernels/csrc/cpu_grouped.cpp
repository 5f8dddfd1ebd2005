// Linear layers and embedding lookups on "grouped" integer-code weights: GGUF K-quants (Q4_K, Q5_K, Q6_K),
// Q5_0 / Q5_1, and AWQ / GPTQ int4 with zero points, held as the file holds them (no dequantized copy).
//
// Layout (engine/layers/grouped_codes.py builds it; panels of 16 output rows, as cpu_linear.cpp's):
//   lo   uint8  [P, K/2, 16]      the low 4 bits of each code, k = 2j in the low, 2j + 1 in the high nibble
//   hi   int32  [P, K/2, H]       H = bits - 4 bit planes: plane h of row pair j has bit 2c + e set when code
//                                 (k = 2j + e, column c) has bit 4 + h
//   sc   int8   [P, K/B, 16]      a scale code per sub-block of B = 32 (16 for Q6_K) weights
//   mn   int8   [P, K/B, 16]      a min code per sub-block (formats with mins; else empty)
//   d    fp16   [P, K/S, 16]      the scale of each super-block (group) of S weights
//   dmin fp16   [P, K/S, 16]      the min scale of each super-block (formats with mins; else empty)
// and w = (d * sc) * (q - offset) - dmin * mn in float32: every product of an fp16 and an int8 is exact in
// float32, so the one rounding left is that of GGUF's own dequantization (engine/model/gguf_blocks.py).
// Q4_K takes 0.578 bytes per weight (the file: 0.5625); scales kept in fp32 per 32 would take 0.75.
//
// Why a layout of its own: K-quants scale each 32 (Q6_K: 16) weights by a 6- or 8-bit code times a
// per-256 fp16, which is not an fp16 value, so cpu_linear.cpp's fp16 scale per 32 cannot hold it exactly,
// and an fp32 one costs a third more memory than the file. Q6_K's 16-weight sub-blocks get their own
// block size B instead of being widened to 32 (impossible without changing values).
//
// Two paths:
// - bf16 x (AVX-512 BF16): per sub-block, the codes as bf16 operands (a vpermw / vpermi2w table lookup:
//   code -> bf16(code - offset), exact) summed against x with vdpbf16ps; then y += (d sc) * dot - (dmin mn)
//   * sum(x) per block. fp32 sums of exact products; results differ from the fp32 path in rounding only.
// - fp32 x: each panel rebuilt in float32 (the weights GGUF dequantizes to, bit for bit) and summed in k
//   order with fused multiply-adds: the same sums as cpu_linear.cpp's kernels on those fp32 weights, so
//   an fp32 model's logits equal those of its dequantized fp32 copy bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_codes_bf16.h"
#include "cpu_codes_int8.h"
#include "cpu_common.h"
#include "cpu_tile.h"

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kRowBlock = 128;  // rows whose x stays in L2 while a thread's panels pass over them
constexpr int64_t kTileRows = 8;    // bf16 path: rows per register tile
// fp32 path: rows per register tile. Two FMA units of 4 cycles' latency need 8 independent sums in flight:
// 6 rows x 2 ymm on AVX2 (12 accumulators, as cpu_gemm.cpp's tile), 8 rows x 1 zmm on AVX-512.
#if defined(__AVX512F__)
constexpr int64_t kTileRows32 = 8;
#else
constexpr int64_t kTileRows32 = 6;
#endif
constexpr int64_t kChunk = 256;     // fp32 path: k rebuilt at a time (16 KB of fp32, in L1)

struct Grouped {
  const uint8_t* lo;
  const uint32_t* hi;
  const int8_t* sc;
  const int8_t* mn;  // nullptr without mins
  const c10::Half* d;
  const c10::Half* dmin;  // nullptr without mins
  int64_t k, planes, block, group, offset;
  // Elements per panel of each tensor.
  int64_t lo_p() const { return k / 2 * kPanel; }
  int64_t hi_p() const { return k / 2 * planes; }
  int64_t sc_p() const { return k / block * kPanel; }
  int64_t d_p() const { return k / group * kPanel; }
  // 4-bit codes in 32-weight blocks, no offset (Q4_K, AWQ / GPTQ int4): `lo` alone is the codes kernels'
  // nibble panels (cpu_linear.cpp), so their rebuild and the int8-activation kernel read it as they are.
  bool nibble_blocks() const { return planes == 0 && block == 32 && offset == 0; }
};

// fmt = [bits, block, group, offset]; the tensors checked against it and K.
Grouped check_grouped(const char* op, int64_t k, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& sc,
                      const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin, at::IntArrayRef fmt) {
  TORCH_CHECK(fmt.size() == 4, op, ": fmt is [bits, block, group, offset], got ", fmt);
  const int64_t bits = fmt[0], block = fmt[1], group = fmt[2], offset = fmt[3];
  TORCH_CHECK(bits >= 4 && bits <= 6 && (block == 16 || block == 32) && group % block == 0 && group > 0 && offset >= 0 &&
                  offset < 64,
              op, ": unsupported format bits=", bits, " block=", block, " group=", group, " offset=", offset);
  TORCH_CHECK(lo.device().is_cpu() && lo.scalar_type() == at::kByte && lo.dim() == 3 && lo.size(2) == kPanel &&
                  lo.is_contiguous() && (k < 0 || lo.size(1) * 2 == k),
              op, ": lo must be contiguous uint8 [panels, K / 2, 16], got ", lo.sizes());
  const int64_t kk = lo.size(1) * 2, panels = lo.size(0);
  TORCH_CHECK(kk % group == 0, op, ": K=", kk, " is not a multiple of the group size ", group);
  TORCH_CHECK(hi.scalar_type() == at::kInt && hi.is_contiguous() && hi.dim() == 3 && hi.size(0) == panels &&
                  hi.size(1) == kk / 2 && hi.size(2) == bits - 4,
              op, ": hi must be contiguous int32 [", panels, ", ", kk / 2, ", ", bits - 4, "], got ", hi.sizes());
  const bool has_min = mn.numel() > 0;
  for (const at::Tensor* t : has_min ? std::vector<const at::Tensor*>{&sc, &mn} : std::vector<const at::Tensor*>{&sc})
    TORCH_CHECK(t->scalar_type() == at::kChar && t->is_contiguous() && t->dim() == 3 && t->size(0) == panels &&
                    t->size(1) == kk / block && t->size(2) == kPanel,
                op, ": sc and mn must be contiguous int8 [", panels, ", ", kk / block, ", 16], got ", t->sizes());
  for (const at::Tensor* t : has_min ? std::vector<const at::Tensor*>{&d, &dmin} : std::vector<const at::Tensor*>{&d})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == panels &&
                    t->size(1) == kk / group && t->size(2) == kPanel,
                op, ": d and dmin must be contiguous float16 [", panels, ", ", kk / group, ", 16], got ", t->sizes());
  TORCH_CHECK(has_min == (dmin.numel() > 0), op, ": mn and dmin are both given or both empty");
  return Grouped{lo.data_ptr<uint8_t>(),
                 reinterpret_cast<const uint32_t*>(hi.data_ptr<int32_t>()),
                 sc.data_ptr<int8_t>(),
                 has_min ? mn.data_ptr<int8_t>() : nullptr,
                 d.data_ptr<c10::Half>(),
                 has_min ? dmin.data_ptr<c10::Half>() : nullptr,
                 kk,
                 bits - 4,
                 block,
                 group,
                 offset};
}

// Sub-blocks [b0, b1) of panel p: each one's scale d * sc and min -(dmin * mn) (-0 without mins) for the 16
// columns, [b1 - b0, 16] each, so that w = fma(q - offset, scale, min). Each an fp16 times an int8: exact in
// fp32. 8 lanes at a time with F16C where built: in scalar code these conversions cost as much as the
// int8 loop's dot products at batch 1 (a 1B Q4_K model on the AVX2 EPYC). A range per call: the int8
// loop takes a whole panel's, the rebuild a chunk's.
inline void block_scales(const Grouped& g, int64_t p, int64_t b0, int64_t b1, float* scale, float* nmin) {
  const int8_t* sc = g.sc + p * g.sc_p();
  const int8_t* mn = g.mn != nullptr ? g.mn + p * g.sc_p() : nullptr;
  const c10::Half* d = g.d + p * g.d_p();
  const c10::Half* dmin = g.dmin != nullptr ? g.dmin + p * g.d_p() : nullptr;
  const int64_t per_group = g.group / g.block;
#if defined(TOKENMILL_LINEAR_AVX2)
  const auto widen_i8 = [](const int8_t* v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
  };
  const auto widen_f16 = [](const c10::Half* v) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b / per_group, o = (b - b0) * kPanel;
    for (int c = 0; c < kPanel; c += 8) {
      _mm256_storeu_ps(scale + o + c, _mm256_mul_ps(widen_f16(d + s * kPanel + c), widen_i8(sc + b * kPanel + c)));
      const __m256 low = mn != nullptr ? _mm256_mul_ps(widen_f16(dmin + s * kPanel + c), widen_i8(mn + b * kPanel + c))
                                       : _mm256_setzero_ps();
      _mm256_storeu_ps(nmin + o + c, _mm256_xor_ps(low, _mm256_set1_ps(-0.0f)));
    }
  }
#else
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b / per_group, o = (b - b0) * kPanel;
    for (int c = 0; c < kPanel; ++c) {
      scale[o + c] = static_cast<float>(d[s * kPanel + c]) * static_cast<float>(sc[b * kPanel + c]);
      nmin[o + c] = mn != nullptr ? -(static_cast<float>(dmin[s * kPanel + c]) * static_cast<float>(mn[b * kPanel + c])) : -0.0f;
    }
  }
#endif
}

#if defined(TOKENMILL_LINEAR_AVX2)
// Bit 4 + h of 8 codes from one bit plane word: lane c's bit sits at 2c + e (sh holds those positions).
template <int H>
inline __m256i plane_bit(uint32_t word, __m256i sh) {
  const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), sh),
                                       _mm256_set1_epi32(1));
  return _mm256_slli_epi32(bit, 4 + H);
}

// Row pairs j in [j0, j1) of a panel with H bit planes (Q5_*: 1, Q6_K: 2) as float32 rows of 16, 8 lanes at a
// time: the scalar loop's fma(float(q) - offset, scale, min) on the same integers (q - offset is exact in
// float32 either way), so the same floats.
template <int H>
void rebuild_planes(const uint8_t* lo, const uint32_t* hi, int64_t j0, int64_t j1, const float* scale,
                    const float* nmin, int32_t offset, float* w) {
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  const __m256 n0 = _mm256_loadu_ps(nmin), n1 = _mm256_loadu_ps(nmin + 8);
  const __m256i off = _mm256_set1_epi32(offset), low = _mm256_set1_epi32(15);
  // Bit positions 2c + e of columns c = 0..7 and 8..15, for k = 2j (e = 0) and 2j + 1 (e = 1).
  const __m256i e0c0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), e0c1 = _mm256_add_epi32(e0c0, _mm256_set1_epi32(16));
  const __m256i e1c0 = _mm256_add_epi32(e0c0, _mm256_set1_epi32(1)), e1c1 = _mm256_add_epi32(e0c1, _mm256_set1_epi32(1));
  for (int64_t j = j0; j < j1; ++j) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + j * kPanel));
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    __m256i q00 = _mm256_and_si256(b0, low), q01 = _mm256_and_si256(b1, low);  // k = 2j: columns 0-7, 8-15
    __m256i q10 = _mm256_srli_epi32(b0, 4), q11 = _mm256_srli_epi32(b1, 4);    // k = 2j + 1
    if constexpr (H >= 1) {
      const uint32_t m = hi[j * H];
      q00 = _mm256_or_si256(q00, plane_bit<0>(m, e0c0));
      q01 = _mm256_or_si256(q01, plane_bit<0>(m, e0c1));
      q10 = _mm256_or_si256(q10, plane_bit<0>(m, e1c0));
      q11 = _mm256_or_si256(q11, plane_bit<0>(m, e1c1));
    }
    if constexpr (H >= 2) {
      const uint32_t m = hi[j * H + 1];
      q00 = _mm256_or_si256(q00, plane_bit<1>(m, e0c0));
      q01 = _mm256_or_si256(q01, plane_bit<1>(m, e0c1));
      q10 = _mm256_or_si256(q10, plane_bit<1>(m, e1c0));
      q11 = _mm256_or_si256(q11, plane_bit<1>(m, e1c1));
    }
    const auto weight = [&](__m256i q, __m256 s, __m256 n) {
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, off)), s, n);
    };
    float* w0 = w + (2 * j - 2 * j0) * kPanel;
    _mm256_storeu_ps(w0, weight(q00, s0, n0));
    _mm256_storeu_ps(w0 + 8, weight(q01, s1, n1));
    _mm256_storeu_ps(w0 + kPanel, weight(q10, s0, n0));
    _mm256_storeu_ps(w0 + kPanel + 8, weight(q11, s1, n1));
  }
}
#endif

// Panel p's weights for k in [k0, k1) (k0, k1 multiples of the block size, k1 - k0 <= kChunk) as float32
// rows of 16.
void rebuild(const Grouped& g, int64_t p, int64_t k0, int64_t k1, float* w) {
  TORCH_CHECK(k1 - k0 <= kChunk, "rebuild: at most ", kChunk, " k at a time, got ", k1 - k0);
  const uint8_t* lo = g.lo + p * g.lo_p();
  const uint32_t* hi = g.hi + p * g.hi_p();
  const float off = static_cast<float>(g.offset);
  // The chunk's sub-blocks' scales and mins first (kChunk / 16 sub-blocks at most).
  float scales[kChunk / 16 * kPanel], nmins[kChunk / 16 * kPanel];
  block_scales(g, p, k0 / g.block, k1 / g.block, scales, nmins);
  for (int64_t b = k0 / g.block; b < k1 / g.block; ++b) {
    const float* scale = scales + (b - k0 / g.block) * kPanel;
    const float* nmin = nmins + (b - k0 / g.block) * kPanel;
#if defined(TOKENMILL_LINEAR_AVX2)
    // The codes kernels' 8-lane rebuild gives the same fma(q, scale, nmin) as the loop below.
    if (g.nibble_blocks()) {
      tokenmill_cpu::rebuild_codes16<true>(reinterpret_cast<const int8_t*>(lo + b * 16 * kPanel), scale, nmin, 32,
                                           w + (b * 32 - k0) * kPanel);
      continue;
    }
    if (g.planes <= 2) {
      const int64_t j0 = b * g.block / 2, j1 = (b + 1) * g.block / 2;
      float* wb = w + (2 * j0 - k0) * kPanel;
      const int32_t o = static_cast<int32_t>(g.offset);
      if (g.planes == 0) rebuild_planes<0>(lo, hi, j0, j1, scale, nmin, o, wb);
      if (g.planes == 1) rebuild_planes<1>(lo, hi, j0, j1, scale, nmin, o, wb);
      if (g.planes == 2) rebuild_planes<2>(lo, hi, j0, j1, scale, nmin, o, wb);
      continue;
    }
#endif
    for (int64_t j = b * g.block / 2; j < (b + 1) * g.block / 2; ++j) {
      int32_t q0[kPanel], q1[kPanel];
      for (int c = 0; c < kPanel; ++c) {
        q0[c] = lo[j * kPanel + c] & 15;
        q1[c] = lo[j * kPanel + c] >> 4;
      }
      for (int64_t h = 0; h < g.planes; ++h) {
        const uint32_t m = hi[j * g.planes + h];
        for (int c = 0; c < kPanel; ++c) {
          q0[c] |= static_cast<int32_t>((m >> (2 * c)) & 1) << (4 + h);
          q1[c] |= static_cast<int32_t>((m >> (2 * c + 1)) & 1) << (4 + h);
        }
      }
      float* w0 = w + (2 * j - k0) * kPanel;
      for (int c = 0; c < kPanel; ++c) {
        w0[c] = std::fma(static_cast<float>(q0[c]) - off, scale[c], nmin[c]);
        w0[kPanel + c] = std::fma(static_cast<float>(q1[c]) - off, scale[c], nmin[c]);
      }
    }
  }
}

// For each of NP panels q: acc_q[r][0..16) += sum over k of x[r, k] * w_q[k, :] for R rows, k in order with
// fused multiply-adds (as cpu_linear.cpp's tiles). w holds the panels' k-slices back to back (w_q = w + q k
// 16); acc_q = acc_io + q acc_panel, [R, 16] in memory between calls, so a panel can be rebuilt and summed
// one k-chunk at a time with the same result as in one pass (a float stored and loaded is the same float).
// Several panels at once give a row or two enough independent sums to keep both FMA units busy (one row of
// one panel is 2 chains on AVX2, 1 on AVX-512, each waiting 4 cycles per k); each sum is unchanged.
template <int R, int NP>
void tile_fp32(const float* x, int64_t ldx, const float* w, int64_t k, float* acc_io, int64_t acc_panel) {
#if defined(__AVX512F__)
  __m512 acc[R][NP];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) acc[r][q] = _mm512_loadu_ps(acc_io + q * acc_panel + r * kPanel);
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (q * k + i) * kPanel), acc[r][q]);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_io + q * acc_panel + r * kPanel, acc[r][q]);
#elif defined(TOKENMILL_LINEAR_AVX2)
  __m256 acc[R][NP][2];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) {
      acc[r][q][0] = _mm256_loadu_ps(acc_io + q * acc_panel + r * kPanel);
      acc[r][q][1] = _mm256_loadu_ps(acc_io + q * acc_panel + r * kPanel + 8);
    }
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) {
        const float* wq = w + (q * k + i) * kPanel;
        acc[r][q][0] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wq), acc[r][q][0]);
        acc[r][q][1] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wq + 8), acc[r][q][1]);
      }
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc_io + q * acc_panel + r * kPanel, acc[r][q][0]);
      _mm256_storeu_ps(acc_io + q * acc_panel + r * kPanel + 8, acc[r][q][1]);
    }
#else
  for (int64_t i = 0; i < k; ++i)
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kPanel; ++c) {
          float& a = acc_io[q * acc_panel + r * kPanel + c];
          a = std::fma(x[r * ldx + i], w[(q * k + i) * kPanel + c], a);
        }
#endif
}

// Panels per tile for a block of `rows` rows: 4 for one row, 2 for two or three (8 to 12 independent sums
// on AVX2, 4 to 6 on AVX-512, whose 16 lanes hold a panel row in one register).
inline int64_t tile_panels(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

void rows_tile_fp32(int64_t rows, int64_t np, const float* x, int64_t ldx, const float* w, int64_t k, float* acc,
                    int64_t acc_panel) {
  if (np > tile_panels(rows)) {  // no tile of that shape (linear_fp32 never asks): a panel at a time
    for (int64_t q = 0; q < np; ++q) rows_tile_fp32(rows, 1, x, ldx, w + q * k * kPanel, k, acc + q * acc_panel, acc_panel);
    return;
  }
  if (np == 4) return tile_fp32<1, 4>(x, ldx, w, k, acc, acc_panel);
  if (np == 3) return tile_fp32<1, 3>(x, ldx, w, k, acc, acc_panel);
  if (np == 2) {
    if (rows == 1) return tile_fp32<1, 2>(x, ldx, w, k, acc, acc_panel);
    if (rows == 2) return tile_fp32<2, 2>(x, ldx, w, k, acc, acc_panel);
    return tile_fp32<3, 2>(x, ldx, w, k, acc, acc_panel);
  }
  switch (rows) {
    case 1: tile_fp32<1, 1>(x, ldx, w, k, acc, acc_panel); break;
    case 2: tile_fp32<2, 1>(x, ldx, w, k, acc, acc_panel); break;
    case 3: tile_fp32<3, 1>(x, ldx, w, k, acc, acc_panel); break;
    case 4: tile_fp32<4, 1>(x, ldx, w, k, acc, acc_panel); break;
    case 5: tile_fp32<5, 1>(x, ldx, w, k, acc, acc_panel); break;
#if defined(__AVX512F__)
    case 6: tile_fp32<6, 1>(x, ldx, w, k, acc, acc_panel); break;
    case 7: tile_fp32<7, 1>(x, ldx, w, k, acc, acc_panel); break;
    default: tile_fp32<8, 1>(x, ldx, w, k, acc, acc_panel); break;
#else
    default: tile_fp32<6, 1>(x, ldx, w, k, acc, acc_panel); break;
#endif
  }
}

// out [M, N] (fp32, or bf16) = x [M, K] fp32 @ W^T (+ bias): per block of rows and group of panels, the
// panels rebuilt a k-chunk at a time into a buffer that stays in L1 (kChunk x 16 fp32 in all) while every
// tile of rows sums it. Rebuilding a whole panel first (K x 16 fp32: 512 KB for K = 8192) left it in L2 or
// beyond, and a 1B Q4_K model's batch-1 step took 630.7 ms on a 2-vCPU AVX2 EPYC, at 0.04 of its memory
// roofline (docs/kernels.md).
template <typename TOut>
void linear_fp32(const Grouped& g, const float* x, int64_t ldx, int64_t m, TOut* out, int64_t ldo, int64_t n,
                 const float* bias) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Up to 3 rows (decode), one tile of rows spans several panels; their slices share the buffer.
  const int64_t np_max = tile_panels(m);
  const int64_t kc = kChunk / np_max;  // a multiple of every block size (16, 32)
  const int64_t acc_panel = kRowBlock * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kChunk * kPanel), acc(np_max * acc_panel);
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t p = begin; p < end; p += np_max) {
        const int64_t np = std::min(np_max, end - p);
        for (int64_t q = 0; q < np; ++q)  // the rows in use only: one row's group would clear 32 KB otherwise
          std::fill_n(acc.data() + q * acc_panel, (r1 - r0) * kPanel, 0.0f);
        for (int64_t k0 = 0; k0 < g.k; k0 += kc) {  // g.k and kc are multiples of the block size
          const int64_t k1 = std::min(g.k, k0 + kc);
          for (int64_t q = 0; q < np; ++q) rebuild(g, p + q, k0, k1, w.data() + q * (k1 - k0) * kPanel);
          for (int64_t r = r0; r < r1; r += kTileRows32)
            rows_tile_fp32(std::min(kTileRows32, r1 - r), np, x + r * ldx + k0, ldx, w.data(), k1 - k0,
                           acc.data() + (r - r0) * kPanel, acc_panel);
        }
        for (int64_t q = 0; q < np; ++q) {
          const int64_t pq = p + q, cols = std::min(kPanel, n - pq * kPanel);
          const float* pb = bias != nullptr ? bias + pq * kPanel : nullptr;
          const float* aq = acc.data() + q * acc_panel;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t c = 0; c < cols; ++c)
              out[r * ldo + pq * kPanel + c] = static_cast<TOut>(aq[(r - r0) * kPanel + c] + (pb != nullptr ? pb[c] : 0.0f));
        }
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_GROUPED_BF16 1

// code -> bf16(code - offset) for codes 0..63: two 32-entry vpermw tables.
inline void code_tables(int64_t offset, __m512i* t0, __m512i* t1) {
  alignas(64) uint16_t e[64];
  for (int i = 0; i < 64; ++i) e[i] = c10::BFloat16(static_cast<float>(i - offset)).x;
  *t0 = _mm512_load_si512(e);
  *t1 = _mm512_load_si512(e + 32);
}

// The codes of k = 2j, 2j + 1 for a panel's 16 columns as bf16 pairs (lane c: (w(2j, c), w(2j + 1, c)) in
// its low and high 16 bits, the order vdpbf16ps pairs them with x's (x_2j, x_2j+1)).
template <int H>
inline __m512i code_pairs(const uint8_t* lo, const uint32_t* hi, int64_t j, __m512i t0, __m512i t1) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + j * kPanel)));
  // Low word: the low nibble (k = 2j); high word: the high nibble (k = 2j + 1).
  __m512i idx = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
  if (H >= 1) idx = _mm512_or_si512(idx, _mm512_maskz_mov_epi16(hi[j * H], _mm512_set1_epi16(16)));
  if (H >= 2) idx = _mm512_or_si512(idx, _mm512_maskz_mov_epi16(hi[j * H + 1], _mm512_set1_epi16(32)));
  return H == 2 ? _mm512_permutex2var_epi16(t0, idx, t1) : _mm512_permutexvar_epi16(idx, t0);
}

// out[r, 16 q + 0..cols) for R rows of x against P adjacent panels starting at p. xsum [R, K / B] the rows'
// sums per sub-block (formats with mins). Each broadcast x pair feeds P dot products; running sums live in
// an L1 array (one load and store per sub-block against B / 2 * P dot products per row).
template <int R, int P, int H, int B, bool MIN, typename TOut>
void tile_dot(const Grouped& g, int64_t p, const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t ldxs,
              __m512i t0, __m512i t1, TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  alignas(64) float acc[R][P][kPanel] = {};
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);
  const int64_t nb = g.k / B;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 blk[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) blk[r][q] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t j = b * B / 2; j < (b + 1) * B / 2; ++j) {
      __m512bh w[P];
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q)
        w[q] = reinterpret_cast<__m512bh>(code_pairs<H>(g.lo + (p + q) * g.lo_p(), g.hi + (p + q) * g.hi_p(), j, t0, t1));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xw[r * ldx / 2 + j]));
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) blk[r][q] = _mm512_dpbf16_ps(blk[r][q], w[q], xv);
      }
    }
    const int64_t s = b * B / g.group;
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) {
      const int64_t si = (p + q) * g.sc_p() + b * kPanel, di = (p + q) * g.d_p() + s * kPanel;
      const __m512 cv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g.sc + si))));
      const __m512 scale = _mm512_mul_ps(tokenmill_cpu::load16(g.d + di), cv);
      __m512 low = _mm512_setzero_ps();
      if (MIN) {
        const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g.mn + si))));
        low = _mm512_mul_ps(tokenmill_cpu::load16(g.dmin + di), mv);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_fmadd_ps(blk[r][q], scale, _mm512_load_ps(acc[r][q]));
        if (MIN) a = _mm512_fnmadd_ps(low, _mm512_set1_ps(xsum[r * ldxs + b]), a);
        _mm512_store_ps(acc[r][q], a);
      }
    }
  }
  tokenmill_cpu::store_tile(acc, out, ldo, cols, bias);
}

template <int P, int H, int B, bool MIN, typename TOut>
void rows_tile_dot(int64_t rows, const Grouped& g, int64_t p, const c10::BFloat16* x, int64_t ldx, const float* xsum,
                   int64_t ldxs, __m512i t0, __m512i t1, TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  tokenmill_cpu::with_tile_rows<kTileRows>(rows, [&](auto r) {
    tile_dot<decltype(r)::value, P, H, B, MIN, TOut>(g, p, x, ldx, xsum, ldxs, t0, t1, out, ldo, cols, bias);
  });
}

template <int H, int B, bool MIN, typename TOut>
void linear_dot(const Grouped& g, const c10::BFloat16* x, int64_t ldx, int64_t m, TOut* out, int64_t ldo, int64_t n,
                const float* bias) {
  const int64_t panels = (n + kPanel - 1) / kPanel, nb = g.k / B;
  std::vector<float> xsum;
  if (MIN) {  // each row's sum of x per sub-block, shared by every column's min term
    xsum.assign(m * nb, 0.0f);
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const c10::BFloat16* xb = x + r * ldx + B * b;
          __m512 s = tokenmill_cpu::load16(xb);
          if (B == 32) s = _mm512_add_ps(s, tokenmill_cpu::load16(xb + 16));
          xsum[r * nb + b] = _mm512_reduce_add_ps(s);
        }
    });
  }
  __m512i t0, t1;
  code_tables(g.offset, &t0, &t1);
  constexpr int64_t kPair = 2;
  const int64_t pairs = (panels + kPair - 1) / kPair;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t pp = begin; pp < end; ++pp) {
        const int64_t p = pp * kPair, np = std::min(kPair, panels - p);
        const int64_t cols = std::min(kPanel, n - (p + np - 1) * kPanel);
        const float* pb = bias != nullptr ? bias + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kTileRows) {
          const int64_t rows = std::min(kTileRows, r1 - r);
          auto* tile = np == kPair ? rows_tile_dot<kPair, H, B, MIN, TOut> : rows_tile_dot<1, H, B, MIN, TOut>;
          tile(rows, g, p, x + r * ldx, ldx, MIN ? xsum.data() + r * nb : nullptr, nb, t0, t1, out + r * ldo + p * kPanel,
               ldo, cols, pb);
        }
      }
    }
  });
}

template <typename TOut>
bool dispatch_dot(const Grouped& g, const c10::BFloat16* x, int64_t ldx, int64_t m, TOut* out, int64_t ldo, int64_t n,
                  const float* bias) {
  const bool min = g.mn != nullptr;
  // The formats that exist: Q4_K, AWQ, GPTQ (4 bits, 32, mins); Q5_K, Q5_1 (5, 32, mins); Q5_0 (5, 32);
  // Q6_K (6, 16).
  if (g.planes == 0 && g.block == 32 && min) linear_dot<0, 32, true>(g, x, ldx, m, out, ldo, n, bias);
  else if (g.planes == 0 && g.block == 32) linear_dot<0, 32, false>(g, x, ldx, m, out, ldo, n, bias);
  else if (g.planes == 1 && g.block == 32 && min) linear_dot<1, 32, true>(g, x, ldx, m, out, ldo, n, bias);
  else if (g.planes == 1 && g.block == 32) linear_dot<1, 32, false>(g, x, ldx, m, out, ldo, n, bias);
  else if (g.planes == 2 && g.block == 16 && !min) linear_dot<2, 16, false>(g, x, ldx, m, out, ldo, n, bias);
  else if (g.planes == 2 && g.block == 32 && !min) linear_dot<2, 32, false>(g, x, ldx, m, out, ldo, n, bias);
  else return false;
  return true;
}
#endif

bool linear_grouped_bf16_supported() {
#if defined(TOKENMILL_GROUPED_BF16)
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ W^T (+ bias, fp32) with W in the grouped layout. x fp32 (out fp32) or bf16 (out
// bf16, or fp32 for logits).
void linear_grouped(at::Tensor out, const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                    const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                    at::IntArrayRef fmt, const c10::optional<at::Tensor>& bias) {
  const char* op = "linear_grouped";
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.stride(0) % 2 == 0),
              op, ": x must be 2-D float32 or bfloat16 with contiguous rows (bfloat16: an even number apart)");
  const Grouped g = check_grouped(op, x.size(1), lo, hi, sc, mn, d, dmin, fmt);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  (out.scalar_type() == x.scalar_type() || (bf16 && out.scalar_type() == at::kFloat)),
              op, ": out must be 2-D [rows of x, N] with contiguous rows, x's dtype (or float32 for bfloat16 x)");
  const int64_t m = x.size(0), n = out.size(1), panels = lo.size(0);
  TORCH_CHECK(n <= panels * kPanel && n > (panels - 1) * kPanel, op, ": out has ", n, " columns, the weight ", panels,
              " panels of 16");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n, op,
                ": bias must be contiguous float32 [", n, "]");
    bp = bias->data_ptr<float>();
  }
  if (m == 0) return;
#if defined(TOKENMILL_GROUPED_BF16)
  if (bf16) {
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    const bool done = out.scalar_type() == at::kFloat
                          ? dispatch_dot(g, xp, x.stride(0), m, out.data_ptr<float>(), out.stride(0), n, bp)
                          : dispatch_dot(g, xp, x.stride(0), m, out.data_ptr<c10::BFloat16>(), out.stride(0), n, bp);
    if (done) return;
  }
#endif
  // fp32 arithmetic: x as is, or a bf16 x widened (CPUs without AVX-512 BF16).
  const at::Tensor x32 = bf16 ? x.to(at::kFloat) : x;
  if (out.scalar_type() == at::kFloat)
    linear_fp32(g, x32.data_ptr<float>(), x32.stride(0), m, out.data_ptr<float>(), out.stride(0), n, bp);
  else
    linear_fp32(g, x32.data_ptr<float>(), x32.stride(0), m, out.data_ptr<c10::BFloat16>(), out.stride(0), n, bp);
}

#if defined(TOKENMILL_LINEAR_AVX2)
// Every sub-block's scale and min (block_scales) of a 4-bit grouped panel, for the int8-activation loop:
// the values rebuild() uses.
void grouped_scales(const void* ctx, int64_t p, float* scratch, const float** scale, const float** min) {
  const Grouped& g = *static_cast<const Grouped*>(ctx);
  const int64_t nb = g.k / g.block;
  float* s = scratch;
  float* n = scratch + nb * kPanel;
  block_scales(g, p, 0, nb, s, n);
  *scale = s;
  *min = n;
}
#endif

// The same as linear_grouped's fp32 path with x rounded to int8 per 32 k (`--int8-activations`,
// cpu_codes_int8.cpp; bf16 rows too where its VNNI tiles are built): 4-bit formats with 32-weight sub-blocks and no offset (Q4_K; AWQ and GPTQ int4), whose
// low nibbles are cpu_linear.cpp's nibble panels.
void linear_grouped_int8x(at::Tensor out, const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                          const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                          at::IntArrayRef fmt, const c10::optional<at::Tensor>& bias) {
  const char* op = "linear_grouped_int8x";
  const bool bf16_ok = tokenmill_cpu::int8x_vnni_built();  // bf16 rows (and fp32 logits of them) on the VNNI tiles
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D ", bf16_ok ? "float32 or bfloat16" : "float32", " with contiguous rows");
  const Grouped g = check_grouped(op, x.size(1), lo, hi, sc, mn, d, dmin, fmt);
  TORCH_CHECK(g.nibble_blocks(), op,
              ": int8 activations take 4-bit codes in 32-weight blocks with no offset (Q4_K, AWQ/GPTQ int4), got bits=",
              fmt[0], " block=", g.block, " offset=", g.offset);
  const int64_t panels = lo.size(0);
  const float* bp = tokenmill_cpu::check_linear_args(op, out, x, panels, "the codes", bias, bf16_ok, bf16_ok);  // AVX2 or refused
#if defined(TOKENMILL_LINEAR_AVX2)
  tokenmill_cpu::linear_int8x_panels(out, x, reinterpret_cast<const int8_t*>(g.lo), true, panels, bp, grouped_scales, &g);
#else
  (void)bp;
#endif
}

// Rows `ids` of a weight held as panels, rebuilt exactly: out[i, k] = w[ids[i], k] (fp32, or rounded once
// to bf16). row(p, col, w) writes one row of panel p into w[K].
template <typename Row>
void gather_rows(const char* op, at::Tensor& out, const at::Tensor& ids, int64_t num_rows, int64_t k, Row&& row) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": ids must be a 1-D int64 CPU tensor");
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == ids.size(0) && out.size(1) == k,
              op, ": out must be contiguous float32 or bfloat16 [", ids.size(0), ", ", k, "], got ", out.sizes());
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t t = ids.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_rows, op, ": id ", ip[i], " is outside the vocabulary [0, ", num_rows, ")");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(k);
    for (int64_t i = begin; i < end; ++i) {
      row(ip[i] / kPanel, ip[i] % kPanel, w.data());
      if (bf16) {
        c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + i * k;
        for (int64_t j = 0; j < k; ++j) o[j] = c10::BFloat16(w[j]);
      } else {
        std::copy(w.begin(), w.end(), out.data_ptr<float>() + i * k);
      }
    }
  });
}

void embedding_grouped(at::Tensor out, const at::Tensor& ids, const at::Tensor& lo, const at::Tensor& hi,
                       const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                       at::IntArrayRef fmt, int64_t num_rows) {
  const char* op = "embedding_grouped";
  const Grouped g = check_grouped(op, -1, lo, hi, sc, mn, d, dmin, fmt);
  TORCH_CHECK(num_rows <= lo.size(0) * kPanel && num_rows > (lo.size(0) - 1) * kPanel, op, ": num_rows=", num_rows,
              " does not fit ", lo.size(0), " panels of 16");
  gather_rows(op, out, ids, num_rows, g.k, [&](int64_t p, int64_t col, float* w) {
    std::vector<float> panel(g.block * kPanel);  // one sub-block of the panel at a time
    for (int64_t k0 = 0; k0 < g.k; k0 += g.block) {
      rebuild(g, p, k0, k0 + g.block, panel.data());
      for (int64_t i = 0; i < g.block; ++i) w[k0 + i] = panel[i * kPanel + col];
    }
  });
}

// The same for cpu_linear.cpp's codes layout (int8 [P, K, 16] or nibbles [P, K / 2, 16]; scales and mins
// fp32 or fp16 per 32): w = fma(code, scale, min), the value the loaded fp32 weight holds.
void embedding_codes(at::Tensor out, const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& mins, int64_t num_rows) {
  const char* op = "embedding_codes";
  tokenmill_cpu::check_codes(op, codes, scales, mins, -1, true, true);
  const bool q4 = codes.scalar_type() == at::kByte, half = scales.scalar_type() == at::kHalf;
  const int64_t k = codes.size(1) * (q4 ? 2 : 1), panels = codes.size(0), nb = k / 32;
  TORCH_CHECK(num_rows <= panels * kPanel && num_rows > (panels - 1) * kPanel, op, ": num_rows=", num_rows,
              " does not fit ", panels, " panels of 16");
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  gather_rows(op, out, ids, num_rows, k, [&](int64_t p, int64_t col, float* w) {
    const uint8_t* c = cp + p * (q4 ? k / 2 : k) * kPanel + col;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = p * nb * kPanel + (j / 32) * kPanel + col;
      const float sv = half ? static_cast<float>(scales.data_ptr<c10::Half>()[s]) : scales.data_ptr<float>()[s];
      const float mv = half ? static_cast<float>(mins.data_ptr<c10::Half>()[s]) : mins.data_ptr<float>()[s];
      const float q = q4 ? static_cast<float>((c[(j / 2) * kPanel] >> (4 * (j & 1))) & 15)
                         : static_cast<float>(static_cast<int8_t>(c[j * kPanel]));
      w[j] = std::fma(q, sv, mv);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_grouped_bf16_supported() -> bool", &linear_grouped_bf16_supported);
  m.def(
      "linear_grouped(Tensor(a!) out, Tensor x, Tensor lo, Tensor hi, Tensor sc, Tensor mn, Tensor d, Tensor dmin, "
      "int[] fmt, Tensor? bias) -> ()");
  m.impl("linear_grouped", c10::DispatchKey::CPU, &linear_grouped);
  m.def(
      "linear_grouped_int8x(Tensor(a!) out, Tensor x, Tensor lo, Tensor hi, Tensor sc, Tensor mn, Tensor d, "
      "Tensor dmin, int[] fmt, Tensor? bias) -> ()");
  m.impl("linear_grouped_int8x", c10::DispatchKey::CPU, &linear_grouped_int8x);
  m.def(
      "embedding_grouped(Tensor(a!) out, Tensor ids, Tensor lo, Tensor hi, Tensor sc, Tensor mn, Tensor d, "
      "Tensor dmin, int[] fmt, int num_rows) -> ()");
  m.impl("embedding_grouped", c10::DispatchKey::CPU, &embedding_grouped);
  m.def("embedding_codes(Tensor(a!) out, Tensor ids, Tensor codes, Tensor scales, Tensor mins, int num_rows) -> ()");
  m.impl("embedding_codes", c10::DispatchKey::CPU, &embedding_codes);
}
