// Batched quantized matmuls with bfloat16 activations: y[M, N] = x[M, K] W^T, W expanded tile by
// tile into bfloat16 and multiplied by oneDNN's brgemm kernel (torch's cpublas::brgemm), which
// runs on AMX tiles where the CPU has them and on AVX512-BF16 dot products otherwise.
//
// y^T = W x^T: a thread owns whole tiles of NT rows of W (NT a multiple of 16). It expands a
// tile, once, into bfloat16 rows (brgemm's A operand, row-major: a row's neighbours along K are
// already the pairs AMX multiplies), then multiplies it by x^T, blocks of 64 rows of x at a time,
// and writes the float32 sums, transposed 16 x 16 in registers and rounded, into its columns of
// y. x^T is laid out once per call in the VNNI layout brgemm's B operand takes (a 32-bit word
// holds the pair x[m][k], x[m][k + 1]; the words of one k pair lie side by side for all rows of
// x: a transpose of x's words). The tile (K * NT * 2 bytes: 144 KiB for SmolLM2's K = 576 and
// NT = 128) stays in the core's cache while x^T streams past, so each weight is expanded once per
// matmul. An earlier version expanded W as the B operand, in VNNI pairs, which cost a 16 x 16
// word transpose per 512 weights: a third of the expansion's instructions. W as A took SmolLM2's
// 64-sequence decode (W2) from 1,235 to about 1,400 tokens/s on the Intel AMX kind.
//
// With AVX512-BF16 a row's 32 weights of one k chunk are expanded in registers: 4-bit ones as a
// word permute of the group's 16 possible values (q * scale + zero for q = 0..15, rounded once
// to bfloat16), int8 ones converted to float, scaled and rounded; one 64-byte store. Without it
// (a build for an older CPU) every weight is expanded one by one: the same values, slowly. One
// thread of the Intel AMX kind multiplies SmolLM2's 576 x 576 weight by 64 rows in 64-67 us
// (F.linear on the same weights in bfloat16: 79), the expansion about 40% of it (perf); brgemm's
// AMX loop is bound by its tile loads from L2 (~1 TFLOP/s a core here: an AMX loop of our own,
// 2 x 2 tiles with or without K blocks, ran no faster).
//
// Rounding: each weight is the float32 value dequantize_rows gives (q * scale + zero, one
// rounding; exact for GGUF's fp16 scales), rounded to the nearest bfloat16 (ties to even) as
// torch's .to(torch.bfloat16) rounds it, so these tiles hold exactly the weights of the float path
// on the dequantized checkpoint in bfloat16. Sums are float32, the output rounded once.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "quantized_matmul_cpu.h"
#include "transpose16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LLMCTL_Q_BF16 1
#include <immintrin.h>
#endif

namespace llmctl_quantized {
namespace {

constexpr int64_t kRowBlock = 64;  // rows of x (columns of x^T) per brgemm call
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead expand_rows fetches packed rows

template <typename S>
struct Rows {  // W[n, k] = q[n, k] * scales[n, k / g] + zeros[n, k / g]
  const uint8_t* q;  // int4: [N, K / 2] nibble pairs (Q4_0 order); int8: [N, K]
  const S* scales;
  const S* zeros;  // nullptr for int8
  int64_t bits, K, G, g;

  float value(int64_t n, int64_t k) const {
    const int64_t gi = n * G + k / g;
    if (bits == 8) return float(reinterpret_cast<const int8_t*>(q)[n * K + k]) * ld(scales, gi);
    const int64_t chunk = k / 32 * 32, j = k % 32;
    const uint8_t byte = q[n * (K / 2) + chunk / 2 + j % 16];
    const float nibble = float(j < 16 ? byte & 0x0F : byte >> 4);
    return std::fma(nibble, ld(scales, gi), ld(zeros, gi));
  }
  // The register path: whole 32-weight chunks; int8: one scale per 16 weights; int4: one
  // group (a 16-value table) per chunk or more, as pack_groups requires.
  bool chunked() const { return K % 32 == 0 && g % (bits == 4 ? 32 : 16) == 0; }
};

inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }  // round to nearest even

#if defined(LLMCTL_Q_BF16)
// 32 int8 weights of one row as 32 bfloat16 values: q the chunk's 32 bytes, scale s for the
// first 16 and s2 for the last (a group of 16 may end between them). (4-bit rows: expand_int4_row.)
inline __m512i int8_chunk_bf16(const int8_t* q, float s, float s2) {
  const __m128i* p = reinterpret_cast<const __m128i*>(q);
  const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))),
                                  _mm512_set1_ps(s));
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), _mm512_set1_ps(s2));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo: the first 16 values
}
#endif

// The float32 scales and zeros of rows [n0, n0 + rows): [rows, G] each (zeros only with int4).
// (float16 ones 16 at a time where the build has AVX-512: one at a time they took a fifth of
// the tiles' expansion time.)
inline void widen(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void widen(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(LLMCTL_Q_BF16)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = ld(src, i);
}

template <typename S>
void widen_scales(const Rows<S>& w, int64_t n0, int64_t rows, float* s, float* z) {
  widen(w.scales + n0 * w.G, rows * w.G, s);
  if (w.zeros != nullptr) widen(w.zeros + n0 * w.G, rows * w.G, z);
}

template <typename S>
Rows<S> rows_of(const at::Tensor& q, const at::Tensor& scales,
                const std::optional<at::Tensor>& zeros, int64_t bits, int64_t g) {
  const int64_t K = bits == 4 ? q.size(1) * 2 : q.size(1);
  const S* zp = zeros.has_value() ? zeros->data_ptr<S>() : nullptr;
  TORCH_CHECK(bits == 8 || zp != nullptr, "4-bit weights need zeros");
  return Rows<S>{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<S>(), zp, bits, K,
                 K / g, g};
}

#if defined(LLMCTL_Q_BF16)
// One row of 4-bit weights as bfloat16: per group, the 16 values q * s + z can take (q = 0..15)
// rounded once to bfloat16 into a table, then each 32-weight chunk is a word permute of that
// table by its nibbles (vpermw): the same bits as converting each weight, 12% faster. The
// loops walk groups, then chunks: no division per chunk (a k % g and k / g per chunk cost
// about 10% of a 3072 x 576 expansion).
inline void expand_int4_row(const uint8_t* q, int64_t K, int64_t g, const float* s,
                            const float* z, uint16_t* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {  // g: a multiple of 32 (pack_groups)
    const __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[gi]), _mm512_set1_ps(z[gi]));
    const __m512i table = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    for (int64_t k = k0; k < k0 + g; k += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));  // weights k .. k + 31
      _mm512_storeu_si512(out + k, _mm512_permutexvar_epi16(idx, table));
    }
  }
}
#endif

// Rows [n0, n0 + rows) of W as bfloat16, row-major: Wt[r][k] (the A operand of brgemm needs no
// VNNI pairing: a row's neighbours along K are already pairs). sz: room for 2 * rows * G floats.
template <typename S>
void expand_rows(const Rows<S>& w, int64_t n0, int64_t rows, uint16_t* Wt, float* sz) {
#if defined(LLMCTL_Q_BF16)
  if (w.chunked()) {
    float *s = sz, *z = sz + rows * w.G;
    widen_scales(w, n0, rows, s, z);
    // The packed rows are read once a step, from memory (a batch's KV cache and the weights
    // outgrow the cache): fetch the rows ~4 KB ahead, where the hardware's prefetchers stop at
    // each page and at each tile's start (W2: the expansion had stalled on these loads).
    const int64_t row_bytes = w.bits == 4 ? w.K / 2 : w.K;
    const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
    // (An address, not a pointer into W: past W's last rows it points at nothing, and a
    // prefetch of it loads nothing.)
    const uintptr_t next = reinterpret_cast<uintptr_t>(w.q) + (n0 + ahead) * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + r * row_bytes + b), _MM_HINT_T0);
      }
      uint16_t* out = Wt + r * w.K;
      const float *rs = s + r * w.G, *rz = z + r * w.G;
      if (w.bits == 4) {
        expand_int4_row(w.q + (n0 + r) * (w.K / 2), w.K, w.g, rs, rz, out);
        continue;
      }
      const auto* q = reinterpret_cast<const int8_t*>(w.q) + (n0 + r) * w.K;
      for (int64_t k = 0, gi = 0, next = w.g; k < w.K; k += 32) {  // no division per chunk
        while (k >= next) ++gi, next += w.g;
        const float s2 = rs[k + 16 >= next ? gi + 1 : gi];  // a group of 16 may end mid-chunk
        _mm512_storeu_si512(out + k, int8_chunk_bf16(q + k, rs[gi], s2));
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < w.K; ++k) Wt[r * w.K + k] = bf16_bits(w.value(n0 + r, k));
}

// x^T in the VNNI layout brgemm's B operand takes: XB[k / 2][m] = (x[m][k], x[m][k + 1]), Mp
// columns (M rounded up to 16; the padding zero). A word of x is already such a pair, so this is
// a transpose of [M, K / 2] words, 16 x 16 at a time in registers.
std::vector<uint32_t> vnni_columns(const c10::BFloat16* x, int64_t M, int64_t K, int64_t Mp) {
  const int64_t K2 = K / 2;
  std::vector<uint32_t> XB(K2 * Mp, 0u);
  const auto* xs = reinterpret_cast<const uint32_t*>(x);  // a word: the pair (k, k + 1)
  int64_t k0 = 0;
#if defined(LLMCTL_Q_BF16)
  for (; k0 + 16 <= K2; k0 += 16) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      __m512i v[16];
      for (int64_t i = 0; i < 16; ++i)
        v[i] = m0 + i < M ? _mm512_loadu_si512(xs + (m0 + i) * K2 + k0) : _mm512_setzero_si512();
      llmctl_kernels::transpose16(v);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(XB.data() + (k0 + j) * Mp + m0, v[j]);
    }
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k2 = k0; k2 < K2; ++k2) XB[k2 * Mp + m] = xs[m * K2 + k2];
  return XB;
}

// 32 bfloat16 rows of K values (Wt, row-major) as one block of AMX's B operand: B[k / 2][n] =
// the word (Wt[n][k], Wt[n][k + 1]), 32 words a k pair: a transpose of [32, K / 2] words, 16 x 16
// at a time in registers. K: a multiple of 32.
void vnni_block(const uint16_t* Wt, int64_t K, uint32_t* B) {
  const int64_t K2 = K / 2;
  const auto* ws = reinterpret_cast<const uint32_t*>(Wt);
#if defined(LLMCTL_Q_BF16)
  for (int64_t k0 = 0; k0 < K2; k0 += 16) {
    for (int64_t h = 0; h < 32; h += 16) {
      __m512i v[16];
      for (int64_t i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(ws + (h + i) * K2 + k0);
      llmctl_kernels::transpose16(v);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(B + (k0 + j) * 32 + h, v[j]);
    }
  }
#else
  for (int64_t n = 0; n < 32; ++n)
    for (int64_t k2 = 0; k2 < K2; ++k2) B[k2 * 32 + n] = ws[n * K2 + k2];
#endif
}

// y[j][i] = bfloat16(C[i][j]) for i < rows, j < mb; C: [rows, ldc] float32, y's rows N apart.
void store_columns(const float* C, int64_t ldc, int64_t rows, int64_t mb, c10::BFloat16* y,
                   int64_t N) {
  int64_t i0 = 0;
#if defined(LLMCTL_Q_BF16)
  for (; i0 + 16 <= rows; i0 += 16) {
    int64_t j0 = 0;
    for (; j0 + 16 <= mb; j0 += 16) {
      __m512i v[16];
      for (int64_t i = 0; i < 16; ++i)
        v[i] = _mm512_loadu_si512(C + (i0 + i) * ldc + j0);
      llmctl_kernels::transpose16(v);  // v[j]: column j0 + j of C, rows i0 .. i0 + 15
      for (int64_t j = 0; j < 16; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (j0 + j) * N + i0),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_castsi512_ps(v[j]))));
    }
    for (int64_t j = j0; j < mb; ++j)
      for (int64_t i = i0; i < i0 + 16; ++i) y[j * N + i] = c10::BFloat16(C[i * ldc + j]);
  }
#endif
  for (int64_t j = 0; j < mb; ++j)
    for (int64_t i = i0; i < rows; ++i) y[j * N + i] = c10::BFloat16(C[i * ldc + j]);
}

// y^T = W x^T, tile by tile: a thread expands NT rows of W into bfloat16 rows (brgemm's A), once,
// and multiplies them by x^T (B, in VNNI pairs, laid out once per call), kRowBlock columns at a
// time. Expanding W as A rather than B spares the 16 x 16 word transposes the VNNI layout needs:
// a third of the expansion's instructions.
template <typename S>
void tiled_mm(const at::Tensor& x, const Rows<S>& w, int64_t N, int64_t NT, at::Tensor& y) {
  const int64_t M = x.size(0), K = w.K, tiles = (N + NT - 1) / NT, Mp = (M + 15) / 16 * 16;
  const std::vector<uint32_t> XB = vnni_columns(x.data_ptr<c10::BFloat16>(), M, K, Mp);
  const auto* xb = reinterpret_cast<const c10::BFloat16*>(XB.data());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // uninitialised: each tile writes the rows of Wt, C and sz it reads
    const int64_t ldc = std::min(Mp, kRowBlock);
    std::unique_ptr<uint16_t[]> Wt(new uint16_t[NT * K]);
    std::unique_ptr<float[]> C(new float[NT * ldc]), sz(new float[2 * NT * w.G]);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT, rows = std::min(NT, N - n0);
      expand_rows(w, n0, rows, Wt.get(), sz.get());
      const auto* a = reinterpret_cast<const c10::BFloat16*>(Wt.get());
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        const int64_t mb = std::min(kRowBlock, M - m0), nb = std::min(kRowBlock, Mp - m0);
        at::native::cpublas::brgemm(rows, nb, K, K, Mp, ldc, false, a, xb + 2 * m0, C.get(), true);
        store_columns(C.get(), ldc, rows, mb, yp + m0 * N + n0, N);
      }
    }
    at::native::cpublas::brgemm_release(true);  // this thread's AMX tile state
  });
}

}  // namespace

at::Tensor bf16_tiled_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t bits,
                               int64_t group_size, int64_t tile_rows) {
  check_dequant(q, scales, zeros, bits);
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.size(1) == K,
              "x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && K % 2 == 0,
              "K must be even and a multiple of group_size");
  TORCH_CHECK(tile_rows > 0 && tile_rows % 16 == 0, "tile_rows must be a multiple of 16");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (scales.scalar_type() == at::kHalf) {
    tiled_mm(x, rows_of<c10::Half>(q, scales, zeros, bits, group_size), N, tile_rows, y);
  } else {
    tiled_mm(x, rows_of<float>(q, scales, zeros, bits, group_size), N, tile_rows, y);
  }
  return y;
}

at::Tensor dequantize_rows_bf16(const at::Tensor& q, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, int64_t bits,
                                int64_t group_size, int64_t n0, int64_t n1) {
  check_dequant(q, scales, zeros, bits);
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N, "row range out of bounds");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "K must be a multiple of group_size");
  at::Tensor w = at::empty({n1 - n0, K}, scales.options().dtype(at::kBFloat16));
  auto* wp = reinterpret_cast<uint16_t*>(w.data_ptr());
  auto run = [&](const auto& rows) {  // the tiles' row expansion, rows [begin, end) at a time
    at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> sz(2 * (end - begin) * rows.G);
      expand_rows(rows, begin, end - begin, wp + (begin - n0) * K, sz.data());
    });
  };
  if (scales.scalar_type() == at::kHalf) {
    run(rows_of<c10::Half>(q, scales, zeros, bits, group_size));
  } else {
    run(rows_of<float>(q, scales, zeros, bits, group_size));
  }
  return w;
}

at::Tensor vnni_blocks_bf16(const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zeros, int64_t bits,
                            int64_t group_size, int64_t gate_up_half) {
  check_dequant(q, scales, zeros, bits);
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "K must be a multiple of group_size");
  TORCH_CHECK(K % 32 == 0, "vnni_blocks_bf16: K must be a multiple of 32, got ", K);
  if (gate_up_half > 0) {
    TORCH_CHECK(N == 2 * gate_up_half && gate_up_half % 16 == 0,
                "vnni_blocks_bf16: gate_up_half must be half of the ", N,
                " rows and a multiple of 16");
  } else {
    TORCH_CHECK(N % 32 == 0, "vnni_blocks_bf16: the rows must be a multiple of 32, got ", N);
  }
  at::Tensor out = at::empty({N / 32, K / 2, 32, 2}, scales.options().dtype(at::kBFloat16));
  auto* bp = reinterpret_cast<uint32_t*>(out.data_ptr());
  auto run = [&](const auto& rows) {
    at::parallel_for(0, N / 32, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint16_t> Wt(32 * K);
      std::vector<float> sz(2 * 16 * rows.G);
      for (int64_t b = b0; b < b1; ++b) {
        // block b: rows 16 b .. and gate_up_half + 16 b .. (gate beside up), or rows 32 b ..
        const int64_t first = gate_up_half > 0 ? 16 * b : 32 * b;
        const int64_t second = gate_up_half > 0 ? gate_up_half + 16 * b : 32 * b + 16;
        expand_rows(rows, first, 16, Wt.data(), sz.data());
        expand_rows(rows, second, 16, Wt.data() + 16 * K, sz.data());
        vnni_block(Wt.data(), K, bp + b * (K / 2) * 32);
      }
    });
  };
  if (scales.scalar_type() == at::kHalf) {
    run(rows_of<c10::Half>(q, scales, zeros, bits, group_size));
  } else {
    run(rows_of<float>(q, scales, zeros, bits, group_size));
  }
  return out;
}

}  // namespace llmctl_quantized
