// bf16 linear layers (y = x W^T + b) on dense bf16 weights prepacked for vdpbf16ps, for CPUs with AVX-512
// BF16: the weights of a checkpoint stored in bf16 (nearly every Hub model), which have no integer codes.
//
// Why: oneDNN's prepacked bf16 GEMM ran a 362M-parameter bf16 Llama's decode steps at 33-41% of the
// memory roofline at batch 1 and 57% of the compute roofline at batch 64 (issue 31), and torch's F.linear
// at one row re-reads x per column block. Here one layout serves every batch size:
//
// Layout: panels of 16 output columns, [panels, K / 2, 32] bf16, where row j of panel p holds the pairs
// (W[16p + i, 2j], W[16p + i, 2j + 1]) for i = 0..15: the 32-bit lanes vdpbf16ps multiplies by a
// broadcast pair (x[2j], x[2j + 1]) of a row (the VNNI layout of cpu_codes_bf16.h's code pairs, and an
// AMX B tile's). Columns past N in the last panel are zero.
//
// Kernel: a register tile of R rows x P panels (R x P accumulators of 16 fp32) runs over the whole K,
// reading each panel's k-pair once per tile and each row's pair as a broadcast; at R <= 6, P = 4 (24
// accumulators, 4 weight registers). Rows are taken in blocks of kRowBlock (their x stays in L2 while
// every panel group passes over them); threads split the panel groups of a row block, so each weight
// byte is read by one thread per block. A decode step (rows <= kRowBlock) reads every weight from
// memory once, whatever the batch.
//
// Numerics: fp32 sums of exact products of the bf16 weights and bf16 x (vdpbf16ps adds the pair's two
// products, then the accumulator; denormals flushed), in k order within each lane pair; the output rounded
// once to bf16 (or kept fp32: logits). The sum order differs from oneDNN's, so results agree with F.linear
// to fp32 rounding of the sum, not bit for bit (tests/test_linear_dense_bf16.py bounds them against the
// exact product).

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

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kGroup = 4;   // panels per register tile
constexpr int64_t kTileRows = 6;
// Rows whose x stays in L2 while every panel group passes over them (K = 2560: 1.3 MB of x).
constexpr int64_t kRowBlock = 256;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_DENSE_BF16 1

// out[r, 16 q + c] for R rows and P panels (cols < 16 only in the weight's last panel), over all K.
template <int R, int P, typename TOut>
inline void dense_tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t pstride, int64_t k2,
                       TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  __m512 acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  const int32_t* xw = reinterpret_cast<const int32_t*>(x);
  const int64_t ldxw = ldx / 2;
#pragma GCC unroll 2
  for (int64_t j = 0; j < k2; ++j) {
    __m512bh wv[P];
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q)
      wv[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + q * pstride + j * 2 * kPanel));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xw[r * ldxw + j]));
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], wv[q], xv);
    }
  }
  tokenmill_cpu::store_tile(acc, out, ldo, cols, bias);
}

template <int P, typename TOut>
void rows_tile(int64_t rows, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t pstride, int64_t k2,
               TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  tokenmill_cpu::with_tile_rows<kTileRows>(rows, [&](auto r) {
    dense_tile<decltype(r)::value, P, TOut>(x, ldx, w, pstride, k2, out, ldo, cols, bias);
  });
}

template <typename TOut>
using TileFn = void (*)(int64_t, const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t, TOut*,
                        int64_t, int64_t, const float*);

template <typename TOut>
TileFn<TOut> tile_for(int64_t panels) {
  switch (panels) {
    case 1: return rows_tile<1, TOut>;
    case 2: return rows_tile<2, TOut>;
    case 3: return rows_tile<3, TOut>;
    default: return rows_tile<4, TOut>;
  }
}
#endif

bool linear_dense_bf16_supported() {
#if defined(TOKENMILL_DENSE_BF16)
  return true;
#else
  return false;
#endif
}

// weight [N, K] bf16 -> [ceil(N / 16), K / 2, 32] bf16 (the layout above; K even).
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "pack_bf16_weight: weight must be a 2-D bfloat16 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0 && k > 0, "pack_bf16_weight: in_features=", k, " must be even (k pairs)");
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = weight;
  if (panels * kPanel != n) {
    padded = at::zeros({panels * kPanel, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
  }
  // [panels, 16, K / 2, 2] -> [panels, K / 2, 16, 2]
  return padded.contiguous().view({panels, kPanel, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view(
      {panels, k / 2, 2 * kPanel});
}

void check_packed(const char* op, const at::Tensor& packed, int64_t k) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == 2 * kPanel && packed.is_contiguous() && packed.size(1) * 2 == k,
              op, ": the weight must be pack_bf16_weight's bfloat16 [panels, K / 2 = ", k / 2, ", 32], got ",
              packed.scalar_type(), " ", packed.sizes());
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(linear_dense_bf16_supported(), op, ": this build has no AVX-512 BF16 path");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.stride(0) % 2 == 0,
              op, ": x must be 2-D bfloat16 with contiguous rows an even number of elements apart");
}

#if defined(TOKENMILL_DENSE_BF16)
// out [m, n] = x [m, k] @ W^T (+ bias) over `panels` panels: panels_of(p, np, buf) gives panel p's first
// element for the group of np panels at p (pstride apart), either the packed weight's own or np panels it
// rebuilt into buf (kGroup * k * 16 bf16, one per thread).
template <typename PanelsOf>
void run_dense(const at::Tensor& x, at::Tensor& out, int64_t panels, const float* bias, PanelsOf&& panels_of) {
  const int64_t m = x.size(0), n = out.size(1), k = x.size(1);
  const int64_t ldx = x.stride(0), ldo = out.stride(0), k2 = k / 2, pstride = k * kPanel;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  auto run = [&](auto* op) {
    using TOut = std::remove_pointer_t<decltype(op)>;
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t rb = std::min(kRowBlock, m - r0);
      at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        std::vector<__m512i> buf;
        for (int64_t g = begin; g < end; ++g) {
          const int64_t p = g * kGroup, np = std::min(kGroup, panels - p);
          const int64_t cols = n - (p + np - 1) * kPanel;  // of the group's last panel
          const float* pb = bias != nullptr ? bias + p * kPanel : nullptr;
          const TileFn<TOut> tile = tile_for<TOut>(np);
          const c10::BFloat16* w = panels_of(p, np, buf);
          for (int64_t r = r0; r < r0 + rb; r += kTileRows)
            tile(std::min(kTileRows, r0 + rb - r), xp + r * ldx, ldx, w, pstride, k2, op + r * ldo + p * kPanel,
                 ldo, std::min(cols, kPanel), pb);
        }
      });
    }
  };
  if (out.scalar_type() == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<c10::BFloat16>());
}
#endif

// out [M, N] (bf16, or fp32: logits) = x [M, K] (bf16) @ W^T (+ bias, fp32), W as pack_bf16_weight made it.
void linear_dense_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  check_x("linear_dense_bf16", x);
  check_packed("linear_dense_bf16", packed, x.size(1));
  const int64_t panels = packed.size(0);
  const float* bp = tokenmill_cpu::check_linear_args("linear_dense_bf16", out, x, panels, "the packed weight", bias,
                                                     true, true);
#if defined(TOKENMILL_DENSE_BF16)
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  const int64_t pstride = x.size(1) * kPanel;
  run_dense(x, out, panels, bp, [&](int64_t p, int64_t, std::vector<__m512i>&) { return wp + p * pstride; });
#else
  (void)bp;
#endif
}

// The same on integer codes (cpu_linear.cpp's layout) for larger batches: each group of kGroup panels is
// rebuilt to the bf16 model's weights (cpu_codes_bf16.h's dequant_panel, bit for bit the weights the model
// cast to bf16 holds) once per block of kRowBlock rows, into a per-thread buffer of 4 x K x 16 bf16 (72 KB
// for K = 576, 192 KB for 1536: in L2), and the register tiles above run on it, so results equal
// linear_dense_bf16 on pack_bf16_weight of those weights bit for bit.
//
// Why: on AVX-512 BF16 CPUs without AMX where vdpbf16ps outruns fp32 FMAs (the AMD EPYC here: 236 against
// 118 GFLOP/s a core), the codes' dot kernel (cpu_linear_bf16.cpp) rescales every block's sums and
// rebuilds the code pairs once per row tile, which past 32 rows costs more than this rebuild once per
// call (docs/kernels.md: 4-18% at 64 rows on 3 of the bundled model's 4 shapes, 3-27% at 256), and
// register tiles on bf16 weights were faster: the codes now take every batch, with no bf16 copy.
void linear_codes_dense(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  check_x("linear_codes_dense", x);
  const int64_t k = x.size(1);
  tokenmill_cpu::check_codes("linear_codes_dense", codes, scales, mins, k, true, true);
  const int64_t panels = codes.size(0);
  const float* bp =
      tokenmill_cpu::check_linear_args("linear_codes_dense", out, x, panels, "the codes", bias, true, true);
#if defined(TOKENMILL_DENSE_BF16)
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel, nb = k / 32, pairs = k / 2;
  const __m512i interleave = tokenmill_cpu::pair_interleave();
  tokenmill_cpu::dispatch_scales(scales, mins, [&](const auto* sp, const auto* mp) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    run_dense(x, out, panels, bp, [&](int64_t p, int64_t np, std::vector<__m512i>& buf) {
      buf.resize(kGroup * pairs);
      for (int64_t q = 0; q < np; ++q) {
        if (q4)
          tokenmill_cpu::dequant_panel<true, S>(buf.data() + q * pairs, p + q, panels, nb, cp, kb, sp, mp, interleave);
        else
          tokenmill_cpu::dequant_panel<false, S>(buf.data() + q * pairs, p + q, panels, nb, cp, kb, sp, mp, interleave);
      }
      return reinterpret_cast<const c10::BFloat16*>(buf.data());
    });
  });
#else
  (void)bp;
#endif
}

// out [T, K] bf16 = rows ids [T] of the weight [N, K] that `packed` holds (a tied embedding read from its LM
// head's packed copy, so the model keeps one).
void embedding_dense_bf16(at::Tensor out, const at::Tensor& ids, const at::Tensor& packed, int64_t num_rows) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "embedding_dense_bf16: ids must be a 1-D int64 CPU tensor");
  const int64_t k = out.size(1);
  check_packed("embedding_dense_bf16", packed, k);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0),
              "embedding_dense_bf16: out must be contiguous bfloat16 [len(ids), K]");
  TORCH_CHECK(num_rows <= packed.size(0) * kPanel, "embedding_dense_bf16: num_rows=", num_rows, " exceeds the ",
              packed.size(0) * kPanel, " rows the packed weight holds");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < num_rows, "embedding_dense_bf16: id ", idp[t], " is outside [0, ", num_rows, ")");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, ids.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = idp[t], p = row / kPanel, i = row % kPanel;
      const uint16_t* src = wp + p * k * kPanel + 2 * i;
      uint16_t* dst = op + t * k;
      for (int64_t j = 0; j < k / 2; ++j) {
        dst[2 * j] = src[j * 2 * kPanel];
        dst[2 * j + 1] = src[j * 2 * kPanel + 1];
      }
    }
  });
}

}  // namespace

// The op as a plain call for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_dense_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  ::linear_dense_bf16(out, x, packed, bias);
}
void linear_codes_dense(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_codes_dense(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_dense_bf16_supported() -> bool", &linear_dense_bf16_supported);
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.impl("pack_bf16_weight", c10::DispatchKey::CPU, &pack_bf16_weight);
  m.def("linear_dense_bf16(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.impl("linear_dense_bf16", c10::DispatchKey::CPU, &linear_dense_bf16);
  m.def("linear_codes_dense(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_dense", c10::DispatchKey::CPU, &linear_codes_dense);
  m.def("embedding_dense_bf16(Tensor(a!) out, Tensor ids, Tensor packed, int num_rows) -> ()");
  m.impl("embedding_dense_bf16", c10::DispatchKey::CPU, &embedding_dense_bf16);
}
