// Fused CPU Adam kernels: one body (adam_body.h) compiled for AVX-512, AVX2 and scalar code, and a
// run-time dispatcher. Knows nothing of torch; bindings.cpp validates tensors and calls in here.
#include "cpu_adam.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "simd.h"

namespace zeroinf {
namespace adam {

using RangeFn = void (*)(float*, const void*, float*, float*, void*, int64_t, const Hyper&);

namespace isa_scalar {
using V = simd::Scalar;
#include "adam_body.h"
}  // namespace isa_scalar

#if ZEROINF_X86
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace isa_avx2 {
using V = simd::Avx2;
#include "adam_body.h"
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
namespace isa_avx512 {
using V = simd::Avx512;
#include "adam_body.h"
}  // namespace isa_avx512
#pragma GCC pop_options
#endif

namespace {

// The one table from (isa, grad dtype, out dtype) to a kernel instantiation.
#define ZEROINF_ROW(NS, ROOF)                                                                   \
  {                                                                                             \
    {nullptr, nullptr, nullptr, nullptr},                                                       \
        {&NS::range<float, simd::no_out_t, ROOF>, nullptr, &NS::range<float, simd::bf16_t, ROOF>, \
         &NS::range<float, simd::fp16_t, ROOF>},                                                \
        {&NS::range<simd::bf16_t, simd::no_out_t, ROOF>, nullptr,                               \
         &NS::range<simd::bf16_t, simd::bf16_t, ROOF>, &NS::range<simd::bf16_t, simd::fp16_t, ROOF>}, \
        {&NS::range<simd::fp16_t, simd::no_out_t, ROOF>, nullptr,                               \
         &NS::range<simd::fp16_t, simd::bf16_t, ROOF>, &NS::range<simd::fp16_t, simd::fp16_t, ROOF>}, \
  }

// [roof][isa][grad dtype][out dtype]; nullptr = combination not offered.
const RangeFn kTable[2][3][4][4] = {
    {ZEROINF_ROW(isa_scalar, false),
#if ZEROINF_X86
     ZEROINF_ROW(isa_avx2, false), ZEROINF_ROW(isa_avx512, false)
#else
     {}, {}
#endif
    },
    {ZEROINF_ROW(isa_scalar, true),
#if ZEROINF_X86
     ZEROINF_ROW(isa_avx2, true), ZEROINF_ROW(isa_avx512, true)
#else
     {}, {}
#endif
    },
};
#undef ZEROINF_ROW

// Elements per tile: 16 Ki floats = 64 KiB per fp32 stream, about 0.3 MiB for the five streams,
// which stays in a core's L2 while the hardware prefetcher runs ahead. A multiple of every W.
constexpr int64_t kTile = int64_t{1} << 14;

int64_t elem_size(DType t) { return t == DType::kF32 ? 4 : (t == DType::kNone ? 0 : 2); }

void run(bool roof, Isa isa, float* p, const void* g, DType gt, float* m, float* v, void* out,
         DType ot, int64_t n, const Hyper& h, int nthreads) {
  const std::string why = isa_unsupported_reason(isa);
  if (!why.empty()) throw std::invalid_argument(why);
  const RangeFn fn = kTable[roof][static_cast<int>(isa)][static_cast<int>(gt)][static_cast<int>(ot)];
  if (fn == nullptr) throw std::invalid_argument("cpu_adam: unsupported grad/output dtype pair");
  if (n <= 0) return;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles)));
  const char* gb = static_cast<const char*>(g);
  char* ob = static_cast<char*>(out);
  const int64_t gs = elem_size(gt), os = elem_size(ot);
  // Tiles are handed out dynamically: a thread whose core is shared with other work (I/O threads,
  // another rank) takes fewer tiles instead of holding the whole step back, as a static split would.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * kTile, len = std::min(kTile, n - b);
    fn(p + b, gb + b * gs, m + b, v + b, ob ? ob + b * os : nullptr, len, h);
  }
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

namespace {
std::string probe(Isa isa) {
  if (isa == Isa::kScalar) return "";
#if ZEROINF_X86
  __builtin_cpu_init();
  std::string missing;
  auto need = [&](bool ok, const char* feature) {
    if (!ok) missing += std::string(missing.empty() ? "" : ", ") + feature;
  };
  if (isa == Isa::kAvx2) {
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("f16c"), "f16c");
  } else {
    need(__builtin_cpu_supports("avx512f"), "avx512f");
    need(__builtin_cpu_supports("avx512bw"), "avx512bw");
    need(__builtin_cpu_supports("avx512vl"), "avx512vl");
    need(__builtin_cpu_supports("avx512dq"), "avx512dq");
    need(__builtin_cpu_supports("avx2"), "avx2");
    need(__builtin_cpu_supports("f16c"), "f16c");
  }
  return missing.empty() ? "" : std::string(isa_name(isa)) + " path needs CPU features this CPU lacks: " + missing;
#else
  return std::string(isa_name(isa)) + " path is x86-64 only";
#endif
}
}  // namespace

std::string isa_unsupported_reason(Isa isa) {
  // cpuid answers do not change while the process runs: probe once.
  static const std::string reasons[3] = {probe(Isa::kScalar), probe(Isa::kAvx2), probe(Isa::kAvx512)};
  const int i = static_cast<int>(isa);
  if (i < 0 || i > 2) return "unknown instruction-set path";
  return reasons[i];
}

Isa best_isa() {
  static const Isa cached = [] {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
      if (isa_unsupported_reason(isa).empty()) return isa;
    return Isa::kScalar;
  }();
  return cached;
}

void adam_update(Isa isa, float* params, const void* grads, DType gt, float* exp_avg,
                 float* exp_avg_sq, void* out, DType ot, int64_t n, const Hyper& h, int nthreads) {
  run(false, isa, params, grads, gt, exp_avg, exp_avg_sq, out, ot, n, h, nthreads);
}

void stream_rmw(Isa isa, float* params, const void* grads, DType gt, float* exp_avg,
                float* exp_avg_sq, void* out, DType ot, int64_t n, int nthreads) {
  const Hyper unused{};
  run(true, isa, params, grads, gt, exp_avg, exp_avg_sq, out, ot, n, unused, nthreads);
}

}  // namespace adam
}  // namespace zeroinf
