// The ops of cpu_layers.cpp, cpu_attention.cpp, cpu_linear_bf16.cpp, cpu_dense_bf16.cpp,
// cpu_gemm_bf16.cpp and cpu_linear_amx.cpp as plain C++
// calls, for cpu_decoder.cpp: it runs a step's decoder layers in one call without going back through
// Python and the dispatcher between them. Same arguments and checks as the registered ops.
#pragma once

#include <ATen/ATen.h>

namespace tokenmill_cpu {

void add_rms_norm(at::Tensor out, at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_neox(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping);
void paged_attention_varlen(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, int64_t max_query_len, int64_t max_pairs);
void linear_codes_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
void linear_codes_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
void linear_dense_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias);
void linear_dense_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias);
void linear_codes_dense(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
void linear_codes_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
void linear_dequant_amx(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
// fp32 rows: fp32 or bf16 panels (cpu_linear.cpp), and integer codes (cpu_linear.cpp, cpu_gemm.cpp).
void linear_packed(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
void linear_packed_q8(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
void linear_q8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
// The same with x rounded to int8 per 32 k (cpu_codes_int8.cpp; `--int8-activations`).
void linear_codes_int8x(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, const c10::optional<at::Tensor>& bias);

}  // namespace tokenmill_cpu
