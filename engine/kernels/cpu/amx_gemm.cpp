// GEMMs of our own on AMX tiles for prefill-sized batches of bfloat16 rows, with the weights laid
// out by vnni_blocks_bf16 (expanded from the packed 4/8-bit weights once a call, ~0.3 ms a
// SmolLM2 layer): a Llama-style MLP in one pass, out = (silu(x Wg^T) * (x Wu^T)) Wd^T
// (amx_gated_mlp), a plain linear, out = x W^T (amx_linear), and a linear whose panel of output
// rows is finished in L2 by the row op after it before it leaves: RoPE after QKV
// (amx_linear_rope), the residual add and RMSNorm after O (amx_linear_add_rms_norm; RoPE had read
// QKV's output back from memory at 2.9 ms a SmolLM2 layer). The quantized layers take them from
// BF16_LARGE_BATCH rows on the AMX path (layers/gated_mlp.py, layers/linear_epilogue.py).
//
// Why the MLP is one kernel: unfused, the [M, 2 I] gate/up output (50 MB for SmolLM2's
// 8,192-token step) goes to memory, SiLU-and-mul reads it back and writes [M, I], and the down
// GEMM reads that. Here each thread takes panels of kPanelRows rows of x: the panel's x rows
// (295 KB) and its activation [kPanelRows, I] (786 KB) stay in the core's L2, and only x, the
// weights and the output [M, H] cross memory. Measured on the Intel AMX kind (2 threads, 8,192 x
// 576 -> 1,536 -> 576, bfloat16 weights as given): 16.5-17 ms against 24-26 for oneDNN's two
// GEMMs with SiLU-and-mul between (same bits at that size); inside the engine the MLP went from
// 24.5 to 18 ms a layer. The linear stores its output with non-temporal stores (it outgrows L2;
// read-for-ownership of its lines had cost it ~15%): QKV 2.9-3.6 ms against oneDNN's 3.6-4.4.
//
// The tile loop: C = 2 x 2 tiles (32 rows x 32 columns, float32 sums), A = two tiles of 16 rows
// (x or the activation, row-major: a row's neighbours along K are AMX's pairs), B = two tiles of
// a weight block ([K / 2][32] words). A weight block stays put while the panel's row blocks pass
// (A read with the non-temporal tile load, so B keeps its place in L1), and the next weight block
// is fetched into L2 meanwhile. The sums leave the tiles through a 4 KB buffer; a block's
// epilogue (rounding, SiLU-and-mul, the store) runs spread over the next block's k steps, which
// took the MLP's gate/up half from ~16 to ~13.5 ms: run after the tile stores it waited for the
// whole block's products, and the tiles idled through it. Lessons paid for: the buffer lives off
// the stack (4K aliasing with the stack's loads cost a few percent) and the activation's rows
// start on cache lines (a row's 64 bytes across two lines took the down GEMM from 5.5 to 9.8 ms).
//
// Rounding: each value is rounded to bfloat16 where the unfused layers round it (each GEMM's
// output, silu's output, the product; layer_ops_cpu.h's silu16 is SiLU-and-mul's own code), and
// the sums run in K order through the same AMX instruction as oneDNN's, so the output has the
// unfused path's bits where oneDNN's kernel adds in that order (8,192 rows: every bit; a few
// hundred rows: ~0.2% of outputs one ulp apart) (tests/kernels/test_amx_gemm.py).

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "layer_ops_cpu.h"
#include "quantized_matmul_cpu.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(LLMCTL_LAYERS_AVX512)
#define LLMCTL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llmctl_quantized {
namespace {

#if defined(LLMCTL_AMX)
using llmctl_layers::silu16;

constexpr int64_t kPanelRows = 256;  // x rows per panel (128 ran ~10% slower, 192-512 alike)
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>

struct TileConfig {  // palette 1: 8 tiles of 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

void request_tile_data() {  // once a process: Linux hands AMX state to processes that ask
  static const long rc = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
  TORCH_CHECK(rc == 0, "AMX GEMM: the kernel refused AMX tile state (arch_prctl "
              "ARCH_REQ_XCOMP_PERM); set LLMCTL_CPU_FLAGS_OFF='amx*' to run without AMX");
}

// C tiles 0-3 = A[32 rows, K] x B block ([K / 2][32] words); after each k step `epi(r)` runs for
// up to `per` rows of the previous block (whose sums the other half of the caller's double
// buffer holds), and `pf_lines` lines from `pf` are fetched into L2.
template <typename Epi>
inline void tile_block(const c10::BFloat16* A, int64_t lda, const uint16_t* B, int64_t K, int per,
                       Epi&& epi, const char* pf, int64_t pf_lines) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t steps = K / 32;
  int r = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k = s * 32;
    _tile_stream_loadd(4, A + k, lda * 2);
    _tile_stream_loadd(5, A + 16 * lda + k, lda * 2);
    _tile_loadd(6, B + k * 32, 128);
    _tile_loadd(7, B + k * 32 + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    for (int e = 0; e < per && r < 32; ++e, ++r) epi(r);
    if (pf != nullptr) {
      for (int64_t l = s * pf_lines / steps; l < (s + 1) * pf_lines / steps; ++l)
        _mm_prefetch(pf + l * 64, _MM_HINT_T1);
    }
  }
  for (; r < 32; ++r) epi(r);
}

// v rounded to bfloat16 (nearest even) and widened back: round16's value in three instructions
inline __m512 to_bf16_and_back(__m512 v) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_tiles(float* c) {  // [32][32] float32
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

using Bf16 = c10::BFloat16;

// The sums' way out of the tiles (two blocks: one stored while the other's epilogue runs), off
// the stack: the stack's loads (the epilogue's captured variables) that shared its page offsets
// waited for the tile stores (4K aliasing).
alignas(64) thread_local float cbuf[2][32 * 32];

// A thread's rows of x (read 32 at a time) and of out: the last block, if partial, read from a
// zero-padded copy and written to a buffer whose valid rows finish() copies out.
struct BlockRows {
  const Bf16* x;
  int64_t M, K;
  Bf16* out;
  int64_t N;
  std::vector<Bf16> x_tail, out_tail;

  const Bf16* in(int64_t m0) {
    if (m0 + 32 <= M) return x + m0 * K;
    if (x_tail.empty()) {
      x_tail.assign(32 * K, Bf16(0.f));
      std::memcpy(x_tail.data(), x + m0 * K, (M - m0) * K * sizeof(Bf16));
    }
    return x_tail.data();
  }
  Bf16* dst(int64_t m0, int64_t n0) {  // row m0, column n0 of out
    if (m0 + 32 <= M) return out + m0 * N + n0;
    if (out_tail.empty()) out_tail.resize(32 * N);
    return out_tail.data() + n0;
  }
  void finish() {
    if (out_tail.empty()) return;
    const int64_t m0 = (M / 32) * 32;
    std::memcpy(out + m0 * N, out_tail.data(), (M - m0) * N * sizeof(Bf16));
  }
};

// out's rows [p0, p0 + 32 blocks) = A W^T: A's row block i at a_rows(i) (K a row), W in blocks
// (vnni_blocks_bf16, N / 32 of them); dst(m0, n0) = {where row m0's columns n0 .. n0 + 31 go (rows
// ldo apart), whether with non-temporal stores}. Each block's store overlaps the next block's k
// steps, the last flushed here.
template <typename ARows, typename Dst>
void panel_linear(ARows&& a_rows, int64_t K, int64_t N, const uint16_t* w, int64_t p0,
                  int64_t blocks, Dst&& dst, int64_t ldo) {
  int cur = 0;
  bool pending = false, nt = false, any_nt = false;
  Bf16* out = nullptr;
  const int per = int((32 * 32 + K - 1) / K);
  auto epi = [&](int r) {
    if (!pending) return;
    const float* c = cbuf[cur ^ 1] + r * 32;
    const __m512i v = reinterpret_cast<__m512i>(
        _mm512_cvtne2ps_pbh(_mm512_load_ps(c + 16), _mm512_load_ps(c)));
    if (nt) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * ldo), v);
    } else {
      _mm512_storeu_si512(out + r * ldo, v);
    }
  };
  const int64_t nb = N / 32, lines = 32 * K * 2 / 64, chunk = (lines + blocks - 1) / blocks;
  for (int64_t n = 0; n < nb; ++n) {
    const uint16_t* B = w + n * 32 * K;
    const char* next = n + 1 < nb ? reinterpret_cast<const char*>(B + 32 * K) : nullptr;
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t m0 = p0 + i * 32;
      const int64_t l0 = std::min(lines, i * chunk), l1 = std::min(lines, l0 + chunk);
      tile_block(a_rows(i), K, B, K, per, epi, next ? next + l0 * 64 : nullptr, l1 - l0);
      store_tiles(cbuf[cur]);
      cur ^= 1;
      pending = true;
      std::tie(out, nt) = dst(m0, n * 32);
      any_nt |= nt;
    }
  }
  for (int r = 0; r < 32; ++r) epi(r);
  if (any_nt) _mm_sfence();  // the non-temporal stores, visible before the caller reads out
}

// `values` bfloat16 values of `store` from a cache line on: rows of a multiple of 32 values each
// start on one (unaligned, each row's 64 bytes of a tile load spanned two lines: the MLP's down
// half took 9.8 ms instead of 5.5).
inline Bf16* aligned_values(std::vector<Bf16>& store, int64_t values) {
  store.resize(values + 32);
  return reinterpret_cast<Bf16*>((reinterpret_cast<uintptr_t>(store.data()) + 63) &
                                 ~uintptr_t(63));
}

// One thread's row blocks [b0, b1) of 32 rows.
void mlp_rows(const Bf16* x, int64_t M, int64_t H, int64_t I, const uint16_t* gu,
              const uint16_t* dn, Bf16* out, int64_t b0, int64_t b1) {
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  thread_local std::vector<Bf16> act_store;  // the panel's activation
  Bf16* act = aligned_values(act_store, kPanelRows * I);
  BlockRows rows{x, M, H, out, H, {}, {}};
  for (int64_t p0 = b0 * 32; p0 < b1 * 32; p0 += kPanelRows) {
    const int64_t p1 = std::min(b1 * 32, p0 + kPanelRows), blocks = (p1 - p0) / 32;
    // Phase 1: act[panel rows, I] = silu(gate) * up, 16 columns of each per weight block.
    {
      int cur = 0;
      bool pending = false;
      Bf16* dst = nullptr;
      const int per = int((32 * 32 + H - 1) / H);  // epilogue rows per k step: done in time
      auto epi = [&](int r) {
        if (!pending) return;
        const float* c = cbuf[cur ^ 1] + r * 32;
        const __m512 g = to_bf16_and_back(_mm512_load_ps(c));
        const __m512 u = to_bf16_and_back(_mm512_load_ps(c + 16));
        const __m512 v = _mm512_mul_ps(silu16<Bf16>(g), u);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * I),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      };
      const int64_t nb = I / 16, lines = 32 * H * 2 / 64, chunk = (lines + blocks - 1) / blocks;
      for (int64_t j = 0; j < nb; ++j) {
        const uint16_t* B = gu + j * 32 * H;
        const char* next = j + 1 < nb ? reinterpret_cast<const char*>(B + 32 * H) : nullptr;
        for (int64_t i = 0; i < blocks; ++i) {
          const int64_t l0 = std::min(lines, i * chunk), l1 = std::min(lines, l0 + chunk);
          tile_block(rows.in(p0 + i * 32), H, B, H, per, epi, next ? next + l0 * 64 : nullptr,
                     l1 - l0);
          store_tiles(cbuf[cur]);
          cur ^= 1;
          pending = true;
          dst = act + i * 32 * I + j * 16;
        }
      }
      for (int r = 0; r < 32; ++r) epi(r);
    }
    // Phase 2: out[panel rows, H] = act Wd^T (the output is read next: plain stores).
    panel_linear([&](int64_t i) { return act + i * 32 * I; }, I, H, dn, p0, blocks,
                 [&](int64_t m0, int64_t n0) { return std::pair(rows.dst(m0, n0), false); }, H);
  }
  rows.finish();
  _tile_release();
  at::native::cpublas::brgemm_release(true);  // torch's brgemm reloads its own tile config
}

// One thread's row blocks [b0, b1) of rows.x W^T, W in blocks (vnni_blocks_bf16): panel_linear
// over panels of kPanelRows rows, dst(p0, m0, n0) as panel_linear's dst for the panel from row
// p0, then done(p0, p1) once rows [p0, p1) are stored.
template <typename Dst, typename Done>
void linear_panels(BlockRows& rows, int64_t N, const uint16_t* w, int64_t b0, int64_t b1,
                   Dst&& dst, Done&& done) {
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  for (int64_t p0 = b0 * 32; p0 < b1 * 32; p0 += kPanelRows) {
    const int64_t blocks = (std::min(b1 * 32, p0 + kPanelRows) - p0) / 32;
    panel_linear([&](int64_t i) { return rows.in(p0 + i * 32); }, rows.K, N, w, p0, blocks,
                 [&](int64_t m0, int64_t n0) { return dst(p0, m0, n0); }, N);
    done(p0, std::min(rows.M, p0 + blocks * 32));
  }
  _tile_release();
  at::native::cpublas::brgemm_release(true);
}

// out[M, N] = x W^T: the sums stored to out with non-temporal stores where out's rows start on
// cache lines (the output outgrows L2 at prefill sizes; read-for-ownership of its lines cost ~15%
// of the call).
void linear_rows(const Bf16* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, Bf16* out,
                 int64_t b0, int64_t b1) {
  BlockRows rows{x, M, K, out, N, {}, {}};
  const bool stream = reinterpret_cast<uintptr_t>(out) % 64 == 0;  // N: a multiple of 32
  linear_panels(
      rows, N, w, b0, b1,
      [&](int64_t, int64_t m0, int64_t n0) {
        return std::pair(rows.dst(m0, n0), stream && m0 + 32 <= M);
      },
      [](int64_t, int64_t) {});
  rows.finish();
}

// linear_rows with each panel's output kept in the core's L2 for a row pass, pass(panel, p0, p1):
// panel row r - p0 holds row r of x W^T, for rows [p0, p1). The pass writes the rows out (a
// rotation, a norm), so the linear's output crosses memory once, already finished.
template <typename Pass>
void linear_panel_rows(const Bf16* x, int64_t M, int64_t K, int64_t N, const uint16_t* w,
                       int64_t b0, int64_t b1, Pass&& pass) {
  thread_local std::vector<Bf16> panel_store;
  Bf16* panel = aligned_values(panel_store, kPanelRows * N);
  BlockRows rows{x, M, K, nullptr, N, {}, {}};
  linear_panels(
      rows, N, w, b0, b1,
      [&](int64_t p0, int64_t m0, int64_t n0) {
        return std::pair(panel + (m0 - p0) * N + n0, false);
      },
      [&](int64_t p0, int64_t p1) { pass(panel, p0, p1); });
}

// n (a multiple of 32) values from src (on a cache line) to dst: non-temporal where dst is on
// one too (rows of a fresh tensor are: 64-byte aligned, a multiple of 32 values long)
inline void copy_row(Bf16* dst, const Bf16* src, int64_t n, bool stream) {
  for (int64_t j = 0; j < n; j += 32) {
    const __m512i v = _mm512_load_si512(src + j);
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), v);
    } else {
      _mm512_storeu_si512(dst + j, v);
    }
  }
}
#endif

}  // namespace

bool amx_built() {
#if defined(LLMCTL_AMX)
  return true;
#else
  return false;
#endif
}

at::Tensor amx_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(amx_built(),
              "amx_gated_mlp: this build has no AMX (the CPU lacks it, or LLMCTL_CPU_MARCH "
              "names a target without it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "amx_gated_mlp: x must be a contiguous bfloat16 [M, H] tensor");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(gate_up.dim() == 4 && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.is_contiguous() && gate_up.size(1) * 2 == H &&
                  gate_up.size(2) == 32 && gate_up.size(3) == 2,
              "amx_gated_mlp: gate_up must be vnni_blocks_bf16's [2 I / 32, H / 2, 32, 2] "
              "for x's H = ", H);
  TORCH_CHECK(down.dim() == 4 && down.scalar_type() == at::kBFloat16 && down.is_contiguous() &&
                  down.size(0) * 32 == H && down.size(2) == 32 && down.size(3) == 2,
              "amx_gated_mlp: down must be vnni_blocks_bf16's [H / 32, I / 2, 32, 2]");
  const int64_t I = gate_up.size(0) * 16;
  TORCH_CHECK(down.size(1) * 2 == I, "amx_gated_mlp: down's I (", down.size(1) * 2,
              ") is not gate_up's (", I, ")");
  TORCH_CHECK(H % 32 == 0 && I % 32 == 0,
              "amx_gated_mlp: H and I must be multiples of 32, got ", H, " and ", I);
  at::Tensor out = at::empty({M, H}, x.options());
#if defined(LLMCTL_AMX)
  if (M == 0) return out;
  request_tile_data();
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  const auto* dp = reinterpret_cast<const uint16_t*>(down.data_ptr());
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, (M + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    mlp_rows(xp, M, H, I, gp, dp, op, b0, b1);
  });
#endif
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(amx_built(), "amx_linear: this build has no AMX (the CPU lacks it, or "
              "LLMCTL_CPU_MARCH names a target without it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "amx_linear: x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                  w.size(1) * 2 == K && w.size(2) == 32 && w.size(3) == 2,
              "amx_linear: w must be vnni_blocks_bf16's [N / 32, K / 2, 32, 2] for x's K = ", K);
  TORCH_CHECK(K % 32 == 0, "amx_linear: K must be a multiple of 32, got ", K);
  const int64_t N = w.size(0) * 32;
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(LLMCTL_AMX)
  if (M == 0) return out;
  request_tile_data();
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, (M + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    linear_rows(xp, M, K, N, wp, op, b0, b1);
  });
#endif
  return out;
}

namespace {

const uint16_t* linear_weight(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(amx_built(), op, ": this build has no AMX (the CPU lacks it, or LLMCTL_CPU_MARCH "
              "names a target without it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                  w.size(1) * 2 == K && w.size(2) == 32 && w.size(3) == 2,
              op, ": w must be vnni_blocks_bf16's [N / 32, K / 2, 32, 2] for x's K = ", K);
  TORCH_CHECK(K % 32 == 0, op, ": K must be a multiple of 32, got ", K);
  return reinterpret_cast<const uint16_t*>(w.data_ptr());
}

bool on_lines(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0; }

}  // namespace

at::Tensor checked_rope_positions(const at::Tensor& positions, const at::Tensor& cos_cache,
                                  const at::Tensor& sin_cache, int64_t rotary_columns, int64_t M,
                                  int64_t N, const char* op) {
  TORCH_CHECK(cos_cache.dim() == 2 && cos_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.sizes() == cos_cache.sizes() &&
                  sin_cache.scalar_type() == at::kFloat && sin_cache.is_contiguous(),
              op, ": cos_cache and sin_cache must be contiguous float32 "
              "[max_position, head_dim]");
  const int64_t D = cos_cache.size(1);
  TORCH_CHECK(D > 0 && D % 2 == 0 && D <= llmctl_layers::kMaxHeadDim && rotary_columns >= 0 &&
                  rotary_columns % D == 0 && rotary_columns <= N,
              op, ": rotary_columns (", rotary_columns, ") must be whole heads of ",
              D, " values within the output's ", N);
  const at::Tensor pos = positions.contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == at::kLong && pos.numel() == M,
              op, ": one int64 position per row of x");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < cos_cache.size(0), op, ": position ", pp[r],
                " is outside the rotary table (", cos_cache.size(0), " positions)");
  return pos;
}

void check_add_rms_norm(const at::Tensor& residual, const at::Tensor& weight, int64_t M,
                        int64_t N, const char* op) {
  TORCH_CHECK(residual.dim() == 2 && residual.size(0) == M && residual.size(1) == N &&
                  residual.scalar_type() == at::kBFloat16 && residual.is_contiguous(),
              op, ": residual must be a contiguous bfloat16 [M, N] tensor, "
              "N = ", N);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == N && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous(),
              op, ": weight must be a contiguous bfloat16 [", N, "] tensor");
}

at::Tensor amx_linear_rope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& positions,
                           const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                           int64_t rotary_columns) {
  const uint16_t* wp = linear_weight(x, w, "amx_linear_rope");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 32;
  const at::Tensor pos =
      checked_rope_positions(positions, cos_cache, sin_cache, rotary_columns, M, N,
                             "amx_linear_rope");
  const int64_t D = cos_cache.size(1);
  const int64_t* pp = pos.data_ptr<int64_t>();
  at::Tensor out = at::empty({M, N}, x.options());
#if defined(LLMCTL_AMX)
  if (M == 0) return out;
  request_tile_data();
  const auto* xp = x.data_ptr<Bf16>();
  const float* cp = cos_cache.data_ptr<float>();
  const float* sp = sin_cache.data_ptr<float>();
  auto* op = out.data_ptr<Bf16>();
  const bool stream = on_lines(out);
  at::parallel_for(0, (M + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    linear_panel_rows(xp, M, K, N, wp, b0, b1, [&](Bf16* panel, int64_t p0, int64_t p1) {
      for (int64_t r = p0; r < p1; ++r) {
        Bf16* row = panel + (r - p0) * N;
        llmctl_layers::rope_row<Bf16>(row, rotary_columns / D, D, cp + pp[r] * D, sp + pp[r] * D);
        copy_row(op + r * N, row, N, stream);
      }
    });
    _mm_sfence();
  });
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor> amx_linear_add_rms_norm(const at::Tensor& x,
                                                           const at::Tensor& w,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps) {
  const uint16_t* wp = linear_weight(x, w, "amx_linear_add_rms_norm");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 32;
  check_add_rms_norm(residual, weight, M, N, "amx_linear_add_rms_norm");
  at::Tensor out = at::empty({M, N}, x.options()), res = at::empty({M, N}, x.options());
#if defined(LLMCTL_AMX)
  if (M == 0) return {out, res};
  request_tile_data();
  const auto* xp = x.data_ptr<Bf16>();
  const auto* rp = residual.data_ptr<Bf16>();
  const auto* np = weight.data_ptr<Bf16>();
  auto* op = out.data_ptr<Bf16>();
  auto* sp = res.data_ptr<Bf16>();
  const bool stream = on_lines(out) && on_lines(res);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, (M + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<Bf16> row_store;  // a row of the sum and of the norm, in L1
    Bf16* sum = aligned_values(row_store, 2 * N);
    Bf16* normed = sum + N;
    linear_panel_rows(xp, M, K, N, wp, b0, b1, [&](Bf16* panel, int64_t p0, int64_t p1) {
      for (int64_t r = p0; r < p1; ++r) {
        std::memcpy(sum, rp + r * N, N * sizeof(Bf16));
        llmctl_layers::add_rms_norm_row<Bf16>(panel + (r - p0) * N, sum, true, np, normed, N,
                                              feps);
        copy_row(sp + r * N, sum, N, stream);
        copy_row(op + r * N, normed, N, stream);
      }
    });
    _mm_sfence();
  });
#endif
  return {out, res};
}

}  // namespace llmctl_quantized
