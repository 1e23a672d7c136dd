// Block-FP8 weights times float activations on the CPU: y[M, N] = x[M, K] W[N, K]^T, with W
// never materialised in float beyond a tile.
//
//   W[n, k] = fp8_e4m3(q[n, k]) * scales[n, k / g]
//
// q: [N, K] uint8, the bits of float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa
// bits; no infinities); scales: [N, ceil(K / g)] float32, the checkpoint's weight_scale_inv of
// the 128 x 128 block each row and group lies in (fp8_matmul.py expands the block rows); the
// last group of a row may be partial (K not a multiple of g).
//
// Decoding an FP8 byte: its 7 magnitude bits shifted left by 7 are the bits of a float16 equal to
// the FP8 value / 256 (the exponent bias differs by 8; FP8 subnormals land on float16 subnormals,
// which F16C converts exactly), and the sign moves to bit 15. So 8 bytes become 8 floats with a
// widen, two ANDs, two shifts, an OR and _mm256_cvtph_ps; the 256 is folded into the scale, and
// w = (fp8 / 256) * (256 * scale) is the float32 product fp8 * scale rounded once: the same bits
// as dequantizing W first (what a reference on the dequantized weights multiplies).
//
// Decode (small M): each thread owns a range of output rows and reads each weight byte once for
// all M activation rows. Larger M: `fp8_tiled_mm` expands tiles of W to float32 and multiplies
// them with torch's GEMM, as quantized_matmul_cpu.cpp's tiled_group_mm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMCTL_FP8_AVX2 1
#include <immintrin.h>
#endif

#ifndef LLMCTL_OP_NAMESPACE
#define LLMCTL_OP_NAMESPACE llmctl_fp8_matmul
#endif

namespace {

constexpr int kMaxRows = 4;  // activation rows per pass over a weight row

// FP8 byte -> float16 bits of its value / 256.
inline uint16_t fp8_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

// The scalar path's table: fp8 / 256 for each byte.
struct Table {
  float v[256];
  Table() {
    for (int b = 0; b < 256; ++b) v[b] = static_cast<float>(c10::Half(fp8_half_bits(b), c10::Half::from_bits()));
  }
};
const Table& table() {
  static const Table t;
  return t;
}

#if defined(LLMCTL_FP8_AVX2)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// 8 FP8 bytes -> 8 floats of their value / 256.
inline __m256 fp8x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
}
#endif

// One weight row against R activation rows: out[r] = sum_k x[r, k] * W[k].
template <int R>
void row_fp8(const uint8_t* q, const float* scales, const float* x, int64_t ldx, int64_t K,
             int64_t g, float* out) {
  const float* lut = table().v;
  float total[R];
  for (int r = 0; r < R; ++r) total[r] = 0.f;
#if defined(LLMCTL_FP8_AVX2)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#endif
  for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
    const float s = scales[gi] * 256.f;  // exact: a power of two
    const int64_t k1 = std::min(K, k0 + g);
    int64_t k = k0;
#if defined(LLMCTL_FP8_AVX2)
    const __m256 vs = _mm256_set1_ps(s);
    for (; k + 8 <= k1; k += 8) {
      const __m256 w = _mm256_mul_ps(fp8x8(q + k), vs);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + k), acc[r]);
    }
#endif
    for (; k < k1; ++k) {
      const float w = lut[q[k]] * s;
      for (int r = 0; r < R; ++r) total[r] += w * x[r * ldx + k];
    }
  }
  for (int r = 0; r < R; ++r) {
#if defined(LLMCTL_FP8_AVX2)
    total[r] += hsum(acc[r]);
#endif
    out[r] = total[r];
  }
}

void check(const at::Tensor& q, const at::Tensor& scales, int64_t g) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(),
              "q must be a contiguous uint8 [N, K] tensor (float8_e4m3fn bits)");
  TORCH_CHECK(g > 0, "group_size must be positive");
  const int64_t N = q.size(0), K = q.size(1), G = (K + g - 1) / g;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == G,
              "scales must be a contiguous float32 [N, ceil(K / group_size)] tensor");
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [M, K] tensor");
}

at::Tensor fp8_group_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        int64_t group_size) {
  check(q, scales, group_size);
  const int64_t N = q.size(0), K = q.size(1), G = scales.size(1), M = x.size(0);
  check_x(x, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
        const float* xr = xp + m0 * K;
        const uint8_t* qr = qp + n * K;
        const float* sr = sp + n * G;
        switch (rows) {
          case 4: row_fp8<4>(qr, sr, xr, K, K, group_size, out); break;
          case 3: row_fp8<3>(qr, sr, xr, K, K, group_size, out); break;
          case 2: row_fp8<2>(qr, sr, xr, K, K, group_size, out); break;
          default: row_fp8<1>(qr, sr, xr, K, K, group_size, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) yp[(m0 + r) * N + n] = out[r];
      }
    }
  });
  return y;
}

// Rows [n0, n1) of W into w (row-major, K floats a row), on the calling thread.
void dequantize_into(const uint8_t* qp, const float* sp, int64_t K, int64_t G, int64_t g,
                     int64_t n0, int64_t n1, float* wp) {
  const float* lut = table().v;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qr = qp + n * K;
    float* wr = wp + (n - n0) * K;
    for (int64_t k0 = 0, gi = 0; k0 < K; k0 += g, ++gi) {
      const float s = sp[n * G + gi] * 256.f;
      const int64_t k1 = std::min(K, k0 + g);
      int64_t k = k0;
#if defined(LLMCTL_FP8_AVX2)
      const __m256 vs = _mm256_set1_ps(s);
      for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(wr + k, _mm256_mul_ps(fp8x8(qr + k), vs));
#endif
      for (; k < k1; ++k) wr[k] = lut[qr[k]] * s;
    }
  }
}

at::Tensor fp8_dequantize_rows(const at::Tensor& q, const at::Tensor& scales, int64_t group_size,
                               int64_t n0, int64_t n1) {
  check(q, scales, group_size);
  const int64_t N = q.size(0), K = q.size(1), G = scales.size(1);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N, "row range out of bounds");
  at::Tensor w = at::empty({n1 - n0, K}, scales.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    dequantize_into(qp, sp, K, G, group_size, begin, end, wp + (begin - n0) * K);
  });
  return w;
}

// The batched path: tiles of `tile_rows` rows of W expanded to float32 and multiplied with
// torch's GEMM on the thread that owns the tile, in one parallel region.
at::Tensor fp8_tiled_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        int64_t group_size, int64_t tile_rows) {
  check(q, scales, group_size);
  const int64_t N = q.size(0), K = q.size(1), G = scales.size(1);
  check_x(x, K);
  TORCH_CHECK(tile_rows > 0, "tile_rows must be positive");
  const int64_t M = x.size(0), tiles = (N + tile_rows - 1) / tile_rows;
  at::Tensor yt = at::empty({N, M}, x.options());  // W x^T: each tile owns whole rows
  const at::Tensor xt = x.t();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  // The engine runs under torch.inference_mode(): the worker threads must be in it too.
  const bool inference_mode = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference_mode);
    at::Tensor w = at::empty({tile_rows, K}, x.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, n1 = std::min(N, n0 + tile_rows);
      dequantize_into(qp, sp, K, G, group_size, n0, n1, w.data_ptr<float>());
      at::Tensor out = yt.narrow(0, n0, n1 - n0);
      at::mm_out(out, w.narrow(0, 0, n1 - n0), xt);
    }
  });
  return yt.t().contiguous();
}

}  // namespace

#define LLMCTL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LLMCTL_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

LLMCTL_LIBRARY(LLMCTL_OP_NAMESPACE, m) {
  m.def("fp8_group_mm(Tensor x, Tensor q, Tensor scales, int group_size) -> Tensor");
  m.def(
      "fp8_dequantize_rows(Tensor q, Tensor scales, int group_size, int n0, int n1) -> Tensor");
  m.def(
      "fp8_tiled_mm(Tensor x, Tensor q, Tensor scales, int group_size, int tile_rows) -> Tensor");
}

LLMCTL_LIBRARY_IMPL(LLMCTL_OP_NAMESPACE, CPU, m) {
  m.impl("fp8_group_mm", &fp8_group_mm);
  m.impl("fp8_dequantize_rows", &fp8_dequantize_rows);
  m.impl("fp8_tiled_mm", &fp8_tiled_mm);
}
