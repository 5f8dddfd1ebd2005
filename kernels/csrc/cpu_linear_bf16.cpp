// bf16 linear layers (y = x W^T + b, x bf16) on the integer-code weights, for CPUs with AVX-512 BF16.
//
// Why: a bf16 model converted from a GGUF keeps its weights' codes (cpu_linear.cpp's panels: Q4 nibbles,
// 0.5 bytes per weight plus fp32 scale and min per 32). The fp32 code tiles rebuild every weight as an
// fp32 value and spend one FMA per weight per row, so past 3 rows they lost to oneDNN's prepacked bf16
// weights, which in turn ran 8 rows at a third of the memory bandwidth (docs/benchmark-log.md).
//
// Here the codes themselves are the bf16 operands. Per block of 32 k and output column,
//   sum_k x_k (d c_k + m) = d * sum_k x_k c_k + m * sum_k x_k,
// the codes (0..15, or -128..127) are exact in bf16 and x is bf16 already, so vdpbf16ps forms
// sum_k x_k c_k two k at a time with exact products, and sum_k x_k is computed once per row and block for
// all columns. A weight then costs a table lookup (Q4) instead of a widen, convert and FMA, and each row
// half an instruction per pair of weights.
//
// Numerics: fp32 sums of exact products, with the fp32 weights' own values (not their bf16 rounding, as
// the fp32 tiles); the sum is grouped by block, so results differ from cpu_linear.cpp's in fp32 rounding.
// The output is rounded once (bf16 out) or kept (fp32 out: the LM head's logits).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_codes_bf16.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_tile.h"

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel (cpu_linear.cpp's layout)
constexpr int64_t kCodeBlock = 32;  // k per scale/min pair
constexpr int64_t kTileRows = 8;    // rows per tile: 8 x kPanels block sums in registers
constexpr int64_t kPanels = 2;      // panels per tile: each x broadcast feeds this many dot products

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_BF16_DOT 1

using tokenmill_cpu::code_pairs;

// out[r, 16 q + 0..cols) for R rows of x (bf16, ldx apart) against P adjacent panels (kb code bytes
// apart); cols < 16 only in the last panel of the weight. xsum [R, K / 32] the rows' block sums (ldxs
// apart). Each broadcast of a row's x pair feeds P dot products; the block sums live in registers and
// the running sums in an L1 array (one load and store per block, against 16 dot products).
template <int R, int P, bool Q4, typename TOut, typename S>
inline void tile_dot(const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t ldxs, const int8_t* codes,
                     int64_t kb, const S* scales, const S* mins, int64_t sb, int64_t k, __m512i table,
                     TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  alignas(64) float acc[R][P][kPanel] = {};
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);  // a row's k pairs as 32-bit words
  for (int64_t b = 0; b < k / kCodeBlock; ++b) {
    __m512 blk[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) blk[r][q] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t j = b * kCodeBlock / 2; j < (b + 1) * kCodeBlock / 2; ++j) {
      __m512bh w[P];
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) w[q] = reinterpret_cast<__m512bh>(code_pairs<Q4>(codes + q * kb, j, table));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xw[r * ldx / 2 + j]));
#pragma GCC unroll 4
        for (int q = 0; q < P; ++q) blk[r][q] = _mm512_dpbf16_ps(blk[r][q], w[q], xv);
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const __m512 d = tokenmill_cpu::load16(scales + q * sb + b * kPanel);
      const __m512 mn = tokenmill_cpu::load16(mins + q * sb + b * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_fmadd_ps(blk[r][q], d, _mm512_load_ps(acc[r][q]));
        _mm512_store_ps(acc[r][q], _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * ldxs + b]), a));
      }
    }
  }
  tokenmill_cpu::store_tile(acc, out, ldo, cols, bias);
}

template <int P, bool Q4, typename TOut, typename S>
void rows_tile_dot(int64_t rows, const c10::BFloat16* x, int64_t ldx, const float* xsum, int64_t ldxs,
                   const int8_t* codes, int64_t kb, const S* scales, const S* mins, int64_t sb, int64_t k,
                   __m512i table, TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  tokenmill_cpu::with_tile_rows<kTileRows>(rows, [&](auto r) {
    tile_dot<decltype(r)::value, P, Q4, TOut, S>(x, ldx, xsum, ldxs, codes, kb, scales, mins, sb, k, table, out, ldo,
                                                 cols, bias);
  });
}
#endif

bool linear_codes_bf16_supported() {
#if defined(TOKENMILL_BF16_DOT)
  return true;
#else
  return false;
#endif
}

// out [M, N] (bf16, or fp32 for logits) = x [M, K] (bf16) @ W^T (+ bias, fp32) with W as integer codes
// (cpu_linear.cpp's linear_packed_q8 layout: int8 [panels, K, 16] or nibbles uint8 [panels, K / 2, 16],
// scales and mins fp32 [panels, K / 32, 16]).
void linear_codes_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_codes_bf16_supported(), "linear_codes_bf16: this build has no AVX-512 BF16 path");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.stride(0) % 2 == 0,
              "linear_codes_bf16: x must be 2-D bfloat16 with contiguous rows an even number of elements apart");
  const int64_t k = x.size(1);
  tokenmill_cpu::check_codes("linear_codes_bf16", codes, scales, mins, k, true, true);
  const int64_t panels = codes.size(0), m = x.size(0), n = out.size(1);
  const float* bp =
      tokenmill_cpu::check_linear_args("linear_codes_bf16", out, x, panels, "the codes", bias, true, true);
#if defined(TOKENMILL_BF16_DOT)
  const int64_t nb = k / kCodeBlock, ldx = x.stride(0), ldo = out.stride(0);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const std::vector<float> xsum = tokenmill_cpu::block_sums(xp, ldx, m, nb, m);
  const __m512i table = tokenmill_cpu::nibble_table();
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;  // code bytes per panel
  auto run = [&](auto* op, const auto* sp, const auto* mp) {
    using TOut = std::remove_pointer_t<decltype(op)>;
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    // Threads split pairs of panels, so each code byte is read by one thread; the pair's codes (at most
    // 9 KB for K = 576) stay in L1 while every row tile passes over them.
    const int64_t pairs = (panels + kPanels - 1) / kPanels, sb = nb * kPanel;
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t pp = begin; pp < end; ++pp) {
        const int64_t p = pp * kPanels, np = std::min(kPanels, panels - p);
        const int64_t cols = n - (p + np - 1) * kPanel;  // of the last panel of the group
        const float* pb = bp != nullptr ? bp + p * kPanel : nullptr;
        for (int64_t r = 0; r < m; r += kTileRows) {
          const int64_t rows = std::min(kTileRows, m - r);
          auto* tile = np == kPanels
                           ? (q4 ? rows_tile_dot<kPanels, true, TOut, S> : rows_tile_dot<kPanels, false, TOut, S>)
                           : (q4 ? rows_tile_dot<1, true, TOut, S> : rows_tile_dot<1, false, TOut, S>);
          tile(rows, xp + r * ldx, ldx, xsum.data() + r * nb, nb, cp + p * kb, kb, sp + p * sb, mp + p * sb, sb, k,
               table, op + r * ldo + p * kPanel, ldo, std::min(cols, kPanel), pb);
        }
      }
    });
  };
  tokenmill_cpu::dispatch_codes_out(out, scales, mins, run);
#else
  (void)bp;
  (void)m;
  (void)n;
#endif
}

}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_codes_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_codes_bf16(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_codes_bf16_supported() -> bool", &linear_codes_bf16_supported);
  m.def("linear_codes_bf16(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_bf16", c10::DispatchKey::CPU, &linear_codes_bf16);
}
