// Paged attention for CPUs: reads K/V blocks where they live in the cache (no gather copy), one pass
// over K for the scores and one over V for the output, fp32 accumulation for every cache dtype.
//
// Why a C++ kernel: the torch reference gathers every sequence's blocks into a temporary, then SDPA
// reads it again, and each layer of each step costs tens of small ops. On the 2-core machines this
// project runs on, decode attention was the largest share of a step at batch 64 (see
// docs/benchmark-log.md). Built on first use by tokenmill.kernels.cpu (torch.utils.cpp_extension).
//
// Layout (the same as the Triton kernels and the torch reference): k_cache/v_cache
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
// query_start_loc int32 [num_seqs + 1]; seq_lens int32 [num_seqs] (cached prefix + this chunk).
// The query row i of a chunk of n rows sits at position seq_len - n + i and sees keys 0..position.
// 8-bit caches (cpu_kv_quant.h) are [.., head_dim + 4]: codes, then the row's fp32 scale. The kernels
// dequantize in registers and apply the scales to the scores (K) and the probabilities (V), not to each
// element: an 8-bit row costs one conversion per element, as a bf16 row does, from half the bytes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "cpu_kv_quant.h"
#include "cpu_ops.h"
#include "cpu_tile.h"

namespace {

using tokenmill_cpu::KvCode;
using tokenmill_cpu::kv_row;
using tokenmill_cpu::kv_scale;
using tokenmill_cpu::raw_code;

// One cache row as fp32 values (8-bit codes times their row's scale).
template <typename C>
inline void load_row(const C* __restrict src, float* __restrict dst, int n) {
  if constexpr (KvCode<C>::quantized) {
    const float s = kv_scale(src, n);
    for (int i = 0; i < n; ++i) dst[i] = raw_code(src[i]) * s;
  } else {
    for (int i = 0; i < n; ++i) dst[i] = raw_code(src[i]);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  // 16 partial sums: a fixed-width inner loop the compiler turns into one vector FMA per step
  // (a single running sum would have to stay scalar to keep IEEE order).
  float acc[16] = {0};
  int i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// Calls fn(t, slot) for the cache slots of tokens 0..n_keys-1 in order, block by block (no division per
// token). Blocks sit anywhere in the pool, so the next block is prefetched while this one is used (unless
// `prefetch` is false: the caller already brought them in).
template <typename T, typename Fn>
inline void for_each_slot(const T* cache, const int32_t* block_table, int64_t block_size, int64_t token_stride,
                          int64_t n_keys, Fn&& fn, bool prefetch = true) {
  const int64_t slot_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  int64_t t = 0;
  for (int64_t b = 0; t < n_keys; ++b) {
    const T* slot = cache + static_cast<int64_t>(block_table[b]) * block_size * token_stride;
    const int64_t stop = std::min(n_keys, t + block_size);
    const char* next = prefetch && stop < n_keys ? reinterpret_cast<const char*>(
        cache + static_cast<int64_t>(block_table[b + 1]) * block_size * token_stride) : nullptr;
    for (; t < stop; ++t, slot += token_stride) {
      if (next) {
        for (int64_t off = 0; off < slot_bytes; off += 64) __builtin_prefetch(next + off);
        next += slot_bytes;
      }
      fn(t, slot);
    }
  }
}

template <typename T, typename C>
void attend_rows(const T* q, int64_t q_row_stride, int64_t q_head_stride, T* out, int64_t out_row_stride,
                 const C* k_cache, const C* v_cache, const int32_t* block_table, int64_t block_size,
                 int64_t num_kv_heads, int64_t head_dim, int64_t kv_head, int64_t group, int64_t first_row,
                 int64_t num_rows, int64_t seq_len, float scale, std::vector<float>& scratch) {
  // Portable path (any head_dim, any x86/ARM CPU); the AVX-512 path below is the fast one.
  const int D = static_cast<int>(head_dim);
  const int64_t row_stride = kv_row<C>(head_dim);
  const int64_t token_stride = num_kv_heads * row_stride;  // one cache slot
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = first_row + r;
    const int64_t n_keys = seq_len - num_rows + r + 1;  // causal: keys 0..position
    // scratch: q rows [group, D] | k row [D] | accumulators [group, D] | scores [group, n_keys]
    scratch.resize(static_cast<size_t>(group * D * 2 + D + group * n_keys));
    float* qf = scratch.data();
    float* kf = qf + group * D;
    float* acc = kf + D;
    float* scores = acc + group * D;
    for (int64_t g = 0; g < group; ++g)
      load_row(q + row * q_row_stride + (kv_head * group + g) * q_head_stride, qf + g * D, D);
    for_each_slot(k_cache, block_table, block_size, token_stride, n_keys, [&](int64_t t, const C* slot) {
      load_row(slot + kv_head * row_stride, kf, D);
      for (int64_t g = 0; g < group; ++g) scores[g * n_keys + t] = dot(qf + g * D, kf, D) * scale;
    });
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * n_keys;
      float m = -INFINITY;
      for (int64_t t = 0; t < n_keys; ++t) m = std::max(m, s[t]);
      float sum = 0;
      for (int64_t t = 0; t < n_keys; ++t) {
        s[t] = tokenmill_cpu::exp_poly(s[t] - m);
        sum += s[t];
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < n_keys; ++t) s[t] *= inv;
    }
    std::fill(acc, acc + group * D, 0.0f);
    for_each_slot(v_cache, block_table, block_size, token_stride, n_keys, [&](int64_t t, const C* slot) {
      load_row(slot + kv_head * row_stride, kf, D);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * n_keys + t];
        float* a = acc + g * D;
        for (int d = 0; d < D; ++d) a[d] += p * kf[d];
      }
    });
    for (int64_t g = 0; g < group; ++g) {
      T* o = out + row * out_row_stride + (kv_head * group + g) * head_dim;
      for (int d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d]);
    }
  }
}

#if defined(__AVX512F__)
using tokenmill_cpu::exp16;
using tokenmill_cpu::load16;

constexpr int kMaxHeads = 64;

// v[i] -> one vector whose element i is the sum of v[i]'s 16 elements: four rounds of pairwise adds, 45
// vector ops for 16 sums where a horizontal sum each took about 8 (and a long dependency chain).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = v[2i], y = v[2i+1]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: the partial sums of v[4i .. 4i+3], in order
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Walks another sequence's K slots into L2 a few cache lines per call: pass 2 reads only what pass 1
// brought into L2, so without this DRAM idles through it and the next sequence's pass 1 starts cold.
struct SlotPrefetcher {
  const char* base = nullptr;  // the K cache's bytes
  const int32_t* table = nullptr;
  int64_t block_bytes = 0, total = 0, done = 0;  // the walk's bytes (its keys' slots), bytes issued
  void step(int64_t lines) {
    for (int64_t i = 0; i < lines && done < total; ++i, done += 64)
      _mm_prefetch(base + table[done / block_bytes] * block_bytes + done % block_bytes, _MM_HINT_T1);
  }
};

// Pass 2 for HC query heads h0.. of KV head kvh: out rows = sum_t p_t v_t / sum_t p_t, with the HC x NV
// sums in registers (over every head at once they did not fit and went through memory, a store per FMA).
template <int HC, int NV, typename T, typename C>
void attend_values(const C* v_cache, const int32_t* block_table, int64_t block_size, int64_t token_stride,
                   int64_t n_keys, int64_t kvh, int64_t h0, const float* scores, int64_t padded,
                   const float* inv_sum, T* out, SlotPrefetcher& next, int64_t lines) {
  constexpr int D = NV * 16;
  constexpr int64_t R = kv_row<C>(D);
  constexpr bool kQuant = KvCode<C>::quantized;
  __m512 acc[HC][NV];
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NV; ++j) acc[h][j] = _mm512_setzero_ps();
  for_each_slot(v_cache, block_table, block_size, token_stride, n_keys, [&](int64_t t, const C* vb) {
    const C* row = vb + kvh * R;
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(row + j * 16);
    const float s = kQuant ? kv_scale(row, D) : 1.0f;  // p x (codes x s) = (p x s) x codes
    next.step(lines);
    for (int h = 0; h < HC; ++h) {
      const float pt = scores[(h0 + h) * padded + t];
      const __m512 p = _mm512_set1_ps(kQuant ? pt * s : pt);
      for (int j = 0; j < NV; ++j) acc[h][j] = _mm512_fmadd_ps(p, vv[j], acc[h][j]);
    }
  }, /*prefetch=*/false);  // pass 1 brought these slots into L2
  for (int h = 0; h < HC; ++h) {
    T* o = out + (h0 + h) * D;
    alignas(64) float tmp[D];
    const __m512 inv = _mm512_set1_ps(inv_sum[h0 + h]);
    for (int j = 0; j < NV; ++j) _mm512_store_ps(tmp + j * 16, _mm512_mul_ps(acc[h][j], inv));
    for (int d = 0; d < D; ++d) o[d] = static_cast<T>(tmp[d]);
  }
}

// One sequence, every head. Pass 1 reads each cache slot (all KV heads of a token, contiguous) once, in
// order, so the hardware prefetcher streams it; pass 2 walks the slots once per KV head (its rows stay in
// L2 after the first walk). NV = head_dim / 16 vectors per row, a compile-time constant so a K or V row
// stays in registers while every query head of its group uses it.
template <typename T, typename C, int NV>
void attend_seq_avx512(const T* q, int64_t q_row_stride, int64_t q_head_stride, T* out, int64_t out_row_stride,
                       const C* k_cache, const C* v_cache, const int32_t* block_table, int64_t block_size,
                       int64_t num_kv_heads, int64_t num_heads, int64_t first_row, int64_t num_rows,
                       int64_t seq_len, float scale, std::vector<float>& scratch, SlotPrefetcher next) {
  constexpr int D = NV * 16;
  constexpr int64_t R = kv_row<C>(D);  // one head's row in a slot
  constexpr bool kQuant = KvCode<C>::quantized;
  // bf16 queries on a bf16 cache: vdpbf16ps multiplies the rows as stored, no widening of K.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  constexpr bool kDotBf16 = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  constexpr bool kDotBf16 = false;
#endif
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * R;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = first_row + r;
    const int64_t n_keys = seq_len - num_rows + r + 1;
    const int64_t padded = (n_keys + 15) / 16 * 16;
    // scores [num_heads, padded] | parts [num_heads, 16 keys, 16] | K scales [num_kv_heads, 16]
    scratch.resize(static_cast<size_t>(num_heads * padded + num_heads * 256 + num_kv_heads * 16));
    float* scores = scratch.data();
    float* parts = scores + num_heads * padded;
    float* kscale = parts + num_heads * 256;
    __m512 qv[kMaxHeads * NV];  // fp32, scaled (or, for vdpbf16ps, NV / 2 vectors of raw bf16 pairs)
    for (int64_t h = 0; h < num_heads; ++h) {
      const T* qp = q + row * q_row_stride + h * q_head_stride;
      if constexpr (kDotBf16) {
        for (int j = 0; j < NV / 2; ++j) qv[h * NV + j] = _mm512_castsi512_ps(_mm512_loadu_si512(qp + j * 32));
      } else {
        for (int j = 0; j < NV; ++j) qv[h * NV + j] = _mm512_mul_ps(load16(qp + j * 16), _mm512_set1_ps(scale));
      }
    }
    // Pass 1: scores = q . k for every key, 16 keys at a time: each (head, key) leaves a vector of partial
    // sums, and one transposed reduction per head turns 16 of them into 16 scores.
    int64_t n = 0, t0 = 0;
    const auto flush = [&]() {
      for (int64_t h = 0; h < num_heads; ++h) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = i < n ? _mm512_loadu_ps(parts + (h * 16 + i) * 16) : _mm512_setzero_ps();
        __m512 sc = transpose_sum16(v);
        if constexpr (kDotBf16) sc = _mm512_mul_ps(sc, _mm512_set1_ps(scale));
        if constexpr (kQuant) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(kscale + h / group * 16));  // (q . codes) x s
        _mm512_storeu_ps(scores + h * padded + t0, sc);
      }
      t0 += n;
      n = 0;
    };
    const int64_t slot_bytes = token_stride * static_cast<int64_t>(sizeof(C));
    for_each_slot(k_cache, block_table, block_size, token_stride, n_keys, [&](int64_t, const C* kb) {
      // This slot's V into L2 for pass 2, which walks the slots once per KV head: a strided walk that
      // the hardware prefetcher does not follow, and that alone made the step slower out of DRAM.
      const char* vslot = reinterpret_cast<const char*>(v_cache + (kb - k_cache));
      for (int64_t off = 0; off < slot_bytes; off += 64) _mm_prefetch(vslot + off, _MM_HINT_T1);
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const C* krow = kb + kvh * R;
        if constexpr (kDotBf16) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          __m512bh kv[NV / 2];
          for (int j = 0; j < NV / 2; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(krow + j * 32);
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < NV / 2; ++j) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(qv[h * NV + j]), kv[j]);
            _mm512_storeu_ps(parts + (h * 16 + n) * 16, acc);
          }
#endif
        } else {
          __m512 kv[NV];
          for (int j = 0; j < NV; ++j) kv[j] = load16(krow + j * 16);
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            __m512 acc = _mm512_mul_ps(qv[h * NV], kv[0]);
            for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[h * NV + j], kv[j], acc);
            _mm512_storeu_ps(parts + (h * 16 + n) * 16, acc);
          }
          if constexpr (kQuant) kscale[kvh * 16 + n] = kv_scale(krow, D);
        }
      }
      if (++n == 16) flush();
    });
    if (n > 0) flush();
    // Softmax numerators in place; the 1/sum goes into the output.
    float inv_sum[kMaxHeads];
    const int64_t full = n_keys / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (n_keys - full)) - 1u);
    for (int64_t h = 0; h < num_heads; ++h) {
      float* s = scores + h * padded;
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (int64_t i = 0; i < full; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
      if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + full));
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
      __m512 sv = _mm512_setzero_ps();
      for (int64_t i = 0; i < full; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
        _mm512_storeu_ps(s + i, e);
        sv = _mm512_add_ps(sv, e);
      }
      if (tail) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m));
        _mm512_mask_storeu_ps(s + full, tail, e);
        sv = _mm512_mask_add_ps(sv, tail, sv, e);
      }
      inv_sum[h] = 1.0f / _mm512_reduce_add_ps(sv);
    }
    // Pass 2, per KV head, up to 16 / NV of its query heads at a time; the last row's spreads the next
    // sequence's K prefetch over its slot visits.
    constexpr int kHeadsPerPass = 16 / NV;
    T* orow = out + row * out_row_stride;
    const int64_t visits = n_keys * num_kv_heads * ((group + kHeadsPerPass - 1) / kHeadsPerPass);
    const int64_t lines = r + 1 == num_rows ? (next.total / 64 + visits - 1) / visits : 0;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
      for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += kHeadsPerPass) {
        const int64_t hc = std::min<int64_t>(kHeadsPerPass, (kvh + 1) * group - h0);
        tokenmill_cpu::with_tile_rows<kHeadsPerPass>(hc, [&](auto hcc) {
          attend_values<decltype(hcc)::value, NV, T, C>(v_cache, block_table, block_size, token_stride, n_keys, kvh, h0,
                                                        scores, padded, inv_sum, orow, next, lines);
        });
      }
  }
}
#endif

#if defined(TOKENMILL_AVX2)
using tokenmill_cpu::exp8;
using tokenmill_cpu::hmax8;
using tokenmill_cpu::hsum8;
using tokenmill_cpu::load8;

// Query rows attended together: each K/V slot read serves up to this many rows of a prompt chunk, so a
// long chunk walks its keys num_rows / kTileRows times instead of num_rows times.
constexpr int64_t kTileRows = 4;

// The AVX2 twin of attend_seq_avx512 (8 lanes), plus row tiling for prompt chunks. NV = head_dim / 8.
template <typename T, typename C, int NV>
void attend_seq_avx2(const T* q, int64_t q_row_stride, int64_t q_head_stride, T* out, int64_t out_row_stride,
                     const C* k_cache, const C* v_cache, const int32_t* block_table, int64_t block_size,
                     int64_t num_kv_heads, int64_t num_heads, int64_t num_rows, int64_t first_row,
                     int64_t seq_len, float scale, std::vector<float>& scratch) {
  constexpr int D = NV * 8;
  constexpr int64_t R = kv_row<C>(D);
  constexpr bool kQuant = KvCode<C>::quantized;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * R;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kTileRows) {
    const int64_t tr = std::min(kTileRows, num_rows - r0);
    const int64_t n_first = seq_len - num_rows + r0 + 1;  // keys row r0 sees; row r0 + j sees n_first + j
    const int64_t n_last = n_first + tr - 1;
    const int64_t padded = (n_last + 7) / 8 * 8;
    const int64_t heads = tr * num_heads;  // (row, head) pairs of the tile
    scratch.resize(static_cast<size_t>(heads * (2 * D + padded + 1)));
    float* qf = scratch.data();         // [tr, heads, D], scaled
    float* acc = qf + heads * D;        // [tr, heads, D]
    float* scores = acc + heads * D;    // [tr, heads, padded]
    float* inv_sum = scores + heads * padded;
    for (int64_t j = 0; j < tr; ++j)
      for (int64_t h = 0; h < num_heads; ++h) {
        const T* qp = q + (first_row + r0 + j) * q_row_stride + h * q_head_stride;
        float* dst = qf + (j * num_heads + h) * D;
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(dst + v * 8, _mm256_mul_ps(load8(qp + v * 8), _mm256_set1_ps(scale)));
      }
    // Pass 1: scores = q . k for every key each row sees.
    for_each_slot(k_cache, block_table, block_size, token_stride, n_last, [&](int64_t t, const C* kb) {
      const int64_t j0 = tr - std::min(tr, n_last - t);  // the first row that sees key t (causal)
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const C* row = kb + kvh * R;
        __m256 kv[NV];
        for (int v = 0; v < NV; ++v) kv[v] = load8(row + v * 8);
        const float s = kQuant ? kv_scale(row, D) : 1.0f;
        for (int64_t j = j0; j < tr; ++j)
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            const float* qh = qf + (j * num_heads + h) * D;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), kv[0]);
            for (int v = 1; v < NV; ++v) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + v * 8), kv[v], a);
            scores[(j * num_heads + h) * padded + t] = kQuant ? hsum8(a) * s : hsum8(a);
          }
      }
    });
    // Softmax numerators in place; the 1/sum goes into the output.
    for (int64_t j = 0; j < tr; ++j) {
      const int64_t n_keys = n_first + j;
      const int64_t full = n_keys / 8 * 8;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores + (j * num_heads + h) * padded;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int64_t i = 0; i < full; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
        float m = hmax8(mv);
        for (int64_t i = full; i < n_keys; ++i) m = std::max(m, s[i]);
        const __m256 mb = _mm256_set1_ps(m);
        __m256 sv = _mm256_setzero_ps();
        for (int64_t i = 0; i < full; i += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
          _mm256_storeu_ps(s + i, e);
          sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum8(sv);
        for (int64_t i = full; i < n_keys; ++i) {
          s[i] = tokenmill_cpu::exp_poly(s[i] - m);
          sum += s[i];
        }
        inv_sum[j * num_heads + h] = 1.0f / sum;
      }
    }
    // Pass 2: out = sum_t p_t v_t, each V row loaded once for every row and head of its group.
    std::fill(acc, acc + heads * D, 0.0f);
    for_each_slot(v_cache, block_table, block_size, token_stride, n_last, [&](int64_t t, const C* vb) {
      const int64_t j0 = tr - std::min(tr, n_last - t);
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        const C* row = vb + kvh * R;
        __m256 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load8(row + v * 8);
        const float s = kQuant ? kv_scale(row, D) : 1.0f;
        for (int64_t j = j0; j < tr; ++j)
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            const float pr = scores[(j * num_heads + h) * padded + t];
            const __m256 p = _mm256_set1_ps(kQuant ? pr * s : pr);
            float* a = acc + (j * num_heads + h) * D;
            for (int v = 0; v < NV; ++v) _mm256_storeu_ps(a + v * 8, _mm256_fmadd_ps(p, vv[v], _mm256_loadu_ps(a + v * 8)));
          }
      }
    });
    for (int64_t j = 0; j < tr; ++j)
      for (int64_t h = 0; h < num_heads; ++h) {
        T* o = out + (first_row + r0 + j) * out_row_stride + h * D;
        const float* a = acc + (j * num_heads + h) * D;
        const float inv = inv_sum[j * num_heads + h];
        for (int d = 0; d < D; ++d) o[d] = static_cast<T>(a[d] * inv);
      }
  }
}
#endif

// out [num_tokens, num_heads, head_dim] (contiguous) <- attention of q's rows; sequences whose chunk has
// more than max_query_len rows or more than max_pairs (query row, key) pairs, counted as
// rows * (seq_len - rows / 2), are skipped (the caller sends those to a matmul-based path).
void paged_attention_varlen(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                            int64_t max_query_len, int64_t max_pairs) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention_varlen: CPU tensors only");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "out, k_cache and v_cache must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables, query_start_loc and seq_lens must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_attention_varlen: k_cache and v_cache dtypes differ");
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  tokenmill_cpu::dispatch_kv(q, k_cache, "paged_attention_varlen", [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    TORCH_CHECK(k_cache.size(3) == kv_row<cache_t>(head_dim), "paged_attention_varlen: the cache rows hold ",
                k_cache.size(3), " elements; head_dim ", head_dim, " needs ", kv_row<cache_t>(head_dim));
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const cache_t* kp = static_cast<const cache_t*>(k_cache.data_ptr());
    const cache_t* vp = static_cast<const cache_t*>(v_cache.data_ptr());
    scalar_t* op = out.data_ptr<scalar_t>();
    // One work item per sequence (threads split the batch; this engine usually runs one).
    at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t s = begin; s < end; ++s) {
        const int64_t first = qsl[s];
        const int64_t rows = qsl[s + 1] - first;
        if (rows == 0 || rows > max_query_len || rows * (lens[s] - rows / 2) > max_pairs) continue;
        if (lens[s] == 0) {  // padding: zero output, as the reference gives
          std::fill_n(op + first * num_heads * head_dim, rows * num_heads * head_dim, static_cast<scalar_t>(0));
          continue;
        }
        const int32_t* table = tables + s * max_blocks;
#if defined(__AVX512F__)
        if (num_heads <= kMaxHeads && (head_dim == 64 || head_dim == 128)) {
          SlotPrefetcher next;  // the next sequence's keys (this thread's), fetched during this one's pass 2
          if (s + 1 < end) {
            const int64_t slot_bytes = num_kv_heads * kv_row<cache_t>(head_dim) * static_cast<int64_t>(sizeof(cache_t));
            next = {reinterpret_cast<const char*>(kp), tables + (s + 1) * max_blocks, block_size * slot_bytes,
                    lens[s + 1] * slot_bytes, 0};
          }
          if (head_dim == 64)
            attend_seq_avx512<scalar_t, cache_t, 4>(qp, q.stride(0), q.stride(1), op, num_heads * head_dim, kp, vp,
                                                    table, block_size, num_kv_heads, num_heads, first, rows, lens[s],
                                                    fscale, scratch, next);
          else
            attend_seq_avx512<scalar_t, cache_t, 8>(qp, q.stride(0), q.stride(1), op, num_heads * head_dim, kp, vp,
                                                    table, block_size, num_kv_heads, num_heads, first, rows, lens[s],
                                                    fscale, scratch, next);
          continue;
        }
#endif
#if defined(TOKENMILL_AVX2)
        if (head_dim == 64 || head_dim == 128) {
          if (head_dim == 64)
            attend_seq_avx2<scalar_t, cache_t, 8>(qp, q.stride(0), q.stride(1), op, num_heads * head_dim, kp, vp,
                                                  table, block_size, num_kv_heads, num_heads, rows, first, lens[s],
                                                  fscale, scratch);
          else
            attend_seq_avx2<scalar_t, cache_t, 16>(qp, q.stride(0), q.stride(1), op, num_heads * head_dim, kp, vp,
                                                   table, block_size, num_kv_heads, num_heads, rows, first, lens[s],
                                                   fscale, scratch);
          continue;
        }
#endif
        for (int64_t h = 0; h < num_kv_heads; ++h)
          attend_rows<scalar_t, cache_t>(qp, q.stride(0), q.stride(1), op, num_heads * head_dim, kp, vp, table,
                                         block_size, num_kv_heads, head_dim, h, group, first, rows, lens[s], fscale,
                                         scratch);
      }
    });
  });
}

// Writes this step's key/value rows [num_tokens, num_kv_heads, head_dim] into their cache slots (slot -1
// skips the row); an 8-bit cache gets each row's codes and scale (cpu_kv_quant.h). One op instead of the
// reference's per-layer compare, all() and two index_copy_ calls: at decode batch sizes those small ops
// cost more than the copy (docs/engine.md, per-step overhead).
void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kv: caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "store_kv: slot_mapping must be contiguous int64");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: key and value, and k_cache and v_cache, must have one dtype each");
  const int64_t num_tokens = key.size(0);
  const int64_t row = k_cache.size(2) * k_cache.size(3);  // one slot: num_kv_heads rows
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t heads = key.size(1), head_dim = key.size(2);
  TORCH_CHECK(heads == k_cache.size(2) && value.sizes() == key.sizes() && slot_mapping.size(0) == num_tokens,
              "store_kv: key/value must be [num_tokens, num_kv_heads, head_dim] with one slot per row");
  // Each head's head_dim values are contiguous; heads may sit at any stride (q|k|v rows of one GEMM).
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "store_kv: key/value last dimension must be contiguous");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  tokenmill_cpu::dispatch_kv(key, k_cache, "store_kv", [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    constexpr bool quant = KvCode<cache_t>::quantized;
    const int64_t width = kv_row<cache_t>(head_dim);
    TORCH_CHECK(k_cache.size(3) == width, "store_kv: the cache rows hold ", k_cache.size(3), " elements; head_dim ",
                head_dim, " needs ", width);
    cache_t* kc = static_cast<cache_t*>(k_cache.data_ptr());
    cache_t* vc = static_cast<cache_t*>(v_cache.data_ptr());
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    std::vector<float> buf(quant ? head_dim : 0);
    // One head's row into its place in the slot: a copy, or its codes and scale.
    auto put = [&](cache_t* dst, const scalar_t* src) {
      if constexpr (quant) {
        for (int64_t d = 0; d < head_dim; ++d) buf[d] = tokenmill_cpu::to_float(src[d]);
        const float s = tokenmill_cpu::quantize_row(buf.data(), head_dim, dst);
        std::memcpy(reinterpret_cast<char*>(dst + head_dim), &s, sizeof(s));
      } else {
        std::memcpy(dst, src, head_dim * sizeof(scalar_t));
      }
    };
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      TORCH_CHECK(s < num_slots, "store_kv: slot ", s, " is outside the cache (", num_slots, " slots)");
      for (int64_t h = 0; h < heads; ++h) {
        put(kc + s * row + h * width, kp + t * key.stride(0) + h * key.stride(1));
        put(vc + s * row + h * width, vp + t * value.stride(0) + h * value.stride(1));
      }
    }
  });
}
}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  ::store_kv(k_cache, v_cache, key, value, slot_mapping);
}
void paged_attention_varlen(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, int64_t max_query_len, int64_t max_pairs) {
  ::paged_attention_varlen(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                           max_pairs);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def(
      "paged_attention_varlen(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int max_query_len, int max_pairs) -> ()");
  m.impl("paged_attention_varlen", c10::DispatchKey::CPU, &paged_attention_varlen);
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
