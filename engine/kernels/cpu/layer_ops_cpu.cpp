// The elementwise parts of a Llama-family layer as torch ops for the module path on the CPU
// (layers/layernorm.py, rotary_embedding.py, activation.py call them through layer_ops.py):
// RMSNorm (with the residual add), RoPE and SiLU-and-mul, in float32 or bfloat16, one pass over
// each row with the row routines of layer_ops_cpu.h, rows split across threads; and the greedy
// sampler's argmax over float32 logits (torch's took ~7 ms for 64 rows of SmolLM2's 49152 on one
// thread of the Intel AMX machine, a scalar compare a value; one vectorised pass here).
//
// In torch each is several ops (RMSNorm: add, to float, pow, mean, add, rsqrt, mul, to bfloat16,
// mul), each a pass over the activations and, in bfloat16, a conversion each way: half of a
// 16 x 512-token bfloat16 prefill of SmolLM2 went to them on the Intel AMX machine, the matmuls a
// third. Compiled into the fused decode extension (its op namespace).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "layer_ops_cpu.h"

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_fused_decode
#endif

namespace {

using llmctl_layers::BFloat16;
using llmctl_layers::widen;

constexpr int64_t kGrainValues = 1 << 15;  // values per task: a small batch stays on one thread

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, " must be a contiguous float32 or bfloat16 [rows, n] tensor");
}

template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(1, width)), f);
}

template <typename T>
void norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps,
               at::Tensor& res_out, at::Tensor& out) {
  const int64_t M = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* res = res_out.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for_rows(M, H, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (rp != nullptr) std::copy(rp + r * H, rp + (r + 1) * H, res + r * H);
      llmctl_layers::add_rms_norm_row<T>(xp + r * H, res + r * H, rp != nullptr, wp, o + r * H, H,
                                         static_cast<float>(eps));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, at::Tensor* residual,
                                        const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous [hidden_size] tensor of x's dtype");
  if (residual != nullptr) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must be shaped like x, of its dtype");
  }
  at::Tensor res = at::empty_like(x), out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<BFloat16>(x, residual, weight, eps, res, out);
  } else {
    norm_rows<float>(x, residual, weight, eps, res, out);
  }
  return {out, res};
}

// x: [rows, hidden] -> weight * norm(x)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, nullptr, weight, eps));
}

// (norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  at::Tensor r = residual;
  return norm(x, &r, weight, eps);
}

// Rotates each token's heads of x in place (token stride x.stride(0)).
template <typename T>
void rope_heads(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos,
                const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), width = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* xp = x.data_ptr<T>();
  for_rows(tokens, heads * D, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      llmctl_layers::rope_row<T>(xp + t * x.stride(0), heads, D,
                                 cos.data_ptr<float>() + pos[t] * width,
                                 sin.data_ptr<float>() + pos[t] * width);
  });
}

// q: [tokens, heads, D], k: [tokens, kv_heads, D] (each token's heads contiguous, any token
// stride: views into the QKV projection's output); positions: [tokens] int64; cos_cache,
// sin_cache: float32 [max_position, D]. Rotates q and k in place (a copy of each, as the op
// before this did, cost a quarter of its time in a 16 x 512-token prefill).
void rotary_embedding_(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                       const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && cos_cache.is_contiguous() &&
                  sin_cache.sizes() == cos_cache.sizes() && sin_cache.is_contiguous() &&
                  sin_cache.scalar_type() == at::kFloat,
              "cos_cache and sin_cache must be contiguous float32 [max_position, head_dim]");
  const at::Tensor pos = positions.contiguous();
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.numel() == q.size(0),
              "one int64 position per token");
  const int64_t D = cos_cache.size(1);
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->size(2) == D && x->stride(2) == 1 && x->stride(1) == D &&
                    x->size(0) == pos.numel() && x->scalar_type() == q.scalar_type() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                "q and k must be float32 or bfloat16 [tokens, heads, head_dim] with each "
                "token's heads contiguous");
  }
  TORCH_CHECK(D % 2 == 0 && D <= llmctl_layers::kMaxHeadDim, "head_dim must be even, <= 512");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)  // the rows below are indexed with these
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos_cache.size(0), "position ", pp[t],
                " is outside the rotary table (", cos_cache.size(0), " positions)");
  if (q.scalar_type() == at::kBFloat16) {
    rope_heads<BFloat16>(pos, q, cos_cache, sin_cache);
    rope_heads<BFloat16>(pos, k, cos_cache, sin_cache);
  } else {
    rope_heads<float>(pos, q, cos_cache, sin_cache);
    rope_heads<float>(pos, k, cos_cache, sin_cache);
  }
}

// torch.argmax's rule one value at a time: the first NaN, else the first of the largest.
template <typename T>
int64_t argmax_scalar(const T* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(widen(x[i]))) return i;
    if (widen(x[i]) > widen(x[best])) best = i;
  }
  return best;
}

template <typename T>
void silu_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t M = x.size(0), I = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for_rows(M, 2 * I, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      llmctl_layers::silu_mul_row<T>(xp + r * 2 * I, xp + r * 2 * I + I, op + r * I, I);
  });
}

// x: [rows, 2 I] as [gate | up] -> silu(gate) * up: [rows, I]
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold [gate | up]: an even number of columns");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_rows<BFloat16>(x, out);
  } else {
    silu_rows<float>(x, out);
  }
  return out;
}

// The first index of row r's largest value (a NaN counting as the largest, as torch.argmax).
// bfloat16 rows are read as the float32 values they hold (widen, load16: exact), the answer
// float32 logits would give.
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(LLMCTL_LAYERS_AVX512)
  __m512 m = _mm512_set1_ps(best);
  __mmask16 nan = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = llmctl_layers::load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  if (nan) return argmax_scalar(x, V);
  best = _mm512_reduce_max_ps(m);
#endif
  for (int64_t j = i; j < V; ++j) {
    if (std::isnan(widen(x[j]))) return argmax_scalar(x, V);
    best = std::max(best, widen(x[j]));
  }
  i = 0;  // the first index holding it (a second pass, over a row still in cache)
#if defined(LLMCTL_LAYERS_AVX512)
  const __m512 b = _mm512_set1_ps(best);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(llmctl_layers::load16(x + i), b, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < V; ++i)
    if (widen(x[i]) == best) return i;
  return 0;  // a row of -inf only
}

// x: [rows, V] float32 or bfloat16 -> [rows] int64: torch.argmax(x, dim=-1), a vectorised pass
// per row. bfloat16 logits need no float32 copy first (64 rows of a 49152-token vocabulary:
// 12.6 MB written, ~2.6 ms of each SmolLM2 W2 decode step on the Intel AMX kind).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous float32 or bfloat16 [rows, vocab] tensor");
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](const auto* xp) {
    for_rows(M, V, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * V, V);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    run(x.data_ptr<BFloat16>());
  }
  return out;
}

}  // namespace

// TORCH_LIBRARY_FRAGMENT pastes its namespace argument: expand LLMCTL_OP_NAMESPACE first.
#define LLMCTL_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY_FRAGMENT(LLMCTL_OP_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
      "(Tensor, Tensor)");
  m.def(
      "rotary_embedding_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_cache, "
      "Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
