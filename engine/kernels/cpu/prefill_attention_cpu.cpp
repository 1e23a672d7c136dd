// Causal prefill attention on the CPU in bfloat16 with oneDNN's brgemm (torch's cpublas::brgemm:
// AMX tiles where the CPU has them, AVX512-BF16 dot products otherwise), for the prefill chunks
// of a step that start a sequence (no cached context, no sliding window inside the chunk, no
// sinks): prefill_attention.py sends the others to scaled_dot_product_attention.
//
// For a chunk of L tokens and a KV head h shared by G query heads, the keys and values are laid
// out once in the VNNI pairs brgemm's B operand takes (K^T: a 32-bit word per (d pair, key);
// V: a word per (key pair, d)), zero-padded to a multiple of 32 keys. A task is (chunk, KV head,
// block of BQ queries): its G x BQ query rows (all G heads of the group read the same keys, so
// one GEMM serves them) times K^T for the keys [0, last query], in blocks of kKeyBlock, an online
// softmax per row (flash attention's running max and sum), P rounded to bfloat16, then P V added
// into a float32 accumulator; the output is acc / sum, rounded once. Tasks run largest first
// (the last query blocks see the most keys), taken from a shared counter.
//
// torch's own kernel (scaled_dot_product_attention's flash attention for the CPU) runs one query
// head at a time with SLEEF's exp: on SmolLM2's 16 x 512-token prefill (9 heads, 3 KV heads,
// head_dim 64) on the Intel AMX kind it took 0.9 ms a sequence and layer, half of it in its exp and
// softmax loops (perf). Here the exp is a degree-6 polynomial after a range reduction (a few ulp
// in float32; P is then rounded to bfloat16's 8 bits, as torch's is).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMCTL_PREFILL_BF16 1
#include <immintrin.h>
#endif

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_paged_attention
#endif

namespace {

constexpr int64_t kMaxHeadDim = 256;

#if defined(LLMCTL_PREFILL_BF16)

using Bf16 = c10::BFloat16;
constexpr int64_t kQueryBlock = 64;   // queries of one head per task (times G heads: the rows)
constexpr int64_t kKeyBlock = 512;    // keys per S block
constexpr int64_t kKeyAlign = 32;     // keys are padded to this (brgemm's K for P V)

// exp(x) for x <= 0 (a score minus its row's maximum): 2^n e^r with r = x - n ln 2 in
// [-ln2/2, ln2/2], e^r by its Taylor polynomial to r^6 (relative error < 2e-7 there). Below
// -87.3 (e^x under float32's normal range) the result is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);         // and the rest
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(live, p, n);
}

// float32 -> bfloat16, nearest even (no NaN reaches here: scores are finite)
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// One chunk's keys and values of one KV head in brgemm's VNNI layouts, Lp = L padded to kKeyAlign.
//   kt[p][j] = the word (K[j][2p], K[j][2p + 1]): B of S = Q K^T, [D / 2][Lp] words
//   vp[j / 2][d] = the word (V[j][d], V[j + 1][d]): B of P V, [Lp / 2][D] words
void pack_kv(const Bf16* k, int64_t k_stride, const Bf16* v, int64_t v_stride, int64_t L,
             int64_t Lp, int64_t D, uint32_t* kt, uint32_t* vp) {
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  for (int64_t p = 0; p < D / 2; ++p) {  // written in order; the L rows' words stay cached
    uint32_t* out = kt + p * Lp;
    for (int64_t j = 0; j < L; ++j) std::memcpy(out + j, kb + j * k_stride + 2 * p, 4);
    std::fill(out + L, out + Lp, 0u);
  }
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
  for (int64_t j = 0; j < Lp; j += 2) {
    uint32_t* out = vp + (j / 2) * D;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t lo = j < L ? vb[j * v_stride + d] : 0u;
      const uint32_t hi = j + 1 < L ? vb[(j + 1) * v_stride + d] : 0u;
      out[d] = lo | (hi << 16);
    }
  }
}

struct Chunk {
  int64_t start, len, padded;
  size_t packed;  // offset of its packed K and V (per KV head: D * padded words each)
};

struct Task {
  int64_t chunk, head, q0;
  int64_t keys() const { return q0; }  // cost order: later query blocks see more keys
};

struct Scratch {
  int64_t rows, D;
  std::unique_ptr<Bf16[]> a, p;
  std::unique_ptr<float[]> s, acc, m, l;
  Scratch(int64_t rows_, int64_t D_)
      : rows(rows_), D(D_), a(new Bf16[rows_ * D_]), p(new Bf16[rows_ * kKeyBlock]),
        s(new float[rows_ * kKeyBlock]), acc(new float[rows_ * D_]), m(new float[rows_]),
        l(new float[rows_]) {}
};

// Rows r = g * nq + i: query token q0 + i of query head head * G + g.
void run_task(const Task& t, const Chunk& c, const Bf16* q, int64_t q_stride, Bf16* out,
              int64_t out_stride, const uint32_t* packed, int64_t G, int64_t D, float scale,
              Scratch& w) {
  const int64_t nq = std::min(kQueryBlock, c.len - t.q0), rows = G * nq;
  const int64_t last = t.q0 + nq - 1;  // the last query's position: keys [0, last]
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < nq; ++i)
      std::memcpy(w.a.get() + (g * nq + i) * D,
                  q + (c.start + t.q0 + i) * q_stride + (t.head * G + g) * D, D * sizeof(Bf16));
  const uint32_t* kt = packed + c.packed + t.head * D * c.padded;  // pack_kv's K^T, then V
  const uint32_t* vp = kt + (D / 2) * c.padded;
  std::fill(w.acc.get(), w.acc.get() + rows * D, 0.f);
  std::fill(w.m.get(), w.m.get() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.l.get(), w.l.get() + rows, 0.f);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t n0 = 0; n0 <= last; n0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, last + 1 - n0);
    const int64_t nkp = (nk + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
    at::native::cpublas::brgemm(rows, nkp, D, D, c.padded, kKeyBlock, false, w.a.get(),
                                reinterpret_cast<const Bf16*>(kt) + 2 * n0, w.s.get(), true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = t.q0 + r % nq;
      const int64_t valid = std::min(nk, pos + 1 - n0);  // keys n0 .. pos: >= 1 here
      float* s = w.s.get() + r * kKeyBlock;
      Bf16* p = w.p.get() + r * kKeyBlock;
      if (valid <= 0) {  // a block past this row's position: nothing to add
        std::memset(p, 0, nkp * sizeof(Bf16));
        continue;
      }
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + 16 <= valid; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
      const __mmask16 tail = static_cast<__mmask16>((1u << (valid - j)) - 1u);
      mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + j));
      const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(mx) * scale);
      const float alpha = std::exp(w.m[r] - m_new);  // 0 at the first block
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (j = 0; j < valid; j += 16) {
        const int64_t left = valid - j;
        const __mmask16 live =
            left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(
            live, exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vm)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), to_bf16(e));
      }
      std::memset(p + j, 0, (nkp - j) * sizeof(Bf16));  // the keys past this row's position
      w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
      w.m[r] = m_new;
      if (alpha != 1.f) {
        float* acc = w.acc.get() + r * D;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), va));
      }
    }
    at::native::cpublas::brgemm(rows, D, nkp, kKeyBlock, D, D, true, w.p.get(),
                                reinterpret_cast<const Bf16*>(vp) + n0 * D, w.acc.get(), true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / nq, i = r % nq;
    Bf16* o = out + (c.start + t.q0 + i) * out_stride + (t.head * G + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    const float* acc = w.acc.get() + r * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + d), inv)));
  }
}

#endif  // LLMCTL_PREFILL_BF16

bool available() {
#if defined(LLMCTL_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

// q: [tokens, heads, D]; k, v: [tokens, kv_heads, D] (each token's heads contiguous, any token
// stride); out: [tokens, heads, D], contiguous. starts, lens: the chunks' first token and length;
// each chunk is a sequence's first tokens (causal from position 0). Writes the chunks' rows of out.
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, at::IntArrayRef starts, at::IntArrayRef lens,
                       double scale) {
  TORCH_CHECK(available(), "prefill_attention: built without AVX512-BF16 (use SDPA)");
  TORCH_CHECK(starts.size() == lens.size(), "one start per chunk length");
  const int64_t D = q.dim() == 3 ? q.size(2) : 0;
  for (const at::Tensor* x : {&q, &k, &v, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kBFloat16 && x->size(2) == D &&
                    x->stride(2) == 1 && x->stride(1) == D && x->size(0) == q.size(0),
                "q, k, v and out must be bfloat16 [tokens, heads, head_dim] with each token's "
                "heads contiguous");
  }
  TORCH_CHECK(D % 32 == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(k.sizes() == v.sizes() && out.sizes() == q.sizes() && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "k and v: [tokens, kv_heads, head_dim] with kv_heads dividing q's heads");
  for (size_t i = 0; i < starts.size(); ++i)
    TORCH_CHECK(starts[i] >= 0 && lens[i] > 0 && starts[i] + lens[i] <= q.size(0),
                "chunk ", i, " (start ", starts[i], ", length ", lens[i], ") is outside q");
#if defined(LLMCTL_PREFILL_BF16)
  const int64_t Hkv = k.size(1), G = q.size(1) / Hkv;
  std::vector<Chunk> chunks;
  size_t words = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t padded = (lens[i] + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
    chunks.push_back({starts[i], lens[i], padded, words});
    words += static_cast<size_t>(Hkv * D * padded);  // K^T and V: D / 2 * padded words each
  }
  std::unique_ptr<uint32_t[]> packed(new uint32_t[words]);
  const auto* qp = q.data_ptr<Bf16>();
  const auto* kp = k.data_ptr<Bf16>();
  const auto* vp = v.data_ptr<Bf16>();
  auto* op = out.data_ptr<Bf16>();
  const int64_t C = static_cast<int64_t>(chunks.size());
  at::parallel_for(0, C * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i / Hkv];
      const int64_t h = i % Hkv;
      uint32_t* kt = packed.get() + c.packed + h * D * c.padded;
      pack_kv(kp + c.start * k.stride(0) + h * D, k.stride(0), vp + c.start * v.stride(0) + h * D,
              v.stride(0), c.len, c.padded, D, kt, kt + (D / 2) * c.padded);
    }
  });
  std::vector<Task> tasks;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t q0 = 0; q0 < chunks[c].len; q0 += kQueryBlock) tasks.push_back({c, h, q0});
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys() > b.keys(); });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1,
                   [&](int64_t begin, int64_t end) {
                     Scratch w(G * kQueryBlock, D);
                     for (int64_t i; (i = next.fetch_add(1)) < n;) {
                       const Task& t = tasks[i];
                       run_task(t, chunks[t.chunk], qp, q.stride(0), op, out.stride(0),
                                packed.get(), G, D, fscale, w);
                     }
                     at::native::cpublas::brgemm_release(true);
                   });
#endif
}

}  // namespace

#define LLMCTL_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY_FRAGMENT(LLMCTL_OP_NAMESPACE, m) {
  m.def("prefill_attention_available() -> bool", &available);
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, "
      "int[] lens, float scale) -> ()");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
