// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of swap-file blocks.
//
// Values are the standard, pre- and post-inverted CRC-32C: crc32c(0, "123456789", 9) is
// 0xE3069283. `crc` continues a running value, so crc32c(crc32c(0, a), b) == crc32c(0, a || b).
// The SSE4.2 instruction path (crc32q, about 8 bytes per 3 cycles per stream, three streams) is
// compiled with a target attribute and chosen at run time by cpuid; every other CPU uses an
// 8-way sliced table (also forced by ZEROINF_CRC32C_ISA=table). Both give identical values.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroinf {
namespace aio {

// CRC-32C of `n` bytes at `data`, continuing `crc` (0 to start). Never throws.
uint32_t crc32c(uint32_t crc, const void* data, size_t n) noexcept;

// CRC-32C of A || B from crc1 = crc32c(0, A), crc2 = crc32c(0, B) and len2 = |B| in bytes.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept;

// True when crc32c() uses the SSE4.2 instruction on this CPU.
bool crc32c_hardware() noexcept;

}  // namespace aio
}  // namespace zeroinf
