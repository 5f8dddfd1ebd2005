// fp32 linear layers for batches of many rows (prompt chunks, large decode batches) on the integer-code
// weights of cpu_linear.cpp, and the embedding lookup from those codes.
//
// Why: so that the integer codes serve every batch size and torch's fp32 copy of such a weight need not
// stay in memory (SmolLM2: 540 MB of fp32 projections and embedding beside 168 MB of codes). Past a few
// dozen rows a linear is bound by the FMA units, not by reading the weight, so the work is cache-blocked
// the way a BLAS GEMM is: per block of rows (and of K for large K) each panel's K-slice is rebuilt to
// fp32 once into a small buffer and a 6 x 16 register tile (12 accumulators, 2 weight vectors, 1
// broadcast) runs over every row of the block, reading the rows in place.
//
// Numerics: each output is the same fp32 sum as cpu_linear.cpp's (k in order 0..K-1, one fused
// multiply-add per term, the weight rebuilt with the same fma(code, scale, min)): across K blocks the
// running sums are stored to `out` and reloaded, which is exact, and the bias is added last. So results
// equal linear_packed_q8's (and linear_packed's on the rebuilt fp32 weights) bit for bit and do not depend
// on the batch size.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int64_t kGemmPanel = 16;  // output columns per panel (the packed layout's)
constexpr int64_t kGemmBlock = 32;  // k per scale/min pair
constexpr int64_t kMr = 6;          // rows per register tile: 12 accumulators + 2 weights + 1 broadcast
// K per block, a multiple of 32 (a block never splits a scale/min pair): a rebuilt panel slice
// (kKc x 16 fp32, up to 64 KB) stays in the 512 KB L2 while the tiles run over every row of a block.
constexpr int64_t kKc = 1024;
// Bytes of x per block of rows (rows = kRowBytes / (4 * K-block), a multiple of kMr): each panel's
// slice is rebuilt once per block. Measured on the 2-core EPYC (1 thread, CPU time, 32/256/2048 rows of
// SmolLM2's qkv, gate_up, down; interleaved against linear_packed_q8): 1 MB blocks 1.7% faster than the
// q8 kernel (geomean), 512 KB 0.5%, 256 KB 0.4%, 128 KB 3% slower; 256-deep K blocks 5% slower, as was
// copying the rows into tile order first. The tile is bound by the FMA units (about 38 GFLOP/s per core),
// so blocking only has to keep the operands out of memory.
constexpr int64_t kRowBytes = 1 << 20;
// Panels per chunk of work (64 output columns): SmolLM2's narrowest linears (576 columns) give 9 chunks
// per row block for 2 threads to share.
constexpr int64_t kChunkPanels = 4;

#if defined(TOKENMILL_LINEAR_AVX2)
// c[r, 0..16) (+)= sum over k of x[r, k] * w[k, :] for R rows: starts from zero when `first`, else
// from c's stored running sums; `last` adds b (bias or zeros, as cpu_linear.cpp's tiles do).
template <int R>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t kc, float* c, int64_t ldc, bool first,
                 bool last, const float* b) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (first) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    } else {
      acc[r][0] = _mm256_loadu_ps(c + r * ldc);
      acc[r][1] = _mm256_loadu_ps(c + r * ldc + 8);
    }
  }
  for (int64_t i = 0; i < kc; ++i) {
    const __m256 w0 = _mm256_load_ps(w + i * kGemmPanel);
    const __m256 w1 = _mm256_load_ps(w + i * kGemmPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  if (last) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_add_ps(acc[r][0], b0);
      acc[r][1] = _mm256_add_ps(acc[r][1], b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

void rows_tile(int64_t rows, const float* x, int64_t ldx, const float* w, int64_t kc, float* c, int64_t ldc,
               bool first, bool last, const float* b) {
  switch (rows) {
    case 1: tile<1>(x, ldx, w, kc, c, ldc, first, last, b); break;
    case 2: tile<2>(x, ldx, w, kc, c, ldc, first, last, b); break;
    case 3: tile<3>(x, ldx, w, kc, c, ldc, first, last, b); break;
    case 4: tile<4>(x, ldx, w, kc, c, ldc, first, last, b); break;
    case 5: tile<5>(x, ldx, w, kc, c, ldc, first, last, b); break;
    default: tile<6>(x, ldx, w, kc, c, ldc, first, last, b); break;
  }
}
#endif

// out [M, N] = x [M, K] @ W^T (+ bias), W as linear_packed_q8 takes it: codes int8 [panels, K, 16],
// scales and mins float32 [panels, K / 32, 16], w = scale * code + min.
void linear_q8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const char* op = "linear_q8_gemm";
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D float32 with contiguous rows");
  const int64_t k = x.size(1);
  tokenmill_cpu::check_codes(op, codes, scales, mins, k, true);
  const int64_t panels = codes.size(0);
  const float* bp = tokenmill_cpu::check_linear_args(op, out, x, panels, "the codes", bias);
  const int64_t n = out.size(1), m = x.size(0);
#if defined(TOKENMILL_LINEAR_AVX2)
  if (m == 0) return;
  const float* xp = x.data_ptr<float>();
  const bool q4 = codes.scalar_type() == at::kByte;  // nibble codes, two k per byte
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), nb = k / kGemmBlock;
  // The bias padded to whole panels (zeros where none), so every tile adds 16 lanes.
  std::vector<float> bias_pad(panels * kGemmPanel, 0.0f);
  if (bp != nullptr) std::copy(bp, bp + n, bias_pad.begin());
  const int64_t kc_max = std::min(kKc, k);
  // Rows per block: their K-slice (at most kRowBytes) is read by every panel of the block.
  const int64_t mc = std::max(kMr, kRowBytes / (4 * kc_max) / kMr * kMr);
  // Work is handed out in chunks of (row block, kChunkPanels panels) from a shared counter rather than
  // split in equal halves, so that a thread the OS deschedules on a shared machine (the 2-core EPYC runs
  // at load 4-5 while engineers work) does not leave the other waiting at the end with half the work
  // undone. Under that load an A/B against the equal split was within noise (wall ratios both ways);
  // the results are the same, since each output is still computed by one tile.
  const int64_t groups = (panels + kChunkPanels - 1) / kChunkPanels, row_blocks = (m + mc - 1) / mc;
  const int64_t chunks = groups * row_blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    float* w = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kc_max * kGemmPanel));
    // A ragged last panel's running sums live here, not in `out`, which has fewer than 16 columns.
    std::vector<float> ragged(mc * kGemmPanel);
    for (int64_t chunk = next.fetch_add(1); chunk < chunks; chunk = next.fetch_add(1)) {
      const int64_t r0 = chunk / groups * mc, r1 = std::min(m, r0 + mc);
      const int64_t p0 = chunk % groups * kChunkPanels, p1 = std::min(panels, p0 + kChunkPanels);
      for (int64_t k0 = 0; k0 < k; k0 += kKc) {
        const int64_t kc = std::min(kKc, k - k0);
        const bool first = k0 == 0, last = k0 + kc == k;
        for (int64_t p = p0; p < p1; ++p) {
          const float* ps = sp + (p * nb + k0 / kGemmBlock) * kGemmPanel;
          const float* pm = mp + (p * nb + k0 / kGemmBlock) * kGemmPanel;
          if (q4)
            tokenmill_cpu::rebuild_codes16<true>(cp + (p * k + k0) / 2 * kGemmPanel, ps, pm, kc, w);
          else
            tokenmill_cpu::rebuild_codes16<false>(cp + (p * k + k0) * kGemmPanel, ps, pm, kc, w);
          const int64_t cols = std::min(kGemmPanel, n - p * kGemmPanel);
          const float* b = bias_pad.data() + p * kGemmPanel;
          for (int64_t r = r0; r < r1; r += kMr) {
            const int64_t rows = std::min(kMr, r1 - r);
            if (cols == kGemmPanel) {
              rows_tile(rows, xp + r * ldx + k0, ldx, w, kc, op_ + r * ldo + p * kGemmPanel, ldo, first, last, b);
            } else {
              float* c = ragged.data() + (r - r0) * kGemmPanel;
              rows_tile(rows, xp + r * ldx + k0, ldx, w, kc, c, kGemmPanel, first, last, b);
              if (last)
                for (int64_t i = 0; i < rows; ++i)
                  std::copy(c + i * kGemmPanel, c + i * kGemmPanel + cols, op_ + (r + i) * ldo + p * kGemmPanel);
            }
          }
        }
      }
    }
    std::free(w);
  });
#else
  (void)bp;
  (void)n;
  (void)m;
#endif
}

// out [T, K] = the fp32 weight rows ids [T] of W given as codes (linear_q8_gemm's layout): the embedding
// lookup of a tied embedding whose fp32 matrix is not kept. Each value is fma(code, scale, min), the
// weight the codes were found to rebuild bit for bit.
void embedding_q8(at::Tensor out, const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                  const at::Tensor& mins, int64_t num_rows) {
  const char* op = "embedding_q8";
  tokenmill_cpu::check_codes(op, codes, scales, mins, -1);
  const int64_t k = codes.size(1), panels = codes.size(0), nb = k / kGemmBlock;
  TORCH_CHECK(num_rows <= panels * kGemmPanel && num_rows > (panels - 1) * kGemmPanel, op, ": num_rows=", num_rows,
              " does not fit ", panels, " panels of 16");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": ids must be a 1-D int64 CPU tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.size(0) &&
                  out.size(1) == k,
              op, ": out must be contiguous float32 [", ids.size(0), ", ", k, "], got ", out.sizes());
  const at::Tensor idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t t = ids.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_rows, op, ": id ", ip[i], " is outside the vocabulary [0, ", num_rows, ")");
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = ip[i] / kGemmPanel, col = ip[i] % kGemmPanel;
      const int8_t* c = cp + p * k * kGemmPanel + col;
      const float* s = sp + p * nb * kGemmPanel + col;
      const float* mn = mp + p * nb * kGemmPanel + col;
      float* o = op_ + i * k;
      // The product of an fp16 scale and a code below 2^8 is exact, so std::fma rounds as the kernels do.
      for (int64_t j = 0; j < k; ++j)
        o[j] = std::fma(static_cast<float>(c[j * kGemmPanel]), s[(j / kGemmBlock) * kGemmPanel],
                        mn[(j / kGemmBlock) * kGemmPanel]);
    }
  });
}

}  // namespace

// The op as a plain call for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_q8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_q8_gemm(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_q8_gemm(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_q8_gemm", c10::DispatchKey::CPU, &linear_q8_gemm);
  m.def("embedding_q8(Tensor(a!) out, Tensor ids, Tensor codes, Tensor scales, Tensor mins, int num_rows) -> ()");
  m.impl("embedding_q8", c10::DispatchKey::CPU, &embedding_q8);
}
