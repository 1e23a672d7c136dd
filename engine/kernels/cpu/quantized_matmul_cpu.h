// What the two sources of the quantized matmul extension share: reading a scale, checking a
// packed weight, and the batched bfloat16 path (quantized_matmul_bf16.cpp) that the float32
// one (quantized_matmul_cpu.cpp) hands bfloat16 activations to. Layouts: quantized_matmul_cpu.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>
#include <tuple>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace llmctl_quantized {

// A scale or zero as float: float32 as it is, float16 widened (F16C where the CPU has it).
inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const c10::Half* p, int64_t i) {
#if defined(__F16C__)
  return _cvtsh_ss(p[i].x);
#else
  return static_cast<float>(p[i]);
#endif
}

inline bool is_scale_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf;
}

inline void check_dequant(const at::Tensor& q, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && is_scale_dtype(scales),
              "q and scales must be contiguous, scales float32 or float16");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "q has the wrong dtype");
  TORCH_CHECK(!zeros.has_value() ||
                  (zeros->is_contiguous() && zeros->scalar_type() == scales.scalar_type()),
              "zeros must be contiguous and of the scales' dtype");
}

// y[M, N] = x[M, K] W^T in bfloat16 (float32 sums), W's tiles expanded to bfloat16 for oneDNN's
// brgemm kernel (quantized_matmul_bf16.cpp).
at::Tensor bf16_tiled_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t bits,
                               int64_t group_size, int64_t tile_rows);

// Rows [n0, n1) of W in bfloat16, row-major (the float values of dequantize_rows, rounded).
at::Tensor dequantize_rows_bf16(const at::Tensor& q, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, int64_t bits,
                                int64_t group_size, int64_t n0, int64_t n1);

// W's rows in the layout of AMX's B operand, blocks of 32 rows: [N / 32, K / 2, 32, 2] bfloat16,
// B[b][k / 2][j] = (W[r][k], W[r][k + 1]) for the block's row j. gate_up_half > 0 (a gated MLP's
// [gate; up] weight, gate_up_half rows each): block b holds gate rows 16 b .. 16 b + 15, then the
// up rows gate_up_half + 16 b .., so one block's sums are 16 columns of both. Otherwise block b
// is rows 32 b .. 32 b + 31. The values are dequantize_rows_bf16's.
at::Tensor vnni_blocks_bf16(const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zeros, int64_t bits,
                            int64_t group_size, int64_t gate_up_half);

// out[M, H] = (silu(x Wg^T) * (x Wu^T)) Wd^T in bfloat16 on AMX tiles (amx_gemm.cpp), the
// weights as vnni_blocks_bf16 lays them out: gate_up with gate_up_half = I, down [H / 32, I / 2,
// 32, 2]. Each value is rounded where the unfused layers round (the GEMMs' outputs, silu, the
// product), so the output has their bits.
at::Tensor amx_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down);
bool amx_built();

// out[M, N] = x W^T on AMX tiles, W as vnni_blocks_bf16 lays it out (gate_up_half 0).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w);
// amx_linear with RoPE ("rotate half", layer_ops_cpu.h's rope_row) on each row's first
// rotary_columns (whole heads of cos_cache's width) while the rows are in cache: QKV's q and k.
at::Tensor amx_linear_rope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& positions,
                           const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                           int64_t rotary_columns);
// (norm(x W^T + residual), x W^T + residual): amx_linear with RMSNorm's residual add
// (add_rms_norm_row) on its rows while they are in cache: O and the post-attention norm.
std::tuple<at::Tensor, at::Tensor> amx_linear_add_rms_norm(const at::Tensor& x,
                                                           const at::Tensor& w,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps);

// The checks of the linear-with-epilogue ops (amx_gemm.cpp's and int8_gemm.cpp's): the positions
// (contiguous) for RoPE after an [M, N] linear, and the residual and norm weight after one.
at::Tensor checked_rope_positions(const at::Tensor& positions, const at::Tensor& cos_cache,
                                  const at::Tensor& sin_cache, int64_t rotary_columns, int64_t M,
                                  int64_t N, const char* op);
void check_add_rms_norm(const at::Tensor& residual, const at::Tensor& weight, int64_t M,
                        int64_t N, const char* op);

// The same four ops on int8 activations and AVX512-VNNI (int8_gemm.cpp), the weights as
// int8_blocks lays them out: [N / 32, 40 K] bytes (gate_up_half as vnni_blocks_bf16's).
at::Tensor int8_blocks(const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                       int64_t gate_up_half);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor int8_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down);
at::Tensor int8_linear_rope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& positions,
                            const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                            int64_t rotary_columns);
std::tuple<at::Tensor, at::Tensor> int8_linear_add_rms_norm(const at::Tensor& x,
                                                            const at::Tensor& w,
                                                            const at::Tensor& residual,
                                                            const at::Tensor& weight, double eps);
bool int8_built();

// AVX2 (no VNNI): float32 x, quantized to int8 per 32 values, against 4-bit weights (int8_gemm.cpp)
at::Tensor int4_group_mm_int8_act(const at::Tensor& x, const at::Tensor& qp,
                                  const at::Tensor& scales, const at::Tensor& zeros,
                                  int64_t group_size);
bool int8_f32_built();

}  // namespace llmctl_quantized
