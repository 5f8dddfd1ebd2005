// The k largest of each row of fp32 logits, for the sampler's candidates (engine/worker/sampler.py).
//
// Why: torch.topk of 64 over [64, 49152] took 2.8 ms a step with 2 threads (a 2-vCPU Xeon), half of the
// sampler at the bundled model's defaults (temperature 0.2, top_p 0.9) at batch 64. Here one pass per
// row keeps a running threshold (the k-th largest seen so far): almost every logit is rejected by one
// vector compare, and the few above it go to a buffer that is cut back to its k largest when full.
//
// Output: values descending, ties by lower index (one valid top-k set; which of several tied at the k-th
// value are kept is the lowest indices seen first). NaN never compares above the threshold, so a NaN is
// not returned unless it is among the first k elements (torch.topk ranks NaN first; logits hold none).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

namespace {

struct Candidate {
  float value;
  int64_t index;
};

inline bool before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// Keep the k first by `before` in buf[0, k); returns the k-th one's value (the new threshold).
inline float cut(std::vector<Candidate>& buf, int64_t k) {
  std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), before);
  buf.resize(k);
  return buf[k - 1].value;
}

void topk_row(const float* x, int64_t v, int64_t k, std::vector<Candidate>& buf, float* out_v, int64_t* out_i) {
  const int64_t cap = std::max<int64_t>(4 * k, 256);
  buf.clear();
  buf.reserve(cap);
  for (int64_t i = 0; i < k; ++i) buf.push_back({x[i], i});
  float threshold = std::numeric_limits<float>::infinity();
  for (const Candidate& c : buf) threshold = std::min(threshold, c.value);
  if (threshold != threshold) threshold = -std::numeric_limits<float>::infinity();  // a NaN among the first k
  auto take = [&](int64_t i) {
    buf.push_back({x[i], i});
    if (static_cast<int64_t>(buf.size()) == cap) threshold = cut(buf, k);
  };
  int64_t i = k;
#if defined(__AVX512F__)
  for (; i + 16 <= v; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(threshold), _CMP_GT_OQ);
    while (above) {  // rare once the threshold has settled
      const int bit = __builtin_ctz(above);
      above &= above - 1;
      if (x[i + bit] > threshold) take(i + bit);  // the threshold may have risen within this vector
    }
  }
#endif
  for (; i < v; ++i)
    if (x[i] > threshold) take(i);
  if (static_cast<int64_t>(buf.size()) > k) cut(buf, k);
  std::sort(buf.begin(), buf.end(), before);
  for (int64_t j = 0; j < k; ++j) {
    out_v[j] = buf[j].value;
    out_i[j] = buf[j].index;
  }
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "topk_rows: x must be 2-D float32 with contiguous rows, got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), v = x.size(1);
  TORCH_CHECK(k >= 1 && k <= v, "topk_rows: k must be in 1..", v, " (the row length), got ", k);
  at::Tensor values = at::empty({m, k}, x.options());
  at::Tensor indices = at::empty({m, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> buf;
    for (int64_t r = begin; r < end; ++r) topk_row(xp + r * ld, v, k, buf, vp + r * k, ip + r * k);
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.impl("topk_rows", c10::DispatchKey::CPU, &topk_rows);
}
