// Paged decode attention on the CPU: one query token per sequence against its paged KV cache.
//
//   q             [num_seqs, num_heads, head_dim]                    float32 or bfloat16
//   key_cache     [num_blocks, block_size, num_kv_heads, head_dim]   same dtype (value_cache alike)
//   block_tables  [num_seqs, max_blocks_per_seq] int64
//   seq_lens      [num_seqs] int64: the query (position seq_len - 1) sees keys 0 .. seq_len - 1,
//                 or with a sliding window only those at positions > seq_len - 1 - window
//   sinks         optional [num_heads] float32 (gpt-oss): head h's softmax adds exp(sinks[h])
//                 to its denominator and nothing to its output
//   out           [num_seqs, num_heads, head_dim], dtype of q
//
// A work item is a sequence and some of its KV heads (all of them when there are sequences
// enough for every thread, else one). Each K and V row is read from memory once, for all the
// query heads that share it. Two passes over the keys: float32 scores q . k into a per-thread
// buffer (bfloat16 pairs with vdpbf16ps where the CPU has AVX512-BF16: exact products, float32
// sums), a softmax, then the weighted sum of the V rows in float32 accumulators. Blocks are
// scattered in memory, so the rows of the block two ahead are prefetched into L2. Items are
// split across threads with at::parallel_for (torch's OpenMP pool); small batches stay on one.
//
// The op is registered under the namespace LLMCTL_OP_NAMESPACE (set by the Python loader to a
// name unique to this build), as LLMCTL_OP_NAMESPACE::paged_decode_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "exp_nonpositive.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMCTL_AVX512 1
#include <immintrin.h>
#ifdef __AVX512BF16__
#define LLMCTL_DOT_BF16 1  // bfloat16 q . k with vdpbf16ps: exact products, float32 sums
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl
#endif

namespace {

using BFloat16 = c10::BFloat16;

constexpr int kLanes = 16;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxVecs = kMaxHeadDim / kLanes;
// Cache rows are prefetched this many blocks ahead, into L2: prefetching into L1 evicts the
// scores and accumulators, and measured slower.
constexpr int64_t kAhead = 2;

// ---- 16 float32 lanes: AVX-512, two AVX2 registers, or plain arrays the compiler vectorizes --
// Loads and stores take the number of valid lanes n (1..16); lanes >= n load as 0.

#ifdef LLMCTL_AVX512

struct Vec {
  __m512 v;
};

inline __mmask16 lanes(int n) {  // n in 0..16
  return static_cast<__mmask16>((1u << n) - 1);
}
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p, int n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
inline Vec vload(const BFloat16* p, int n) {
  __m256i raw = _mm256_maskz_loadu_epi16(lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void vstore(float* p, Vec a, int n) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline void vstore(BFloat16* p, Vec a, int n) {
#ifdef __AVX512BF16__
  __m256i half = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v));
#else
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  __m512i bits = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  half = _mm256_mask_mov_epi16(half, nan, _mm256_set1_epi16(0x7FC0));
#endif
  _mm256_mask_storeu_epi16(p, lanes(n), half);
}
inline Vec vadd(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float vmaxall(Vec a) { return _mm512_reduce_max_ps(a.v); }

// [sum a, sum b, sum c, sum d]: one transposing add tree instead of four reductions.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], and alike for c, d.
  const __m512d ab =
      _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  const __m512d cd =
      _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  // Per 128-bit lane: [a, b, c, d], each summed over the lane.
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// dst[u] = sum of the lanes of s[u], u < R.
template <int R>
inline void vsums(const Vec* s, float* dst) {
  if constexpr (R == 4) {
    _mm_storeu_ps(dst, sum4(s[0].v, s[1].v, s[2].v, s[3].v));
  } else if constexpr (R == 2) {
    const __m512 z = _mm512_setzero_ps();
    _mm_storel_pi(reinterpret_cast<__m64*>(dst), sum4(s[0].v, s[1].v, z, z));
  } else {
    for (int u = 0; u < R; ++u) dst[u] = vsum(s[u]);
  }
}

// exp(x) for x <= 0 (exp_nonpositive.h: Cephes' polynomial, about 1 ulp)
inline Vec vexp(Vec a) { return {llmctl_attention::exp_nonpositive(a.v)}; }

#elif defined(__AVX2__) && defined(__FMA__)

// ---- AVX2: the 16 lanes as two __m256 (lo: lanes 0-7, hi: 8-15) --------------------------------

struct Vec {
  __m256 lo, hi;
};

// lanes < n of the 8 starting at `first`: an all-ones int mask per valid lane
inline __m256i lanes8(int n, int first) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - first), iota);
}
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec vload(const float* p, int n) {
  if (n == kLanes) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, lanes8(n, 0)), _mm256_maskload_ps(p + 8, lanes8(n, 8))};
}
inline __m256 bf16x8_to_ps(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec vload(const BFloat16* p, int n) {
  if (n == kLanes) {
    return {bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  alignas(32) uint16_t raw[kLanes] = {};
  for (int i = 0; i < n; ++i) raw[i] = p[i].x;
  return {bf16x8_to_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(raw))),
          bf16x8_to_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(raw + 8)))};
}
inline void vstore(float* p, Vec a, int n) {
  if (n == kLanes) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  _mm256_maskstore_ps(p, lanes8(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, lanes8(n, 8), a.hi);
}
inline void vstore(BFloat16* p, Vec a, int n) {  // rounded as c10::BFloat16 rounds
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, a.lo);
  _mm256_store_ps(f + 8, a.hi);
  for (int i = 0; i < n; ++i) p[i] = static_cast<BFloat16>(f[i]);
}
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vsum(Vec a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vmaxall(Vec a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <int R>
inline void vsums(const Vec* s, float* dst) {
  for (int u = 0; u < R; ++u) dst[u] = vsum(s[u]);
}
// exp(x) for x <= 0 (exp_nonpositive.h's 8-lane version, the same polynomial)
inline Vec vexp(Vec a) {
  return {llmctl_attention::exp_nonpositive8(a.lo), llmctl_attention::exp_nonpositive8(a.hi)};
}

#else  // portable

struct Vec {
  float v[kLanes];
};

inline Vec vset1(float x) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline Vec vzero() { return vset1(0.0f); }
template <typename T>
inline Vec vload(const T* p, int n) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  return r;
}
template <typename T>
inline void vstore(T* p, Vec a, int n) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<T>(a.v[i]);
}
inline Vec vadd(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vec vsub(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] -= b.v[i];
  return a;
}
inline Vec vmul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec vmax(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
inline float vsum(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
}
inline float vmaxall(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, a.v[i]);
  return m;
}
template <int R>
inline void vsums(const Vec* s, float* dst) {
  for (int u = 0; u < R; ++u) dst[u] = vsum(s[u]);
}
inline Vec vexp(Vec a) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = std::exp(a.v[i]);
  return a;
}

#endif

// ---- the kernel --------------------------------------------------------------------------------

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size;
  int64_t q_seq, q_head;                  // strides of q, in elements
  int64_t k_block, k_slot, k_head;        // strides of key_cache
  int64_t v_block, v_slot, v_head;        // strides of value_cache
  const int64_t* block_tables;            // [num_seqs, table_width], contiguous
  int64_t table_width;
  const int64_t* seq_lens;                // [num_seqs]
  int64_t window;                         // 0: no sliding window
  float scale;
  const float* sinks;                     // [num_heads], or nullptr
};

// Position of the first key the query of a sequence of `seq_len` tokens sees.
inline int64_t first_key(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

// Starts loading one row of `bytes` bytes into L2. Inline asm: GCC's dead-code elimination
// drops __builtin_prefetch from loops that do nothing else.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes + 63; b += 64) {  // + 63: a row need not start on a line
    const char* line = p + std::min(b, bytes - 1);
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*line));
#else
    __builtin_prefetch(line, 0, 2);
#endif
  }
}

// Per-thread scratch, float32, for the query heads of one item: query rows [heads][Dp],
// accumulators alike, scores [heads][np], 1 / softmax denominators [heads].
struct Scratch {
  std::vector<float> q, acc, scores, inv_sum;
  std::vector<uint16_t> q_bf16;
};

// One work item: a sequence and the KV heads h0 .. h0 + nh - 1, i.e. the query heads
// h0 * group .. (h0 + nh) * group - 1, for head_dim <= NV * 16. Keys and values are taken U slots
// at a time (U * NV vectors in registers), so a query row is loaded once per U keys and an
// accumulator once per U values; all nh heads of a slot are read together (they are adjacent
// in the cache).
template <typename T, int NV>
struct Item {
  static constexpr int U = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
  static constexpr int64_t Dp = NV * kLanes;

  // The bfloat16 dot product takes 32 lanes (pairs) per instruction.
  static constexpr int NW = (NV + 1) / 2;
  static constexpr int64_t Dw = NW * 2 * kLanes;
#ifdef LLMCTL_DOT_BF16
  static constexpr bool kDot = std::is_same_v<T, BFloat16>;
#else
  static constexpr bool kDot = false;
#endif

  const Layout& L;
  const int G;                  // query heads per KV head
  float* __restrict__ qf;       // [nh * G][Dp]
  uint16_t* __restrict__ qb;    // [nh * G][Dw], the raw bfloat16 query when kDot
  float* __restrict__ acc;      // [nh * G][Dp]
  float* __restrict__ scores;   // [nh * G][np]
  float* __restrict__ inv_sum;  // [nh * G]
  const int64_t np;             // score row length: max visible keys, rounded up to 16
  int nh = 0;

  int width(int i) const {
    return static_cast<int>(std::clamp<int64_t>(L.head_dim - i * kLanes, 0, kLanes));
  }

  // scores[h * G + g][t + u] = q_{h * G + g} . k_{h, slot u}, u < R; k: slot 0 at head 0.
  template <int R>
  void score(const T* k, int64_t t) const {
#ifdef LLMCTL_DOT_BF16
    if constexpr (kDot) {
      return score_dot<R>(k, t);
    }
#endif
    for (int h = 0; h < nh; ++h) {
      Vec kv[R][NV];
      for (int u = 0; u < R; ++u) {
        const T* row = k + h * L.k_head + u * L.k_slot;
        for (int i = 0; i < NV; ++i) kv[u][i] = vload(row + i * kLanes, width(i));
      }
      for (int g = h * G; g < (h + 1) * G; ++g) {
        const float* qg = qf + g * Dp;
        Vec s[R];
        const Vec q0 = vload(qg, kLanes);
        for (int u = 0; u < R; ++u) s[u] = vmul(q0, kv[u][0]);
        for (int i = 1; i < NV; ++i) {
          const Vec qi = vload(qg + i * kLanes, kLanes);
          for (int u = 0; u < R; ++u) s[u] = vfma(qi, kv[u][i], s[u]);
        }
        vsums<R>(s, scores + g * np + t);
      }
    }
  }

#ifdef LLMCTL_DOT_BF16
  __mmask32 word_lanes(int i) const {
    const int64_t n = std::clamp<int64_t>(L.head_dim - i * 2 * kLanes, 0, 2 * kLanes);
    return n == 2 * kLanes ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
  }

  template <int R>
  void score_dot(const T* k, int64_t t) const {
    for (int h = 0; h < nh; ++h) {
      __m512i kv[R][NW];
      for (int u = 0; u < R; ++u) {
        const T* row = k + h * L.k_head + u * L.k_slot;
        for (int i = 0; i < NW; ++i) {
          kv[u][i] = _mm512_maskz_loadu_epi16(word_lanes(i), row + i * 2 * kLanes);
        }
      }
      for (int g = h * G; g < (h + 1) * G; ++g) {
        const uint16_t* qg = qb + g * Dw;
        Vec s[R];
        for (int u = 0; u < R; ++u) s[u] = vzero();
        for (int i = 0; i < NW; ++i) {
          const __m512bh qi = (__m512bh)_mm512_loadu_si512(qg + i * 2 * kLanes);
          for (int u = 0; u < R; ++u) s[u].v = _mm512_dpbf16_ps(s[u].v, qi, (__m512bh)kv[u][i]);
        }
        vsums<R>(s, scores + g * np + t);
      }
    }
  }
#endif

  // acc[h * G + g] += sum_u p[h * G + g][t + u] * v_{h, slot u}, u < R; v: slot 0 at head 0.
  template <int R>
  void accumulate(const T* v, int64_t t) const {
    for (int h = 0; h < nh; ++h) {
      Vec vv[R][NV];
      for (int u = 0; u < R; ++u) {
        const T* row = v + h * L.v_head + u * L.v_slot;
        for (int i = 0; i < NV; ++i) vv[u][i] = vload(row + i * kLanes, width(i));
      }
      for (int g = h * G; g < (h + 1) * G; ++g) {
        Vec p[R];
        for (int u = 0; u < R; ++u) p[u] = vset1(scores[g * np + t + u]);
        float* ag = acc + g * Dp;
        for (int i = 0; i < NV; ++i) {
          Vec a = vload(ag + i * kLanes, kLanes);
          for (int u = 0; u < R; ++u) a = vfma(p[u], vv[u][i], a);
          vstore(ag + i * kLanes, a, kLanes);
        }
      }
    }
  }

  // Prefetches slots from .. to - 1 of a run (all nh heads).
  void prefetch(const T* rows, int64_t from, int64_t to, int64_t slot, int64_t head) const {
    const int64_t bytes = L.head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t r = from; r < to; ++r) {
      for (int h = 0; h < nh; ++h) prefetch_row(rows + r * slot + h * head, bytes);
    }
  }

  // Walks the slots first .. seq_len - 1 of one cache block by block, calling
  // step(integral_constant<R>, rows, t) on groups of R = U (or 1) slots, and prefetching the same
  // slots kAhead blocks ahead: blocks are scattered, so hardware prefetchers cannot guess them.
  template <typename Step>
  void walk(const int64_t* table, int64_t first, int64_t seq_len, const T* base,
            int64_t block_stride, int64_t slot, int64_t head, Step step) const {
    const int64_t bs = L.block_size;
    const int64_t b0 = first / bs, b_end = (seq_len + bs - 1) / bs;
    auto block = [&](int64_t b) { return base + table[b] * block_stride; };
    auto lo = [&](int64_t b) { return b == b0 ? first % bs : int64_t{0}; };
    auto hi = [&](int64_t b) { return std::min(bs, seq_len - b * bs); };
    for (int64_t b = b0; b < std::min(b0 + kAhead, b_end); ++b) {
      prefetch(block(b), lo(b), hi(b), slot, head);
    }
    int64_t t = 0;
    for (int64_t b = b0; b < b_end; ++b) {
      const T* rows = block(b);
      const int64_t from = lo(b), to = hi(b);
      const T* pf = b + kAhead < b_end ? block(b + kAhead) : nullptr;
      const int64_t pf_to = pf ? hi(b + kAhead) : 0;
      int64_t j = from;
      for (; j + U <= to; j += U, t += U) {
        if (pf) prefetch(pf, j, std::min(j + U, pf_to), slot, head);
        step(std::integral_constant<int, U>{}, rows + j * slot, t);
      }
      for (; j < to; ++j, ++t) {
        if (pf) prefetch(pf, j, std::min(j + 1, pf_to), slot, head);
        step(std::integral_constant<int, 1>{}, rows + j * slot, t);
      }
      if (pf) prefetch(pf, 0, std::min(from, pf_to), slot, head);  // before a partial first run
    }
  }

  void run(const T* q, const T* key_cache, const T* value_cache, T* out, int64_t seq,
           int64_t h0, int heads) {
    nh = heads;
    const int64_t D = L.head_dim;
    const int HQ = nh * G;
    const int64_t seq_len = L.seq_lens[seq];
    const int64_t first = first_key(seq_len, L.window);
    const int64_t n = seq_len - first;
    T* out_rows = out + (seq * L.num_heads + h0 * G) * D;  // [HQ, head_dim], contiguous
    if (n <= 0) {  // nothing visible: zeros rather than the NaN of an empty softmax
      for (int64_t i = 0; i < HQ * D; ++i) out_rows[i] = static_cast<T>(0.0f);
      return;
    }
    const int64_t* table = L.block_tables + seq * L.table_width;
    const T* k_base = key_cache + h0 * L.k_head;
    const T* v_base = value_cache + h0 * L.v_head;
    // The first values are needed after all the keys: start fetching them into L2 now.
    const int64_t bs = L.block_size;
    prefetch(v_base + table[first / bs] * L.v_block, first % bs, std::min(bs, first % bs + n),
             L.v_slot, L.v_head);

    for (int g = 0; g < HQ; ++g) {  // zero-padded to Dp (Dw) lanes
      const T* qg = q + seq * L.q_seq + (h0 * G + g) * L.q_head;
#ifdef LLMCTL_DOT_BF16
      if constexpr (kDot) {
        for (int i = 0; i < NW; ++i) {
          const __m512i raw = _mm512_maskz_loadu_epi16(word_lanes(i), qg + i * 2 * kLanes);
          _mm512_storeu_si512(qb + g * Dw + i * 2 * kLanes, raw);
        }
        continue;
      }
#endif
      for (int i = 0; i < NV; ++i) {
        vstore(qf + g * Dp + i * kLanes, vload(qg + i * kLanes, width(i)), kLanes);
      }
    }

    // Pass 1: scores.
    walk(table, first, seq_len, k_base, L.k_block, L.k_slot, L.k_head,
         [&](auto r, const T* k, int64_t t) { score<decltype(r)::value>(k, t); });

    // Softmax over t < n per query head; n .. np-1 are padding (-inf: weight 0).
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
    const Vec scale = vset1(L.scale);
    for (int g = 0; g < HQ; ++g) {
      float* sg = scores + g * np;
      for (int64_t i = 0; i < n16; i += kLanes) {
        vstore(sg + i, vmul(vload(sg + i, kLanes), scale), kLanes);
      }
      for (int64_t i = n; i < n16; ++i) sg[i] = neg_inf;
      Vec m = vset1(neg_inf);
      for (int64_t i = 0; i < n16; i += kLanes) m = vmax(m, vload(sg + i, kLanes));
      float top = vmaxall(m);
      const float sink = L.sinks ? L.sinks[h0 * G + g] : neg_inf;
      top = std::max(top, sink);
      const Vec mx = vset1(top);
      Vec sum = vzero();
      for (int64_t i = 0; i < n16; i += kLanes) {
        const Vec e = vexp(vsub(vload(sg + i, kLanes), mx));
        vstore(sg + i, e, kLanes);
        sum = vadd(sum, e);
      }
      inv_sum[g] = 1.0f / (vsum(sum) + (L.sinks ? std::exp(sink - top) : 0.0f));
    }

    // Pass 2: weighted sum of the values.
    for (int64_t i = 0; i < HQ * Dp; ++i) acc[i] = 0.0f;
    walk(table, first, seq_len, v_base, L.v_block, L.v_slot, L.v_head,
         [&](auto r, const T* v, int64_t t) { accumulate<decltype(r)::value>(v, t); });

    for (int g = 0; g < HQ; ++g) {
      const Vec inv = vset1(inv_sum[g]);
      for (int i = 0; i < NV; ++i) {
        const Vec o = vmul(vload(acc + g * Dp + i * kLanes, kLanes), inv);
        vstore(out_rows + g * D + i * kLanes, o, width(i));
      }
    }
  }
};

template <typename T, int NV>
void run(const Layout& L, const at::Tensor& q, const at::Tensor& key_cache,
         const at::Tensor& value_cache, at::Tensor& out, int64_t num_seqs) {
  const T* q_ptr = q.const_data_ptr<T>();
  const T* k_ptr = key_cache.const_data_ptr<T>();
  const T* v_ptr = value_cache.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  const int G = static_cast<int>(L.group);
  constexpr int64_t Dp = NV * kLanes;

  int64_t max_visible = 0, work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = L.seq_lens[s] - first_key(L.seq_lens[s], L.window);
    max_visible = std::max(max_visible, n);
    work += std::max<int64_t>(n, 0);
  }
  work *= L.num_heads * L.head_dim;
  const int64_t np = std::max<int64_t>(kLanes, (max_visible + kLanes - 1) / kLanes * kLanes);

  // An item takes all KV heads of a sequence (its cache rows are then read front to back) when
  // there are sequences enough to share among the threads and the scores fit in L2 (256 KiB);
  // else one KV head.
  const int64_t threads = at::get_num_threads();
  int64_t heads_per_item = 1;
  if (num_seqs >= 4 * threads) {
    heads_per_item = std::clamp<int64_t>((int64_t{1} << 16) / (G * np), 1, L.num_kv_heads);
  }
  const int64_t chunks = (L.num_kv_heads + heads_per_item - 1) / heads_per_item;
  const int64_t items = num_seqs * chunks;
  // Below ~100k multiply-adds (tens of microseconds) waking a second thread costs more than it
  // saves.
  const int64_t grain = work < (int64_t{1} << 17) ? items : 1;

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local Scratch buf;  // kept between calls: no allocation per layer
    const int64_t rows = heads_per_item * G;
    if (static_cast<int64_t>(buf.q.size()) < rows * Dp) {
      buf.q.resize(rows * Dp);
      buf.q_bf16.resize(rows * Item<T, NV>::Dw);
      buf.acc.resize(rows * Dp);
      buf.inv_sum.resize(rows);
    }
    if (static_cast<int64_t>(buf.scores.size()) < rows * np) buf.scores.resize(rows * np);
    Item<T, NV> item{.L = L,
                     .G = G,
                     .qf = buf.q.data(),
                     .qb = buf.q_bf16.data(),
                     .acc = buf.acc.data(),
                     .scores = buf.scores.data(),
                     .inv_sum = buf.inv_sum.data(),
                     .np = np};
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / chunks, h0 = (i % chunks) * heads_per_item;
      const int heads = static_cast<int>(std::min(heads_per_item, L.num_kv_heads - h0));
      item.run(q_ptr, k_ptr, v_ptr, out_ptr, seq, h0, heads);
    }
  });
}

// Vectors per head row are a compile-time constant: head_dim 16, 32, 64, 128 and 256 run
// exactly, others in the next larger variant (its extra lanes load as zeros). Each variant
// costs about a second of compile time.
template <typename T>
void dispatch(const Layout& L, const at::Tensor& q, const at::Tensor& key_cache,
              const at::Tensor& value_cache, at::Tensor& out, int64_t num_seqs) {
  const int64_t nv = (L.head_dim + kLanes - 1) / kLanes;
  if (nv <= 1) return run<T, 1>(L, q, key_cache, value_cache, out, num_seqs);
  if (nv <= 2) return run<T, 2>(L, q, key_cache, value_cache, out, num_seqs);
  if (nv <= 4) return run<T, 4>(L, q, key_cache, value_cache, out, num_seqs);
  if (nv <= 8) return run<T, 8>(L, q, key_cache, value_cache, out, num_seqs);
  return run<T, kMaxVecs>(L, q, key_cache, value_cache, out, num_seqs);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale,
                                  std::optional<int64_t> sliding_window,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
              "head_dim], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "q, key_cache and value_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "head_dim of q (", head_dim,
              ") and of the KV cache (", key_cache.size(3), ") differ");
  TORCH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in 1..", kMaxHeadDim);
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(q.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "q and the KV caches must be contiguous in head_dim");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  block_tables.scalar_type() == at::kLong,
              "block_tables must be int64 [num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs &&
                  seq_lens.scalar_type() == at::kLong,
              "seq_lens must be int64 [num_seqs]");
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                  seq_lens.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  const int64_t window = sliding_window.value_or(0);
  TORCH_CHECK(!sliding_window.has_value() || window >= 1, "sliding_window must be >= 1");
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_values.dim() == 1 && sink_values.size(0) == num_heads &&
                    sink_values.device().is_cpu(),
                "sinks must be a CPU tensor of num_heads (", num_heads, ") values, got ",
                sink_values.sizes());
  }

  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* table_ptr = tables.const_data_ptr<int64_t>();
  const int64_t* lens_ptr = lens.const_data_ptr<int64_t>();
  // Every block a query reads must exist: an out-of-range id would read outside the cache.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens_ptr[s];
    TORCH_CHECK(len >= 0 && len <= width * block_size, "seq_lens[", s, "] = ", len,
                " does not fit block_tables (", width, " blocks of ", block_size, ")");
    for (int64_t b = first_key(len, window) / block_size; b * block_size < len; ++b) {
      const int64_t id = table_ptr[s * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, ", ", b, "] = ", id,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }

  Layout L{};
  L.num_heads = num_heads;
  L.num_kv_heads = num_kv_heads;
  L.head_dim = head_dim;
  L.group = num_heads / num_kv_heads;
  L.block_size = block_size;
  L.q_seq = q.stride(0);
  L.q_head = q.stride(1);
  L.k_block = key_cache.stride(0);
  L.k_slot = key_cache.stride(1);
  L.k_head = key_cache.stride(2);
  L.v_block = value_cache.stride(0);
  L.v_slot = value_cache.stride(1);
  L.v_head = value_cache.stride(2);
  L.block_tables = table_ptr;
  L.table_width = width;
  L.seq_lens = lens_ptr;
  L.window = window;
  L.scale = static_cast<float>(scale);
  L.sinks = sinks.has_value() ? sink_values.const_data_ptr<float>() : nullptr;

  at::Tensor out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch<float>(L, q, key_cache, value_cache, out, num_seqs);
  } else {
    dispatch<BFloat16>(L, q, key_cache, value_cache, out, num_seqs);
  }
  return out;
}

}  // namespace

// TORCH_LIBRARY pastes its namespace argument: expand LLMCTL_OP_NAMESPACE first.
#define LLMCTL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY(LLMCTL_OP_NAMESPACE, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int? sliding_window=None, "
      "Tensor? sinks=None) -> Tensor");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
