// A 16 x 16 transpose of 32-bit words in AVX-512 registers: the step that lays bfloat16 rows out
// in the VNNI pairs brgemm's B operand takes (a word is a pair of neighbours along K). Used by the
// batched quantized matmul (x^T, and the transposed output) and the prefill attention kernel (the
// keys of the paged cache as K^T).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace llmctl_kernels {

// v[i] word j -> v[j] word i, for 16 x 16 32-bit words.
inline void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: word pairs of rows i, i + 1
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // v[i + c], lane L: word 4 L + c of rows i .. i + 3
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of v[c], v[4 + c], v[8 + c], v[12 + c]
    const __m512i a = _mm512_shuffle_i32x4(v[c], v[4 + c], 0x44);  // lanes 0, 1 of each
    const __m512i b = _mm512_shuffle_i32x4(v[c], v[4 + c], 0xEE);  // lanes 2, 3 of each
    const __m512i d = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0x44);
    const __m512i e = _mm512_shuffle_i32x4(v[8 + c], v[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(a, d, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(a, d, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(b, e, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(b, e, 0xDD);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

}  // namespace llmctl_kernels

#endif
