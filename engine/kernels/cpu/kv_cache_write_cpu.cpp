// A step's new keys and values into their slots of the paged KV cache on the CPU: one row copy
// per token and KV cache, rows split across threads. index_copy_ did the same at ~4 GB/s (0.78 ms
// for each of the 8192 rows of a 16 x 512-token SmolLM2 prefill, twice a layer, on the Intel AMX
// kind); the copies run at memory speed. Built into the paged attention extension.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_paged_attention
#endif

namespace {

// key_cache, value_cache: contiguous [num_blocks, block_size, kv_heads, head_dim]; k, v:
// [tokens, kv_heads, head_dim] of the caches' dtype, each token's heads contiguous (any token
// stride); slot_mapping: [tokens] int64, a negative slot (padding) is not written.
void write_kv_cache(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache and value_cache: contiguous [num_blocks, block_size, kv_heads, head_dim]"
              " of one dtype");
  const int64_t heads = key_cache.size(2), D = key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const at::Tensor slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slot_mapping: int64 [tokens]");
  const int64_t tokens = slots.numel();
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) == heads && x->size(2) == D &&
                    x->stride(2) == 1 && x->stride(1) == D &&
                    x->scalar_type() == key_cache.scalar_type(),
                "k and v: [tokens, kv_heads, head_dim] of the caches' dtype, each token's heads "
                "contiguous");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " is outside the KV cache (", num_slots,
                " slots)");
  const int64_t row = heads * D * static_cast<int64_t>(key_cache.element_size());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size();
  const int64_t v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, row)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       if (sp[t] < 0) continue;
                       std::memcpy(kc + sp[t] * row, kp + t * k_stride, row);
                       std::memcpy(vc + sp[t] * row, vp + t * v_stride, row);
                     }
                   });
}

}  // namespace

#define LLMCTL_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY_FRAGMENT(LLMCTL_OP_NAMESPACE, m) {
  m.def(
      "write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, "
      "Tensor slot_mapping) -> ()");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
