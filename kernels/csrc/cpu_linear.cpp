// fp32 linear layers (y = x W^T + b) for AVX2 CPUs, on weights packed once at model load.
//
// Why: on an AVX2-only EPYC torch's fp32 F.linear ran a decode step's small batches far below the
// memory bandwidth (docs/benchmark-log.md: 8 rows of SmolLM2's MLP weight took 3.8x the time of one row,
// although both read the same 7 MB). Here every weight is read once per block of rows and used for
// all of them from registers, so 1-16 rows cost what reading the weight costs, and larger batches run
// a 6 x 16 register tile at the FMA units' rate.
//
// Layout: W [N, K] is packed into panels of 16 output columns, panel p holding W[16p .. 16p+15, k] for
// k = 0..K-1 contiguously ([ceil(N / 16), K, 16], the last panel zero-padded). A thread streams its
// panels front to back, which the hardware prefetcher follows.
//
// Numerics: each output is one fp32 sum over k in order 0..K-1 with fused multiply-adds, whatever the
// number of rows (torch's GEMM sums in its own blocked order, which changes with the batch), so results
// differ from F.linear by rounding only and a row's result does not depend on the rows beside it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int64_t kPanel = 16;    // output columns per panel: two 8-lane vectors
constexpr int64_t kTileRows = 6;  // rows per register tile: 6 x 2 accumulators + 2 weights + 1 broadcast
// Rows whose x stays in L2 while a thread's panels pass over them; larger batches are cut into such
// blocks so the activations are not re-read from memory once per panel.
constexpr int64_t kRowBlock = 96;
constexpr int64_t kCodeBlock = 32;  // k per scale/min pair of the integer-code weights (GGUF's block size)
constexpr int64_t kTileRowsQ8 = 4;

// Whether every value of an fp32 tensor is a bf16 value (its low 16 bits zero): a checkpoint stored in
// bf16 and served in fp32, as AVX2 CPUs serve one. Such a weight's panels keep the top halves only.
bool bf16_exact(const float* v, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(v);
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    uint32_t any = 0;
    for (int64_t i = begin; i < end; ++i) any |= u[i];
    if (any & 0xffffu) exact = false;
  });
  return exact.load();
}

// bf16_if_exact: where every weight is a bf16 value, the panels are bfloat16 (half the bytes to read);
// the tiles widen them back to the same fp32 values, so results are those of fp32 panels bit for bit.
at::Tensor pack_linear_weight(const at::Tensor& weight, bool bf16_if_exact) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear_weight: weight must be a 2-D float32 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const float* src = w.data_ptr<float>();
  const bool half = bf16_if_exact && bf16_exact(src, n * k);
  at::Tensor packed = at::zeros({panels, k, kPanel}, w.options().dtype(half ? at::kBFloat16 : at::kFloat));
  float* dst = half ? nullptr : packed.data_ptr<float>();
  uint16_t* dst16 = half ? reinterpret_cast<uint16_t*>(packed.data_ptr()) : nullptr;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t c = 0; c < cols; ++c) {
        const float* row = src + (p * kPanel + c) * k;
        if (half) {
          const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
          uint16_t* panel = dst16 + p * k * kPanel;
          for (int64_t i = 0; i < k; ++i) panel[i * kPanel + c] = static_cast<uint16_t>(bits[i] >> 16);
        } else {
          float* panel = dst + p * k * kPanel;
          for (int64_t i = 0; i < k; ++i) panel[i * kPanel + c] = row[i];
        }
      }
    }
  });
  return packed;
}

// One block of 32 weights as w = d * q + m, rebuilt exactly; see engine/layers/weight_codes.py for the forms.
// With an fp16 scale d and a code below 2^8 the product is exact in float, so float(d * q + m) rounds
// once, as the kernel's fused multiply-add does, and the check below is the kernel's own arithmetic.
bool fit_block(const float* v, int8_t* q, float* d_out, float* m_out) {
  float lo = v[0], hi = v[0], amax = std::fabs(v[0]);
  for (int i = 1; i < kCodeBlock; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  auto try_form = [&](float m, float span, int levels, int qlo, int qhi) {
    const float d = static_cast<float>(c10::Half(span / static_cast<float>(levels)));
    if (!std::isfinite(d)) return false;
    const float inv = d > 0 ? 1.0f / d : 0.0f;  // a guess of each code; the exact check below decides
    float codes[kCodeBlock];
    bool exact = true;
    for (int i = 0; i < kCodeBlock; ++i) {  // no early exit, so the loop vectorizes
      const float c = std::min(std::max(std::nearbyint((v[i] - m) * inv), static_cast<float>(qlo)),
                               static_cast<float>(qhi));
      codes[i] = c;
      exact &= d * c + m == v[i];
    }
    if (!exact) return false;
    for (int i = 0; i < kCodeBlock; ++i) q[i] = static_cast<int8_t>(codes[i]);
    *d_out = d;
    *m_out = m;
    return true;
  };
  // Codes 0..15 above the block's smallest value (GGUF Q4_1 as llama.cpp's reference quantizer writes
  // it), signed codes with min 0 (Q8_0), then narrower unsigned spans (Q4_1 blocks whose codes miss 0
  // or 15); the common forms first, so a model's check costs one or two tries per block.
  if (try_form(lo, hi - lo, 15, 0, 15)) return true;
  if (try_form(0.0f, amax, 127, -128, 127)) return true;
  for (int j = 14; j >= 1; --j)
    if (try_form(lo, hi - lo, j, 0, j)) return true;
  return false;
}

// (codes int8 [N, K], scales [N, K / 32], mins [N, K / 32], ok) for a float32 weight [N, K]; ok is false
// (and the rest undefined) when some block has no exact form.
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> find_weight_blocks(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.size(1) % kCodeBlock == 0,
              "find_weight_blocks: weight must be 2-D float32 with K a multiple of 32, got ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), nb = n * (k / kCodeBlock);
  at::Tensor codes = at::empty({n, k}, w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n, k / kCodeBlock}, w.options());
  at::Tensor mins = at::empty({n, k / kCodeBlock}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* mp = mins.data_ptr<float>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, nb, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && ok.load(std::memory_order_relaxed); ++b)
      if (!fit_block(wp + b * kCodeBlock, cp + b * kCodeBlock, sp + b, mp + b)) ok.store(false);
  });
  return {codes, scales, mins, ok.load()};
}

#if defined(TOKENMILL_LINEAR_AVX2)
// out[r, 0..cols) = x[r, :] . panel for R rows; cols < 16 only in the last panel.
// 8 panel weights as fp32: loaded, or bf16 widened (its bits are the fp32 value's top half).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* panel, int64_t k, float* out, int64_t ldo,
                 int64_t cols, const float* bias) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = load8(panel + i * kPanel);
    const __m256 w1 = load8(panel + i * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(b, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, w1, acc[r][1]);
    }
  }
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  alignas(32) float bias_pad[kPanel] = {0};
  if (bias != nullptr) {
    std::copy(bias, bias + cols, bias_pad);
    b0 = _mm256_load_ps(bias_pad);
    b1 = _mm256_load_ps(bias_pad + 8);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 y0 = _mm256_add_ps(acc[r][0], b0), y1 = _mm256_add_ps(acc[r][1], b1);
    if (cols == kPanel) {
      _mm256_storeu_ps(out + r * ldo, y0);
      _mm256_storeu_ps(out + r * ldo + 8, y1);
    } else {
      alignas(32) float tmp[kPanel];
      _mm256_store_ps(tmp, y0);
      _mm256_store_ps(tmp + 8, y1);
      std::copy(tmp, tmp + cols, out + r * ldo);
    }
  }
}

template <typename W>
void rows_tile(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t k, float* out, int64_t ldo,
               int64_t cols, const float* bias) {
  switch (rows) {
    case 1: tile<1>(x, ldx, panel, k, out, ldo, cols, bias); break;
    case 2: tile<2>(x, ldx, panel, k, out, ldo, cols, bias); break;
    case 3: tile<3>(x, ldx, panel, k, out, ldo, cols, bias); break;
    case 4: tile<4>(x, ldx, panel, k, out, ldo, cols, bias); break;
    case 5: tile<5>(x, ldx, panel, k, out, ldo, cols, bias); break;
    default: tile<6>(x, ldx, panel, k, out, ldo, cols, bias); break;
  }
}


// The same tile on integer codes: panel p's weights are code rows (above) with, per 32 k and per column,
// w = scale * code + min. The weight is rebuilt in registers with one FMA, which rounds the exact
// scale * code + min once: the value an fp32 weight stored from it holds (engine/layers/weight_codes.py checks
// that), so the sums equal tile()'s on those fp32 weights bit for bit while 1.25 bytes per weight (0.75
// for nibbles) are read instead of 4. Four rows: 8 accumulators + 4 scale/min + 2 weights + 1 broadcast
// fill the 16 registers.
template <int R, bool Q4>
inline void tile_codes(const float* x, int64_t ldx, const int8_t* codes, const float* scales, const float* mins,
                       int64_t k, float* out, int64_t ldo, int64_t cols, const float* bias) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kCodeBlock; ++b) {
    const __m256 d0 = _mm256_loadu_ps(scales + b * kPanel), d1 = _mm256_loadu_ps(scales + b * kPanel + 8);
    const __m256 m0 = _mm256_loadu_ps(mins + b * kPanel), m1 = _mm256_loadu_ps(mins + b * kPanel + 8);
#pragma GCC unroll 2
    for (int64_t i = b * kCodeBlock; i < (b + 1) * kCodeBlock; ++i) {
      const __m128i c = tokenmill_cpu::code_row<Q4>(codes, i);
      const __m256 w0 = _mm256_fmadd_ps(tokenmill_cpu::codes8<Q4>(c), d0, m0);
      const __m256 w1 = _mm256_fmadd_ps(tokenmill_cpu::codes8<Q4>(_mm_srli_si128(c, 8)), d1, m1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
  alignas(32) float tmp[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
  }
}

#if defined(__AVX512F__)
// tile_codes on AVX-512 CPUs: a panel's 16 columns are one register, so a weight is rebuilt and used with
// half the instructions. Each lane does tile_codes's arithmetic (the same two FMAs in the same k order),
// so the results are equal bit for bit.
template <int R, bool Q4>
inline void tile_codes_512(const float* x, int64_t ldx, const int8_t* codes, const float* scales, const float* mins,
                           int64_t k, float* out, int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kCodeBlock; ++b) {
    const __m512 d = _mm512_loadu_ps(scales + b * kPanel), mn = _mm512_loadu_ps(mins + b * kPanel);
#pragma GCC unroll 2
    for (int64_t i = b * kCodeBlock; i < (b + 1) * kCodeBlock; ++i) {
      const __m128i c = tokenmill_cpu::code_row<Q4>(codes, i);
      const __m512 w =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(Q4 ? _mm512_cvtepu8_epi32(c) : _mm512_cvtepi8_epi32(c)), d, mn);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), w, acc[r]);
    }
  }
  alignas(64) float tmp[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(tmp, acc[r]);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
  }
}
#define TOKENMILL_TILE_CODES tile_codes_512
#else
#define TOKENMILL_TILE_CODES tile_codes
#endif

template <bool Q4>
void rows_tile_codes(int64_t rows, const float* x, int64_t ldx, const int8_t* codes, const float* scales,
                     const float* mins, int64_t k, float* out, int64_t ldo, int64_t cols, const float* bias) {
  switch (rows) {
    case 1: TOKENMILL_TILE_CODES<1, Q4>(x, ldx, codes, scales, mins, k, out, ldo, cols, bias); break;
    case 2: TOKENMILL_TILE_CODES<2, Q4>(x, ldx, codes, scales, mins, k, out, ldo, cols, bias); break;
    case 3: TOKENMILL_TILE_CODES<3, Q4>(x, ldx, codes, scales, mins, k, out, ldo, cols, bias); break;
    default: TOKENMILL_TILE_CODES<4, Q4>(x, ldx, codes, scales, mins, k, out, ldo, cols, bias); break;
  }
}
#endif

bool packed_linear_supported() { return tokenmill_cpu::linear_kernels_built(); }

// out [M, N] = x [M, K] @ W^T (+ bias), W given packed by pack_linear_weight: fp32 or bf16 panels.
void linear_packed(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const bool half = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
                  packed.is_contiguous() && (half || packed.scalar_type() == at::kFloat),
              "linear_packed: packed weight is float32 or bfloat16 [panels, K=", x.dim() == 2 ? x.size(1) : -1,
              ", 16], got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t panels = packed.size(0);
  const float* bp = tokenmill_cpu::check_linear_args("linear_packed", out, x, panels, "the packed weight", bias);
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
#if defined(TOKENMILL_LINEAR_AVX2)
  const float* xp = x.data_ptr<float>();
  const float* wp = half ? nullptr : packed.data_ptr<float>();
  const uint16_t* wp16 = half ? reinterpret_cast<const uint16_t*>(packed.data_ptr()) : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // Threads split the panels (output columns), so each weight byte is read by one thread only.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* pb = bp != nullptr ? bp + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kTileRows) {
          const int64_t rows = std::min(kTileRows, r1 - r);
          float* o = op + r * ldo + p * kPanel;
          // bf16 panels are widened in registers by every tile: the shifts run beside the FMAs, where
          // widening a panel once into a buffer per block of rows cost more (8 rows: 3x the time of 4).
          if (half)
            rows_tile(rows, xp + r * ldx, ldx, wp16 + p * k * kPanel, k, o, ldo, cols, pb);
          else
            rows_tile(rows, xp + r * ldx, ldx, wp + p * k * kPanel, k, o, ldo, cols, pb);
        }
      }
    }
  });
#else
  (void)bp;
  (void)m;
  (void)k;
  (void)n;
#endif
}

// out [M, N] = x [M, K] @ W^T (+ bias) with W as integer codes [panels, K, 16] int8 and per-(32 k, column)
// scales and mins [panels, K / 32, 16] fp32: w = scale * code + min. x and out are float32, or both
// bfloat16 (a bf16 model's single rows): then x is widened here and each fp32 sum rounded once to bf16,
// which saves the two tensor conversions a caller would make per linear.
void linear_packed_q8(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "linear_packed_q8: x must be 2-D float32 or bfloat16 with contiguous rows");
  const int64_t k = x.size(1);
  tokenmill_cpu::check_codes("linear_packed_q8", codes, scales, mins, k, true);
  const int64_t panels = codes.size(0);
  const float* bp = tokenmill_cpu::check_linear_args("linear_packed_q8", out, x, panels, "the codes", bias, true);
  const int64_t m = x.size(0), n = out.size(1);
#if defined(TOKENMILL_LINEAR_AVX2)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  std::vector<float> x32, out32;  // fp32 staging for bf16 x and out
  if (bf16) {
    x32.resize(m * k);
    out32.resize(m * n);
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) x32[r * k + i] = static_cast<float>(xb[r * x.stride(0) + i]);
  }
  const float* xp = bf16 ? x32.data() : x.data_ptr<float>();
  // Nibble codes (uint8, two k per byte) or int8 codes; `kb` bytes of codes per panel.
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op = bf16 ? out32.data() : out.data_ptr<float>();
  const int64_t ldx = bf16 ? k : x.stride(0), ldo = bf16 ? n : out.stride(0), nb = k / kCodeBlock;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // one panel rebuilt as fp32, for batches past kTileRowsQ8 rows
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t r1 = std::min(m, r0 + kRowBlock);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* pb = bp != nullptr ? bp + p * kPanel : nullptr;
        if (r1 - r0 > kTileRowsQ8) {
          // More rows than one tile: rebuild the panel once (the same fma per weight the q8 tile does)
          // and run the fp32 tiles over it, instead of rebuilding it in every tile.
          scratch.resize(k * kPanel);
          (q4 ? tokenmill_cpu::rebuild_codes16<true> : tokenmill_cpu::rebuild_codes16<false>)(
              cp + p * kb, sp + p * nb * kPanel, mp + p * nb * kPanel, k, scratch.data());
          for (int64_t r = r0; r < r1; r += kTileRows)
            rows_tile(std::min(kTileRows, r1 - r), xp + r * ldx, ldx, scratch.data(), k, op + r * ldo + p * kPanel,
                      ldo, cols, pb);
          continue;
        }
        for (int64_t r = r0; r < r1; r += kTileRowsQ8) {
          const int64_t rows = std::min(kTileRowsQ8, r1 - r);
          (q4 ? rows_tile_codes<true> : rows_tile_codes<false>)(rows, xp + r * ldx, ldx, cp + p * kb,
                                                                sp + p * nb * kPanel, mp + p * nb * kPanel, k,
                                                                op + r * ldo + p * kPanel, ldo, cols, pb);
        }
      }
    }
  });
  if (bf16) {
    c10::BFloat16* ob = out.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) ob[r * out.stride(0) + c] = c10::BFloat16(out32[r * n + c]);
  }
#else
  (void)bp;
  (void)m;
  (void)n;
#endif
}

}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_packed(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  ::linear_packed(out, x, packed, bias);
}
void linear_packed_q8(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_packed_q8(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("pack_linear_weight(Tensor weight, bool bf16_if_exact=False) -> Tensor");
  m.def("linear_packed(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("packed_linear_supported() -> bool", &packed_linear_supported);
  m.def("find_weight_blocks(Tensor weight) -> (Tensor, Tensor, Tensor, bool)");
  m.impl("find_weight_blocks", c10::DispatchKey::CPU, &find_weight_blocks);
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.impl("linear_packed", c10::DispatchKey::CPU, &linear_packed);
  m.def("linear_packed_q8(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_packed_q8", c10::DispatchKey::CPU, &linear_packed_q8);
}
