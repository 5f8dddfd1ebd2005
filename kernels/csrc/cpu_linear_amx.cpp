// bf16 linear layers (y = x W^T + b, x bf16) on the integer-code weights with AMX tiles, for CPUs with
// AMX-BF16.
//
// Why: the same arithmetic as cpu_linear_bf16.cpp (per block of 32 k and column, d * sum(x c) + m * sum(x),
// the codes exact bf16 operands), but each block's products for 16 rows x 16 columns come from one
// TDPBF16PS instead of 16 rows x 16 vdpbf16ps. Past a few rows the vector kernel is bound by its dot
// products and oneDNN's AMX path by reading 2 bytes per weight; this one reads the codes (0.5 or 1 byte
// plus 8 bytes of scale and min per 32) and leaves the products to the tile unit.
//
// Per panel of 16 columns and block of 32 k: the 16 code-pair rows (code_pairs, already the VNNI layout
// of a B tile) make a 1 KB B tile; each group of 16 rows of x is an A tile; their block product (a C
// tile) is read back and scaled into fp32 running sums (the scale is per block, so the tile cannot carry
// the sum across blocks). Two blocks are in flight at a time.
//
// Numerics: fp32 sums of exact products (AMX flushes bf16 denormals in x to zero: |x| < 1.2e-38), grouped
// by block as in the vector kernel; the order within a block is the tile unit's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_codes_bf16.h"
#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel (cpu_linear.cpp's layout)
constexpr int64_t kCodeBlock = 32;  // k per scale/min pair: one B tile's depth in bf16 pairs
constexpr int64_t kGroup = 16;      // rows of x per A tile

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_AMX 1

// Linux hands out the 8 KB of tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..count-1, each 16 rows x 64 bytes: A = 16 rows of x by 32 k (bf16), B = 16 k pairs by 16
// columns (bf16 pairs), C = 16 rows by 16 columns (fp32).
TileConfig tile_config(int count) {
  TileConfig c;
  for (int t = 0; t < count; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = kGroup;
  }
  return c;
}

// acc[r] += d * C[r] + m * xsum[r] for the group's first `live` rows (the rest are padding, never stored;
// unrolled, so acc stays in registers and the test is a predictable branch).
inline void scale_block(__m512 (&acc)[kGroup], const float* cbuf, __m512 d, __m512 mn, const float* xs, int64_t nb,
                        int64_t live) {
#pragma GCC unroll 16
  for (int r = 0; r < kGroup; ++r) {
    if (r >= live) break;
    const __m512 s = _mm512_fmadd_ps(_mm512_load_ps(cbuf + r * kPanel), d, acc[r]);
    acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb]), s);
  }
}

// Panels [begin, end) of the output for all M rows. xp: x padded to whole groups of 16 rows (lda apart);
// xsum [groups * 16, nb], zero in the padding rows.
template <bool Q4, typename TOut, typename S>
void panels_amx(int64_t begin, int64_t end, int64_t m, const c10::BFloat16* xp, int64_t lda, const float* xsum,
                int64_t nb, const int8_t* codes, int64_t kb, const S* scales, const S* mins, int64_t n,
                const float* bias, TOut* out, int64_t ldo) {
  const TileConfig cfg = tile_config(6);  // A, B, C twice (tiles 0-2 and 3-5): two blocks in flight
  _tile_loadconfig(&cfg);
  const __m512i table = tokenmill_cpu::nibble_table();
  const int64_t groups = (m + kGroup - 1) / kGroup, sb = nb * kPanel, ldb = lda * sizeof(c10::BFloat16);
  // The panel's B tiles, one per block (1 KB each; 48 KB for K = 1536): built once, read by every group.
  std::vector<__m512i> btiles(nb * kCodeBlock / 2);
  alignas(64) float cbuf[2][kGroup * kPanel];
  // One group: each block's tile is built just before its product (still in L1); more: all up front.
  const bool lazy = groups == 1;
  for (int64_t p = begin; p < end; ++p) {
    const int8_t* cp = codes + p * kb;
    auto build = [&](int64_t b0, int64_t b1) {
      for (int64_t j = b0 * kCodeBlock / 2; j < b1 * kCodeBlock / 2; ++j)
        btiles[j] = tokenmill_cpu::code_pairs<Q4>(cp, j, table);
    };
    if (!lazy) build(0, nb);
    const S* ps = scales + p * sb;
    const S* pm = mins + p * sb;
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) bv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), bias + p * kPanel);
    for (int64_t g = 0; g < groups; ++g) {
      const c10::BFloat16* a = xp + g * kGroup * lda;
      const float* xs = xsum + g * kGroup * nb;
      __m512 acc[kGroup];
#pragma GCC unroll 16
      for (int r = 0; r < kGroup; ++r) acc[r] = _mm512_setzero_ps();
      const int64_t rows = std::min(kGroup, m - g * kGroup);
      auto scale = [&](int64_t b, const float* c) {
        scale_block(acc, c, tokenmill_cpu::load16(ps + b * kPanel), tokenmill_cpu::load16(pm + b * kPanel), xs + b, nb,
                    rows);
      };
      int64_t b = 0;
      for (; b + 1 < nb; b += 2) {  // the second block's product runs while the first is read back
        if (lazy) build(b, b + 2);
        _tile_loadd(0, a + b * kCodeBlock, ldb);
        _tile_loadd(1, &btiles[b * kCodeBlock / 2], 64);
        _tile_zero(2);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(3, a + (b + 1) * kCodeBlock, ldb);
        _tile_loadd(4, &btiles[(b + 1) * kCodeBlock / 2], 64);
        _tile_zero(5);
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(2, cbuf[0], 64);
        _tile_stored(5, cbuf[1], 64);
        scale(b, cbuf[0]);
        scale(b + 1, cbuf[1]);
      }
      if (b < nb) {
        if (lazy) build(b, b + 1);
        _tile_loadd(0, a + b * kCodeBlock, ldb);
        _tile_loadd(1, &btiles[b * kCodeBlock / 2], 64);
        _tile_zero(2);
        _tile_dpbf16ps(2, 0, 1);
        _tile_stored(2, cbuf[0], 64);
        scale(b, cbuf[0]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 y = _mm512_add_ps(acc[r], bv);
        tokenmill_cpu::store_cols(out + (g * kGroup + r) * ldo + p * kPanel, y, cols);
      }
    }
  }
  _tile_release();
}

// ---- linear_dequant_amx: the codes dequantized to the bf16 weights in tiles, then a plain tile GEMM ----
//
// Why: past a few groups of 16 rows, linear_codes_amx spends its time reading every block's C tile
// back (the scale is per block), and oneDNN reads 2 bytes per weight. Here each panel's codes become its
// bf16 weights once per call, bf16(d * c + m) (the product is exact, so this is the bf16 model's weight
// bit for bit: the values oneDNN's path multiplies), laid out as B tiles in L2; C tiles then carry the
// sum over all of K and are read back once. 2 panels x 2 groups of 16 rows per pass: 4 C tiles, 2 A, 2 B
// (an odd last group: 2 C tiles, 1 A).

// Panel pairs [begin, end) of the output for all M rows. xp: x padded to whole groups of 16 rows (lda apart).
template <bool Q4, typename TOut, typename S>
void panel_pairs_dequant(int64_t begin, int64_t end, int64_t m, const c10::BFloat16* xp, int64_t lda, int64_t nb,
                         const int8_t* codes, int64_t kb, const S* scales, const S* mins, int64_t panels, int64_t n,
                         const float* bias, TOut* out, int64_t ldo) {
  // Tiles 0-3: C (group g / g + 1 x panel p / p + 1), 4-5: A (the two groups), 6-7: B (the two panels).
  const TileConfig cfg = tile_config(8);
  _tile_loadconfig(&cfg);
  const __m512i interleave = tokenmill_cpu::pair_interleave();
  const int64_t tiles = nb * kCodeBlock / 2, ldb = lda * sizeof(c10::BFloat16);
  std::vector<__m512i> bt(2 * tiles);  // both panels' B tiles: 2 KB per block (96 KB for K = 1536)
  alignas(64) float cbuf[4][kGroup * kPanel];
  const int64_t groups = (m + kGroup - 1) / kGroup;
  for (int64_t pp = begin; pp < end; ++pp) {
    const int64_t p0 = 2 * pp;
    tokenmill_cpu::dequant_panel<Q4, S>(bt.data(), p0, panels, nb, codes, kb, scales, mins, interleave);
    tokenmill_cpu::dequant_panel<Q4, S>(bt.data() + tiles, p0 + 1, panels, nb, codes, kb, scales, mins, interleave);
    for (int64_t g = 0; g < groups; g += 2) {
      const c10::BFloat16* a = xp + g * kGroup * lda;
      const bool pair = g + 1 < groups;  // an odd last group runs alone (tiles 0 and 1)
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      if (pair) {
        for (int64_t b = 0; b < nb; ++b) {
          _tile_loadd(4, a + b * kCodeBlock, ldb);
          _tile_loadd(5, a + kGroup * lda + b * kCodeBlock, ldb);
          _tile_loadd(6, &bt[b * kCodeBlock / 2], 64);
          _tile_loadd(7, &bt[tiles + b * kCodeBlock / 2], 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {
        for (int64_t b = 0; b < nb; ++b) {
          _tile_loadd(4, a + b * kCodeBlock, ldb);
          _tile_loadd(6, &bt[b * kCodeBlock / 2], 64);
          _tile_loadd(7, &bt[tiles + b * kCodeBlock / 2], 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, cbuf[0], 64);
      _tile_stored(1, cbuf[1], 64);
      _tile_stored(2, cbuf[2], 64);
      _tile_stored(3, cbuf[3], 64);
      for (int q = 0; q < (pair ? 4 : 2); ++q) {
        const int64_t p = p0 + (q & 1), g0 = (g + (q >> 1)) * kGroup;
        if (p >= panels) continue;
        const int64_t cols = std::min(kPanel, n - p * kPanel), rows = std::min(kGroup, m - g0);
        __m512 bv = _mm512_setzero_ps();
        if (bias != nullptr) bv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), bias + p * kPanel);
        for (int64_t r = 0; r < rows; ++r)
          tokenmill_cpu::store_cols(out + (g0 + r) * ldo + p * kPanel,
                                    _mm512_add_ps(_mm512_load_ps(cbuf[q] + r * kPanel), bv), cols);
      }
    }
  }
  _tile_release();
}
#endif

bool linear_codes_amx_supported() {
#if defined(TOKENMILL_AMX)
  return amx_permitted();
#else
  return false;
#endif
}


// Both ops' argument checks (out, x, codes, scales, mins, bias); returns the bias pointer (or null).
const float* check_amx_args(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_codes_amx_supported(), op, ": this CPU, build or kernel gives no AMX-BF16 tiles");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be 2-D bfloat16 with contiguous rows");
  tokenmill_cpu::check_codes(op, codes, scales, mins, x.size(1), true, true);
  return tokenmill_cpu::check_linear_args(op, out, x, codes.size(0), "the codes", bias, true, true);
}

#if defined(TOKENMILL_AMX)
// x's rows as A tiles read them: 16 at a time, so a batch that is not whole groups of 16 is copied into
// zero-padded rows.
struct GroupRows {
  std::vector<c10::BFloat16> padded;
  const c10::BFloat16* data;
  int64_t ld;
};

GroupRows group_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
  const int64_t mp16 = (m + kGroup - 1) / kGroup * kGroup;
  GroupRows g{{}, x.data_ptr<c10::BFloat16>(), ldx};
  if (mp16 != m) {
    g.padded.assign(mp16 * k, c10::BFloat16(0.0f));
    for (int64_t r = 0; r < m; ++r) std::memcpy(&g.padded[r * k], g.data + r * ldx, k * sizeof(c10::BFloat16));
    g.data = g.padded.data();
    g.ld = k;
  }
  return g;
}
#endif

// out [M, N] (bf16, or fp32 for logits) = x [M, K] (bf16) @ W^T (+ bias, fp32), W as integer codes in
// linear_codes_bf16's layout. Same contract as linear_codes_bf16; another order of the fp32 sums.
void linear_codes_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const float* bp = check_amx_args("linear_codes_amx", out, x, codes, scales, mins, bias);
  const int64_t k = x.size(1), panels = codes.size(0), m = x.size(0), n = out.size(1);
#if defined(TOKENMILL_AMX)
  if (m == 0) return;
  const int64_t nb = k / kCodeBlock, ldx = x.stride(0), ldo = out.stride(0);
  const int64_t mp16 = (m + kGroup - 1) / kGroup * kGroup;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const GroupRows rows = group_rows(x);
  const c10::BFloat16* xa = rows.data;
  const int64_t lda = rows.ld;
  const std::vector<float> xsum = tokenmill_cpu::block_sums(xp, ldx, m, nb, mp16);
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;  // code bytes per panel
  auto run = [&](auto* op, const auto* sp, const auto* mp) {
    using TOut = std::remove_pointer_t<decltype(op)>;
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    // Threads split the panels: each code byte is read once, and each thread configures its own tiles.
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      (q4 ? panels_amx<true, TOut, S> : panels_amx<false, TOut, S>)(begin, end, m, xa, lda, xsum.data(), nb, cp, kb,
                                                                    sp, mp, n, bp, op, ldo);
    });
  };
  tokenmill_cpu::dispatch_codes_out(out, scales, mins, run);
#else
  (void)bp;
  (void)k;
  (void)panels;
  (void)m;
  (void)n;
#endif
}


// out [M, N] (bf16, or fp32 for logits) = x [M, K] (bf16) @ bf16(W)^T (+ bias, fp32), W the integer codes
// of linear_codes_bf16's layout rebuilt as the bf16 model's weights: what oneDNN computes from the bf16
// weight, in another order of the fp32 sums. Needs linear_codes_amx_supported().
void linear_dequant_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const float* bp = check_amx_args("linear_dequant_amx", out, x, codes, scales, mins, bias);
  const int64_t k = x.size(1), panels = codes.size(0), m = x.size(0), n = out.size(1);
#if defined(TOKENMILL_AMX)
  if (m == 0) return;
  const int64_t nb = k / kCodeBlock, ldo = out.stride(0);
  const GroupRows rows = group_rows(x);
  const c10::BFloat16* xa = rows.data;
  const int64_t lda = rows.ld;
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel;
  auto run = [&](auto* op, const auto* sp, const auto* mp) {
    using TOut = std::remove_pointer_t<decltype(op)>;
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      (q4 ? panel_pairs_dequant<true, TOut, S> : panel_pairs_dequant<false, TOut, S>)(
          begin, end, m, xa, lda, nb, cp, kb, sp, mp, panels, n, bp, op, ldo);
    });
  };
  tokenmill_cpu::dispatch_codes_out(out, scales, mins, run);
#else
  (void)bp;
  (void)k;
  (void)panels;
  (void)m;
  (void)n;
#endif
}

}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_codes_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_codes_amx(out, x, codes, scales, mins, bias);
}
void linear_dequant_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_dequant_amx(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_codes_amx_supported() -> bool", &linear_codes_amx_supported);
  m.def("linear_codes_amx(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_amx", c10::DispatchKey::CPU, &linear_codes_amx);
  m.def("linear_dequant_amx(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_dequant_amx", c10::DispatchKey::CPU, &linear_dequant_amx);
}
