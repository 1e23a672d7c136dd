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
// each int4 or int8 packed (quantization/kernels.py's PackedLinearWeight) or float32 [N, K].

#include <ATen/ATen.h>
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

#if defined(__AVX2__) && defined(__FMA__)
#define LLMCTL_FD_AVX2 1
#include <immintrin.h>
// SLEEF's exp with 1-ulp error, as linked into libtorch_cpu: the one ATen's vectorised silu calls.
extern "C" __m256 Sleef_expf8_u10avx2(__m256);
#endif

namespace {

using Int4Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, int64_t);
using Int8Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using PagedAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, double,
                                  std::optional<int64_t>, const std::optional<at::Tensor>&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Sig>();
}

struct Part {
  int64_t bits = 0;  // 4, 8; 0: a float32 [N, K] weight in q; -1: oneDNN's prepacked weight
  int64_t group = 0;
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

// gu: [M, 2 I] as [gate | up] -> silu(gate) * up: [M, I], silu(g) = g / (1 + exp(-g)) as ATen's
// silu computes it. With AVX2 a plain loop on the same SLEEF exp (the same bits): at::silu and
// mul_ (two TensorIterators and an allocation) took ~11 us a layer for SmolLM2's 1536 columns,
// the loop 2 us. Elsewhere (no AVX2, or another architecture) ATen's own vectorised ops.
at::Tensor silu_and_mul(const at::Tensor& gu) {
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
#if defined(LLMCTL_FD_AVX2)
  TORCH_CHECK(gu.is_contiguous(), "silu_and_mul: gu must be contiguous");
  at::Tensor act = at::empty({M, I}, gu.options());
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  auto eight = [&](const float* g8, const float* u8, float* o8) {
    const __m256 g = _mm256_loadu_ps(g8);
    const __m256 e = Sleef_expf8_u10avx2(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(o8, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                       _mm256_loadu_ps(u8)));
  };
  for (int64_t r = 0; r < M; ++r) {
    const float* gate = gu.data_ptr<float>() + r * 2 * I;
    const float* up = gate + I;
    float* o = act.data_ptr<float>() + r * I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) eight(gate + i, up + i, o + i);
    if (i < I) {  // the tail through the same vector code, as ATen does it
      float g8[8] = {}, u8[8] = {}, o8[8];
      std::copy(gate + i, gate + I, g8);
      std::copy(up + i, up + I, u8);
      eight(g8, u8, o8);
      std::copy(o8, o8 + (I - i), o + i);
    }
  }
  return act;
#else
  at::Tensor act = at::silu(gu.narrow(1, 0, I));
  return act.mul_(gu.narrow(1, I, I));
#endif
}

// x[M, H] -> w * (x * rsqrt(mean(x^2) + eps)), row by row (RMSNorm as layernorm.py computes it)
void rmsnorm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps,
                  int64_t x_stride, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    float ss = 0.f;
    int64_t i = 0;
#if defined(LLMCTL_FD_AVX2)
    // 8 partial sums of squares (one chain of n adds was ~1 us a norm at n = 576)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (float lane : lanes) ss += lane;
#endif
    for (; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (i = 0; i < n; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  // tensors: cos_cache, sin_cache, then per layer: input_norm, post_norm, kv_cache, then for
  //   qkv, o, gate_up, down: per part q, scales, zeros (an empty tensor when none), then the
  //   bias when it has one.
  // meta: num_layers, num_heads, num_kv_heads, head_dim, then per layer and linear:
  //   num_parts, has_bias, then per part: bits, group.
  // ops: the qualified names of int4_group_mm, int8_group_mm and paged_decode_attention.
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> meta, double eps,
              double scale, std::string int4_op, std::string int8_op, std::string attention_op)
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
    cos_ = next_t().contiguous();
    sin_ = next_t().contiguous();
    const int64_t num_layers = next_m();
    num_heads_ = next_m();
    num_kv_heads_ = next_m();
    head_dim_ = next_m();
    auto read_linear = [&]() {
      Linear lin;
      const int64_t num_parts = next_m();
      const bool has_bias = next_m() != 0;
      for (int64_t p = 0; p < num_parts; ++p) {
        Part part;
        part.bits = next_m();
        part.group = next_m();
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
      TORCH_CHECK(layer.kv_cache.dim() == 5 && layer.kv_cache.is_contiguous() &&
                      layer.kv_cache.scalar_type() == at::kFloat,
                  "DecodeStack: a KV cache must be a contiguous float32 [2, blocks, block_size, "
                  "kv_heads, head_dim] tensor");
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
    if (!int4_op.empty()) int4_ = find_op<Int4Mm>(int4_op);
    if (!int8_op.empty()) int8_ = find_op<Int8Mm>(int8_op);
    attention_ = find_op<PagedAttention>(attention_op);
  }

  // hidden: [M, H] float32; residual: [M, H] or None at the model's first layer; positions,
  // slot_mapping: [M] int64; block_tables [M, width], seq_lens [M]: the decode attention's.
  // Returns (the last MLP's output, the residual), as LlamaModel's layer loop leaves them; with
  // final_norm (the model's last stage) the first is rmsnorm(residual + that output) * final_norm,
  // the model's output, and the residual includes it.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor hidden, std::optional<at::Tensor> residual,
                                             at::Tensor positions, at::Tensor slot_mapping,
                                             at::Tensor block_tables, at::Tensor seq_lens,
                                             std::optional<int64_t> sliding_window,
                                             std::optional<at::Tensor> final_norm) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat,
                "hidden must be float32 [num_tokens, hidden_size]");
    const int64_t M = hidden.size(0), H = hidden.size(1);
    const int64_t D = head_dim_, half = D / 2;
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
      add_and_norm(h, res, x, L.input_norm, have_residual);
      have_residual = true;
      at::Tensor qkv = linear(x, L.qkv);  // [M, q + 2 kv]
      float* qkv_p = qkv.data_ptr<float>();
      const int64_t ld = qkv.size(1);
      // RoPE, "rotate half": x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
      for (int64_t r = 0; r < M; ++r) {
        const float* c = cos_p + pos_p[r] * rope_width;
        const float* s = sin_p + pos_p[r] * rope_width;
        float* row = qkv_p + r * ld;
        for (int64_t head = 0; head < num_heads_ + num_kv_heads_; ++head) {
          float* v = row + head * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] + (-x2) * s[i];
            v[i + half] = x2 * c[i + half] + x1 * s[i + half];
          }
        }
      }
      // The new token's key and value into its slot of the paged cache.
      const at::Tensor& key_cache = L.key_cache;
      const at::Tensor& value_cache = L.value_cache;
      float* kc = key_cache.data_ptr<float>();
      float* vc = value_cache.data_ptr<float>();
      const int64_t slot_stride = num_kv_heads_ * D;  // [num_blocks * block_size, kvh, D] rows
      for (int64_t r = 0; r < M; ++r) {
        if (slot_p[r] < 0) continue;
        const float* row = qkv_p + r * ld;
        std::copy(row + q_size, row + q_size + kv_size, kc + slot_p[r] * slot_stride);
        std::copy(row + q_size + kv_size, row + q_size + 2 * kv_size,
                  vc + slot_p[r] * slot_stride);
      }
      at::Tensor q = qkv.narrow(1, 0, q_size).contiguous().view({M, num_heads_, D});
      at::Tensor attn =
          attention_->call(q, key_cache, value_cache, block_tables, seq_lens, scale_,
                          sliding_window, std::nullopt)
              .view({M, q_size});
      at::Tensor o = linear(attn, L.o);
      add_and_norm(o, res, x, L.post_norm, true);
      at::Tensor gu = linear(x, L.gate_up);  // [M, 2 I] as [gate | up]
      h = linear(silu_and_mul(gu), L.down);
    }
    if (final_norm.has_value()) {
      TORCH_CHECK(final_norm->scalar_type() == at::kFloat && final_norm->is_contiguous() &&
                      final_norm->numel() == H,
                  "final_norm must be a contiguous float32 [hidden_size] tensor");
      at::Tensor out = at::empty({M, H}, hidden.options());
      add_and_norm(h, res, out, *final_norm, have_residual);
      return std::make_tuple(out, res);
    }
    return std::make_tuple(h, res);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // res += h (res = h when there is none yet); x = rmsnorm(res) * w
  void add_and_norm(const at::Tensor& h, at::Tensor& res, at::Tensor& x, const at::Tensor& w,
                    bool have_residual) {
    const int64_t n = h.numel();
    const float* hp = h.data_ptr<float>();
    float* rp = res.data_ptr<float>();
    if (have_residual) {
      for (int64_t i = 0; i < n; ++i) rp[i] = hp[i] + rp[i];
    } else {
      std::copy(hp, hp + n, rp);
    }
    const int64_t H = h.size(1);
    rmsnorm_rows(rp, w.data_ptr<float>(), x.data_ptr<float>(), h.size(0), H, eps_, H, H);
  }

  at::Tensor part_mm(const at::Tensor& x, const Part& p) {
    if (p.bits == 4) return int4_->call(x, p.q, p.scales, p.zeros, p.group);
    if (p.bits == 8) return int8_->call(x, p.q, p.scales, p.group);
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
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  at::Tensor cos_, sin_;
  std::vector<Layer> layers_;
  std::optional<c10::TypedOperatorHandle<Int4Mm>> int4_;
  std::optional<c10::TypedOperatorHandle<Int8Mm>> int8_;
  std::optional<c10::TypedOperatorHandle<PagedAttention>> attention_;
  std::optional<c10::OperatorHandle> mkldnn_linear_;
};

}  // namespace

// TORCH_LIBRARY pastes its namespace argument: expand LLMCTL_OP_NAMESPACE first.
#define LLMCTL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

LLMCTL_LIBRARY(LLMCTL_OP_NAMESPACE, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double, double, std::string,
                       std::string, std::string>())
      .def("forward", &DecodeStack::forward)
      .def("num_layers", &DecodeStack::num_layers);
}
