// A small SIMD vocabulary for the CPU kernels: one struct per instruction set, same names in each.
//
//   struct   W (floats per vector)   compiled for
//   Avx512   16                      avx512f, avx512bw, avx512vl, avx512dq, f16c
//   Avx2     8                       avx2, f16c
//   Scalar   1                       the baseline x86-64 (or any) target
//
// Each struct is defined inside a `#pragma GCC target` region, so the wide paths are compiled
// without -march flags on the command line and a binary built here runs on any x86-64 CPU; the
// caller picks one at run time with __builtin_cpu_supports (see csrc/adam/cpu_adam.cpp). Kernel
// bodies that use a struct must be compiled inside the same target region (GCC will not inline a
// function of a wider target into a narrower one).
//
// Every operation is an IEEE-754 single-precision operation with round-to-nearest-even, and the
// kernels are compiled with -ffp-contract=off, so Avx512, Avx2 and Scalar give the same bits for
// the same sequence of calls. Conversions to 16-bit types follow PyTorch's CPU casts bit for bit:
//   * bf16: round to nearest even by adding 0x7FFF + lsb to the fp32 bits; every NaN becomes 0xFFFF
//     (what `torch.Tensor.to(torch.bfloat16)` gives on CPU).
//   * fp16: IEEE round to nearest even (VCVTPS2PH imm 0); NaN keeps its sign and top payload bits
//     with the quiet bit set; overflow gives infinity.
//
// Stochastic rounding to bf16 (store_sr) adds 16 random bits to the fp32 bits and truncates, so the
// magnitude rounds up with probability (dropped bits) / 2^16 and the expected result is the fp32
// value (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"); NaN becomes 0xFFFF,
// infinity stays, and a value within one bf16 step of the largest finite one may round to infinity.
// The random bits come from hash_index: lowbias32 (C. Wellons, "Prospecting for hash functions",
// 2018) of (element index XOR key), a bijection of 32-bit words computed with 32-bit integer
// operations only, so every path gives the same bits for the same (index, key).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZEROINF_X86 1
#else
#define ZEROINF_X86 0
#endif

namespace zeroinf {
namespace simd {

// 16-bit storage types, distinct so that overloads pick the right conversion.
struct bf16_t { uint16_t x; };
struct fp16_t { uint16_t x; };
// "no 16-bit output": the kernels skip the fused parameter copy for this type.
struct no_out_t { uint16_t x; };

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// fp32 -> bf16 bits as PyTorch's CPU cast: round to nearest even, NaN -> 0xFFFF.
inline uint16_t bf16_from_f32(float f) {
  if (f != f) return 0xFFFF;
  uint32_t u = f32_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float f32_from_bf16(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// lowbias32: a bijective 32-bit mixer (see the header comment).
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 bits with stochastic rounding; `r16` holds 16 random bits (< 2^16).
inline uint16_t bf16_sr_from_f32(float f, uint32_t r16) {
  if (f != f) return 0xFFFF;
  return static_cast<uint16_t>((f32_bits(f) + r16) >> 16);
}

// fp32 -> fp16 bits, IEEE round to nearest even, with VCVTPS2PH's NaN and overflow results.
inline uint16_t fp16_from_f32(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((ax >> 13) & 0x3FFu);  // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to infinity (and inf itself)
  if (ax >= 0x38800000u) {                       // a normal half: rebias 127 -> 15, round 13 bits
    const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u) - (112u << 23);
    return sign | static_cast<uint16_t>(r >> 13);
  }
  const uint32_t e = ax >> 23;  // subnormal half: k * 2^-24 with k = round(m * 2^(e-126))
  if (e < 102) return sign;     // below 2^-25: rounds to zero
  const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
  const uint32_t s = 126u - e;  // 14..24
  uint32_t k = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
  if (rem > half || (rem == half && (k & 1u))) ++k;
  return sign | static_cast<uint16_t>(k);
}

// fp16 bits -> fp32, exact; a signalling NaN comes back quiet (as VCVTPH2PS does).
inline float f32_from_fp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 31) return bits_f32(sign | 0x7F800000u | ((m ? (m | 0x200u) : 0u) << 13));
  if (e == 0) {
    const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -mag : mag;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// ---------------------------------------------------------------------------------------------
struct Scalar {
  using vf = float;
  static constexpr int W = 1;
  static inline vf set1(float a) { return a; }
  static inline vf load(const float* p) { return *p; }
  static inline vf load(const bf16_t* p) { return f32_from_bf16(p->x); }
  static inline vf load(const fp16_t* p) { return f32_from_fp16(p->x); }
  static inline void store(float* p, vf a) { *p = a; }
  static inline void store(bf16_t* p, vf a) { p->x = bf16_from_f32(a); }
  static inline void store(fp16_t* p, vf a) { p->x = fp16_from_f32(a); }
  static inline vf add(vf a, vf b) { return a + b; }
  static inline vf sub(vf a, vf b) { return a - b; }
  static inline vf mul(vf a, vf b) { return a * b; }
  static inline vf div(vf a, vf b) { return a / b; }
  static inline vf sqrt(vf a) { return __builtin_sqrtf(a); }
  // stochastic rounding (see the header comment): 32 random bits per element idx0 + lane
  using vi = uint32_t;
  static inline vi hash_index(uint32_t idx0, uint32_t key) { return hash32(idx0 ^ key); }
  static inline vi lo16(vi r) { return r & 0xFFFFu; }
  static inline vi hi16(vi r) { return r >> 16; }
  static inline void store_sr(bf16_t* p, vf a, vi r16) { p->x = bf16_sr_from_f32(a, r16); }
};

#if ZEROINF_X86
// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
struct Avx2 {
  using vf = __m256;
  static constexpr int W = 8;
  static inline vf set1(float a) { return _mm256_set1_ps(a); }
  static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
  static inline vf load(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static inline vf load(const fp16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store(float* p, vf a) { _mm256_storeu_ps(p, a); }
  static inline void store(bf16_t* p, vf a) {
    const __m256i u = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 ordered = _mm256_cmp_ps(a, a, _CMP_ORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0xFFFF)),
                                             _mm256_castsi256_ps(r), ordered));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static inline void store(fp16_t* p, vf a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
  }
  static inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
  static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
  static inline vf sqrt(vf a) { return _mm256_sqrt_ps(a); }
  using vi = __m256i;
  static inline vi hash_index(uint32_t idx0, uint32_t key) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(idx0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int>(key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static inline vi lo16(vi r) { return _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)); }
  static inline vi hi16(vi r) { return _mm256_srli_epi32(r, 16); }
  static inline void store_sr(bf16_t* p, vf a, vi r16) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(a), r16), 16);
    const __m256 ordered = _mm256_cmp_ps(a, a, _CMP_ORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0xFFFF)),
                                             _mm256_castsi256_ps(r), ordered));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
struct Avx512 {
  using vf = __m512;
  static constexpr int W = 16;
  static inline vf set1(float a) { return _mm512_set1_ps(a); }
  static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
  static inline vf load(const bf16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static inline vf load(const fp16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
  static inline void store(bf16_t* p, vf a) {
    const __m512i u = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static inline void store(fp16_t* p, vf a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
  }
  static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
  static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
  static inline vf sqrt(vf a) { return _mm512_sqrt_ps(a); }
  using vi = __m512i;
  static inline vi hash_index(uint32_t idx0, uint32_t key) {
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(idx0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(x, _mm512_set1_epi32(static_cast<int>(key)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static inline vi lo16(vi r) { return _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)); }
  static inline vi hi16(vi r) { return _mm512_srli_epi32(r, 16); }
  static inline void store_sr(bf16_t* p, vf a, vi r16) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(a), r16), 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q);
    r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};
#pragma GCC pop_options
#endif  // ZEROINF_X86

}  // namespace simd
}  // namespace zeroinf
