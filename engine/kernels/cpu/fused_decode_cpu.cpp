// A Llama-family decoder's decode step on the CPU in one call: every layer of a pipeline stage,
// from the hidden states after the embedding (or the previous stage) to the last MLP's output.
//
// Single-stream decode of a small quantized model spends most of its time outside the matmuls:
// ~40 torch ops and a dozen Python module calls per layer, each a few microseconds, against
// ~0.2 ms of matmul. This does the same math with the Python and the per-op dispatch gone: the
// elementwise work (RMSNorm with the residual add, RoPE, the KV-cache write, SiLU-and-mul) runs
// as plain loops over the step's few rows, and the heavy parts call the same kernels the Python
// path calls (the quantized matmul ops, the paged decode attention op, torch's GEMM for float
// weights), looked up once through the dispatcher by the names the Python side gives.
//
// Per layer (HF's LlamaDecoderLayer, as engine/models/llama.py computes it):
//   residual += h (or residual = h at the stage's first layer); x = rmsnorm(residual)
//   q, k, v = split(x W_qkv^T + b); rope(q, k)
//   kv_cache[slot] = k, v; a = paged_attention(q); residual += a W_o^T; x = rmsnorm(residual)
//   h = (silu(x W_gate^T) * x W_up^T) W_down^T
//
// A linear is one or more row blocks ("parts"; a GGUF Q4_K_M layer mixes Q4_K and Q6_K rows),
// each int4 or int8 packed (quantized_matmul.py's PackedLinearWeight) or a float [N, K] weight.
//
// Activations, norms' weights and the KV cache are all float32 or all bfloat16 (the model's
// dtype): the elementwise work runs layer_ops_cpu.h's row routines, which round where torch's
// bfloat16 ops round, and the matmuls are the module path's own ops (a packed weight's decode
// kernel widens bfloat16 in registers; above `tile_from` rows of bfloat16, its bfloat16 tiles;
// above `f32_tile_from` rows of float32 its float32 tiles, or from `int8_from` rows int8
// activations where the part takes them, as PackedLinearWeight.matmul chooses).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_fused_decode
#endif

#include "layer_ops_cpu.h"

namespace {

using Int4Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, int64_t);
using Int8Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using TiledMm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, int64_t, int64_t, int64_t);
using Int8ActMm = Int4Mm;  // int4_group_mm_int8_act(x, qp, scales, zeros, group_size)
using PagedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, double,
                                  std::optional<int64_t>, const std::optional<at::Tensor>&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Sig>();
}

struct Part {
  int64_t bits = 0;  // 4, 8; 0: a float [N, K] weight in q; -1: oneDNN's prepacked weight
  int64_t group = 0;
  int64_t tile_rows = 0;  // rows of W per bfloat16 tile (quantized_matmul.bf16_tile_rows)
  int64_t f32_tile_rows = 0;  // per float32 tile (quantized_matmul.float32_tile_rows)
  bool int8_act = false;  // float32 batches from int8_from rows on int8 activations
  at::Tensor q, scales, zeros;
};

struct Linear {
  std::vector<Part> parts;
  at::Tensor bias;  // undefined when the layer has none
};

struct Layer {
  at::Tensor input_norm, post_norm, kv_cache;
  at::Tensor key_cache, value_cache;  // kv_cache[0], kv_cache[1], made once
  Linear qkv, o, gate_up, down;
};

using llmctl_layers::BFloat16;

// Rows split across threads where a step has enough of them (a batch of decodes); a single
// sequence's step stays on its thread (waking the others costs more than its rows).
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  constexpr int64_t kGrainValues = 1 << 15;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(1, width)), f);
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  // tensors: cos_cache, sin_cache, then per layer: input_norm, post_norm, kv_cache, then for
  //   qkv, o, gate_up, down: per part q, scales, zeros (an empty tensor when none), then the
  //   bias when it has one.
  // meta: num_layers, num_heads, num_kv_heads, head_dim, tile_from, f32_tile_from, int8_from,
  //   then per layer and linear: num_parts, has_bias, then per part: bits, group, tile_rows,
  //   f32_tile_rows, int8_act. tile_from: the rows of bfloat16 above which a packed weight runs
  //   its bfloat16 tiles (tiled_op), f32_tile_from the same for float32 rows and its float32
  //   tiles, int8_from the float32 rows from which a part marked int8_act runs
  //   int4_group_mm_int8_act instead; 0 for never.
  // ops: the qualified names of int4_group_mm, int8_group_mm, tiled_group_mm,
  //   int4_group_mm_int8_act (empty where int8_from is 0) and paged_decode_attention.
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> meta, double eps,
              double scale, std::vector<std::string> ops)
      : eps_(static_cast<float>(eps)), scale_(scale) {
    size_t t = 0, m = 0;
    auto next_t = [&]() {
      TORCH_CHECK(t < tensors.size(), "DecodeStack: too few tensors");
      return tensors[t++];
    };
    auto next_m = [&]() {
      TORCH_CHECK(m < meta.size(), "DecodeStack: too few meta values");
      return meta[m++];
    };
    TORCH_CHECK(ops.size() == 5, "DecodeStack: five op names");
    cos_ = next_t().contiguous();
    sin_ = next_t().contiguous();
    const int64_t num_layers = next_m();
    num_heads_ = next_m();
    num_kv_heads_ = next_m();
    head_dim_ = next_m();
    tile_from_ = next_m();
    f32_tile_from_ = next_m();
    int8_from_ = next_m();
    TORCH_CHECK(head_dim_ % 2 == 0 && head_dim_ <= llmctl_layers::kMaxHeadDim,
                "DecodeStack: head_dim must be even, at most ", llmctl_layers::kMaxHeadDim);
    auto read_linear = [&]() {
      Linear lin;
      const int64_t num_parts = next_m();
      const bool has_bias = next_m() != 0;
      for (int64_t p = 0; p < num_parts; ++p) {
        Part part;
        part.bits = next_m();
        part.group = next_m();
        part.tile_rows = next_m();
        part.f32_tile_rows = next_m();
        part.int8_act = next_m() != 0;
        part.q = next_t();
        part.scales = next_t();
        part.zeros = next_t();
        lin.parts.push_back(part);
      }
      if (has_bias) lin.bias = next_t();
      return lin;
    };
    for (int64_t i = 0; i < num_layers; ++i) {
      Layer layer;
      layer.input_norm = next_t();
      layer.post_norm = next_t();
      layer.kv_cache = next_t();
      if (i == 0) dtype_ = layer.kv_cache.scalar_type();
      TORCH_CHECK(layer.kv_cache.dim() == 5 && layer.kv_cache.is_contiguous() &&
                      (dtype_ == at::kFloat || dtype_ == at::kBFloat16) &&
                      layer.kv_cache.scalar_type() == dtype_ &&
                      layer.input_norm.scalar_type() == dtype_ &&
                      layer.post_norm.scalar_type() == dtype_,
                  "DecodeStack: the KV caches (contiguous [2, blocks, block_size, kv_heads, "
                  "head_dim]) and norms must all be float32 or all bfloat16");
      layer.key_cache = layer.kv_cache.select(0, 0);
      layer.value_cache = layer.kv_cache.select(0, 1);
      layer.qkv = read_linear();
      layer.o = read_linear();
      layer.gate_up = read_linear();
      layer.down = read_linear();
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(t == tensors.size() && m == meta.size(), "DecodeStack: unused inputs");
    mkldnn_linear_ =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    if (!ops[0].empty()) int4_ = find_op<Int4Mm>(ops[0]);
    if (!ops[1].empty()) int8_ = find_op<Int8Mm>(ops[1]);
    if (!ops[2].empty()) tiled_ = find_op<TiledMm>(ops[2]);
    if (!ops[3].empty()) int8_act_ = find_op<Int8ActMm>(ops[3]);
    TORCH_CHECK((f32_tile_from_ == 0 || tiled_) && (int8_from_ == 0 || int8_act_),
                "DecodeStack: float32 tiles or int8 activations without their op");
    attention_ = find_op<PagedAttention>(ops[4]);
  }

  // hidden: [M, H] of the stack's dtype; residual: [M, H] or None at the model's first layer;
  // positions, slot_mapping: [M] int64; block_tables [M, width], seq_lens [M]: the decode
  // attention's. Returns (the last MLP's output, the residual), as LlamaModel's layer loop leaves
  // them; with final_norm (the model's last stage) the first is rmsnorm(residual + that output) *
  // final_norm, the model's output, and the residual includes it.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             at::Tensor positions, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens,
                                             std::optional<int64_t> sliding_window,
                                             std::optional<at::Tensor> final_norm) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == dtype_,
                "hidden must be [num_tokens, hidden_size] of the KV cache's dtype");
    if (dtype_ == at::kBFloat16) {
      return run<BFloat16>(hidden, residual, positions, slot_mapping, block_tables, seq_lens,
                           sliding_window, final_norm);
    }
    return run<float>(hidden, residual, positions, slot_mapping, block_tables, seq_lens,
                      sliding_window, final_norm);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  template <typename T>
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden,
                                         const std::optional<at::Tensor>& residual,
                                         const at::Tensor& positions,
                                         const at::Tensor& slot_mapping,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         std::optional<int64_t> sliding_window,
                                         const std::optional<at::Tensor>& final_norm) {
    const int64_t M = hidden.size(0), H = hidden.size(1);
    const int64_t D = head_dim_;
    const int64_t q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
    at::Tensor h = hidden.contiguous();
    bool have_residual = residual.has_value();
    // Our own residual buffer: the caller's tensors are not written.
    at::Tensor res = have_residual ? residual->clone(at::MemoryFormat::Contiguous)
                                   : at::empty({M, H}, hidden.options());
    at::Tensor x = at::empty({M, H}, hidden.options());
    const at::Tensor pos = positions.contiguous();
    const at::Tensor slots = slot_mapping.contiguous();
    const int64_t* pos_p = pos.data_ptr<int64_t>();
    const int64_t* slot_p = slots.data_ptr<int64_t>();
    const float* cos_p = cos_.data_ptr<float>();
    const float* sin_p = sin_.data_ptr<float>();
    const int64_t rope_width = cos_.size(1);
    TORCH_CHECK(pos.numel() == M && slots.numel() == M, "one position and slot per token");
    const int64_t num_slots =
        layers_.empty() ? 0 : layers_[0].kv_cache.size(1) * layers_[0].kv_cache.size(2);
    for (int64_t r = 0; r < M; ++r) {  // the loops below index with these: check them first
      TORCH_CHECK(pos_p[r] >= 0 && pos_p[r] < cos_.size(0), "position ", pos_p[r],
                  " is outside the rotary table (", cos_.size(0), " positions)");
      TORCH_CHECK(slot_p[r] < num_slots, "slot ", slot_p[r], " is outside the KV cache");
    }

    for (auto& L : layers_) {
      add_and_norm<T>(h, res, x, L.input_norm, have_residual);
      have_residual = true;
      at::Tensor qkv = linear(x, L.qkv);  // [M, q + 2 kv]
      T* qkv_p = qkv.data_ptr<T>();
      const int64_t ld = qkv.size(1);
      for_rows(M, ld, [&](int64_t begin, int64_t end) {  // RoPE on the query and key heads
        for (int64_t r = begin; r < end; ++r)
          llmctl_layers::rope_row<T>(qkv_p + r * ld, num_heads_ + num_kv_heads_, D,
                                     cos_p + pos_p[r] * rope_width, sin_p + pos_p[r] * rope_width);
      });
      // The new token's key and value into its slot of the paged cache.
      T* kc = L.key_cache.data_ptr<T>();
      T* vc = L.value_cache.data_ptr<T>();
      const int64_t slot_stride = num_kv_heads_ * D;  // [num_blocks * block_size, kvh, D] rows
      for (int64_t r = 0; r < M; ++r) {
        if (slot_p[r] < 0) continue;
        const T* row = qkv_p + r * ld;
        std::copy(row + q_size, row + q_size + kv_size, kc + slot_p[r] * slot_stride);
        std::copy(row + q_size + kv_size, row + q_size + 2 * kv_size,
                  vc + slot_p[r] * slot_stride);
      }
      at::Tensor q = qkv.narrow(1, 0, q_size).contiguous().view({M, num_heads_, D});
      at::Tensor attn = attention_
                            ->call(q, L.key_cache, L.value_cache, block_tables, seq_lens, scale_,
                                   sliding_window, std::nullopt)
                            .view({M, q_size});
      at::Tensor o = linear(attn, L.o);
      add_and_norm<T>(o, res, x, L.post_norm, true);
      at::Tensor gu = linear(x, L.gate_up);  // [M, 2 I] as [gate | up]
      const int64_t I = gu.size(1) / 2;
      at::Tensor act = at::empty({M, I}, gu.options());
      const T* gu_p = gu.data_ptr<T>();
      T* act_p = act.data_ptr<T>();
      for_rows(M, 2 * I, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          llmctl_layers::silu_mul_row<T>(gu_p + r * 2 * I, gu_p + r * 2 * I + I, act_p + r * I, I);
      });
      h = linear(act, L.down);
    }
    if (final_norm.has_value()) {
      TORCH_CHECK(final_norm->scalar_type() == dtype_ && final_norm->is_contiguous() &&
                      final_norm->numel() == H,
                  "final_norm must be a contiguous [hidden_size] tensor of the stack's dtype");
      at::Tensor out = at::empty({M, H}, hidden.options());
      add_and_norm<T>(h, res, out, *final_norm, have_residual);
      return std::make_tuple(out, res);
    }
    return std::make_tuple(h, res);
  }

  // res += h (res = h when there is none yet); x = rmsnorm(res) * w, row by row
  template <typename T>
  void add_and_norm(const at::Tensor& h, at::Tensor& res, at::Tensor& x, const at::Tensor& w,
                    bool have_residual) {
    TORCH_CHECK(h.is_contiguous() && h.scalar_type() == dtype_, "a layer's output changed dtype");
    const int64_t M = h.size(0), H = h.size(1);
    const T *hp = h.data_ptr<T>(), *wp = w.data_ptr<T>();
    T *rp = res.data_ptr<T>(), *xp = x.data_ptr<T>();
    for_rows(M, H, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        llmctl_layers::add_rms_norm_row<T>(hp + r * H, rp + r * H, have_residual, wp, xp + r * H,
                                           H, eps_);
    });
  }

  at::Tensor part_mm(const at::Tensor& x, const Part& p) {
    if (p.bits == 4 || p.bits == 8) {
      const int64_t M = x.size(0);
      const std::optional<at::Tensor> zeros =
          p.bits == 4 ? std::optional<at::Tensor>(p.zeros) : std::nullopt;
      if (tile_from_ > 0 && x.scalar_type() == at::kBFloat16 && M > tile_from_)
        return tiled_->call(x, p.q, p.scales, zeros, p.bits, p.group, p.tile_rows);
      if (f32_tile_from_ > 0 && x.scalar_type() == at::kFloat && M > f32_tile_from_) {
        if (p.int8_act && int8_from_ > 0 && M >= int8_from_)
          return int8_act_->call(x, p.q, p.scales, p.zeros, p.group);
        return tiled_->call(x, p.q, p.scales, zeros, p.bits, p.group, p.f32_tile_rows);
      }
      if (p.bits == 4) return int4_->call(x, p.q, p.scales, p.zeros, p.group);
      return int8_->call(x, p.q, p.scales, p.group);
    }
    if (p.bits == -1) {  // linear.py's prepacked float weight: mkldnn::_linear_pointwise
      torch::jit::Stack stack{x, p.q, c10::IValue(), std::string("none"),
                              c10::List<std::optional<c10::Scalar>>(), std::string("")};
      mkldnn_linear_->callBoxed(&stack);
      return stack[0].toTensor();
    }
    return at::mm(x, p.q.t());
  }

  at::Tensor linear(const at::Tensor& x, const Linear& lin) {
    at::Tensor y;
    if (lin.parts.size() == 1) {
      y = part_mm(x, lin.parts[0]);
    } else {
      std::vector<at::Tensor> outs;
      for (const auto& p : lin.parts) outs.push_back(part_mm(x, p));
      y = at::cat(outs, 1);
    }
    if (lin.bias.defined()) y.add_(lin.bias);
    return y;
  }

  float eps_;
  double scale_;
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0, tile_from_ = 0;
  int64_t f32_tile_from_ = 0, int8_from_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  at::Tensor cos_, sin_;
  std::vector<Layer> layers_;
  std::optional<c10::TypedOperatorHandle<Int4Mm>> int4_;
  std::optional<c10::TypedOperatorHandle<Int8Mm>> int8_;
  std::optional<c10::TypedOperatorHandle<Int8ActMm>> int8_act_;
  std::optional<c10::TypedOperatorHandle<TiledMm>> tiled_;
  std::optional<c10::TypedOperatorHandle<PagedAttention>> attention_;
  std::optional<c10::OperatorHandle> mkldnn_linear_;
};

}  // namespace

// TORCH_LIBRARY pastes its namespace argument: expand LLMCTL_OP_NAMESPACE first.
#define LLMCTL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

LLMCTL_LIBRARY(LLMCTL_OP_NAMESPACE, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double,
                       std::vector<std::string>>())
      .def("forward", &DecodeStack::forward)
      .def("num_layers", &DecodeStack::num_layers);
}
