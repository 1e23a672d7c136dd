// exp(x) for x <= 0, 16 float32 lanes with AVX-512: the softmax's exp(score - max) of the paged
// attention extension's kernels (paged_attention_cpu.cpp's decode, prefill_attention_cpu.cpp's
// prefill). Cephes' expf polynomial after a range reduction, about 1 ulp; -inf and x < -104
// give 0.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace llmctl_attention {

inline __m512 exp_nonpositive(__m512 a) {
  __m512 x = _mm512_max_ps(a, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

}  // namespace llmctl_attention

#endif
