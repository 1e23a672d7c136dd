// Prefill GEMMs of packed 4/8-bit weights against int8 activations on AVX512-VNNI, for CPUs whose
// bfloat16 GEMM is AVX512-BF16 dot products (Zen 4): VPDPBUSD multiplies 64 pairs of bytes an
// instruction where VDPBF16PS multiplies 32 pairs of bfloat16, and both issue once a cycle there.
// The ops mirror amx_gemm.cpp's: a linear (int8_linear), a Llama-style MLP in one pass
// (int8_gated_mlp), and a linear whose rows are finished in cache by RoPE (int8_linear_rope) or
// by the residual add and RMSNorm (int8_linear_add_rms_norm). The quantized layers take them from
// INT8_LARGE_BATCH rows on that path (layers/gated_mlp.py, layers/linear_epilogue.py). A float32
// flavour for AVX2 CPUs without VNNI (int4_group_mm_int8_act, `avx2` below: VPMADDUBSW, 4-bit
// weights) takes the AVX2 path's prefill batches.
//
// Numerics (what differs from the bfloat16 path): each row of x is quantized per block of 32
// values, as llama.cpp quantizes activations for its integer dot products: s = amax / 127,
// a = round-to-nearest-even(x * (127 / amax)) in [-127, 127] (all zeros where amax is 0), and
// the output is W x^ for x^ = s a, the activations as quantized. With W[n, k] = d * q + m inside
// a block (q unsigned: 0..15 for 4 bits; an int8 weight q' is q = q' + 128 with m = -128 d), a
// block contributes
//     d * s * sum(q * a) + m * (s * sum(a))
// both sums exact in int32. Blocks add in K order in float32; the output is rounded to bfloat16
// once.
// Everything after a GEMM (SiLU-and-mul, RoPE, the residual add and the norm) rounds where the
// unfused layers round, with layer_ops_cpu.h's code, so the fused ops give the bits of the
// unfused int8 layers (tests/kernels/test_int8_gemm.py holds both to a float64 reference).
//
// Layout (int8_blocks, once a call: 0.84 ms for SmolLM2's gate/up weight): panels of 32 output
// columns, each [K / 4][32][4] bytes (a 32-bit word holds 4 consecutive k of one column, the
// operand VPDPBUSD wants), then the blocks' d and m as float32 [K / 32][32] each: 40 K bytes a
// panel. With gate_up_half, panel p holds gate columns 16 p .. 16 p + 15 and the up columns of
// the same features, so one panel's sums are SiLU-and-mul's two inputs.
//
// The loop: each thread takes panels of up to kPanelRows rows of x, quantizes them into buffers
// of its own, and multiplies them by every weight panel in turn; a micro tile is 6 rows x 32
// columns (12 int32 sums per block, 12 float32 totals, in registers). Per block of 32 k: 96
// VPDPBUSD, then per sum a conversion, a multiply (d times s), a multiply-add, and a multiply-add
// for m * s * sum(a). Those four share VPDPBUSD's pipes on Zen 4: with L1-resident operands a
// block takes 136 cycles (97 without them), 70% of VPDPBUSD's peak and 1.45x VDPBF16PS's
// multiply-adds a cycle; the m term cannot join the int32 sums for Q4_1 (m / d is not an
// integer). On the Zen 4 kind (2 threads, 8,192 rows) SmolLM2's shapes ran at 510-590 GFLOP/s
// against 300-440 for oneDNN's bfloat16 GEMM on the same weights expanded.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "layer_ops_cpu.h"
#include "quantized_matmul_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__) && defined(__F16C__) && defined(LLMCTL_LAYERS_AVX512)
#define LLMCTL_INT8 1
#include <immintrin.h>
#endif

// The float32 flavour (int4_group_mm_int8_act): AVX2 CPUs without VNNI (Zen 1-3), float32 x.
#if defined(__AVX2__) && defined(__FMA__)
#define LLMCTL_INT8_AVX2 1
#include <immintrin.h>
#endif

namespace llmctl_quantized {
namespace {

using Bf16 = c10::BFloat16;
constexpr int64_t kCols = 32;  // output columns per weight panel
constexpr int64_t kBlock = 32;  // k per quantization block (activations and weights)

inline int64_t panel_bytes(int64_t K) { return K * kCols + 2 * (K / kBlock) * kCols * 4; }

// Which weight row feeds column j of panel p.
inline int64_t panel_row(int64_t p, int64_t j, int64_t gate_up_half) {
  if (gate_up_half == 0) return p * kCols + j;
  return (j < 16 ? 0 : gate_up_half) + p * 16 + (j & 15);
}

template <typename S>
void lay_out_panel(const uint8_t* q, const S* scales, const S* zeros, int64_t bits, int64_t K,
                   int64_t G, int64_t g, int64_t p, int64_t gate_up_half, uint8_t* out) {
  const int64_t nb = K / kBlock;
  float* d = reinterpret_cast<float*>(out + K * kCols);
  float* m = d + nb * kCols;
  for (int64_t b = 0; b < nb; ++b) {
    // the block's 32 unsigned values of each of the panel's columns, then their 4-byte words
    // moved to [k / 4][column] (a 32 x 8 word transpose)
    alignas(64) uint32_t cols[kCols][kBlock / 4];
    for (int64_t j = 0; j < kCols; ++j) {
      const int64_t n = panel_row(p, j, gate_up_half);
      uint8_t* v = reinterpret_cast<uint8_t*>(cols[j]);
#if defined(__SSE2__)
      if (bits == 4) {
        const __m128i packed =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + b * 16));
        const __m128i low = _mm_set1_epi8(0x0F);
        _mm_store_si128(reinterpret_cast<__m128i*>(v), _mm_and_si128(packed, low));
        _mm_store_si128(reinterpret_cast<__m128i*>(v + 16),
                        _mm_and_si128(_mm_srli_epi16(packed, 4), low));
      } else {  // q' + 128
        const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
        const uint8_t* src = q + n * K + b * kBlock;
        for (int h = 0; h < 2; ++h)
          _mm_store_si128(reinterpret_cast<__m128i*>(v + 16 * h),
                          _mm_xor_si128(_mm_loadu_si128(
                                            reinterpret_cast<const __m128i*>(src + 16 * h)),
                                        flip));
      }
#else
      if (bits == 4) {
        const uint8_t* src = q + n * (K / 2) + b * 16;
        for (int t = 0; t < 16; ++t) v[t] = src[t] & 0x0F, v[t + 16] = src[t] >> 4;
      } else {
        const uint8_t* src = q + n * K + b * kBlock;
        for (int t = 0; t < kBlock; ++t) v[t] = src[t] ^ 0x80;  // q' + 128
      }
#endif
      const int64_t s = n * G + (b * kBlock) / g;
      d[b * kCols + j] = ld(scales, s);
      m[b * kCols + j] = bits == 4 ? ld(zeros, s) : -128.f * ld(scales, s);
    }
    uint32_t* words = reinterpret_cast<uint32_t*>(out) + b * (kBlock / 4) * kCols;
    for (int t = 0; t < kBlock / 4; ++t)
      for (int64_t j = 0; j < kCols; ++j) words[t * kCols + j] = cols[j][t];
  }
}

constexpr int64_t kPanelRows = 96;  // rows of x per thread panel (a multiple of 6 and of 4)

// One thread's quantized rows of x: int8 [rows, K], s and s * sum(a) [rows, K / 32]. fill: from
// bfloat16 x (the VNNI flavour) or float32 x (the AVX2 flavour), each flavour's quantize_rows.
struct QuantizedRows {
  std::vector<int8_t> a;
  std::vector<float> s, sum;
  void resize(int64_t rows, int64_t K) {
    a.resize(rows * K);
    s.resize(rows * (K / kBlock));
    sum.resize(rows * (K / kBlock));
  }
#if defined(LLMCTL_INT8)
  void fill(const Bf16* x, int64_t ldx, int64_t rows, int64_t K);
#endif
#if defined(LLMCTL_INT8_AVX2)
  void fill(const float* x, int64_t ldx, int64_t rows, int64_t K);
#endif
};

// Rows per thread panel for M rows: at most kPanelRows, a multiple of the micro tile's rows mr,
// and a number of panels the threads share evenly where M allows (256 rows on 2 threads and
// mr = 6: 4 of 66, 66, 66, 58).
int64_t panel_rows(int64_t M, int64_t mr) {
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  int64_t panels = std::max<int64_t>(T, (M + kPanelRows - 1) / kPanelRows);
  panels = (panels + T - 1) / T * T;
  const int64_t rows = (M + panels - 1) / panels;
  return std::max<int64_t>(mr, (rows + mr - 1) / mr * mr);
}

// f(r0, r1) on every thread panel of rows [r0, r1), the panels shared by the threads.
template <typename F>
void for_row_panels(int64_t M, int64_t mr, F&& f) {
  const int64_t pr = panel_rows(M, mr), panels = (M + pr - 1) / pr;
  at::parallel_for(0, panels, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b * pr, std::min(M, (b + 1) * pr));
  });
}

// f(p, panel, r0, n, a, s, sum) for each weight panel p in [0, panels) and, inside it, each tile
// of n <= mr rows of x from row r0 (a, s, sum: its quantized rows): a panel stays in cache across
// all the rows. Both flavours' panel_gemm walk their micro tiles this way.
template <typename F>
void for_tiles(const QuantizedRows& x, int64_t rows, int64_t K, const uint8_t* w, int64_t panels,
               int64_t mr, F&& f) {
  const int64_t nb = K / kBlock, stride = panel_bytes(K);
  for (int64_t p = 0; p < panels; ++p) {
    const uint8_t* panel = w + p * stride;
    for (int64_t r0 = 0; r0 < rows; r0 += mr)
      f(p, panel, r0, std::min(mr, rows - r0), x.a.data() + r0 * K, x.s.data() + r0 * nb,
        x.sum.data() + r0 * nb);
  }
}

#if defined(LLMCTL_INT8)
constexpr int kMR = 6;  // rows per micro tile

// rows x K bfloat16 values (row stride ldx) -> a [rows, K] int8, and s and s * sum(a)
// [rows, K / 32]: the blocks' quantization (header).
void quantize_rows(const Bf16* x, int64_t ldx, int64_t rows, int64_t K, int8_t* a, float* s,
                   float* sum) {
  const int64_t nb = K / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const Bf16* xr = x + r * ldx;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 v0 = llmctl_layers::load16(xr + b * kBlock);
      const __m512 v1 = llmctl_layers::load16(xr + b * kBlock + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      int8_t* dst = a + r * K + b * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
      s[r * nb + b] = amax / 127.f;
      // the quantized values' sum, exact in int32: m * s * sum(a) is the m part of W x^
      sum[r * nb + b] = float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))) * (amax / 127.f);
    }
  }
}

void QuantizedRows::fill(const Bf16* x, int64_t ldx, int64_t rows, int64_t K) {
  resize(rows, K);
  quantize_rows(x, ldx, rows, K, a.data(), s.data(), sum.data());
}

// The float32 totals of MR rows x 32 columns of one weight panel; epi(r, lo, hi) takes each row's
// two vectors of 16 columns.
template <int MR, typename Epi>
inline void micro_tile(const int8_t* a, const float* s, const float* sum, int64_t K,
                       const uint8_t* panel, Epi&& epi) {
  const int64_t nb = K / kBlock;
  const float* d = reinterpret_cast<const float*>(panel + K * kCols);
  const float* m = d + nb * kCols;
  __m512 f[MR][2];
  for (int r = 0; r < MR; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const uint8_t* w = panel + b * 8 * kCols * 4;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i w0 = _mm512_loadu_si512(w + t * kCols * 4);
      const __m512i w1 = _mm512_loadu_si512(w + t * kCols * 4 + 64);
      for (int r = 0; r < MR; ++r) {
        int32_t word;
        std::memcpy(&word, a + r * K + b * kBlock + t * 4, 4);
        const __m512i av = _mm512_set1_epi32(word);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, av);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, av);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d + b * kCols), d1 = _mm512_loadu_ps(d + b * kCols + 16);
    const __m512 m0 = _mm512_loadu_ps(m + b * kCols), m1 = _mm512_loadu_ps(m + b * kCols + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 sr = _mm512_set1_ps(s[r * nb + b]), xr = _mm512_set1_ps(sum[r * nb + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(d0, sr), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(d1, sr), f[r][1]);
      f[r][0] = _mm512_fmadd_ps(m0, xr, f[r][0]);
      f[r][1] = _mm512_fmadd_ps(m1, xr, f[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) epi(r, f[r][0], f[r][1]);
}

// rows of quantized x times weight panels [0, panels): epi(row, panel, lo, hi).
template <typename Epi>
void panel_gemm(const QuantizedRows& x, int64_t rows, int64_t K, const uint8_t* w,
                int64_t panels, Epi&& epi) {
  for_tiles(x, rows, K, w, panels, kMR,
            [&](int64_t p, const uint8_t* panel, int64_t r0, int64_t n, const int8_t* a,
                const float* s, const float* sum) {
              auto row = [&](int r, __m512 lo, __m512 hi) { epi(r0 + r, p, lo, hi); };
              switch (n) {
                case 6: micro_tile<6>(a, s, sum, K, panel, row); break;
                case 5: micro_tile<5>(a, s, sum, K, panel, row); break;
                case 4: micro_tile<4>(a, s, sum, K, panel, row); break;
                case 3: micro_tile<3>(a, s, sum, K, panel, row); break;
                case 2: micro_tile<2>(a, s, sum, K, panel, row); break;
                default: micro_tile<1>(a, s, sum, K, panel, row); break;
              }
            });
}

inline void store_bf16(Bf16* dst, __m512 lo, __m512 hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
}

// Each thread's linear output rows for a row op: the panel's rows in a buffer that stays in cache.
template <typename Pass>
void linear_panels(const Bf16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, Pass&& pass) {
  for_row_panels(M, kMR, [&](int64_t r0, int64_t r1) {
    thread_local QuantizedRows qx;
    thread_local std::vector<Bf16> buf;
    buf.resize((r1 - r0) * N);
    qx.fill(x + r0 * K, K, r1 - r0, K);
    panel_gemm(qx, r1 - r0, K, w, N / kCols, [&](int64_t r, int64_t p, __m512 lo, __m512 hi) {
      store_bf16(buf.data() + r * N + p * kCols, lo, hi);
    });
    pass(buf.data(), r0, r1);
  });
}
#endif

#if defined(LLMCTL_INT8_AVX2)
// The float32 flavour on AVX2 (no VNNI): VPMADDUBSW multiplies 32 pairs of bytes into 16 signed
// 16-bit sums of two products, one instruction a cycle on Zen 3 and 4 where float32 FMAs do 8
// multiply-adds twice a cycle. With 4-bit weights the 16-bit sums never saturate over a block:
// a product is at most 15 * 127, and a lane adds 16 of them (two a step, 8 steps of 4 k) into at
// most 30,480 < 32,767, so the steps add in 16 bits (VPADDW) and one VPMADDWD by ones a block
// widens them to int32: per 8 columns x 32 k, 8 VPMADDUBSW + 8 VPADDW where float32 takes 32
// FMAs. (8-bit weights, 0..255 as unsigned bytes, would overflow: not taken.) In L1 a micro tile
// of 4 rows x 16 columns ran at ~107 G multiply-adds/s a core on the Zen 4 kind (built for
// Zen 3, 256-bit), 1.85x the best float32 FMA tile on the same machine (58). The numerics are the
// VNNI flavour's (the same quantization of x per 32 values, the same float32 operations per
// block in the same order), from float32 x, into float32 y.
namespace avx2 {
constexpr int kMR = 4;  // rows per micro tile (two 8-column halves of 16 columns a pass)
// From this many rows W is laid out once for all threads and the threads split the rows; below
// it each thread lays out its own panels and takes every row (measured: see int4_group_mm_int8_act)
constexpr int64_t kLaidOutFrom = 256;

// rows x K float32 values (row stride ldx) -> int8 [rows, K], s and s * sum(a) [rows, K / 32]
void quantize_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, int8_t* a, float* s,
                   float* sum) {
  const int64_t nb = K / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xr + b * kBlock + 8 * i);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask),
                                              _mm256_and_ps(v[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask),
                                              _mm256_and_ps(v[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      // in [-127, 127]: the saturating packs are exact; they interleave 4-value groups of
      // the 128-bit lanes, which the permutation puts back in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + r * K + b * kBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      const __m256i t =
          _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      s[r * nb + b] = amax / 127.f;
      sum[r * nb + b] = float(_mm_cvtsi128_si32(t4)) * (amax / 127.f);
    }
  }
}

}  // namespace avx2

void QuantizedRows::fill(const float* x, int64_t ldx, int64_t rows, int64_t K) {
  resize(rows, K);
  avx2::quantize_rows(x, ldx, rows, K, a.data(), s.data(), sum.data());
}

namespace avx2 {

// One step of 4 k for 4 rows x 16 columns: each row's 4 int8 values broadcast, times the two
// 8-column halves of the weight words, added into the 16-bit sums. Written out because GCC's
// schedule of the intrinsics kept three broadcasts live, spilled a sum and reloaded a weight
// vector, and copied every sum between registers: 40 instructions a step for 8 VPMADDUBSW.
inline void t_step4(const uint8_t* w, const int8_t* a, int64_t K, __m256i (&acc)[4][2]) {
  __m256i w0, w1, av, p;
  asm("vmovdqu (%[w]), %[w0]\n\t"
      "vmovdqu 32(%[w]), %[w1]\n\t"
      "vpbroadcastd (%[a]), %[av]\n\t"
      "vpmaddubsw %[av], %[w0], %[p]\n\t"
      "vpaddw %[p], %[c00], %[c00]\n\t"
      "vpmaddubsw %[av], %[w1], %[p]\n\t"
      "vpaddw %[p], %[c01], %[c01]\n\t"
      "vpbroadcastd (%[a],%[K]), %[av]\n\t"
      "vpmaddubsw %[av], %[w0], %[p]\n\t"
      "vpaddw %[p], %[c10], %[c10]\n\t"
      "vpmaddubsw %[av], %[w1], %[p]\n\t"
      "vpaddw %[p], %[c11], %[c11]\n\t"
      "vpbroadcastd (%[a],%[K],2), %[av]\n\t"
      "vpmaddubsw %[av], %[w0], %[p]\n\t"
      "vpaddw %[p], %[c20], %[c20]\n\t"
      "vpmaddubsw %[av], %[w1], %[p]\n\t"
      "vpaddw %[p], %[c21], %[c21]\n\t"
      "vpbroadcastd (%[a3]), %[av]\n\t"
      "vpmaddubsw %[av], %[w0], %[p]\n\t"
      "vpaddw %[p], %[c30], %[c30]\n\t"
      "vpmaddubsw %[av], %[w1], %[p]\n\t"
      "vpaddw %[p], %[c31], %[c31]"
      : [c00] "+x"(acc[0][0]), [c01] "+x"(acc[0][1]), [c10] "+x"(acc[1][0]),
        [c11] "+x"(acc[1][1]), [c20] "+x"(acc[2][0]), [c21] "+x"(acc[2][1]),
        [c30] "+x"(acc[3][0]), [c31] "+x"(acc[3][1]), [w0] "=&x"(w0), [w1] "=&x"(w1),
        [av] "=&x"(av), [p] "=&x"(p)
      : [w] "r"(w), [a] "r"(a), [K] "r"(K), [a3] "r"(a + 3 * K)
      : "memory");
}

// MR rows x 16 columns (the `half` of a 32-column weight panel): epi(r, lo, hi) takes each row's
// columns 0-7 and 8-15 of that half.
template <int MR, typename Epi>
inline void micro_tile(const int8_t* a, const float* s, const float* sum, int64_t K,
                       const uint8_t* panel, int half, Epi&& epi) {
  const int64_t nb = K / kBlock;
  const float* d = reinterpret_cast<const float*>(panel + K * kCols) + half * 16;
  const float* m = d + nb * kCols;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MR][2];
  for (int r = 0; r < MR; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const uint8_t* w = panel + b * 8 * kCols * 4 + half * 64;
    if constexpr (MR == 4) {
      const int8_t* a0 = a + b * kBlock;
      for (int t = 0; t < 8; ++t) t_step4(w + t * kCols * 4, a0 + t * 4, K, acc);
    } else {
      // the rows left over: not unrolled (GCC's unrolled form spilled the 16-bit sums)
#pragma GCC unroll 1
      for (int t = 0; t < 8; ++t) {
        const __m256i w0 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * kCols * 4));
        const __m256i w1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * kCols * 4 + 32));
        for (int r = 0; r < MR; ++r) {
          int32_t word;
          std::memcpy(&word, a + r * K + b * kBlock + t * 4, 4);
          const __m256i av = _mm256_set1_epi32(word);
          acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, av));
          acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, av));
        }
      }
    }
    const __m256 d0 = _mm256_loadu_ps(d + b * kCols), d1 = _mm256_loadu_ps(d + b * kCols + 8);
    const __m256 m0 = _mm256_loadu_ps(m + b * kCols), m1 = _mm256_loadu_ps(m + b * kCols + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 sr = _mm256_set1_ps(s[r * nb + b]), xr = _mm256_set1_ps(sum[r * nb + b]);
      const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][0], ones));
      const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][1], ones));
      f[r][0] = _mm256_fmadd_ps(p0, _mm256_mul_ps(d0, sr), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(p1, _mm256_mul_ps(d1, sr), f[r][1]);
      f[r][0] = _mm256_fmadd_ps(m0, xr, f[r][0]);
      f[r][1] = _mm256_fmadd_ps(m1, xr, f[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) epi(r, f[r][0], f[r][1]);
}

// rows of quantized x times weight panels [0, panels) into y (row stride ldy, float32)
void panel_gemm(const QuantizedRows& x, int64_t rows, int64_t K, const uint8_t* w,
                int64_t panels, float* y, int64_t ldy) {
  for_tiles(x, rows, K, w, panels, kMR,
            [&](int64_t p, const uint8_t* panel, int64_t r0, int64_t n, const int8_t* a,
                const float* s, const float* sum) {
              for (int half = 0; half < 2; ++half) {
                float* out = y + r0 * ldy + p * kCols + half * 16;
                auto row = [&](int r, __m256 lo, __m256 hi) {
                  _mm256_storeu_ps(out + r * ldy, lo);
                  _mm256_storeu_ps(out + r * ldy + 8, hi);
                };
                switch (n) {
                  case 4: micro_tile<4>(a, s, sum, K, panel, half, row); break;
                  case 3: micro_tile<3>(a, s, sum, K, panel, half, row); break;
                  case 2: micro_tile<2>(a, s, sum, K, panel, half, row); break;
                  default: micro_tile<1>(a, s, sum, K, panel, half, row); break;
                }
              }
            });
}
}  // namespace avx2
#endif

const uint8_t* checked_weight(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(int8_built(), op, ": this build has no AVX512-VNNI int8 GEMM (the CPU lacks it, "
              "or LLMCTL_CPU_MARCH names a target without it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, op, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) == panel_bytes(K),
              op, ": w must be int8_blocks' [N / 32, 40 K] bytes for x's K = ", K);
  return w.data_ptr<uint8_t>();
}

}  // namespace

bool int8_built() {
#if defined(LLMCTL_INT8)
  return true;
#else
  return false;
#endif
}

bool int8_f32_built() {
#if defined(LLMCTL_INT8_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor int4_group_mm_int8_act(const at::Tensor& x, const at::Tensor& qp,
                                  const at::Tensor& scales, const at::Tensor& zeros,
                                  int64_t group_size) {
  constexpr const char* op = "int4_group_mm_int8_act";
  TORCH_CHECK(int8_f32_built(), op, ": this build has no AVX2 int8 GEMM (the CPU lacks AVX2 and "
              "FMA, or LLMCTL_CPU_MARCH names a target without them)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(qp.dim() == 2 && qp.scalar_type() == at::kByte && qp.is_contiguous(), op,
              ": qp must be a contiguous uint8 [N, K / 2] tensor (4-bit weights)");
  const int64_t M = x.size(0), K = x.size(1), N = qp.size(0);
  TORCH_CHECK(qp.size(1) * 2 == K, op, ": x has ", K, " features, the weight ", qp.size(1) * 2);
  TORCH_CHECK(K % kBlock == 0 && N % kCols == 0, op, ": N and K must be multiples of 32, got N = ",
              N, ", K = ", K);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0, op,
              ": group_size must be a multiple of 32 dividing K = ", K, ", got ", group_size);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size &&
                  zeros.sizes() == scales.sizes(),
              op, ": scales and zeros must be [N, K / group_size]");
  check_dequant(qp, scales, zeros, 4);
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(LLMCTL_INT8_AVX2)
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t panels = N / kCols, G = K / group_size;
  if (M >= avx2::kLaidOutFrom) {
    // W laid out once by all threads, then each thread its panels of rows against all of it
    const at::Tensor w = int8_blocks(qp, scales, zeros, 4, group_size, 0);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    for_row_panels(M, avx2::kMR, [&](int64_t r0, int64_t r1) {
      thread_local QuantizedRows qx;
      qx.fill(xp + r0 * K, K, r1 - r0, K);
      avx2::panel_gemm(qx, r1 - r0, K, wp, panels, yp + r0 * N, N);
    });
    return out;
  }
  // Fewer rows (batched decode): x quantized once, then each thread lays out its own weight
  // panels one at a time into a buffer that stays in cache and multiplies every row by it. W's
  // laid-out bytes (twice its packed size) never reach memory: at M = 64 a layout in memory
  // made the weights' bytes cross it three times, a third of the step's matmul time.
  QuantizedRows qx;
  qx.fill(xp, K, M, K);
  const uint8_t* qb = qp.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint8_t> panel;
    panel.resize(panel_bytes(K));
    for (int64_t p = p0; p < p1; ++p) {
      if (scales.scalar_type() == at::kHalf) {
        lay_out_panel(qb, scales.data_ptr<c10::Half>(), zeros.data_ptr<c10::Half>(), 4, K, G,
                      group_size, p, 0, panel.data());
      } else {
        lay_out_panel(qb, scales.data_ptr<float>(), zeros.data_ptr<float>(), 4, K, G, group_size,
                      p, 0, panel.data());
      }
      avx2::panel_gemm(qx, M, K, panel.data(), 1, yp + p * kCols, N);
    }
  });
#endif
  return out;
}

at::Tensor int8_blocks(const at::Tensor& q, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, int64_t bits, int64_t group_size,
                       int64_t gate_up_half) {
  check_dequant(q, scales, zeros, bits);
  TORCH_CHECK(q.dim() == 2 && scales.dim() == 2, "int8_blocks: q and scales must be 2-D");
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0 && K % group_size == 0,
              "int8_blocks: group_size must be a multiple of 32 dividing K = ", K, ", got ",
              group_size);
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / group_size,
              "int8_blocks: scales must be [N, K / group_size]");
  TORCH_CHECK(bits == 8 || (zeros.has_value() && zeros->sizes() == scales.sizes()),
              "int8_blocks: 4-bit weights need zeros shaped like the scales");
  TORCH_CHECK(N % kCols == 0, "int8_blocks: N must be a multiple of 32, got ", N);
  TORCH_CHECK(gate_up_half == 0 || (gate_up_half * 2 == N && gate_up_half % 16 == 0),
              "int8_blocks: gate_up_half must be half of N (", N, ") and a multiple of 16, got ",
              gate_up_half);
  const int64_t panels = N / kCols, stride = panel_bytes(K), G = K / group_size;
  at::Tensor out = at::empty({panels, stride}, q.options().dtype(at::kByte));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (scales.scalar_type() == at::kHalf) {
        const auto* z = zeros ? zeros->data_ptr<c10::Half>() : nullptr;
        lay_out_panel(qp, scales.data_ptr<c10::Half>(), z, bits, K, G, group_size, p,
                      gate_up_half, op + p * stride);
      } else {
        const float* z = zeros ? zeros->data_ptr<float>() : nullptr;
        lay_out_panel(qp, scales.data_ptr<float>(), z, bits, K, G, group_size, p, gate_up_half,
                      op + p * stride);
      }
    }
  });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w) {
  const uint8_t* wp = checked_weight(x, w, "int8_linear");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kCols;
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(LLMCTL_INT8)
  const auto* xp = x.data_ptr<Bf16>();
  auto* op = out.data_ptr<Bf16>();
  for_row_panels(M, kMR, [&](int64_t r0, int64_t r1) {
    thread_local QuantizedRows qx;
    qx.fill(xp + r0 * K, K, r1 - r0, K);
    panel_gemm(qx, r1 - r0, K, wp, N / kCols, [&](int64_t r, int64_t p, __m512 lo, __m512 hi) {
      store_bf16(op + (r0 + r) * N + p * kCols, lo, hi);
    });
  });
#endif
  return out;
}

at::Tensor int8_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  const uint8_t* gp = checked_weight(x, gate_up, "int8_gated_mlp");
  const int64_t M = x.size(0), H = x.size(1), I = gate_up.size(0) * 16;
  TORCH_CHECK(I % kBlock == 0, "int8_gated_mlp: I must be a multiple of 32, got ", I);
  TORCH_CHECK(down.dim() == 2 && down.scalar_type() == at::kByte && down.is_contiguous() &&
                  down.size(0) * kCols == H && down.size(1) == panel_bytes(I),
              "int8_gated_mlp: down must be int8_blocks' [H / 32, 40 I] bytes for H = ", H,
              ", I = ", I);
  at::Tensor out = at::empty({M, H}, x.options());
#if defined(LLMCTL_INT8)
  const auto* xp = x.data_ptr<Bf16>();
  const uint8_t* dp = down.data_ptr<uint8_t>();
  auto* op = out.data_ptr<Bf16>();
  const float* silu = llmctl_layers::silu_bf16_table();
  for_row_panels(M, kMR, [&](int64_t r0, int64_t r1) {
    thread_local QuantizedRows qx, qact;
    thread_local std::vector<Bf16> act;
    const int64_t rows = r1 - r0;
    act.resize(rows * I);
    qx.fill(xp + r0 * H, H, rows, H);
    // act = silu(gate) * up, each rounded where SiLU-and-mul rounds (gate and up: the GEMM's
    // bfloat16 outputs); silu through SiLU-and-mul's table of every bfloat16 gate (its bits)
    panel_gemm(qx, rows, H, gp, I / 16, [&](int64_t r, int64_t p, __m512 g, __m512 u) {
      const __m512i bits = _mm512_cvtepu16_epi32(
          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(g)));
      const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(bits, silu, 4),
                                     llmctl_layers::round16(u));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(act.data() + r * I + p * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    });
    qact.fill(act.data(), I, rows, I);
    panel_gemm(qact, rows, I, dp, H / kCols, [&](int64_t r, int64_t p, __m512 lo, __m512 hi) {
      store_bf16(op + (r0 + r) * H + p * kCols, lo, hi);
    });
  });
#endif
  return out;
}

at::Tensor int8_linear_rope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& positions,
                            const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                            int64_t rotary_columns) {
  const uint8_t* wp = checked_weight(x, w, "int8_linear_rope");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kCols;
  const at::Tensor pos = checked_rope_positions(positions, cos_cache, sin_cache, rotary_columns,
                                                M, N, "int8_linear_rope");
  const int64_t* pp = pos.data_ptr<int64_t>();
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(LLMCTL_INT8)
  const int64_t D = cos_cache.size(1);
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  auto* op = out.data_ptr<Bf16>();
  linear_panels(x.data_ptr<Bf16>(), M, K, wp, N, [&](Bf16* panel, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      Bf16* row = panel + (r - r0) * N;
      llmctl_layers::rope_row<Bf16>(row, rotary_columns / D, D, cp + pp[r] * D, sp + pp[r] * D);
      std::memcpy(op + r * N, row, N * sizeof(Bf16));
    }
  });
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8_linear_add_rms_norm(const at::Tensor& x,
                                                            const at::Tensor& w,
                                                            const at::Tensor& residual,
                                                            const at::Tensor& weight,
                                                            double eps) {
  const uint8_t* wp = checked_weight(x, w, "int8_linear_add_rms_norm");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kCols;
  check_add_rms_norm(residual, weight, M, N, "int8_linear_add_rms_norm");
  at::Tensor out = at::empty({M, N}, x.options()), res = at::empty({M, N}, x.options());
#if defined(LLMCTL_INT8)
  const auto* rp = residual.data_ptr<Bf16>();
  const auto* np = weight.data_ptr<Bf16>();
  auto* op = out.data_ptr<Bf16>();
  auto* sp = res.data_ptr<Bf16>();
  const float feps = static_cast<float>(eps);
  linear_panels(x.data_ptr<Bf16>(), M, K, wp, N, [&](Bf16* panel, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(sp + r * N, rp + r * N, N * sizeof(Bf16));
      llmctl_layers::add_rms_norm_row<Bf16>(panel + (r - r0) * N, sp + r * N, true, np,
                                            op + r * N, N, feps);
    }
  });
#endif
  return {out, res};
}

}  // namespace llmctl_quantized
