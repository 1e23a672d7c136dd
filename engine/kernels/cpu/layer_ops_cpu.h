// The elementwise parts of a Llama-family layer, one row at a time, in float32 or bfloat16, as
// the module path computes them in torch (engine/layers): RMSNorm with the residual add, RoPE
// ("rotate half") and SiLU-and-mul. The fused decode stack (fused_decode_cpu.cpp) runs them
// inline; layer_ops_cpu.cpp wraps them as torch ops for the module path (prefill, batches).
//
// Arithmetic is float32; with bfloat16 every value torch would round (each op's output) is
// rounded here too, to the nearest even (`rnd`), so a bfloat16 layer gives torch's bits up to
// the order of a reduction's sums (RMSNorm's sum of squares). Products of two bfloat16 values
// are exact in float32, so rounding one is rounding the exact product, as torch does.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define LLMCTL_LAYERS_AVX2 1
#include <immintrin.h>
// SLEEF's exp with 1-ulp error, as linked into libtorch_cpu: the one ATen's vectorised silu calls.
extern "C" __m256 Sleef_expf8_u10avx2(__m256);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LLMCTL_LAYERS_AVX512 1
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);  // ATen's with AVX-512: 16 lanes
#endif

namespace llmctl_layers {

using BFloat16 = c10::BFloat16;

// bfloat16 bits of a float, to the nearest even (NaN stays NaN), and back.
inline uint16_t bf16_round(float v) { return BFloat16(v).x; }
inline float widen(float v) { return v; }
inline float widen(BFloat16 v) { return static_cast<float>(v); }

// The value T holds of a float: float32 as it is, bfloat16 rounded.
template <typename T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return static_cast<float>(BFloat16(v));
  } else {
    return v;
  }
}
template <typename T>
inline T store(float v) {
  return static_cast<T>(v);  // BFloat16(float) rounds to nearest even
}

#if defined(LLMCTL_LAYERS_AVX2)
// 8 values of T at p <-> 8 floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
// Round 8 floats to bfloat16 (nearest even; NaN is not special-cased: none reach here) and
// return them widened again: what a bfloat16 tensor would hold.
inline __m256 round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int(0xFFFF0000u))));
}
template <typename T>
inline __m256 rnd8(__m256 v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return round8(v);
  } else {
    return v;
  }
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {  // v already rounded: keep the high halves
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round8(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// The same with 16 lanes, where the CPU has AVX-512 (each lane's arithmetic as the 8-lane code's)
#if defined(LLMCTL_LAYERS_AVX512)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 round16(__m512 v) {  // to bfloat16 (nearest even) and back, as round8
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int(0xFFFF0000u))));
}
template <typename T>
inline __m512 rnd16(__m512 v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return round16(v);
  } else {
    return v;
  }
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BFloat16* p, __m512 v) {
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(round16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
}
#endif

// res = h + res (res = h when `add` is false), rounded to T; out = w * T(res * rsqrt(mean(res^2)
// + eps)), rounded: RMSNorm (layers/layernorm.py) with its residual add, over n values.
template <typename T>
void add_rms_norm_row(const T* h, T* res, bool add, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if defined(LLMCTL_LAYERS_AVX512)
  __m512 acc16 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 r = load16(h + i);
    if (add) r = rnd16<T>(_mm512_add_ps(r, load16(res + i)));
    store16(res + i, r);
    acc16 = _mm512_fmadd_ps(r, r, acc16);
  }
  ss = _mm512_reduce_add_ps(acc16);
#endif
#if defined(LLMCTL_LAYERS_AVX2)
  __m256 acc = _mm256_setzero_ps();  // 8 partial sums (one chain of n adds: ~1 us at n = 576)
  for (; i + 8 <= n; i += 8) {
    __m256 r = load8(h + i);
    if (add) r = rnd8<T>(_mm256_add_ps(r, load8(res + i)));
    store8(res + i, r);
    acc = _mm256_fmadd_ps(r, r, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) ss += lane;
#endif
  for (; i < n; ++i) {
    const float r = add ? rnd<T>(widen(h[i]) + widen(res[i])) : widen(h[i]);
    res[i] = store<T>(r);
    ss += r * r;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(LLMCTL_LAYERS_AVX512)
  const __m512 vinv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = rnd16<T>(_mm512_mul_ps(load16(res + i), vinv16));
    store16(out + i, rnd16<T>(_mm512_mul_ps(load16(w + i), x)));
  }
#endif
#if defined(LLMCTL_LAYERS_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = rnd8<T>(_mm256_mul_ps(load8(res + i), vinv));
    store8(out + i, rnd8<T>(_mm256_mul_ps(load8(w + i), x)));
  }
#endif
  for (; i < n; ++i) out[i] = store<T>(widen(w[i]) * rnd<T>(widen(res[i]) * inv));
}

constexpr int64_t kMaxHeadDim = 512;

// RoPE on `heads` heads of D values at v (stride D), "rotate half": x1' = x1 c - x2 s,
// x2' = x2 c + x1 s, with c, s this position's rows of the float32 tables rounded to T and each
// product and sum rounded (torch's x * cos + rotate_half(x) * sin). D <= kMaxHeadDim, even.
template <typename T>
void rope_row(T* v, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  float c[kMaxHeadDim], s[kMaxHeadDim];  // the row as T holds it
  int64_t j = 0;
#if defined(LLMCTL_LAYERS_AVX512)
  for (; j + 16 <= D; j += 16) {
    _mm512_storeu_ps(c + j, rnd16<T>(_mm512_loadu_ps(cos + j)));
    _mm512_storeu_ps(s + j, rnd16<T>(_mm512_loadu_ps(sin + j)));
  }
#endif
  for (; j < D; ++j) c[j] = rnd<T>(cos[j]), s[j] = rnd<T>(sin[j]);
  for (int64_t head = 0; head < heads; ++head) {
    T* x = v + head * D;
    int64_t i = 0;
#if defined(LLMCTL_LAYERS_AVX512)
    const __m512 sign16 = _mm512_set1_ps(-0.f);
    for (; i + 16 <= half; i += 16) {
      const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
      __m512 a = rnd16<T>(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i)));
      __m512 b = rnd16<T>(_mm512_mul_ps(_mm512_xor_ps(x2, sign16), _mm512_loadu_ps(s + i)));
      __m512 d = rnd16<T>(_mm512_mul_ps(x2, _mm512_loadu_ps(c + i + half)));
      __m512 e = rnd16<T>(_mm512_mul_ps(x1, _mm512_loadu_ps(s + i + half)));
      __asm__("" : "+v"(a), "+v"(b), "+v"(d), "+v"(e));  // no fused multiply-add (below)
      store16(x + i, _mm512_add_ps(a, b));
      store16(x + i + half, _mm512_add_ps(d, e));
    }
#endif
#if defined(LLMCTL_LAYERS_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= half; i += 8) {
      const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
      __m256 a = rnd8<T>(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)));
      __m256 b = rnd8<T>(_mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + i)));
      __m256 d = rnd8<T>(_mm256_mul_ps(x2, _mm256_loadu_ps(c + i + half)));
      __m256 e = rnd8<T>(_mm256_mul_ps(x1, _mm256_loadu_ps(s + i + half)));
      // each product rounded on its own, as torch's ops round it: no fused multiply-add
      __asm__("" : "+x"(a), "+x"(b), "+x"(d), "+x"(e));
      store8(x + i, _mm256_add_ps(a, b));
      store8(x + i + half, _mm256_add_ps(d, e));
    }
#endif
    for (; i < half; ++i) {
      const float x1 = widen(x[i]), x2 = widen(x[i + half]);
      float a = rnd<T>(x1 * c[i]), b = rnd<T>(-x2 * s[i]);
      float d = rnd<T>(x2 * c[i + half]), e = rnd<T>(x1 * s[i + half]);
      __asm__("" : "+x"(a), "+x"(b), "+x"(d), "+x"(e));  // no fused multiply-add, as above
      x[i] = store<T>(a + b);
      x[i + half] = store<T>(d + e);
    }
  }
}

// out[0 .. I) = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as ATen computes it, with silu's
// output rounded to T before the product. With AVX2 a loop on SLEEF's exp (ATen's, the same
// bits): at::silu and mul_ (two TensorIterators and an allocation) took ~11 us a layer for
// SmolLM2's 1536 columns in float32 decode, the loop 2 us.

#if defined(LLMCTL_LAYERS_AVX512)
// silu of 16 lanes, rounded to T; 16 lanes where ATen runs 16 (the same exp): twice the 8-lane
// loop's rate. (Also the epilogue of the AMX gated MLP, gated_mlp_amx.cpp.)
template <typename T>
inline __m512 silu16(__m512 g) {
  const __m512 e = Sleef_expf16_u10avx512f(_mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(int(0x80000000u)))));
  return rnd16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}
#endif

template <typename T>
void silu_mul_compute(const T* gate, const T* up, T* out, int64_t I) {
  int64_t i = 0;
#if defined(LLMCTL_LAYERS_AVX512)
  for (; i + 16 <= I; i += 16)
    store16(out + i, rnd16<T>(_mm512_mul_ps(silu16<T>(load16(gate + i)), load16(up + i))));
#endif
#if defined(LLMCTL_LAYERS_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  auto eight = [&](__m256 g, __m256 u) {
    const __m256 e = Sleef_expf8_u10avx2(_mm256_xor_ps(g, sign));
    return rnd8<T>(_mm256_mul_ps(rnd8<T>(_mm256_div_ps(g, _mm256_add_ps(one, e))), u));
  };
  for (; i + 8 <= I; i += 8) store8(out + i, eight(load8(gate + i), load8(up + i)));
  if (i < I) {  // the tail through the same vector code, as ATen does it
    float g8[8] = {}, u8[8] = {}, o8[8];
    for (int64_t j = i; j < I; ++j) g8[j - i] = widen(gate[j]), u8[j - i] = widen(up[j]);
    _mm256_storeu_ps(o8, eight(_mm256_loadu_ps(g8), _mm256_loadu_ps(u8)));
    for (int64_t j = i; j < I; ++j) out[j] = store<T>(o8[j - i]);
  }
#else
  for (; i < I; ++i) {
    const float g = widen(gate[i]);
    out[i] = store<T>(rnd<T>(g / (1.f + std::exp(-g))) * widen(up[i]));
  }
#endif
}

// bfloat16 silu through a table: a bfloat16 gate is one of 65536 bit patterns, so the rounded
// silu of each is computed once, by silu_mul_compute's own vector code (its product by 1.0 is
// exact), and kept as the float32 it widens to (256 KiB; a layer's gates touch a few KiB of it).
// A row then costs a gather, a multiply and a rounding per 16 values where SLEEF's exp and a
// division cost ~55 cycles: SiLU-and-mul took 11 ms of each SmolLM2 layer in a 16 x 512-token
// bfloat16 prefill on the Intel AMX kind (2 threads), the table 5.5. The same bits as computing
// it, for every input; a row's tail too (silu_mul_compute's tail is its vector code as well).
inline const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<BFloat16> gate(65536), one(65536, BFloat16(1.f)), silu(65536);
    for (uint32_t b = 0; b < 65536; ++b)
      gate[b] = BFloat16(static_cast<uint16_t>(b), BFloat16::from_bits());
    silu_mul_compute<BFloat16>(gate.data(), one.data(), silu.data(), 65536);
    std::vector<float> widened(65536);
    for (uint32_t b = 0; b < 65536; ++b) widened[b] = static_cast<float>(silu[b]);
    return widened;
  }();
  return table.data();
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t I) {
  if constexpr (!std::is_same_v<T, BFloat16>) {
    silu_mul_compute<T>(gate, up, out, I);
  } else {
    const float* table = silu_bf16_table();
    int64_t i = 0;
#if defined(LLMCTL_LAYERS_AVX512)
    for (; i + 16 <= I; i += 16) {
      const __m512i bits =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i)));
      const __m512 s = _mm512_i32gather_ps(bits, table, 4);
      store16(out + i, _mm512_mul_ps(s, load16(up + i)));  // store16 rounds
    }
#endif
#if defined(LLMCTL_LAYERS_AVX2)
    for (; i + 8 <= I; i += 8) {
      const __m256i bits =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gate + i)));
      store8(out + i, _mm256_mul_ps(_mm256_i32gather_ps(table, bits, 4), load8(up + i)));
    }
#endif
    for (; i < I; ++i) out[i] = store<T>(table[gate[i].x] * widen(up[i]));
  }
}

}  // namespace llmctl_layers
