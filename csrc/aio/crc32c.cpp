// CRC-32C kernels (see crc32c.h). The combine is zlib's crc32_combine method (multiplication
// modulo the polynomial by x^(8*len2), with x^(2^k) precomputed), for the Castagnoli polynomial.
#include "crc32c.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define ZEROINF_CRC_X86 1
#endif

namespace zeroinf {
namespace aio {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t slice[8][256];  // slice[k][b]: CRC of byte b followed by k zero bytes
  uint32_t x2n[32];        // x^(2^k) mod P, reflected
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      slice[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; ++b) {
      for (int k = 1; k < 8; ++k) slice[k][b] = (slice[k - 1][b] >> 8) ^ slice[0][slice[k - 1][b] & 0xFF];
    }
    uint32_t p = 1u << 30;  // x^1
    x2n[0] = p;
    for (int k = 1; k < 32; ++k) x2n[k] = p = multmodp(p, p);
  }
  // a * b mod P (reflected bit order: bit 31 is x^0).
  static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
      if (a & m) {
        p ^= b;
        if ((a & (m - 1)) == 0) break;
      }
      m >>= 1;
      b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
    }
    return p;
  }
};

const Tables& tables() {
  static const Tables t;  // thread-safe one-time initialisation
  return t;
}

// x^(8n) mod P.
uint32_t x8nmodp(uint64_t n) {
  const Tables& t = tables();
  uint32_t p = 1u << 31;  // x^0
  int k = 3;
  while (n) {
    if (n & 1) p = Tables::multmodp(t.x2n[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

// Raw (not inverted) register update, portable: 8 bytes per step through the sliced tables.
uint32_t crc_table(uint32_t c, const unsigned char* p, size_t n) {
  const Tables& t = tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = (c >> 8) ^ t.slice[0][(c ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only reach here with the same byte order as x86
    const uint32_t lo = static_cast<uint32_t>(w) ^ c, hi = static_cast<uint32_t>(w >> 32);
    c = t.slice[7][lo & 0xFF] ^ t.slice[6][(lo >> 8) & 0xFF] ^ t.slice[5][(lo >> 16) & 0xFF] ^
        t.slice[4][lo >> 24] ^ t.slice[3][hi & 0xFF] ^ t.slice[2][(hi >> 8) & 0xFF] ^
        t.slice[1][(hi >> 16) & 0xFF] ^ t.slice[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t.slice[0][(c ^ *p++) & 0xFF];
  return c;
}

#ifdef ZEROINF_CRC_X86
// Raw register update with crc32q. Inputs of 3 * kStripe bytes or more run three independent
// streams (the instruction's latency is 3 cycles, its throughput 1 per cycle) and merge them
// with the combine multiplication: stream values are raw registers, so a stream is shifted past
// the bytes after it by multiplying with x^(8*len).
__attribute__((target("sse4.2"))) uint32_t crc_hw_raw(uint32_t c, const unsigned char* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  constexpr size_t kStripe = 8192;
  if (n >= 3 * kStripe) {
    static const uint32_t shift = x8nmodp(kStripe);  // x^(8 * kStripe)
    while (n >= 3 * kStripe) {
      uint64_t a = c, b = 0, d = 0;
      const unsigned char* pa = p;
      const unsigned char* pb = p + kStripe;
      const unsigned char* pd = p + 2 * kStripe;
      for (size_t i = 0; i < kStripe; i += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, pa + i, 8);
        std::memcpy(&wb, pb + i, 8);
        std::memcpy(&wd, pd + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      // raw(A||B||D) = raw(A)*x^(2L) ^ raw_from_0(B)*x^L ^ raw_from_0(D)
      uint32_t r = Tables::multmodp(shift, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      c = Tables::multmodp(shift, r) ^ static_cast<uint32_t>(d);
      p += 3 * kStripe;
      n -= 3 * kStripe;
    }
  }
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

using RawFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

// ZEROINF_CRC32C_ISA=table forces the table path (tests compare the two); read once.
RawFn pick() {
  const char* isa = std::getenv("ZEROINF_CRC32C_ISA");
  if (isa != nullptr && std::strcmp(isa, "table") == 0) return crc_table;
#ifdef ZEROINF_CRC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("sse4.2")) return crc_hw_raw;
#endif
  return crc_table;
}

RawFn raw_fn() {
  static const RawFn fn = pick();
  return fn;
}

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) noexcept {
  return ~raw_fn()(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept {
  return Tables::multmodp(x8nmodp(len2), crc1) ^ crc2;
}

bool crc32c_hardware() noexcept {
#ifdef ZEROINF_CRC_X86
  return raw_fn() == crc_hw_raw;
#else
  return false;
#endif
}

}  // namespace aio
}  // namespace zeroinf
