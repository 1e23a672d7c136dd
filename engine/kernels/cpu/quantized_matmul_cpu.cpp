// Group-quantized weight times float activations on the CPU: y[M, N] = x[M, K] W[N, K]^T, with W
// never materialised in float.
//
//   W[n, k] = q[n, k] * scales[n, k / g] + zeros[n, k / g]      (zeros absent for int8)
//
// Weight layouts (built by kernels.py):
//   int8: q   [N, K]     int8, row-major.
//   int4: qp  [N, K / 2] uint8; each 32-element chunk of a row is 16 bytes, byte j holding element
//         j in its low nibble and element j + 16 in its high nibble (GGUF's Q4_0 order), so one
//         16-byte load gives two contiguous 16-element halves. g is a multiple of 32.
//   scales, zeros: [N, K / g], both float32 or both float16 (GGUF's Q4_0, Q4_1 and Q8_0 keep the
//         file's own fp16 values: half the bytes, exact).
//
// Decode (small M): each thread owns a range of output rows and reads each weight byte once,
// dequantizing it in registers for all M activation rows. The zero term is
// sum_g zeros[n, g] * xsum[m, g], with xsum the per-group sums of x computed once. Widening the
// 4-bit weights to float, not reading them, bounds a single row: a sequence decoded alone
// (M = 1) takes 4 int4 weight rows a pass (independent FMA chains, each load of x shared, a
// software prefetch per row since side-by-side rows defeat the hardware's stream detection;
// int8 rows, bound by reading them, go one at a time), and each 8-byte half of a 32-weight
// chunk is widened to 32-bit lanes once, its low and high nibbles then an AND and a shift apart
// (two shuffles per chunk where there were six). A row's sum takes the same operations in the
// same order on every path, so its bits do not depend on the batch or the thread split: the
// int4 loops are written once over "lanes" per instruction set (below, before rows_int4_m1).
// Larger M (prefill) goes through `tiled_group_mm`: tiles of W expanded to float32 and multiplied
// with torch's GEMM, the dequantization amortised over the M rows.
//
// Built with -march=native on the machine that runs it (the build cache key hashes the CPU's
// flags): the 256-bit AVX2 path wherever the CPU has AVX2 and FMA, with a scalar path for anything
// else, and 512-bit versions of the decode loops on Intel CPUs with AMX (LLMCTL_Q_512 below).
// On AMD's Zen 4 (AVX-512, 512-bit operations split in two) 512-bit loops were 5-19% slower at
// M = 1 and M = 4: AVX-512 CPUs without AMX keep the 256-bit loops, and there bfloat16
// activations meet int4 weights in bfloat16 dot products (LLMCTL_Q_BF16DOT below). A row gets the
// same bits on every node of one kind, not across loop widths or the two int4 paths.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "quantized_matmul_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LLMCTL_Q_AVX2 1
#include <immintrin.h>
#endif
// 512-bit decode loops where the CPU runs them whole: Intel's AMX cores (two 512-bit FMA units),
// 1.29x the 256-bit loops' rate on one core of the Intel AMX kind (int4, SmolLM2's 53 MB of
// layers, cold: 4.55 against 5.85 ms). AMD's Zen 4 splits 512-bit operations in two, and there
// they were 5-19% slower: it keeps the 256-bit loops (as a build with LLMCTL_CPU_MARCH=znver4 on
// an Intel CPU does).
#if defined(LLMCTL_Q_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AMX_TILE__)
#define LLMCTL_Q_512 1
#endif

// bfloat16 activations against int4 weights by bfloat16 dot products (VDPBF16PS) where the CPU
// has AVX512-BF16 and runs the 256-bit loops (Zen 4): a nibble q becomes the bfloat16 word of
// 16 + q by a shift and one logic op (bf16dot below), each product of a bfloat16 activation and
// 16 + q is exact in float32, and 64 weights take 13 operations (one load) where widening them to
// float32 took 28. On the Zen 4 kind, 2 threads, SmolLM2's 30 layers of int4 weights (53 MB) at
// M = 1: 3.7 ms where the float32 loops took 4.75 (1.27x; 1.35x at M = 4; session 21, with a
// word permute per 16 weights, which the logic op then beat by 1.25x in cache).
#if defined(LLMCTL_Q_AVX2) && !defined(LLMCTL_Q_512) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMCTL_Q_BF16DOT 1
#endif

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_quantized_matmul
#endif

namespace {

using llmctl_quantized::check_dequant;
using llmctl_quantized::is_scale_dtype;
using llmctl_quantized::ld;

constexpr int kMaxRows = 4;  // activation rows handled per pass over a weight row

#if defined(LLMCTL_Q_AVX2)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 bytes (int8 or uint8 nibbles already widened) -> 8 floats
inline __m256 i8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline __m256 u8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
// 8 int8 weights from memory -> 8 floats (one widening shuffle, its load folded in)
inline __m256 i8_mem_to_ps(const int8_t* p) {
  return i8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// 32 nibbles (16 bytes, GGUF's Q4_0 order) -> weights 0-7, 8-15, 16-23, 24-31 as floats
// Each half of the bytes is widened to 32-bit lanes once (two shuffles in all): a lane's low
// nibble is its AND with 15, its high nibble its shift right by 4.
inline void nibbles_to_ps(const uint8_t* b16, __m256* w) {
  const __m256i m = _mm256_set1_epi32(0x0F);
  const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b16)));
  const __m256i v1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b16 + 8)));
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}
#endif

#if defined(LLMCTL_Q_512)
// 32 nibbles (16 bytes, Q4_0's order) -> weights 0-15 and 16-31 as 16 floats each
inline void nibbles_to_ps512(const uint8_t* b16, __m512* w) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b16)));
  w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
  w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#endif

// One weight row against R activation rows: out[r] = sum_k x[r, k] * W[k] (zero term excluded).
// Per group, two independent FMA chains per row of x sum q * x unscaled; the group's sum then
// enters the row total with one FMA by the scale, the only dependency carried across groups.
template <int R, typename S>
void row_int8(const int8_t* q, const S* scales, const float* x, int64_t ldx, int64_t K,
              int64_t g, float* out) {
  const int64_t G = K / g;
#if defined(LLMCTL_Q_512)
  if (g % 16 == 0) {  // one chain per row and group, 16 lanes
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < G; ++gi) {
      __m512 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_ps();
      for (int64_t k = gi * g; k < (gi + 1) * g; k += 16) {
        const __m512 w = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
        for (int r = 0; r < R; ++r) p[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * ldx + k), p[r]);
      }
      const __m512 s = _mm512_set1_ps(ld(scales, gi));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(p[r], s, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
    return;
  }
#elif defined(LLMCTL_Q_AVX2)
  if (g % 16 == 0) {  // one chain per row and group
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < G; ++gi) {
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_ps();
      for (int64_t k = gi * g; k < (gi + 1) * g; k += 16) {
        __m256 w0 = i8_mem_to_ps(q + k);
        __m256 w1 = i8_mem_to_ps(q + k + 8);
        for (int r = 0; r < R; ++r) {
          p[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), p[r]);
          p[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), p[r]);
        }
      }
      const __m256 s = _mm256_set1_ps(ld(scales, gi));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p[r], s, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t gi = 0; gi < G; ++gi) {
      float part = 0.f;
      for (int64_t k = gi * g; k < (gi + 1) * g; ++k) part += x[r * ldx + k] * float(q[k]);
      total += part * ld(scales, gi);
    }
    out[r] = total;
  }
}

// int4 rows, written once over "lanes": how one kind of vector turns 32 weights (16 bytes) into
// values and multiplies them into a row's partial sum. rows_int4_m1 (a sequence decoded alone:
// NR weight rows a pass, each load of x shared, NR independent chains hiding each other's latency)
// and row_int4 (one weight row against R activation rows, each chunk of weights decoded once)
// take a row's operations in the same order, so its bits do not depend on the batch or the thread
// split. Per group, the chunks' products go into one chain per row; the group's sum enters the
// row's total by one multiply-add with its scale, the only dependency carried across groups.
//   F32x16   512-bit float32 FMAs (LLMCTL_Q_512)
//   F32x8    256-bit float32 FMAs (AVX2)
//   Scalar   anything else
// (bfloat16 activations on AVX512-BF16 CPUs take their own loops, `bf16dot` below.)
struct Scalar {
  using X = float;
  using Acc = float;
  struct Weights {
    const uint8_t* b;
  };
  struct Acts {
    const float* x;
  };
  static Acc zero() { return 0.f; }
  Weights weights(const uint8_t* b) const { return {b}; }
  static Acts acts(const float* x) { return {x}; }
  static Acc madd(Acc p, const Weights& w, const Acts& a) {
    for (int j = 0; j < 16; ++j) {
      p += a.x[j] * float(w.b[j] & 0x0F);
      p += a.x[16 + j] * float(w.b[j] >> 4);
    }
    return p;
  }
  static Acc scaled(Acc p, float s, Acc acc) { return acc + p * s; }
  static float total(Acc acc) { return acc; }
};

#if defined(LLMCTL_Q_AVX2)
struct F32x8 {
  using X = float;
  using Acc = __m256;
  struct Weights {
    __m256 v[4];
  };
  struct Acts {
    __m256 v[4];
  };
  static Acc zero() { return _mm256_setzero_ps(); }
  Weights weights(const uint8_t* b) const {
    Weights w;
    nibbles_to_ps(b, w.v);
    return w;
  }
  static Acts acts(const float* x) {
    return {{_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16),
             _mm256_loadu_ps(x + 24)}};
  }
  static Acc madd(Acc p, const Weights& w, const Acts& a) {
    for (int j = 0; j < 4; ++j) p = _mm256_fmadd_ps(w.v[j], a.v[j], p);
    return p;
  }
  static Acc scaled(Acc p, float s, Acc acc) { return _mm256_fmadd_ps(p, _mm256_set1_ps(s), acc); }
  static float total(Acc acc) { return hsum(acc); }
};
#endif

#if defined(LLMCTL_Q_512)
struct F32x16 {
  using X = float;
  using Acc = __m512;
  struct Weights {
    __m512 v[2];
  };
  struct Acts {
    __m512 v[2];
  };
  static Acc zero() { return _mm512_setzero_ps(); }
  Weights weights(const uint8_t* b) const {
    Weights w;
    nibbles_to_ps512(b, w.v);
    return w;
  }
  static Acts acts(const float* x) { return {{_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)}}; }
  static Acc madd(Acc p, const Weights& w, const Acts& a) {
    p = _mm512_fmadd_ps(w.v[0], a.v[0], p);
    return _mm512_fmadd_ps(w.v[1], a.v[1], p);
  }
  static Acc scaled(Acc p, float s, Acc acc) { return _mm512_fmadd_ps(p, _mm512_set1_ps(s), acc); }
  static float total(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

#if defined(LLMCTL_Q_512)
using Int4Lanes = F32x16;
#elif defined(LLMCTL_Q_AVX2)
using Int4Lanes = F32x8;
#else
using Int4Lanes = Scalar;
#endif

constexpr int kBlockRows = 4;  // weight rows a pass when a sequence is decoded alone

template <class L, int NR, typename S>
void rows_int4_m1(const uint8_t* qp, int64_t row_bytes, const S* scales, int64_t G,
                  const typename L::X* x, int64_t g, float* out) {
  const L lanes;
  typename L::Acc acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = L::zero();
  for (int64_t gi = 0; gi < G; ++gi) {
    typename L::Acc p[NR];
    for (int r = 0; r < NR; ++r) p[r] = L::zero();
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 32) {
      const typename L::Acts a = L::acts(x + k);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* b = qp + r * row_bytes + k / 2;
        // The rows read side by side defeat the hardware's stream prefetch: ask for the next
        // pass's line of this row (a prefetch past the end is harmless).
        if ((k / 2) % 64 == 0) __builtin_prefetch(b + NR * row_bytes, 0, 3);
        p[r] = L::madd(p[r], lanes.weights(b), a);
      }
    }
    for (int r = 0; r < NR; ++r) acc[r] = L::scaled(p[r], ld(scales, r * G + gi), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = L::total(acc[r]);
}

template <class L, int R, typename S>
void row_int4(const uint8_t* qp, const S* scales, const typename L::X* x, int64_t ldx, int64_t K,
              int64_t g, float* out) {
  const L lanes;
  const int64_t G = K / g;
  typename L::Acc acc[R];
  for (int r = 0; r < R; ++r) acc[r] = L::zero();
  for (int64_t gi = 0; gi < G; ++gi) {
    typename L::Acc p[R];
    for (int r = 0; r < R; ++r) p[r] = L::zero();
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 32) {
      const typename L::Weights w = lanes.weights(qp + k / 2);
      for (int r = 0; r < R; ++r) p[r] = L::madd(p[r], w, L::acts(x + r * ldx + k));
    }
    const float s = ld(scales, gi);
    for (int r = 0; r < R; ++r) acc[r] = L::scaled(p[r], s, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = L::total(acc[r]);
}

// sum of x[0 .. g): a group's sum for the zero term (g is a multiple of 32 for int4). In 8 lanes
// where the CPU has them: one chain of g scalar adds was ~1 us per matmul call at K = 576, on the
// thread that every other waits for.
inline float group_sum(const float* x, int64_t g) {
  int64_t k = 0;
  float total = 0.f;
#if defined(LLMCTL_Q_AVX2)
  if (g % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (; k < g; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + k));
    total = hsum(acc);
  }
#endif
  for (; k < g; ++k) total += x[k];
  return total;
}

// sum_i a[i] * b[i]: the zero term, zeros[n, :] . xsum[m, :]
inline float dot(const c10::Half* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(LLMCTL_Q_AVX2) && defined(__F16C__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 av = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    acc = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + i), acc);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += ld(a, i) * b[i];
  return total;
}
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(LLMCTL_Q_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

#if defined(LLMCTL_Q_BF16DOT)
// bfloat16 activations against int4 weights by bfloat16 dot products (VDPBF16PS), 64 weights
// (two 32-weight chunks, one 32-byte load) a step. A nibble q becomes the bfloat16 word
// 0x4180 | q << 3, the value 16 + q, by a shift and one three-input logic op (VPTERNLOGD:
// (v & 0x78) | 0x4180), where a 16-entry word permute (VPERMW) took one slow shuffle per 16
// weights. Each product of a bfloat16 activation (8 significant bits) and 16 + q (5) is exact in
// float32, two a lane added in float32 (subnormal inputs read as zero, as in oneDNN's bfloat16
// GEMMs); the 16's share, 16 d_g sum(x over group g), leaves with the zero term:
//   y = sum_g d_g sum_k (16 + q[k]) x[k] + sum_g (z_g - 16 d_g) xsum_g.
// The load's 16 words are, per 128-bit half (one chunk each), bytes 2i and 2i + 1 of the chunk:
// elements 2i and 2i + 16 in the low byte's nibbles, 2i + 1 and 2i + 17 in the high byte's. x is
// laid out in that order once a call (`pair_order`), so the weights need no shuffle at all. On the
// Zen 4 kind, a [3072, 576] Q4_1 weight in cache, in turns with the word permutes' loop: 1.25x
// (1 thread and 2); the bundled model's 120 layers cold, 1.08x; its single-stream decode waits on
// memory, not on this loop (docs/benchmarks.md, "Zen 4: single-stream decode and memory").
namespace bf16dot {

constexpr float kOffset = 16.f;  // the value the nibbles' words carry on top of q

// x's words (K of them) in the order the weights' words come in: per pair of chunks, four
// vectors of 16 words (elements 2i, 2i + 16, 2i + 1, 2i + 17 of the first chunk in the low 8
// words, of the second in the high 8); an odd chunk left at the end stays in order.
inline void pair_order(const uint16_t* x, int64_t K, uint16_t* xp) {
  const int64_t C = K / 32;
  int64_t c = 0;
  for (; c + 2 <= C; c += 2) {
    uint16_t* o = xp + c * 32;
    for (int half = 0; half < 2; ++half) {
      const uint16_t* xc = x + (c + half) * 32;
      for (int i = 0; i < 8; ++i) {
        o[half * 8 + i] = xc[2 * i];
        o[16 + half * 8 + i] = xc[2 * i + 16];
        o[32 + half * 8 + i] = xc[2 * i + 1];
        o[48 + half * 8 + i] = xc[2 * i + 17];
      }
    }
  }
  if (c < C) std::copy(x + c * 32, x + K, xp + c * 32);
}

// The words of 16 + q for the nibbles at bit `shift` of each 16-bit lane.
template <int shift>
inline __m256bh words(__m256i v) {
  __m256i at3;  // the nibble at bits 3-6
  if constexpr (shift <= 3) {
    at3 = _mm256_slli_epi16(v, 3 - shift);
  } else {
    at3 = _mm256_srli_epi16(v, shift - 3);
  }
  // (at3 & 0x78) | 0x4180: truth table 0xEA for (a & b) | c
  return (__m256bh)_mm256_ternarylogic_epi32(at3, _mm256_set1_epi16(0x78),
                                             _mm256_set1_epi16(0x4180), 0xEA);
}

// The scales of chunks c (low 4 lanes) and c + 1 (high 4 lanes). kChunkGroups: g == 32, one
// group a chunk (GGUF's Q4_0, Q4_1, Q4_K), the two scales side by side; decided once a call, not
// in the loop (with the branch there and one pair a pass, the loop was 5% slower on Zen 4).
template <bool kChunkGroups, typename S>
inline __m256 pair_scales(const S* scales, int64_t c, int64_t g) {
  if constexpr (kChunkGroups) {
    __m128 two;
    if constexpr (std::is_same_v<S, float>) {
      two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + c)));
    } else {
      uint32_t bits;
      std::memcpy(&bits, scales + c, sizeof(bits));
      two = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
    }
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {
    return _mm256_setr_m128(_mm_set1_ps(ld(scales, c * 32 / g)),
                            _mm_set1_ps(ld(scales, (c + 1) * 32 / g)));
  }
}

inline __m256bh xwords(const uint16_t* x) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}

// A pair of chunks of one weight row (32 bytes at b) against one row of pair-ordered x.
struct Pair {
  __m256bh w[4];
  explicit Pair(const uint8_t* b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    w[0] = words<0>(v);
    w[1] = words<4>(v);
    w[2] = words<8>(v);
    w[3] = words<12>(v);
  }
  __m256 dot(const uint16_t* xc) const {
    __m256 p = _mm256_dpbf16_ps(_mm256_setzero_ps(), w[0], xwords(xc));
    p = _mm256_dpbf16_ps(p, w[1], xwords(xc + 16));
    p = _mm256_dpbf16_ps(p, w[2], xwords(xc + 32));
    return _mm256_dpbf16_ps(p, w[3], xwords(xc + 48));
  }
};

// An odd last chunk (16 bytes at b; x in order): byte j's nibbles are elements j and j + 16.
struct Tail {
  __m256bh w[2];
  explicit Tail(const uint8_t* b) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    w[0] = words<0>(v);
    w[1] = words<4>(v);
  }
  __m256 dot(const uint16_t* xc) const {
    const __m256 p = _mm256_dpbf16_ps(_mm256_setzero_ps(), w[0], xwords(xc));
    return _mm256_dpbf16_ps(p, w[1], xwords(xc + 16));
  }
};

// NR weight rows (row_bytes apart) against one row of x: a sequence decoded alone. Each pair's
// sum enters its row's total by one multiply-add with the pair's scales, pair after pair; a pass
// takes two pairs (64 bytes) of each row.
template <int NR, bool kChunkGroups, typename S>
void rows_m1(const uint8_t* qp, int64_t row_bytes, const S* scales, int64_t G, int64_t g,
             const uint16_t* xp, int64_t K, float* out) {
  const int64_t C = K / 32;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 4 <= C; c += 4) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* b = qp + r * row_bytes + c * 16;
      const S* s = scales + r * G;
      // The rows read side by side defeat the hardware's stream prefetch: ask for the next
      // pass's line of this row (a prefetch past the end is harmless).
      __builtin_prefetch(b + NR * row_bytes, 0, 3);
      acc[r] = _mm256_fmadd_ps(Pair(b).dot(xp + c * 32), pair_scales<kChunkGroups>(s, c, g), acc[r]);
      acc[r] = _mm256_fmadd_ps(Pair(b + 32).dot(xp + c * 32 + 64),
                               pair_scales<kChunkGroups>(s, c + 2, g), acc[r]);
    }
  }
  if (c + 2 <= C) {
    for (int r = 0; r < NR; ++r) {
      const __m256 s = pair_scales<kChunkGroups>(scales + r * G, c, g);
      acc[r] = _mm256_fmadd_ps(Pair(qp + r * row_bytes + c * 16).dot(xp + c * 32), s, acc[r]);
    }
    c += 2;
  }
  if (c < C) {
    for (int r = 0; r < NR; ++r) {
      const __m256 s = _mm256_set1_ps(ld(scales + r * G, c * 32 / g));
      acc[r] = _mm256_fmadd_ps(Tail(qp + r * row_bytes + c * 16).dot(xp + c * 32), s, acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(acc[r]);
}

// One weight row against R rows of x (ldx apart): each pair's words made once, the same
// operations per row of x as rows_m1's.
template <int R, bool kChunkGroups, typename S>
void row(const uint8_t* qp, const S* scales, int64_t g, const uint16_t* xp, int64_t ldx,
         int64_t K, float* out) {
  const int64_t C = K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= C; c += 2) {
    const Pair w(qp + c * 16);
    const __m256 s = pair_scales<kChunkGroups>(scales, c, g);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w.dot(xp + r * ldx + c * 32), s, acc[r]);
  }
  if (c < C) {
    const Tail w(qp + c * 16);
    const __m256 s = _mm256_set1_ps(ld(scales, c * 32 / g));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w.dot(xp + r * ldx + c * 32), s, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// The zero term with the nibbles' offset: sum_g (z_g - 16 d_g) xsum_g, z - 16 d rounded once.
// (Masked loads for the last groups, in place of the scalar tail, were 6% slower a call.)
template <typename S>
inline float zero_term(const S* z, const S* s, const float* xsum, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  const __m256 off = _mm256_set1_ps(kOffset);
  for (; i + 8 <= G; i += 8) {
    __m256 zv, sv;
    if constexpr (std::is_same_v<S, float>) {
      zv = _mm256_loadu_ps(z + i);
      sv = _mm256_loadu_ps(s + i);
    } else {
      zv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + i)));
      sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    }
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(sv, off, zv), _mm256_loadu_ps(xsum + i), acc);
  }
  float total = hsum(acc);
  for (; i < G; ++i) total += std::fma(-kOffset, ld(s, i), ld(z, i)) * xsum[i];
  return total;
}

// y's float32 values rounded to bfloat16 (to nearest even, as c10::BFloat16), 8 a step (a decode
// call 1% faster, in turns, than c10::BFloat16's scalar rounding).
inline void round_bf16(const float* y, int64_t n, c10::BFloat16* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128bh v = _mm256_cvtneps_pbh(_mm256_loadu_ps(y + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), (__m128i)v);
  }
  for (; i < n; ++i) out[i] = c10::BFloat16(y[i]);
}

}  // namespace bf16dot
#endif

template <typename S>
struct Int8Row {
  const int8_t* q;
  const S* scales;
  int64_t K, G, g;
  template <int R>
  void call(int64_t n, const float* x, int64_t ldx, float* out) const {
    row_int8<R, S>(q + n * K, scales + n * G, x, ldx, K, g, out);
  }
  // A sequence decoded alone reads one row at a time (row_int8<1>, the same bits): int8 rows are
  // bound by reading them, and one sequential stream keeps the hardware prefetcher on. With 4
  // rows a pass and a software prefetch per row (the int4 path's), the bundled model's 28 MB LM
  // head took 1.45 ms a decode step on 2 threads of the Zen 4 machine; one row a pass, 1.0 ms
  // (a standalone copy of both loops: 17 against 22-24 GB/s).
  static constexpr bool kBlocks = false;
  static constexpr bool kBf16Dot = false;  // bfloat16 x is widened to float32 (bound by reading)
};

template <typename S>
struct Int4Row {
  const uint8_t* qp;
  const S* scales;
  int64_t K, G, g;
  template <int R>
  void call(int64_t n, const float* x, int64_t ldx, float* out) const {
    row_int4<Int4Lanes, R, S>(qp + n * (K / 2), scales + n * G, x, ldx, K, g, out);
  }
  static constexpr bool kBlocks = true;  // M = 1: kBlockRows rows a pass
  template <int NR>
  void block(int64_t n, const float* x, float* out) const {
    rows_int4_m1<Int4Lanes, NR, S>(qp + n * (K / 2), K / 2, scales + n * G, G, x, g, out);
  }
#if defined(LLMCTL_Q_BF16DOT)
  // bfloat16 x: VDPBF16PS on its own words, pair-ordered (bf16dot::pair_order)
  static constexpr bool kBf16Dot = true;
  template <int R>
  void call(int64_t n, const uint16_t* x, int64_t ldx, float* out) const {
    if (g == 32) {
      bf16dot::row<R, true, S>(qp + n * (K / 2), scales + n * G, g, x, ldx, K, out);
    } else {
      bf16dot::row<R, false, S>(qp + n * (K / 2), scales + n * G, g, x, ldx, K, out);
    }
  }
  template <int NR>
  void block(int64_t n, const uint16_t* x, float* out) const {
    if (g == 32) {
      bf16dot::rows_m1<NR, true, S>(qp + n * (K / 2), K / 2, scales + n * G, G, g, x, K, out);
    } else {
      bf16dot::rows_m1<NR, false, S>(qp + n * (K / 2), K / 2, scales + n * G, G, g, x, K, out);
    }
  }
  float zero_term(int64_t n, const S* zp, const float* xsum) const {
    return bf16dot::zero_term(zp + n * G, scales + n * G, xsum, G);
  }
#else
  static constexpr bool kBf16Dot = false;
#endif
};

// f(std::integral_constant<int, R>{}) for R = rows, 1 to kMaxRows: the row kernels take their
// row count as a template argument, so their accumulators stay in registers.
template <typename F>
void with_rows(int64_t rows, const F& f) {
  static_assert(kMaxRows == 4 && kBlockRows == 4, "with_rows dispatches 1 to 4 rows");
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

void check_common(const at::Tensor& x, const at::Tensor& scales, int64_t N, int64_t K, int64_t g) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(g > 0 && K % g == 0, "K=", K, " is not a multiple of group_size=", g);
  TORCH_CHECK(is_scale_dtype(scales) && scales.is_contiguous() && scales.size(0) == N &&
                  scales.size(1) == K / g,
              "scales must be contiguous float32 or float16 [N, K / group_size]");
}

// rows [begin, end) of y for activation rows handled R at a time; zp: [N, G] zeros or nullptr.
// bfloat16 x is widened to float32 first (exactly) and y rounded back at the end: the same sums
// (rows with RowFn::kBf16Dot take bfloat16 x's own words instead, laid out by
// bf16dot::pair_order, and their own zero term).
template <typename S, typename RowFn>
at::Tensor run_rows(const at::Tensor& x, int64_t N, int64_t g, int64_t row_bytes, const S* zp,
                    const RowFn& row) {
  const int64_t M = x.size(0), K = x.size(1), G = K / g;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<float> x32, y32;  // bfloat16 x: float32 copies of x and y
  if (bf16) {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    x32.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xb[i]);
    y32.resize(M * N);
  }
  const float* xp = bf16 ? x32.data() : x.data_ptr<float>();
  float* yp = bf16 ? y32.data() : y.data_ptr<float>();
  const bool has_zeros = zp != nullptr;
  at::Tensor xsum;
  if (has_zeros) {  // [M, G]: per-group sums of x, for the zero term
    xsum = at::empty({M, G}, x.options().dtype(at::kFloat));
    float* s = xsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t gi = 0; gi < G; ++gi) s[m * G + gi] = group_sum(xp + m * K + gi * g, g);
  }
  const float* sp = has_zeros ? xsum.data_ptr<float>() : nullptr;
  std::vector<uint16_t> words;  // bfloat16 x's words for rows that take them, pair-ordered
#if defined(LLMCTL_Q_BF16DOT)
  if (RowFn::kBf16Dot && bf16) {
    words.resize(M * K);
    const uint16_t* xw = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    for (int64_t m = 0; m < M; ++m) bf16dot::pair_order(xw + m * K, K, words.data() + m * K);
  }
#endif
  // >= 128 KiB of packed weight per task (~10 us of reading): a small matrix stays on one
  // thread, where waking the others would cost more than it saves (much more on a busy machine).
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    // xs: x's float32 rows, or bfloat16 x's own words for rows that take them (RowFn::kBf16Dot)
    auto columns = [&](const auto* xs) {
      // the zero term of row n against the per-group sums of one row of x
      auto zero_term = [&](int64_t n, const float* xsum_row) {
        if constexpr (std::is_same_v<std::decay_t<decltype(*xs)>, uint16_t>) {
          return row.zero_term(n, zp, xsum_row);
        } else {
          return dot(zp + n * G, xsum_row, G);
        }
      };
      float out[kMaxRows];
      int64_t n = begin;
      if constexpr (RowFn::kBlocks) {
        if (M == 1) {  // decode: kBlockRows weight rows a pass, same bits per row
          for (; n < end; n += kBlockRows) {
            const int64_t rows = std::min<int64_t>(kBlockRows, end - n);
            with_rows(rows, [&](auto nr) { row.template block<decltype(nr)::value>(n, xs, out); });
            for (int64_t r = 0; r < rows; ++r)
              yp[n + r] = has_zeros ? out[r] + zero_term(n + r, sp) : out[r];
          }
        }
      }
      for (; n < end; ++n) {
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
          with_rows(rows, [&](auto r) {
            row.template call<decltype(r)::value>(n, xs + m0 * K, K, out);
          });
          for (int64_t r = 0; r < rows; ++r) {
            float v = out[r];
            if (has_zeros) v += zero_term(n, sp + (m0 + r) * G);
            yp[(m0 + r) * N + n] = v;
          }
        }
      }
    };
    if constexpr (RowFn::kBf16Dot) {
      if (bf16) {
        columns(static_cast<const uint16_t*>(words.data()));
      } else {
        columns(xp);
      }
    } else {
      columns(xp);
    }
    if (bf16) {  // this thread's columns, rounded
      c10::BFloat16* yb = y.data_ptr<c10::BFloat16>();
      for (int64_t m = 0; m < M; ++m) {
#if defined(LLMCTL_Q_BF16DOT)
        bf16dot::round_bf16(yp + m * N + begin, end - begin, yb + m * N + begin);
#else
        for (int64_t c = begin; c < end; ++c) yb[m * N + c] = c10::BFloat16(yp[m * N + c]);
#endif
      }
    }
  });
  return y;
}

at::Tensor int8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                         int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q must be a contiguous int8 [N, K] tensor");
  const int64_t N = q.size(0), K = q.size(1), G = K / group_size;
  check_common(x, scales, N, K, group_size);
  const int8_t* qb = q.data_ptr<int8_t>();
  if (scales.scalar_type() == at::kHalf) {
    const c10::Half* sb = scales.data_ptr<c10::Half>();
    return run_rows<c10::Half>(x, N, group_size, K, nullptr,
                               Int8Row<c10::Half>{qb, sb, K, G, group_size});
  }
  const float* sb = scales.data_ptr<float>();
  return run_rows<float>(x, N, group_size, K, nullptr, Int8Row<float>{qb, sb, K, G, group_size});
}

at::Tensor int4_group_mm(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& scales,
                         const at::Tensor& zeros, int64_t group_size) {
  TORCH_CHECK(qp.dim() == 2 && qp.scalar_type() == at::kByte && qp.is_contiguous(),
              "qp must be a contiguous uint8 [N, K / 2] tensor");
  TORCH_CHECK(group_size % 32 == 0, "int4 group_size must be a multiple of 32");
  const int64_t N = qp.size(0), K = qp.size(1) * 2, G = K / group_size;
  check_common(x, scales, N, K, group_size);
  TORCH_CHECK(zeros.scalar_type() == scales.scalar_type() && zeros.is_contiguous() &&
                  zeros.sizes() == scales.sizes(),
              "zeros must be contiguous, shaped like scales and of their dtype");
  const uint8_t* qb = qp.data_ptr<uint8_t>();
  if (scales.scalar_type() == at::kHalf) {
    const c10::Half* sb = scales.data_ptr<c10::Half>();
    return run_rows<c10::Half>(x, N, group_size, K / 2, zeros.data_ptr<c10::Half>(),
                               Int4Row<c10::Half>{qb, sb, K, G, group_size});
  }
  const float* sb = scales.data_ptr<float>();
  return run_rows<float>(x, N, group_size, K / 2, zeros.data_ptr<float>(),
                         Int4Row<float>{qb, sb, K, G, group_size});
}

// Rows [n0, n1) of W into w (row-major, K floats a row), on the calling thread.
template <typename S>
void dequantize_into(const at::Tensor& q, const S* sp, const S* zp, int64_t bits,
                     int64_t group_size, int64_t K, int64_t n0, int64_t n1, float* wp) {
  const int64_t G = K / group_size;
  for (int64_t n = n0; n < n1; ++n) {
    float* wr = wp + (n - n0) * K;
    for (int64_t gi = 0; gi < G; ++gi) {
      const float s = ld(sp, n * G + gi), z = zp ? ld(zp, n * G + gi) : 0.f;
      const int64_t k0 = gi * group_size, k1 = k0 + group_size;
      if (bits == 8) {
        const int8_t* qr = q.data_ptr<int8_t>() + n * K;
        for (int64_t k = k0; k < k1; ++k) wr[k] = float(qr[k]) * s + z;
      } else {
        const uint8_t* qr = q.data_ptr<uint8_t>() + n * (K / 2);
        int64_t k = k0;
#if defined(LLMCTL_Q_AVX2)
        const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
        const __m128i mask = _mm_set1_epi8(0x0F);
        for (; k < k1; k += 32) {
          __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k / 2));
          __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          _mm256_storeu_ps(wr + k, _mm256_fmadd_ps(u8_to_ps(lo), vs, vz));
          _mm256_storeu_ps(wr + k + 8, _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), vs, vz));
          _mm256_storeu_ps(wr + k + 16, _mm256_fmadd_ps(u8_to_ps(hi), vs, vz));
          _mm256_storeu_ps(wr + k + 24, _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), vs, vz));
        }
#endif
        for (; k < k1; k += 32) {
          float lo[16], hi[16];  // split first: the loops below vectorise
          for (int j = 0; j < 16; ++j) {
            lo[j] = float(qr[k / 2 + j] & 0x0F);
            hi[j] = float(qr[k / 2 + j] >> 4);
          }
          for (int j = 0; j < 16; ++j) wr[k + j] = lo[j] * s + z;
          for (int j = 0; j < 16; ++j) wr[k + 16 + j] = hi[j] * s + z;
        }
      }
    }
  }
}

// Rows [n0, n1) of W in float32: embedding rows and references.
at::Tensor dequantize_rows(const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t bits,
                           int64_t group_size, int64_t n0, int64_t n1) {
  check_dequant(q, scales, zeros, bits);
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N, "row range out of bounds");
  at::Tensor w = at::empty({n1 - n0, K}, scales.options().dtype(at::kFloat));
  float* wp = w.data_ptr<float>();
  auto run = [&](auto* sp, auto* zp) {
    at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
      dequantize_into(q, sp, zp, bits, group_size, K, begin, end, wp + (begin - n0) * K);
    });
  };
  if (scales.scalar_type() == at::kHalf) {
    run(scales.data_ptr<c10::Half>(), zeros.has_value() ? zeros->data_ptr<c10::Half>() : nullptr);
  } else {
    run(scales.data_ptr<float>(), zeros.has_value() ? zeros->data_ptr<float>() : nullptr);
  }
  return w;
}

// The batched path: y = x W^T by tiles of `tile_rows` rows of W, each expanded to float32 and
// multiplied with torch's GEMM on the thread that owns the tile, into the tile's columns of y
// (the GEMM writes a column slice in place, its leading dimension N). One parallel region for
// the whole matmul (the GEMM inside runs on its tile's thread).
at::Tensor tiled_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros, int64_t bits,
                          int64_t group_size, int64_t tile_rows) {
  if (x.scalar_type() == at::kBFloat16) {  // tiles in bfloat16 for oneDNN's brgemm
    TORCH_CHECK(tile_rows % 16 == 0, "tile_rows must be a multiple of 16 for bfloat16 x");
    return llmctl_quantized::bf16_tiled_group_mm(x, q, scales, zeros, bits, group_size,
                                                 tile_rows);
  }
  check_dequant(q, scales, zeros, bits);
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.size(1) == K,
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(tile_rows > 0, "tile_rows must be positive");
  const int64_t M = x.size(0), tiles = (N + tile_rows - 1) / tile_rows;
  at::Tensor y = at::empty({M, N}, x.options());
  // The engine runs under torch.inference_mode(): the worker threads must be in it too, or
  // mm_out into yt (an inference tensor) is refused there.
  const bool inference_mode = c10::InferenceMode::is_enabled();
  auto run = [&](auto* sp, auto* zp) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      c10::InferenceMode guard(inference_mode);
      at::Tensor w = at::empty({tile_rows, K}, x.options());
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * tile_rows, n1 = std::min(N, n0 + tile_rows);
        dequantize_into(q, sp, zp, bits, group_size, K, n0, n1, w.data_ptr<float>());
        at::Tensor out = y.narrow(1, n0, n1 - n0);
        at::mm_out(out, x, w.narrow(0, 0, n1 - n0).t());
      }
    });
  };
  if (scales.scalar_type() == at::kHalf) {
    run(scales.data_ptr<c10::Half>(), zeros.has_value() ? zeros->data_ptr<c10::Half>() : nullptr);
  } else {
    run(scales.data_ptr<float>(), zeros.has_value() ? zeros->data_ptr<float>() : nullptr);
  }
  return y;
}

}  // namespace

// TORCH_LIBRARY pastes its namespace argument: expand LLMCTL_OP_NAMESPACE first.
#define LLMCTL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY(LLMCTL_OP_NAMESPACE, m) {
  m.def("int8_group_mm(Tensor x, Tensor q, Tensor scales, int group_size) -> Tensor");
  m.def(
      "int4_group_mm(Tensor x, Tensor qp, Tensor scales, Tensor zeros, int group_size) -> "
      "Tensor");
  m.def(
      "tiled_group_mm(Tensor x, Tensor q, Tensor scales, Tensor? zeros, int bits, "
      "int group_size, int tile_rows) -> Tensor");
  m.def(
      "dequantize_rows(Tensor q, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "int n0, int n1) -> Tensor");
  m.def(
      "dequantize_rows_bf16(Tensor q, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "int n0, int n1) -> Tensor");
  m.def(
      "vnni_blocks_bf16(Tensor q, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "int gate_up_half) -> Tensor");
  m.def("amx_gated_mlp(Tensor x, Tensor gate_up, Tensor down) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor w) -> Tensor");
  m.def(
      "amx_linear_rope(Tensor x, Tensor w, Tensor positions, Tensor cos_cache, "
      "Tensor sin_cache, int rotary_columns) -> Tensor");
  m.def(
      "amx_linear_add_rms_norm(Tensor x, Tensor w, Tensor residual, Tensor weight, float eps) "
      "-> (Tensor, Tensor)");
  m.def("amx_built() -> bool", &llmctl_quantized::amx_built);
  m.def(
      "int8_blocks(Tensor q, Tensor scales, Tensor? zeros, int bits, int group_size, "
      "int gate_up_half) -> Tensor");
  m.def("int8_gated_mlp(Tensor x, Tensor gate_up, Tensor down) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w) -> Tensor");
  m.def(
      "int8_linear_rope(Tensor x, Tensor w, Tensor positions, Tensor cos_cache, "
      "Tensor sin_cache, int rotary_columns) -> Tensor");
  m.def(
      "int8_linear_add_rms_norm(Tensor x, Tensor w, Tensor residual, Tensor weight, float eps) "
      "-> (Tensor, Tensor)");
  m.def("int8_built() -> bool", &llmctl_quantized::int8_built);
  m.def(
      "int4_group_mm_int8_act(Tensor x, Tensor qp, Tensor scales, Tensor zeros, int group_size) "
      "-> Tensor");
  m.def("int8_f32_built() -> bool", &llmctl_quantized::int8_f32_built);
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("int8_group_mm", &int8_group_mm);
  m.impl("int4_group_mm", &int4_group_mm);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("tiled_group_mm", &tiled_group_mm);
  m.impl("dequantize_rows_bf16", &llmctl_quantized::dequantize_rows_bf16);
  m.impl("vnni_blocks_bf16", &llmctl_quantized::vnni_blocks_bf16);
  m.impl("amx_gated_mlp", &llmctl_quantized::amx_gated_mlp);
  m.impl("amx_linear", &llmctl_quantized::amx_linear);
  m.impl("amx_linear_rope", &llmctl_quantized::amx_linear_rope);
  m.impl("amx_linear_add_rms_norm", &llmctl_quantized::amx_linear_add_rms_norm);
  m.impl("int8_blocks", &llmctl_quantized::int8_blocks);
  m.impl("int8_gated_mlp", &llmctl_quantized::int8_gated_mlp);
  m.impl("int8_linear", &llmctl_quantized::int8_linear);
  m.impl("int8_linear_rope", &llmctl_quantized::int8_linear_rope);
  m.impl("int8_linear_add_rms_norm", &llmctl_quantized::int8_linear_add_rms_norm);
  m.impl("int4_group_mm_int8_act", &llmctl_quantized::int4_group_mm_int8_act);
}
