// Causal prefill attention on the CPU in bfloat16 with oneDNN's brgemm (torch's cpublas::brgemm:
// AMX tiles where the CPU has them, AVX512-BF16 dot products otherwise), and in float32 (f32
// below: any CPU with AVX2 and FMA), over the paged KV cache:
// a chunk of a sequence's new tokens, after `context` tokens already cached (a prefix-cache hit,
// an earlier chunk) or none, within the layer's sliding window if it has one. The chunk's own keys
// and values are in the cache already (the backend writes them first). prefill_attention.py sends
// layers with sinks and odd head sizes to scaled_dot_product_attention instead.
//
// For a chunk and a KV head h shared by G query heads, the keys any of its queries sees are read
// once from the cache's blocks into the VNNI pairs brgemm's B operand takes (K^T: a 32-bit word
// per (d pair, key); V: a word per (key pair, d)), zero-padded. A task is (chunk, KV head, block
// of BQ queries): its G x BQ query rows (all G heads of the group read the same keys, so one GEMM
// serves them) times K^T for the keys the block sees, kKeyBlock at a time, an online softmax per
// row (flash attention's running max and sum) over the row's own interval of keys (causal, and
// windowed), P rounded to bfloat16, then P V added into a float32 accumulator; the output is
// acc / sum, rounded once. Tasks run largest first, taken from a shared counter. KV heads go in
// waves whose packed copies fit kMaxPackedBytes (every head at once below ~100K tokens of
// context for SmolLM2's shapes), so a long context's copy stays far below its KV cache.
//
// torch's own kernel (scaled_dot_product_attention's flash attention for the CPU) runs one query
// head at a time with SLEEF's exp: on SmolLM2's 16 x 512-token prefill (9 heads, 3 KV heads,
// head_dim 64) on the Intel AMX kind it took 0.9 ms a sequence and layer, half of it in its exp and
// softmax loops (perf); this kernel 0.56 ms (0.62-0.69 in an hour where its first version took
// 0.80-0.84, since packing went 16 keys at a time and S blocks to 256 keys). Its exp is the
// decode kernel's (exp_nonpositive.h, about 1 ulp; P is then rounded to bfloat16's 8 bits, as
// torch's is). A chunk after cached context went through a gather of its blocks and a masked SDPA
// before.

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
#include <optional>
#include <vector>

#include "exp_nonpositive.h"
#include "transpose16.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LLMCTL_PREFILL_F32 1
#include <immintrin.h>
#endif
#if defined(LLMCTL_PREFILL_F32) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__)
#define LLMCTL_PREFILL_BF16 1
#endif

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_paged_attention
#endif

namespace {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxPackedBytes = 64 << 20;  // packed K and V per wave of KV heads

#if defined(LLMCTL_PREFILL_F32)
struct Chunk {
  int64_t start, len, context;  // its first row in q and out, its tokens, the tokens before it
  const int64_t* table;         // its block table row
  int64_t first_key, padded;    // the earliest key any of its queries sees; packed key columns
  size_t packed;                // offset of its K and V in a KV head's slab, in packed words
};

struct Task {
  int64_t chunk, head, q0, cost;
};

// A row's running P V sums, times alpha when its running maximum grew (a plain loop: -O3
// vectorizes it for either flavour)
inline void rescale(float* acc, int64_t D, float alpha) {
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
}

// A task's query block: its queries, rows (G heads each), first query position, and the keys
// [lo, hi) that cover every row's (causal up to the last query, windowed from the first's),
// relative to the chunk's first_key
struct Block {
  int64_t nq, rows, pos0, lo, hi;
};

inline Block block_of(const Task& t, const Chunk& c, int64_t G, int64_t query_block,
                      int64_t window) {
  const int64_t nq = std::min(query_block, c.len - t.q0), pos0 = c.context + t.q0;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1 - c.first_key) : 0;
  return {nq, G * nq, pos0, lo, pos0 + nq - c.first_key};
}

// The block's query rows into a (row g * nq + i: token q0 + i of query head head * G + g), and
// its rows' running sums, maxima and denominators reset
template <typename T>
inline void start_block(const Task& t, const Chunk& c, const Block& b, const T* q,
                        int64_t q_stride, int64_t G, int64_t D, T* a, float* acc, float* m,
                        float* l) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < b.nq; ++i)
      std::memcpy(a + (g * b.nq + i) * D,
                  q + (c.start + t.q0 + i) * q_stride + (t.head * G + g) * D, D * sizeof(T));
  std::fill(acc, acc + b.rows * D, 0.f);
  std::fill(m, m + b.rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + b.rows, 0.f);
}

#endif  // LLMCTL_PREFILL_F32

#if defined(LLMCTL_PREFILL_BF16)

using Bf16 = c10::BFloat16;
constexpr int64_t kQueryBlock = 64;   // queries of one head per task (times G heads: the rows)
// Keys per S block: S is rows x kKeyBlock float32 (192 KiB for SmolLM2's 192 rows). 256 ran the
// 16 x 512-token prefill 3-10% faster than 512 or 128 (Intel AMX kind, A/B in one hour); query
// blocks of 128 were no faster than 64 and halve the tasks a short chunk splits into.
constexpr int64_t kKeyBlock = 256;
constexpr int64_t kKeyAlign = 32;     // keys are padded to this (brgemm's K for P V)


// float32 -> bfloat16, nearest even (no NaN reaches here: scores are finite)
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The paged cache of one layer: [num_blocks, block_size, kv_heads, D] rows of keys or values.
struct Cache {
  const Bf16* k;
  const Bf16* v;
  int64_t block_size, heads, D;
};

// Chunk c's keys [first_key, first_key + n) of KV head h in brgemm's VNNI layouts, zero-padded
// to `padded` keys:
//   kt[p][j] = the word (K[j][2p], K[j][2p + 1]): B of S = Q K^T, [D / 2][padded] words
//   vp[j / 2][d] = the word (V[j][d], V[j + 1][d]): B of P V, [padded / 2][D] words
// 16 keys at a time: K^T as 16 x 16 word transposes of their rows, V as two rows' values
// interleaved (a word per d). Key by key and word by word (a block lookup per word) this took
// ~15% of the kernel on SmolLM2's 16 x 512-token prefill.
void pack_kv(const Cache& cache, const Chunk& c, int64_t h, uint32_t* kt, uint32_t* vp) {
  const int64_t n = c.context + c.len - c.first_key, Lp = c.padded, D = cache.D, D2 = D / 2;
  auto row = [&](const Bf16* base, int64_t j) {  // key j of the chunk's packed range
    const int64_t key = c.first_key + j, bs = cache.block_size;
    const int64_t slot = c.table[key / bs] * bs + key % bs;
    return base + (slot * cache.heads + h) * D;
  };
  // (V[j][d], V[j + 1][d]) for d = d0 .. d0 + 15 (lo) and d0 + 16 .. d0 + 31 (hi)
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                   37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
    const Bf16* k[16];
    const Bf16* v[16];
    for (int64_t i = 0; i < 16; ++i) {
      k[i] = j0 + i < n ? row(cache.k, j0 + i) : nullptr;
      v[i] = j0 + i < n ? row(cache.v, j0 + i) : nullptr;
    }
    for (int64_t p0 = 0; p0 < D2; p0 += 16) {  // D is a multiple of 32
      __m512i w[16];
      for (int64_t i = 0; i < 16; ++i)
        w[i] = k[i] != nullptr ? _mm512_loadu_si512(k[i] + 2 * p0) : zero;
      llmctl_kernels::transpose16(w);  // w[i]: word p0 + i of the 16 keys
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (p0 + i) * Lp + j0, w[i]);
    }
    for (int64_t i = 0; i < 16; i += 2) {
      uint32_t* out = vp + ((j0 + i) / 2) * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i a = v[i] != nullptr ? _mm512_loadu_si512(v[i] + d) : zero;
        const __m512i b = v[i + 1] != nullptr ? _mm512_loadu_si512(v[i + 1] + d) : zero;
        _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
  }
}

struct Scratch {
  std::unique_ptr<Bf16[]> a, p;
  std::unique_ptr<float[]> s, acc, m, l;
  Scratch(int64_t rows, int64_t D)
      : a(new Bf16[rows * D]), p(new Bf16[rows * kKeyBlock]), s(new float[rows * kKeyBlock]),
        acc(new float[rows * D]), m(new float[rows]), l(new float[rows]) {}
};

inline __mmask16 lanes(int64_t from, int64_t to, int64_t j) {  // lanes j + i in [from, to)
  const int64_t lo = std::max<int64_t>(0, from - j), hi = std::min<int64_t>(16, to - j);
  if (hi <= lo) return 0;
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// f(j, mask) for the 16-lane vectors from a's down to b's, mask the lanes j + i in [a, b): the
// whole vectors between without computing one (with lanes() for every vector the kernel took ~5%
// longer on SmolLM2's 16 x 512-token prefill: 0.75 against 0.70 ms a sequence and layer, Intel AMX
// kind, 4 rounds taking turns). Returns the end of the last vector.
template <typename F>
inline int64_t for_lanes(int64_t a, int64_t b, F&& f) {
  int64_t j = a & ~int64_t(15);
  if (j < a) {  // the vector holding a, partial
    f(j, lanes(a, b, j));
    j += 16;
  }
  for (; j + 16 <= b; j += 16) f(j, static_cast<__mmask16>(0xFFFF));
  if (j < b) {
    f(j, lanes(a, b, j));
    j += 16;
  }
  return j;
}

// The block's key blocks and output, its queries in w.a and its running sums reset (start_block,
// by the driver). Rows r = g * nq + i: query token q0 + i of the chunk (position context + q0 +
// i) of query head head * G + g. Key indices below are relative to the chunk's first_key.
void run_task(const Task& t, const Chunk& c, const Block& blk, Bf16* out, int64_t out_stride,
              const uint32_t* packed, int64_t G, int64_t D, float scale, int64_t window,
              Scratch& w) {
  const int64_t nq = blk.nq, rows = blk.rows, pos0 = blk.pos0, lo = blk.lo, hi = blk.hi;
  const uint32_t* kt = packed + c.packed;  // pack_kv's K^T, then V (of the task's KV head)
  const uint32_t* vp = kt + (D / 2) * c.padded;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t n0 = lo & ~int64_t(1); n0 < hi; n0 += kKeyBlock) {  // even: V's key pairs
    const int64_t nk = std::min(kKeyBlock, hi - n0);
    const int64_t nkp = (nk + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
    at::native::cpublas::brgemm(rows, nkp, D, D, c.padded, kKeyBlock, false, w.a.get(),
                                reinterpret_cast<const Bf16*>(kt) + 2 * n0, w.s.get(), true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos0 + r % nq;
      // this row's keys in the block: [a, b), block-relative
      const int64_t row_lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t a = std::max(row_lo - c.first_key, n0) - n0;
      const int64_t b = std::min(pos + 1 - c.first_key, n0 + nk) - n0;
      float* s = w.s.get() + r * kKeyBlock;
      Bf16* p = w.p.get() + r * kKeyBlock;
      if (a >= b) {  // none in this block
        std::memset(p, 0, nkp * sizeof(Bf16));
        continue;
      }
      const int64_t j0 = a & ~int64_t(15);
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for_lanes(a, b, [&](int64_t j, __mmask16 m) {
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(s + j));
      });
      const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(mx) * scale);
      const float alpha = std::exp(w.m[r] - m_new);  // 0 at the row's first block
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      std::memset(p, 0, j0 * sizeof(Bf16));
      const int64_t j = for_lanes(a, b, [&](int64_t j, __mmask16 m) {
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vm);
        const __m512 e = _mm512_maskz_mov_ps(m, llmctl_attention::exp_nonpositive(x));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), to_bf16(e));
      });
      std::memset(p + j, 0, (nkp - j) * sizeof(Bf16));  // the keys past this row's position
      w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(sum);
      w.m[r] = m_new;
      if (alpha != 1.f) rescale(w.acc.get() + r * D, D, alpha);
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

#if defined(LLMCTL_PREFILL_F32)
// The float32 flavour (any CPU with AVX2 and FMA; the float32 layers of the AVX2 path, and of
// dtype="float32" elsewhere): the same tasks, keys read once a chunk and KV head, online softmax
// over blocks of kKeyBlock keys, but P stays float32 and both products are oneDNN's float32
// brgemm (torch's cpublas), whose B operands are plain rows: K^T as [D][padded], V as
// [padded][D]. torch's scaled_dot_product_attention for the CPU computes every key of a
// 512-key block for a causal 512-token prompt (its kv split is 512 there), one query head at a
// time; here a task's G heads share one product and a block of queries stops at its last key.
namespace f32 {

constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 256;

struct Cache {
  const float* k;
  const float* v;
  int64_t block_size, heads, D;
};

// r[i][j] <- r[j][i], 8 x 8 float32
inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Chunk c's keys [first_key, first_key + n) of KV head h, zero-padded to `padded` keys (a
// multiple of 8): kt = K^T [D][padded], the B of S = Q K^T; vr = V [padded][D], the B of P V.
void pack_kv(const Cache& cache, const Chunk& c, int64_t h, float* kt, float* vr) {
  const int64_t n = c.context + c.len - c.first_key, Lp = c.padded, D = cache.D;
  auto row = [&](const float* base, int64_t j) {  // key j of the chunk's packed range
    const int64_t key = c.first_key + j, bs = cache.block_size;
    const int64_t slot = c.table[key / bs] * bs + key % bs;
    return base + (slot * cache.heads + h) * D;
  };
  for (int64_t j0 = 0; j0 < Lp; j0 += 8) {
    const float* k[8];
    for (int64_t i = 0; i < 8; ++i) {
      const bool in = j0 + i < n;
      k[i] = in ? row(cache.k, j0 + i) : nullptr;
      float* v = vr + (j0 + i) * D;
      if (in) {
        std::memcpy(v, row(cache.v, j0 + i), D * sizeof(float));
      } else {
        std::memset(v, 0, D * sizeof(float));
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 8) {  // D is a multiple of 32
      __m256 w[8];
      for (int64_t i = 0; i < 8; ++i)
        w[i] = k[i] != nullptr ? _mm256_loadu_ps(k[i] + d0) : _mm256_setzero_ps();
      transpose8(w);  // w[i]: dimension d0 + i of the 8 keys
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * Lp + j0, w[i]);
    }
  }
}

struct Scratch {
  std::unique_ptr<float[]> a, s, p, acc, m, l;
  Scratch(int64_t rows, int64_t D)
      : a(new float[rows * D]), s(new float[rows * kKeyBlock]), p(new float[rows * kKeyBlock]),
        acc(new float[rows * D]), m(new float[rows]), l(new float[rows]) {}
};

// f(j, e) over the 8-lane vectors of e = exp(s[j] * scale - m) for j in [a, b), the lanes past b
// (the last vector's) as exp(-inf) = 0: the same exp for every key
template <typename F>
inline void for_exp(const float* s, int64_t a, int64_t b, __m256 vscale, __m256 vm, F&& f) {
  int64_t j = a;
  for (; j + 8 <= b; j += 8)
    f(j, llmctl_attention::exp_nonpositive8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vscale, vm)),
      8);
  if (j < b) {
    alignas(32) float tail[8];
    for (int64_t i = 0; i < 8; ++i)
      tail[i] = j + i < b ? s[j + i] : -std::numeric_limits<float>::infinity();
    f(j, llmctl_attention::exp_nonpositive8(_mm256_fmsub_ps(_mm256_load_ps(tail), vscale, vm)),
      b - j);
  }
}

// As the bfloat16 run_task: rows r = g * nq + i are query token q0 + i of head head * G + g.
void run_task(const Task& t, const Chunk& c, const Block& blk, float* out, int64_t out_stride,
              const float* packed, int64_t G, int64_t D, float scale, int64_t window,
              Scratch& w) {
  const int64_t nq = blk.nq, rows = blk.rows, pos0 = blk.pos0, lo = blk.lo, hi = blk.hi;
  const float* kt = packed + c.packed;  // pack_kv's K^T, then V (of the task's KV head)
  const float* vr = kt + D * c.padded;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t n0 = lo; n0 < hi; n0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, hi - n0);
    at::native::cpublas::brgemm(rows, nk, D, D, c.padded, kKeyBlock, false, w.a.get(), kt + n0,
                                w.s.get(), false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos0 + r % nq;
      const int64_t row_lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t a = std::max(row_lo - c.first_key, n0) - n0;
      const int64_t b = std::min(pos + 1 - c.first_key, n0 + nk) - n0;
      const float* s = w.s.get() + r * kKeyBlock;
      float* p = w.p.get() + r * kKeyBlock;
      if (a >= b) {  // none in this block
        std::memset(p, 0, nk * sizeof(float));
        continue;
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = a; j < b; ++j) mx = std::max(mx, s[j]);
      const float m_new = std::max(w.m[r], mx * scale);
      const float alpha = std::exp(w.m[r] - m_new);  // 0 at the row's first block
      __m256 sum = _mm256_setzero_ps();
      std::memset(p, 0, a * sizeof(float));
      for_exp(s, a, b, vscale, _mm256_set1_ps(m_new), [&](int64_t j, __m256 e, int64_t lanes) {
        sum = _mm256_add_ps(sum, e);  // the lanes past b are 0
        if (lanes == 8) {
          _mm256_storeu_ps(p + j, e);
        } else {
          alignas(32) float tail[8];
          _mm256_store_ps(tail, e);
          std::memcpy(p + j, tail, lanes * sizeof(float));
        }
      });
      std::memset(p + b, 0, (nk - b) * sizeof(float));  // the keys past this row's position
      w.l[r] = w.l[r] * alpha + hsum(sum);
      w.m[r] = m_new;
      if (alpha != 1.f) rescale(w.acc.get() + r * D, D, alpha);
    }
    at::native::cpublas::brgemm(rows, D, nk, kKeyBlock, D, D, true, w.p.get(), vr + n0 * D,
                                w.acc.get(), false);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / nq, i = r % nq;
    float* o = out + (c.start + t.q0 + i) * out_stride + (t.head * G + g) * D;
    const __m256 inv = _mm256_set1_ps(1.f / w.l[r]);
    const float* acc = w.acc.get() + r * D;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), inv));
  }
}

}  // namespace f32
#endif  // LLMCTL_PREFILL_F32

bool available() {
#if defined(LLMCTL_PREFILL_BF16)
  return true;
#else
  return false;
#endif
}

bool f32_available() {
#if defined(LLMCTL_PREFILL_F32)
  return true;
#else
  return false;
#endif
}

// Each flavour's parts for run_chunks: element and packed word types, scratch, queries a task,
// a chunk's padded keys and packed words (K^T and V, one KV head), the packing and the task.
#if defined(LLMCTL_PREFILL_BF16)
struct Bf16Kernel {
  using T = Bf16;
  using Word = uint32_t;
  using Work = Scratch;
  static constexpr int64_t kQueries = kQueryBlock;
  static constexpr bool kVnni = true;
  // room for a block to start one key early (an even start) and end on kKeyAlign
  static int64_t padded(int64_t keys) {
    return (keys + kKeyAlign - 1) / kKeyAlign * kKeyAlign + kKeyAlign;
  }
  static size_t words(int64_t D, int64_t padded) { return static_cast<size_t>(D * padded); }
  static void pack(const Cache& cache, const Chunk& c, int64_t h, Word* slab) {
    pack_kv(cache, c, h, slab, slab + (cache.D / 2) * c.padded);
  }
  static void run(const Task& t, const Chunk& c, const Block& blk, T* out, int64_t out_stride,
                  const Word* packed, int64_t G, int64_t D, float scale, int64_t window,
                  Work& w) {
    run_task(t, c, blk, out, out_stride, packed, G, D, scale, window, w);
  }
};
#endif

#if defined(LLMCTL_PREFILL_F32)
struct F32Kernel {
  using T = float;
  using Word = float;
  using Work = f32::Scratch;
  static constexpr int64_t kQueries = f32::kQueryBlock;
  static constexpr bool kVnni = false;
  static int64_t padded(int64_t keys) { return (keys + 7) / 8 * 8; }
  static size_t words(int64_t D, int64_t padded) { return static_cast<size_t>(2 * D * padded); }
  static void pack(const f32::Cache& cache, const Chunk& c, int64_t h, Word* slab) {
    f32::pack_kv(cache, c, h, slab, slab + cache.D * c.padded);
  }
  static void run(const Task& t, const Chunk& c, const Block& blk, T* out, int64_t out_stride,
                  const Word* packed, int64_t G, int64_t D, float scale, int64_t window,
                  Work& w) {
    f32::run_task(t, c, blk, out, out_stride, packed, G, D, scale, window, w);
  }
};

// The chunks (checked by the caller) in kernel K's flavour: KV heads in waves whose packed keys
// and values fit `budget` bytes (all of them at once for the usual prompts; one or a few for a
// context of a hundred thousand tokens, whose packed copy would otherwise be as large as the
// sequence's KV cache), each wave's tasks largest first from a shared counter.
template <typename K, typename CacheT>
void run_chunks(const at::Tensor& q, const CacheT& cache, at::Tensor& out,
                const at::Tensor& tables, at::IntArrayRef table_rows, at::IntArrayRef starts,
                at::IntArrayRef lens, at::IntArrayRef contexts, float scale, int64_t window,
                int64_t budget) {
  using T = typename K::T;
  using Word = typename K::Word;
  const int64_t D = cache.D, Hkv = cache.heads, G = q.size(1) / Hkv, width = tables.size(1);
  std::vector<Chunk> chunks;
  size_t words = 0;  // one KV head's packed keys and values, all chunks
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, contexts[i] - window + 1) : 0;
    const int64_t padded = K::padded(contexts[i] + lens[i] - first);
    const int64_t* table = tables.data_ptr<int64_t>() + table_rows[i] * width;
    chunks.push_back({starts[i], lens[i], contexts[i], table, first, padded, words});
    words += K::words(D, padded);
  }
  const int64_t wave = std::clamp<int64_t>(
      budget / std::max<int64_t>(1, static_cast<int64_t>(words * sizeof(Word))), 1, Hkv);
  std::unique_ptr<Word[]> packed(new Word[words * wave]);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t h0 = 0; h0 < Hkv; h0 += wave) {
    const int64_t heads = std::min(wave, Hkv - h0);
    // head h0 + j of chunk c: at j * words + c.packed
    at::parallel_for(0, num_chunks * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Chunk& c = chunks[i / heads];
        K::pack(cache, c, h0 + i % heads, packed.get() + (i % heads) * words + c.packed);
      }
    });
    std::vector<Task> tasks;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const Chunk& ch = chunks[c];
      for (int64_t h = h0; h < h0 + heads; ++h)
        for (int64_t q0 = 0; q0 < ch.len; q0 += K::kQueries) {
          const int64_t last = ch.context + std::min(ch.len, q0 + K::kQueries);
          const int64_t first = window > 0 ? std::max<int64_t>(0, ch.context + q0 - window + 1) : 0;
          tasks.push_back({c, h, q0, last - first});  // the keys it reads
        }
    }
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const Task& a, const Task& b) { return a.cost > b.cost; });
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(tasks.size());
    at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1,
                     [&](int64_t begin, int64_t end) {
                       typename K::Work w(G * K::kQueries, D);
                       for (int64_t i; (i = next.fetch_add(1)) < n;) {
                         const Task& t = tasks[i];
                         const Word* kv = packed.get() + (t.head - h0) * words;
                         const Chunk& c = chunks[t.chunk];
                         // the block's queries gathered and its running sums reset here, then
                         // the flavour's key blocks and output
                         const Block blk = block_of(t, c, G, K::kQueries, window);
                         start_block(t, c, blk, qp, q.stride(0), G, D, w.a.get(), w.acc.get(),
                                     w.m.get(), w.l.get());
                         K::run(t, c, blk, op, out.stride(0), kv, G, D, scale, window, w);
                       }
                       at::native::cpublas::brgemm_release(K::kVnni);
                     });
  }
}
#endif  // LLMCTL_PREFILL_F32

// q, out: [tokens, heads, D] (each token's heads contiguous, any token stride); key_cache,
// value_cache: contiguous [num_blocks, block_size, kv_heads, D], the chunks' own keys and values
// already written; block_tables: [rows, width] int64; per chunk: its block table row, first token
// in q, length and context (tokens cached before it). Writes the chunks' rows of out.
void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, at::Tensor& out,
                       const at::Tensor& block_tables, at::IntArrayRef table_rows,
                       at::IntArrayRef starts, at::IntArrayRef lens, at::IntArrayRef contexts,
                       double scale, std::optional<int64_t> sliding_window,
                       std::optional<int64_t> max_packed_bytes) {
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(f32 ? f32_available() : available(),
              f32 ? "prefill_attention: built without AVX2 and FMA (use SDPA)"
                  : "prefill_attention: built without AVX512-BF16 (use SDPA)");
  const int64_t D = q.dim() == 3 ? q.size(2) : 0;
  const auto dtype = q.scalar_type();
  for (const at::Tensor* x : {&q, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == dtype &&
                    (dtype == at::kBFloat16 || dtype == at::kFloat) && x->size(2) == D &&
                    x->stride(2) == 1 && x->stride(1) == D && x->sizes() == q.sizes(),
                "q and out must be both bfloat16 or both float32 [tokens, heads, head_dim] with "
                "each token's heads contiguous");
  }
  TORCH_CHECK(D % 32 == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype && key_cache.size(3) == D &&
                  key_cache.size(2) > 0 && q.size(1) % key_cache.size(2) == 0,
              "key_cache, value_cache: contiguous [num_blocks, block_size, kv_heads, head_dim] of "
              "q's dtype (bfloat16 or float32) with kv_heads dividing q's heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong,
              "block_tables: int64 [rows, width]");
  const size_t C = starts.size();
  TORCH_CHECK(table_rows.size() == C && lens.size() == C && contexts.size() == C,
              "one table row, start, length and context per chunk");
  const int64_t window = sliding_window.value_or(0);
  TORCH_CHECK(window >= 0, "sliding_window must be positive");
  const at::Tensor tables = block_tables.contiguous();
  const int64_t bs = key_cache.size(1), width = tables.size(1);
  for (size_t i = 0; i < C; ++i) {
    TORCH_CHECK(starts[i] >= 0 && lens[i] > 0 && starts[i] + lens[i] <= q.size(0),
                "chunk ", i, " (start ", starts[i], ", length ", lens[i], ") is outside q");
    TORCH_CHECK(contexts[i] >= 0 && (contexts[i] + lens[i] + bs - 1) / bs <= width &&
                    table_rows[i] >= 0 && table_rows[i] < tables.size(0),
                "chunk ", i, ": its block table row cannot hold ", contexts[i] + lens[i],
                " tokens");
    const int64_t* row = tables.data_ptr<int64_t>() + table_rows[i] * width;
    for (int64_t b = 0; b < (contexts[i] + lens[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < key_cache.size(0), "chunk ", i, ": block id ", row[b],
                  " is outside the KV cache");
  }
  const int64_t budget = max_packed_bytes.value_or(kMaxPackedBytes);
  TORCH_CHECK(budget > 0, "max_packed_bytes must be positive");
  const float fscale = static_cast<float>(scale);
  const int64_t Hkv = key_cache.size(2);
  if (f32) {
#if defined(LLMCTL_PREFILL_F32)
    const f32::Cache cache{key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), bs, Hkv, D};
    run_chunks<F32Kernel>(q, cache, out, tables, table_rows, starts, lens, contexts, fscale,
                          window, budget);
#endif
  } else {
#if defined(LLMCTL_PREFILL_BF16)
    const Cache cache{key_cache.data_ptr<Bf16>(), value_cache.data_ptr<Bf16>(), bs, Hkv, D};
    run_chunks<Bf16Kernel>(q, cache, out, tables, table_rows, starts, lens, contexts, fscale,
                           window, budget);
#endif
  }
}

}  // namespace

#define LLMCTL_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY_FRAGMENT(LLMCTL_OP_NAMESPACE, m) {
  m.def("prefill_attention_available() -> bool", &available);
  m.def("prefill_attention_f32_available() -> bool", &f32_available);
  m.def(
      "prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor(a!) out, "
      "Tensor block_tables, int[] table_rows, int[] starts, int[] lens, int[] contexts, "
      "float scale, int? sliding_window=None, int? max_packed_bytes=None) -> ()");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
