// A step's decoder layers (Llama: RMSNorm, q|k|v, rotary, paged attention, o, RMSNorm, gate|up, SiLU, down)
// in one call, for bf16 models on the CPU whose projections run from their integer codes or dense bf16 panels,
// and fp32 models whose projections run from integer codes or the fp32 kernel's panels (fp32 or bf16).
//
// Why: at small batches the kernels themselves take about half of a decode step and Python the rest. The
// bundled model's 30 layers make ~300 op calls a step, each with a module call, an output allocation and
// the dispatcher's argument parsing: 5.97 ms of a 20.4 ms batch-1 forward was left when every kernel was
// replaced by a no-op (docs/benchmark-log.md). Here the same kernels run in the same order on the same
// buffers' shapes, so the result is the Python path's bit for bit (tests/test_decoder_layers_cpu.py).
//
// The caller (engine/models/llama.py) decides when this applies: no tensor parallelism, no
// q/k norms, the full rotary tables, every projection with codes or dense panels, and a batch small enough
// for their kernels; it passes its row thresholds for picking a linear kernel, so the choice stays in one place
// (engine/layers/cpu_gemm_policy.py).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "cpu_ops.h"

namespace {

// Per layer, in this order: the two norms' weights, then codes, scales, mins and bias (an empty tensor:
// none) of q|k|v, o, gate|up and down, then the layer's K and V caches. A dense bf16 projection has its
// packed weight (bf16) in the codes' place and empty scales and mins; in an fp32 model a projection on
// panels (fp32, or bf16 for a bf16 checkpoint) has them there, with empty scales and mins.
constexpr int64_t kPerLayer = 20;

struct Linear {
  const at::Tensor* codes;
  const at::Tensor* scales;
  const at::Tensor* mins;
  c10::optional<at::Tensor> bias;
};

Linear linear_at(at::TensorList w, int64_t base) {
  const at::Tensor& bias = w[base + 3];
  return {&w[base], &w[base + 1], &w[base + 2], bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt};
}

// The row thresholds that pick a linear's kernel (engine/layers/cpu_gemm_policy.py's, passed in sizes).
struct Thresholds {
  int64_t amx_min_rows, dequant_min_rows, gemm_min_rows, packed_max_rows, codes_dense_min_rows;
  bool int8_x;
};

// engine/layers/linear.py's CpuPackedWeight.linear: fp32 rows on codes or panels; bf16 rows from
// gemm_min_rows on the fp32-FMA GEMM (dense or codes); below it a dense bf16 weight's dot kernel, or on codes
// from amx_min_rows the AMX codes kernel (from dequant_min_rows the AMX dequant kernel), else from
// codes_dense_min_rows the dense kernel on rebuilt codes, else the codes' dot kernel. With int8_x, rows on codes
// (fp32 up to packed_max_rows, bf16 at every size the loop takes) take the int8-activation kernel.
void run_linear(at::Tensor out, const at::Tensor& x, const Linear& l, const Thresholds& t) {
  const int64_t rows = x.size(0);
  if (x.scalar_type() == at::kFloat) {  // CpuPackedWeight.linear for fp32 rows
    if (l.scales->numel() == 0)
      tokenmill_cpu::linear_packed(out, x, *l.codes, l.bias);
    else if (rows > t.packed_max_rows)
      tokenmill_cpu::linear_q8_gemm(out, x, *l.codes, *l.scales, *l.mins, l.bias);
    else if (t.int8_x)
      tokenmill_cpu::linear_codes_int8x(out, x, *l.codes, *l.scales, *l.mins, l.bias);
    else
      tokenmill_cpu::linear_packed_q8(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  } else if (l.codes->scalar_type() == at::kBFloat16) {  // dense bf16 panels in the codes' place (no scales, mins)
    if (rows >= t.gemm_min_rows)
      tokenmill_cpu::linear_dense_gemm(out, x, *l.codes, l.bias);
    else
      tokenmill_cpu::linear_dense_bf16(out, x, *l.codes, l.bias);
  } else if (t.int8_x) {  // bf16 rows on codes, every batch size the loop takes (the VNNI tiles)
    tokenmill_cpu::linear_codes_int8x(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  } else if (rows >= t.gemm_min_rows) {
    tokenmill_cpu::linear_codes_gemm(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  } else if (rows >= t.amx_min_rows) {
    if (rows >= t.dequant_min_rows)
      tokenmill_cpu::linear_dequant_amx(out, x, *l.codes, *l.scales, *l.mins, l.bias);
    else
      tokenmill_cpu::linear_codes_amx(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  } else if (rows >= t.codes_dense_min_rows) {
    tokenmill_cpu::linear_codes_dense(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  } else {
    tokenmill_cpu::linear_codes_bf16(out, x, *l.codes, *l.scales, *l.mins, l.bias);
  }
}

// hidden [T, H] and residual [T, H] (bf16 or fp32) after the step's first layer -> (hidden, residual) after
// the last. sizes = {num_heads, num_kv_heads, head_dim, qkv width, intermediate size, max_query_len, max_pairs,
// amx_min_rows, dequant_min_rows, gemm_min_rows, packed_max_rows, int8_x (0 or 1: rows on codes take
// int8 activations, CpuPackedWeight.int8_x), codes_dense_min_rows}.
std::tuple<at::Tensor, at::Tensor> decoder_layers(at::Tensor hidden, at::Tensor residual,
                                                  at::TensorList weights, const at::Tensor& positions,
                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                  const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                                  double scale, double eps, at::IntArrayRef sizes) {
  TORCH_CHECK(sizes.size() == 13, "decoder_layers: sizes must have 13 entries");
  TORCH_CHECK(weights.size() % kPerLayer == 0, "decoder_layers: weights must come ", kPerLayer, " per layer");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && (dtype == at::kBFloat16 || dtype == at::kFloat) &&
                  residual.sizes() == hidden.sizes() && residual.scalar_type() == dtype,
              "decoder_layers: hidden and residual must be contiguous bf16 or fp32 [tokens, hidden] of one shape and dtype");
  const int64_t heads = sizes[0], kv_heads = sizes[1], head_dim = sizes[2], qkv_width = sizes[3], inter = sizes[4];
  const int64_t max_query_len = sizes[5], max_pairs = sizes[6];
  const Thresholds t{sizes[7], sizes[8], sizes[9], sizes[10], sizes[12], sizes[11] != 0};
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(qkv_width == q_size + 2 * kv_size, "decoder_layers: the q|k|v width must be (heads + 2 kv heads) x head_dim");
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const auto opts = hidden.options();
  for (size_t layer = 0; layer < weights.size() / kPerLayer; ++layer) {
    const int64_t base = layer * kPerLayer;
    const at::Tensor& k_cache = weights[base + 18];
    const at::Tensor& v_cache = weights[base + 19];
    // norm(hidden + residual); hidden becomes that sum, the next residual (RMSNorm.forward's in-place add)
    at::Tensor normed = at::empty_like(hidden);
    tokenmill_cpu::add_rms_norm(normed, hidden, residual, weights[base], eps);
    residual = hidden;
    at::Tensor qkv = at::empty({tokens, qkv_width}, opts);
    run_linear(qkv, normed, linear_at(weights, base + 2), t);
    // q and k heads side by side in each row: one in-place rotation of both (LlamaAttention.forward)
    tokenmill_cpu::rotary_neox(qkv.narrow(1, 0, q_size + kv_size).view({tokens, heads + kv_heads, head_dim}), positions,
                               cos, sin);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    tokenmill_cpu::store_kv(k_cache, v_cache, k, v, slot_mapping);
    at::Tensor attn = at::empty({tokens, heads, head_dim}, opts);
    tokenmill_cpu::paged_attention_varlen(attn, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                          max_query_len, max_pairs);
    at::Tensor o = at::empty({tokens, width}, opts);
    run_linear(o, attn.view({tokens, q_size}), linear_at(weights, base + 6), t);
    at::Tensor normed2 = at::empty_like(o);
    tokenmill_cpu::add_rms_norm(normed2, o, residual, weights[base + 1], eps);
    residual = o;
    at::Tensor gate_up = at::empty({tokens, 2 * inter}, opts);
    run_linear(gate_up, normed2, linear_at(weights, base + 10), t);
    at::Tensor act = at::empty({tokens, inter}, opts);
    tokenmill_cpu::silu_and_mul(act, gate_up);
    hidden = at::empty({tokens, width}, opts);
    run_linear(hidden, act, linear_at(weights, base + 14), t);
  }
  return {hidden, residual};
}

}  // namespace

// hidden is summed into in place, as RMSNorm.forward does; the layers' K and V caches in `weights` are
// written (this step's keys and values).
TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "decoder_layers(Tensor(a!) hidden, Tensor residual, Tensor[] weights, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, float eps, "
      "int[] sizes) -> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
}
