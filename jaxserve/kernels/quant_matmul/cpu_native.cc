// jaxserve: quantized matmul y[M, N] = x[M, K] @ W[K, N] on CPU, an XLA FFI custom call.
//
// Weight layout (built at load by cpu_native.py from a QWeight), row n = output feature:
//   codes  uint8 [L?, N, Kc * bits / 8]   unsigned integer codes, Kc = K padded to a multiple of 64
//          bits 8: one code per byte, in K order;
//          bits 4: per chunk of 64 rows of K, 32 bytes: byte j holds row j (low nibble) and row 32 + j
//          (high nibble), so the low nibbles of a chunk are rows 0..31 in order, the high ones 32..63.
//   scale  f16 or f32 [L?, N, Kc / group]          per-group scale s
//   offset same dtype [L?, N, Kc / group] or [0]   per-group offset o (absent: o = -zp * s)
//   w[k, n] = s * code + o                         (o = -zp * s without an offset array)
// group is 16, 32 or a multiple of 64. L: optional stacked layers, `layer` picks one.
//
// Activations: each row of x is quantized to int8 per block of 32 (d = max|x| / 127, q = round(x / d)),
// so a 4-element slice of codes . q is an exact integer dot (VNNI vpdpbusd: u8 codes x s8 q). Per
// group: y += s * sum_blocks(d * isum) + o * sum(x) where sum(x) is the exact f32 sum of the group's
// x (the offset term carries no activation rounding).
//
// Instruction set chosen at compile time (-march=native): AVX-512 VNNI (zmm, 64 rows per step),
// AVX2 (ymm, maddubs), or portable scalar C++.
// Threads: the N rows are split in blocks claimed from an atomic counter by the calling thread and
// spinning helper threads (Pool).

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#include <algorithm>
#include <functional>
#include <type_traits>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kChunk = 64;  // K rows per step
constexpr int kABlock = 32; // activation quantization block
constexpr int kMR = 4;      // activation rows per weight-row pass

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JS_AVX512 1
const char* kIsa = "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__)
#define JS_AVX2 1
const char* kIsa = "avx2";
#else
const char* kIsa = "scalar";
#endif

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 1024));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 1023) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

template <typename ST> inline float sval(const ST* s, int64_t i);
template <> inline float sval<float>(const float* s, int64_t i) { return s[i]; }
template <> inline float sval<uint16_t>(const uint16_t* s, int64_t i) { return half_to_float(s[i]); }

// One quantized activation row.
struct XRow {
  const int8_t* q;   // [Kc]
  const int8_t* lo;  // [Kc] second level (16-bit activations) or nullptr
  const float* dl;   // [Kc / 4]: the block scale d of every 4-row lane
  const float* gs;   // [Kc / group]: exact f32 sum of x over each weight group
};

struct Problem {
  const float* x; int64_t M, K;        // x [M, K] (K logical)
  const uint8_t* codes; const void* scale; const void* offset;
  int64_t N, Kc, G, group, zp, bits, act_bits;
  float* y;
};

void quantize_rows(const Problem& p, std::vector<int8_t>& q, std::vector<int8_t>& lo,
                   std::vector<float>& dl, std::vector<float>& gs) {
  const int64_t Kc = p.Kc, G = p.G;
  const bool two = p.act_bits == 16;
  q.assign(p.M * Kc, 0);
  lo.assign(two ? p.M * Kc : 0, 0);
  dl.assign(p.M * Kc / 4, 0.f);
  gs.assign(p.M * G, 0.f);
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    int8_t* qm = q.data() + m * Kc;
    int8_t* lm = two ? lo.data() + m * Kc : nullptr;
    float* dm = dl.data() + m * Kc / 4;
    for (int64_t b = 0; b * kABlock < p.K; ++b) {
      const int64_t k0 = b * kABlock, k1 = std::min<int64_t>(k0 + kABlock, p.K);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(x[k]));
      // x ~ d * q (8-bit), or x ~ (d / 256) * (256 * q + lo): lo = round(256 * residual), |lo| <= 127.
      // (A second level only in blocks with outlier channels was tried: SmolLM2 KL 0.004-0.02.)
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t k = k0; k < k1; ++k) {
        const float t = x[k] * inv;
        const int v = std::max(-127, std::min(127, (int)std::nearbyint(t)));
        qm[k] = (int8_t)v;
        if (two) lm[k] = (int8_t)std::max(-127, std::min(127, (int)std::nearbyint((t - v) * 256.f)));
      }
      const float dd = two ? d * (1.f / 256.f) : d;
      for (int64_t l = k0 / 4; l < k0 / 4 + kABlock / 4; ++l) dm[l] = dd;
    }
    float* gm = gs.data() + m * G;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      const int64_t k1 = std::min<int64_t>((g + 1) * p.group, p.K);
      for (int64_t k = g * p.group; k < k1; ++k) acc += x[k];
      gm[g] = acc;
    }
  }
}

template <int BITS>
inline const uint8_t* row_codes(const Problem& p, int64_t n) { return p.codes + n * (p.Kc * BITS / 8); }
template <typename ST>
inline const ST* row_scales(const Problem& p, int64_t n) { return static_cast<const ST*>(p.scale) + n * p.G; }

// ------------------------------------------------------------------------------------- scalar
template <int BITS, typename ST>
void rows_scalar(const Problem& p, int64_t n, const XRow* xr, int mr, float* out) {
  const int64_t row_bytes = p.Kc * BITS / 8;
  const uint8_t* w = row_codes<BITS>(p, n);
  const ST* s = row_scales<ST>(p, n);
  for (int r = 0; r < mr; ++r) out[r] = 0.f;
  for (int64_t c = 0; c < p.Kc / kChunk; ++c) {
    for (int l = 0; l < kChunk / 4; ++l) {
      const float sc = sval<ST>(s, (c * kChunk + 4 * l) / p.group);
      for (int r = 0; r < mr; ++r) {
        int32_t isum = 0;
        for (int e = 0; e < 4; ++e) {
          const int j = 4 * l + e;  // row inside the chunk
          int code;
          if (BITS == 8) code = w[c * kChunk + j];
          else code = (w[c * 32 + (j & 31)] >> (j < 32 ? 0 : 4)) & 15;
          const int xv = xr[r].lo ? 256 * xr[r].q[c * kChunk + j] + xr[r].lo[c * kChunk + j]
                                  : xr[r].q[c * kChunk + j];
          isum += code * xv;
        }
        out[r] += (float)isum * xr[r].dl[c * 16 + l] * sc;
      }
    }
  }
}

#if JS_AVX512
template <int GM, typename ST>
inline __m512 expand_scales(const ST* s, int64_t c, int64_t group) {
  // GM: 16 -> 4 groups per chunk, 32 -> 2, 0 -> one group (group a multiple of 64)
  if (GM == 0) return _mm512_set1_ps(sval<ST>(s, c * kChunk / group));
  __m128 v;
  if (std::is_same<ST, float>::value) {
    const float* f = reinterpret_cast<const float*>(s);
    v = GM == 16 ? _mm_loadu_ps(f + c * 4) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f + c * 2)));
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(s);
    __m128i raw;
    if (GM == 16) raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + c * 4));
    else { int32_t t; std::memcpy(&t, h + c * 2, 4); raw = _mm_cvtsi32_si128(t); }
    v = _mm_cvtph_ps(raw);
  }
  const __m512i idx = GM == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                               : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

template <int BITS, int GM, typename ST>
void rows_simd(const Problem& p, int64_t n, const XRow* xr, int mr, float* out) {
  const int64_t row_bytes = p.Kc * BITS / 8;
  const uint8_t* w = row_codes<BITS>(p, n);
  const ST* s = row_scales<ST>(p, n);
  __m512 acc[kMR];
  for (int r = 0; r < kMR; ++r) acc[r] = _mm512_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15);
  const int64_t nch = p.Kc / kChunk;
  for (int64_t c = 0; c < nch; ++c) {
    __m512i codes;
    if (BITS == 4) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
      const __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
      codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
      codes = _mm512_loadu_si512(w + c * kChunk);
    }
    const __m512 sv = expand_scales<GM, ST>(s, c, p.group);
    for (int r = 0; r < mr; ++r) {
      const __m512i xq = _mm512_loadu_si512(xr[r].q + c * kChunk);
      __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xq);
      if (xr[r].lo) {  // 16-bit activations: 256 * (codes . q) + codes . lo
        isum = _mm512_dpbusd_epi32(_mm512_slli_epi32(isum, 8), codes,
                                   _mm512_loadu_si512(xr[r].lo + c * kChunk));
      }
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_loadu_ps(xr[r].dl + c * 16));
      acc[r] = _mm512_fmadd_ps(t, sv, acc[r]);
    }
  }
  for (int r = 0; r < mr; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
// The scales of 4 chunks (GM 16 or 32: 16 or 8 values) as one f32 vector; chunk i's lanes are then
// picked by a permute (scale_lanes) instead of a load + convert per chunk.
template <int GM, typename ST>
inline __m512 load_scales4(const ST* s, int64_t c) {
  static_assert(GM == 16 || GM == 32, "two or four groups per chunk");
  constexpr int n = GM == 16 ? 16 : 8;
  if (std::is_same<ST, float>::value) {
    const float* f = reinterpret_cast<const float*>(s) + c * (kChunk / GM);
    return n == 16 ? _mm512_loadu_ps(f) : _mm512_castps256_ps512(_mm256_loadu_ps(f));
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(s) + c * (kChunk / GM);
  return n == 16 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)))
                 : _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
}

template <int GM>
inline __m512i scale_lanes(int i) {  // lane l of chunk i of 4 -> its group's index in load_scales4
  const __m512i l = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return GM == 16 ? _mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_srli_epi32(l, 2))
                  : _mm512_add_epi32(_mm512_set1_epi32(2 * i), _mm512_srli_epi32(l, 3));
}

// One activation row (decode), NR weight rows at a time: the activation loads are shared and NR
// independent dot chains keep the core busy while codes stream in.
template <int BITS, int GM, typename ST, int NR, bool TWO>
void rows1_simd(const Problem& p, int64_t n, const XRow& xr, float* out) {
  const int64_t row_bytes = p.Kc * BITS / 8;
  const uint8_t* w = row_codes<BITS>(p, n);
  const ST* s = row_scales<ST>(p, n);
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15);
  // nibble unpack: both halves of a broadcast 32-byte load, the upper one shifted right by 4
  const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  const __m512i lanes[4] = {scale_lanes<GM>(0), scale_lanes<GM>(1), scale_lanes<GM>(2), scale_lanes<GM>(3)};
  const int64_t nch = p.Kc / kChunk;
  __m512 s4[NR] = {};
  for (int64_t c = 0; c < nch; ++c) {
    const __m512i xq = _mm512_loadu_si512(xr.q + c * kChunk);
    const __m512i xl = TWO ? _mm512_loadu_si512(xr.lo + c * kChunk) : _mm512_setzero_si512();
    const __m512 dl = _mm512_loadu_ps(xr.dl + c * 16);
    const bool batched = GM != 0 && (c & ~int64_t(3)) + 4 <= nch;
    if constexpr (GM != 0) {
      if (batched && (c & 3) == 0)
        for (int j = 0; j < NR; ++j) s4[j] = load_scales4<GM, ST>(s + j * p.G, c);
    }
    for (int j = 0; j < NR; ++j) {
      __m512i codes;
      // the same chunk of the rows NR ahead: measured ~20% faster than the hardware prefetch alone
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * row_bytes + c * kChunk * BITS / 8), _MM_HINT_T0);
      if (BITS == 4) {
        const __m512i b = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + c * 32)));
        codes = _mm512_and_si512(_mm512_srlv_epi64(b, shift), m4);
      } else {
        codes = _mm512_loadu_si512(w + j * row_bytes + c * kChunk);
      }
      __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xq);
      if (TWO) isum = _mm512_dpbusd_epi32(_mm512_slli_epi32(isum, 8), codes, xl);
      const __m512 sv = batched ? _mm512_permutexvar_ps(lanes[c & 3], s4[j])
                                : expand_scales<GM, ST>(s + j * p.G, c, p.group);
      acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dl), sv, acc[j]);
    }
  }
  for (int j = 0; j < NR; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

#elif JS_AVX2
template <int GM, typename ST>
inline __m256 half_scales(const ST* s, int64_t c, int h, int64_t group) {
  // lanes 0..7 cover rows c*64 + h*32 + 4l
  if (GM == 16) {
    const float s0 = sval<ST>(s, c * 4 + h * 2), s1 = sval<ST>(s, c * 4 + h * 2 + 1);
    return _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
  }
  if (GM == 32) return _mm256_set1_ps(sval<ST>(s, c * 2 + h));
  return _mm256_set1_ps(sval<ST>(s, c * kChunk / group));
}

template <int BITS, int GM, typename ST>
void rows_simd(const Problem& p, int64_t n, const XRow* xr, int mr, float* out) {
  const int64_t row_bytes = p.Kc * BITS / 8;
  const uint8_t* w = row_codes<BITS>(p, n);
  const ST* s = row_scales<ST>(p, n);
  __m256 acc[kMR];
  for (int r = 0; r < kMR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1),
                flip = _mm256_set1_epi8((char)0x80);
  const int64_t nch = p.Kc / kChunk;
  for (int64_t c = 0; c < nch; ++c) {
    __m256i half[2];
    if (BITS == 4) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
      half[0] = _mm256_and_si256(b, m4);
      half[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    } else {
      half[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * kChunk));
      half[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * kChunk + 32));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = half_scales<GM, ST>(s, c, h, p.group);
      // 8-bit codes: maddubs would saturate u8*s8 pairs; use (code - 128) = ws with the sign trick
      // (|ws| <= 128: pairs <= 32512) and add back 128 * sum(q).
      __m256i ws, wa;
      if (BITS == 8) { ws = _mm256_xor_si256(half[h], flip); wa = _mm256_abs_epi8(ws); }
      for (int r = 0; r < mr; ++r) {
        auto dot = [&](const int8_t* xs) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + c * kChunk + h * 32));
          if (BITS == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(half[h], xq), ones16);
          return _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xq, ws)), ones16),
              _mm256_madd_epi16(_mm256_maddubs_epi16(flip, xq), ones16));
        };
        __m256i isum = dot(xr[r].q);
        if (xr[r].lo) isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 8), dot(xr[r].lo));
        const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(xr[r].dl + c * 16 + h * 8));
        acc[r] = _mm256_fmadd_ps(t, sv, acc[r]);
      }
    }
  }
  for (int r = 0; r < mr; ++r) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    out[r] = _mm_cvtss_f32(v);
  }
}
#endif

// sum_g a[g] * b[g] (the offset term: a = offsets or scales, b = group sums of x).
template <typename ST>
inline float group_dot(const ST* a, const float* b, int64_t G) {
  int64_t g = 0;
  float t = 0.f;
#if JS_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1);
    __m512 av;
    if (std::is_same<ST, float>::value) av = _mm512_maskz_loadu_ps(k, reinterpret_cast<const float*>(a) + g);
    else av = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, reinterpret_cast<const uint16_t*>(a) + g));
    acc = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(k, b + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif JS_AVX2 && defined(__F16C__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= G; g += 8) {
    __m256 av;
    if (std::is_same<ST, float>::value) av = _mm256_loadu_ps(reinterpret_cast<const float*>(a) + g);
    else av = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(a) + g)));
    acc = _mm256_fmadd_ps(av, _mm256_loadu_ps(b + g), acc);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float v : lanes) t += v;
#endif
  for (; g < G; ++g) t += sval<ST>(a, g) * b[g];
  return t;
}

template <int BITS, int GM, typename ST>
void block(const Problem& p, const std::vector<XRow>& xr, int64_t n0, int64_t n1) {
  const ST* scale = static_cast<const ST*>(p.scale);
  const ST* offset = static_cast<const ST*>(p.offset);
  int64_t nfast = n0;
#if JS_AVX512
  if (p.M == 1) {  // decode
    constexpr int NR = 4;
    for (; nfast + NR <= n1; nfast += NR) {
      float out[NR];
      if (xr[0].lo) rows1_simd<BITS, GM, ST, NR, true>(p, nfast, xr[0], out);
      else rows1_simd<BITS, GM, ST, NR, false>(p, nfast, xr[0], out);
      for (int j = 0; j < NR; ++j) {
        if (offset || p.zp) {
          const ST* so = (offset ? offset : scale) + (nfast + j) * p.G;
          out[j] += (offset ? 1.f : -(float)p.zp) * group_dot<ST>(so, xr[0].gs, p.G);
        }
        p.y[nfast + j] = out[j];
      }
    }
  }
#endif
  for (int64_t m0 = 0; m0 < p.M; m0 += kMR) {
    const int mr = (int)std::min<int64_t>(kMR, p.M - m0);
    for (int64_t n = p.M == 1 ? nfast : n0; n < n1; ++n) {
      float out[kMR];
#if JS_AVX512 || JS_AVX2
      rows_simd<BITS, GM, ST>(p, n, xr.data() + m0, mr, out);
#else
      rows_scalar<BITS, ST>(p, n, xr.data() + m0, mr, out);
#endif
      // offset term: sum_g o[g] * sum(x over g), o = offset or -zp * s
      const ST* so = offset ? offset + n * p.G : scale + n * p.G;
      const float mul = offset ? 1.f : -(float)p.zp;
      if (offset || p.zp) {
        for (int r = 0; r < mr; ++r) {
          const float* gs = xr[m0 + r].gs;
          out[r] += mul * group_dot<ST>(so, gs, p.G);
        }
      }
      for (int r = 0; r < mr; ++r) p.y[(m0 + r) * p.N + n] = out[r];
    }
  }
}

using BlockFn = void (*)(const Problem&, const std::vector<XRow>&, int64_t, int64_t);

template <int BITS, int GM>
BlockFn pick_st(bool f16) { return f16 ? block<BITS, GM, uint16_t> : block<BITS, GM, float>; }

template <int BITS>
BlockFn pick_gm(int64_t group, bool f16) {
  if (group == 16) return pick_st<BITS, 16>(f16);
  if (group == 32) return pick_st<BITS, 32>(f16);
  return pick_st<BITS, 0>(f16);
}

// A small pool of spinning helper threads (XLA's intra-op pool wakes its threads too slowly for
// ~40 us GEMVs). Helpers spin for kSpinUs after each job, then sleep on a condition variable.
// One job at a time: a second concurrent caller runs its job alone.
constexpr int kSpinUs = 300;

class Pool {
 public:
  explicit Pool(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { loop(); }).detach();
  }
  int size() const { return helpers_ + 1; }

  // Runs fn(i) for i in [0, total) on the caller and the helpers; returns when all are done.
  void run(int64_t total, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> own(caller_, std::try_to_lock);
    if (!own.owns_lock() || helpers_ == 0 || total < 2) {
      for (int64_t i = 0; i < total; ++i) fn(i);
      return;
    }
    fn_ = &fn;
    total_ = total;
    next_.store(0);
    done_.store(0);
    posted_.fetch_add(1);  // seq_cst: pairs with the helper's sleeping_ store
    if (sleeping_.load()) {
      { std::lock_guard<std::mutex> g(mu_); }
      cv_.notify_all();
    }
    work();
    // A helper may hold a claimed block while descheduled (cores shared with other processes):
    // yield now and then so it can run on this core.
    for (int it = 1; done_.load(std::memory_order_acquire) != helpers_; ++it) {
      pause();
      if ((it & 63) == 0) std::this_thread::yield();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  void work() {
    for (int64_t i; (i = next_.fetch_add(1)) < total_;) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; posted_.load(std::memory_order_acquire) == seen; ++it) {
        pause();
        if ((it & 63) == 63) std::this_thread::yield();  // cheap when nothing else wants the core
        if ((it & 255) == 255 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinUs)) {
          std::unique_lock<std::mutex> lk(mu_);
          sleeping_.fetch_add(1);
          cv_.wait(lk, [&] { return posted_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = posted_.load(std::memory_order_acquire);
      work();
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  const int helpers_;
  std::mutex caller_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> posted_{0};
  std::atomic<int> sleeping_{0}, done_{0};
  std::atomic<int64_t> next_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t total_ = 0;
};

int num_threads() {
  const char* e = std::getenv("JAXSERVE_QGEMV_THREADS");
  if (e && std::atoi(e) > 0) return std::atoi(e);
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool* p = new Pool(num_threads() - 1);  // never destroyed: helpers outlive static teardown
  return *p;
}

ffi::Error qgemv_impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                      ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group, int64_t zp,
                      int64_t act_bits) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() < 2 || sd.size() != cd.size())
    return ffi::Error::InvalidArgument("qgemv: x must be [M, K], codes/scale [L?, N, .]");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("qgemv: bits must be 4 or 8");
  if (act_bits != 8 && act_bits != 16) return ffi::Error::InvalidArgument("qgemv: act_bits must be 8 or 16");
  if (!(group == 16 || group == 32 || (group > 0 && group % 64 == 0)))
    return ffi::Error::InvalidArgument("qgemv: group must be 16, 32 or a multiple of 64");
  const bool f16 = scale.element_type() == ffi::DataType::F16;
  if (!f16 && scale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("qgemv: scale must be f16 or f32");
  const int r = (int)cd.size();
  Problem p;
  p.M = xd[0]; p.K = xd[1]; p.N = cd[r - 2]; p.bits = bits; p.group = group; p.zp = zp; p.act_bits = act_bits;
  p.Kc = cd[r - 1] * 8 / bits; p.G = sd[r - 1];
  if (p.Kc % kChunk || p.Kc % group || p.G * group != p.Kc || sd[r - 2] != p.N || p.K > p.Kc)
    return ffi::Error::InvalidArgument("qgemv: inconsistent shapes");
  int64_t L = 1;
  for (int i = 0; i < r - 2; ++i) L *= cd[i];
  const int64_t li = layer.element_count() ? layer.typed_data()[0] : 0;
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("qgemv: layer index out of range");
  const size_t es = f16 ? 2 : 4;
  p.x = x.typed_data();
  p.codes = static_cast<const uint8_t*>(codes.untyped_data()) + li * p.N * cd[r - 1];
  p.scale = static_cast<const char*>(scale.untyped_data()) + li * p.N * p.G * es;
  const bool has_off = offset.element_count() > 0;
  if (has_off && (offset.element_type() != scale.element_type() || offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("qgemv: offset must match scale");
  p.offset = has_off ? static_cast<const char*>(offset.untyped_data()) + li * p.N * p.G * es : nullptr;
  p.y = y->typed_data();

  thread_local std::vector<int8_t> q, lo;
  thread_local std::vector<float> dl, gs;
  quantize_rows(p, q, lo, dl, gs);
  std::vector<XRow> xr(p.M);
  for (int64_t m = 0; m < p.M; ++m)
    xr[m] = XRow{q.data() + m * p.Kc, act_bits == 16 ? lo.data() + m * p.Kc : nullptr,
                 dl.data() + m * p.Kc / 4, gs.data() + m * p.G};

  const BlockFn fn = bits == 4 ? pick_gm<4>(group, f16) : pick_gm<8>(group, f16);
  Pool& workers = pool();
  // Row blocks: ~4 per thread, a multiple of 8 rows, at least 16.
  int64_t nb = std::max<int64_t>(16, (p.N + 4 * workers.size() - 1) / (4 * workers.size()));
  nb = (nb + 7) / 8 * 8;
  workers.run((p.N + nb - 1) / nb, [&](int64_t i) { fn(p, xr, i * nb, std::min(p.N, (i + 1) * nb)); });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------- paged decode attention
// Each query token attends to its own sequence's keys at positions [lo, pos], read in place from the
// paged cache [L, NB, BS, KV, D] of `layer` (f32); the contract of paged_attention/reference.py,
// computed per token (the decode region of a step: one token per sequence). Two passes per (token,
// KV head): scores of the G query heads for every key, then softmax and the weighted sum of values.
// XLA's own version of this is a while loop of ~10 small ops per chunk of keys and layer.

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 independent lanes: vectorized without fast-math
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

ffi::Error paged_decode_impl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables,
                             ffi::Buffer<ffi::S32> tseq, ffi::Buffer<ffi::S32> pos,
                             ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale,
                             float softcap) {
  auto qd = q.dimensions(), cd = kc.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2 || vc.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("paged_decode: q [T, H, D], caches [L, NB, BS, KV, D], tables [S, MB]");
  const int64_t T = qd[0], H = qd[1], D = qd[2], L = cd[0], NB = cd[1], BS = cd[2], KV = cd[3];
  const int64_t S = td[0], MB = td[1];
  if (cd[4] != D || H % KV || (int64_t)tseq.element_count() != T || (int64_t)pos.element_count() != T)
    return ffi::Error::InvalidArgument("paged_decode: inconsistent shapes");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("paged_decode: layer index out of range");
  const int64_t win = window.element_count() ? window.typed_data()[0] : 0;
  const int64_t G = H / KV, stride = NB * BS * KV * D;
  const float* K = kc.typed_data() + li * stride;
  const float* V = vc.typed_data() + li * stride;
  const int32_t* tab = tables.typed_data();
  const float* qp = q.typed_data();
  float* o = out->typed_data();
  auto task = [&](int64_t i) {
    const int64_t t = i / KV, h = i % KV;
    float* ot = o + (t * H + h * G) * D;
    std::fill(ot, ot + G * D, 0.0f);
    const int64_t s = tseq.typed_data()[t], p = std::min<int64_t>(pos.typed_data()[t], MB * BS - 1);
    if (s < 0 || s >= S || p < 0) return;
    const int64_t lo = win > 0 ? std::max<int64_t>(p - win + 1, 0) : 0, n = p - lo + 1;
    thread_local std::vector<float> sc;
    sc.assign(G * n, 0.0f);
    for (int64_t j = lo; j <= p; ++j) {
      const int64_t blk = tab[s * MB + j / BS];
      const bool ok = blk >= 0 && blk < NB;
      const float* kp = K + ((blk * BS + j % BS) * KV + h) * D;
      for (int64_t g = 0; g < G; ++g) {
        float v = ok ? dot_f32(qp + (t * H + h * G + g) * D, kp, D) * scale : -INFINITY;
        if (softcap > 0 && ok) v = std::tanh(v / softcap) * softcap;
        sc[g * n + j - lo] = v;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* r = sc.data() + g * n;
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) m = std::max(m, r[j]);
      if (!std::isfinite(m)) continue;
      float sum = 0;
      for (int64_t j = 0; j < n; ++j) { r[j] = std::exp(r[j] - m); sum += r[j]; }
      float* og = ot + g * D;
      for (int64_t j = lo; j <= p; ++j) {
        const int64_t blk = tab[s * MB + j / BS];
        if (blk < 0 || blk >= NB) continue;
        const float* vp = V + ((blk * BS + j % BS) * KV + h) * D;
        const float w = r[j - lo];
        for (int64_t d = 0; d < D; ++d) og[d] += w * vp[d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < D; ++d) og[d] *= inv;
    }
  };
  const int64_t tasks = T * KV;
  if (tasks == 1) task(0);
  else pool().run(tasks, task);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, paged_decode_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQGemv, qgemv_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("zp")
                                  .Attr<int64_t>("act_bits"));

extern "C" const char* jaxserve_qgemv_isa() { return kIsa; }
