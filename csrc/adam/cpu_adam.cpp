// Fused CPU Adam kernels: one body (adam_body.h) compiled for AVX-512, AVX2 and scalar code, and a
// run-time dispatcher. Knows nothing of torch; bindings.cpp validates tensors and calls in here.
#include "cpu_adam.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <stdexcept>
#include <type_traits>

#include "simd.h"

namespace zeroinf {
namespace adam {

using RangeFn = void (*)(float*, const void*, void*, void*, void*, int64_t, uint32_t, uint32_t, const Hyper&);
using RoundFn = void (*)(const float*, simd::bf16_t*, int64_t, uint32_t, uint32_t);

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

// The one table from (isa, grad dtype, out dtype, moment dtype) to a kernel instantiation.
#define ZEROINF_ROW(NS, ROOF, M)                                                                   \
  {                                                                                                \
    {nullptr, nullptr, nullptr, nullptr},                                                          \
        {&NS::range<float, simd::no_out_t, M, ROOF>, nullptr, &NS::range<float, simd::bf16_t, M, ROOF>, \
         &NS::range<float, simd::fp16_t, M, ROOF>},                                                \
        {&NS::range<simd::bf16_t, simd::no_out_t, M, ROOF>, nullptr,                               \
         &NS::range<simd::bf16_t, simd::bf16_t, M, ROOF>, &NS::range<simd::bf16_t, simd::fp16_t, M, ROOF>}, \
        {&NS::range<simd::fp16_t, simd::no_out_t, M, ROOF>, nullptr,                               \
         &NS::range<simd::fp16_t, simd::bf16_t, M, ROOF>, &NS::range<simd::fp16_t, simd::fp16_t, M, ROOF>}, \
  }

// [roof][isa][grad dtype][out dtype] with fp32 moments; nullptr = combination not offered.
const RangeFn kTable[2][3][4][4] = {
    {ZEROINF_ROW(isa_scalar, false, float),
#if ZEROINF_X86
     ZEROINF_ROW(isa_avx2, false, float), ZEROINF_ROW(isa_avx512, false, float)
#else
     {}, {}
#endif
    },
    {ZEROINF_ROW(isa_scalar, true, float),
#if ZEROINF_X86
     ZEROINF_ROW(isa_avx2, true, float), ZEROINF_ROW(isa_avx512, true, float)
#else
     {}, {}
#endif
    },
};

// [isa][grad dtype][out dtype] with bf16 moments (Adam only; the roof is defined on fp32 state).
const RangeFn kTableBf16State[3][4][4] = {
    ZEROINF_ROW(isa_scalar, false, simd::bf16_t),
#if ZEROINF_X86
    ZEROINF_ROW(isa_avx2, false, simd::bf16_t), ZEROINF_ROW(isa_avx512, false, simd::bf16_t)
#else
    {}, {}
#endif
};

const RoundFn kRound[3] = {
    &isa_scalar::round_sr_range,
#if ZEROINF_X86
    &isa_avx2::round_sr_range, &isa_avx512::round_sr_range
#else
    nullptr, nullptr
#endif
};
#undef ZEROINF_ROW

// Elements per chunk of the work list: 16 Ki floats = 64 KiB per fp32 stream, about 0.3 MiB for
// the five streams, which stays in a core's L2 while the hardware prefetcher runs ahead. A
// multiple of every W. Small tensors are packed together into items of at least this many.
constexpr int64_t kChunk = int64_t{1} << 14;

int64_t elem_size(DType t) { return t == DType::kF32 ? 4 : (t == DType::kNone ? 0 : 2); }

// A slice [begin, begin + len) of one tensor's elements.
struct Slice {
  int32_t tensor;
  int64_t begin, len;
};

// The flat work list of one call: slices in list order, grouped into items (a thread takes one
// item at a time) and phases (an item never spans two; phases run one after the other).
//   slices of item j:  [item_start[j], item_start[j + 1])
//   items of phase k:  [phase_start[k], phase_start[k + 1])
struct WorkList {
  std::vector<Slice> slices;
  std::vector<int64_t> item_start, phase_start;
};

// Byte ranges of the buffers of the current phase, disjoint and keyed by their start; a tensor
// with a buffer meeting one of them must wait for the phase to end.
class PhaseMemory {
 public:
  bool overlaps(uintptr_t lo, uintptr_t hi) const {
    auto it = spans_.upper_bound(lo);  // the first span starting after lo
    if (it != spans_.end() && it->first < hi) return true;
    return it != spans_.begin() && std::prev(it)->second > lo;
  }
  void add(uintptr_t lo, uintptr_t hi) {  // merges with the spans it meets (the tensor's own)
    auto it = spans_.upper_bound(lo);
    if (it != spans_.begin() && std::prev(it)->second >= lo) it = std::prev(it);
    while (it != spans_.end() && it->first <= hi) {
      lo = std::min(lo, it->first);
      hi = std::max(hi, it->second);
      it = spans_.erase(it);
    }
    spans_.emplace(lo, hi);
  }
  void clear() { spans_.clear(); }

 private:
  std::map<uintptr_t, uintptr_t> spans_;
};

WorkList make_work_list(const std::vector<Buffers>& bufs) {
  WorkList w;
  PhaseMemory phase;
  int64_t pending = 0;  // elements in the open item
  auto close_item = [&] {
    if (pending > 0) w.item_start.push_back(static_cast<int64_t>(w.slices.size()));
    pending = 0;
  };
  w.item_start.push_back(0);
  w.phase_start.push_back(0);
  for (size_t i = 0; i < bufs.size(); ++i) {
    const Buffers& b = bufs[i];
    if (b.n <= 0) continue;
    const std::pair<const void*, int64_t> spans[5] = {
        {b.p, 4}, {b.g, elem_size(b.gt)}, {b.m, elem_size(b.mt)}, {b.v, elem_size(b.mt)}, {b.out, elem_size(b.ot)}};
    bool meets = false;
    for (const auto& [ptr, size] : spans)
      if (ptr != nullptr) {
        const auto lo = reinterpret_cast<uintptr_t>(ptr);
        meets = meets || phase.overlaps(lo, lo + static_cast<uintptr_t>(b.n * size));
      }
    if (meets) {
      close_item();
      w.phase_start.push_back(static_cast<int64_t>(w.item_start.size()) - 1);
      phase.clear();
    }
    for (const auto& [ptr, size] : spans)
      if (ptr != nullptr) {
        const auto lo = reinterpret_cast<uintptr_t>(ptr);
        phase.add(lo, lo + static_cast<uintptr_t>(b.n * size));
      }
    for (int64_t s = 0; s < b.n;) {
      const int64_t len = std::min(kChunk - pending, b.n - s);
      w.slices.push_back({static_cast<int32_t>(i), s, len});
      pending += len;
      s += len;
      if (pending >= kChunk) close_item();
    }
  }
  close_item();
  w.phase_start.push_back(static_cast<int64_t>(w.item_start.size()) - 1);
  return w;
}

// A range [front, back) of item indices, taken from the front by its owner and from the back by
// the other threads; both ends live in one atomic word so the two never take the same item.
class alignas(64) ItemRange {
 public:
  void reset(int64_t front, int64_t back) {
    fb_.store(pack(front, back), std::memory_order_relaxed);
  }
  bool take_front(int64_t& item) {
    uint64_t x = fb_.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = static_cast<uint32_t>(x), b = static_cast<uint32_t>(x >> 32);
      if (f >= b) return false;
      if (fb_.compare_exchange_weak(x, pack(f + 1, b), std::memory_order_relaxed)) {
        item = f;
        return true;
      }
    }
  }
  bool take_back(int64_t& item) {
    uint64_t x = fb_.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = static_cast<uint32_t>(x), b = static_cast<uint32_t>(x >> 32);
      if (f >= b) return false;
      if (fb_.compare_exchange_weak(x, pack(f, b - 1), std::memory_order_relaxed)) {
        item = b - 1;
        return true;
      }
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  std::atomic<uint64_t> fb_{0};
};

void run(bool roof, Isa isa, const std::vector<Buffers>& bufs, const std::vector<Hyper>& hypers, int nthreads) {
  const std::string why = isa_unsupported_reason(isa);
  if (!why.empty()) throw std::invalid_argument(why);
  std::vector<RangeFn> fns(bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    const Buffers& b = bufs[i];
    const int gt = static_cast<int>(b.gt), ot = static_cast<int>(b.ot);
    const bool known = gt >= 0 && gt < 4 && ot >= 0 && ot < 4;
    fns[i] = nullptr;
    if (known && b.mt == DType::kF32) fns[i] = kTable[roof][static_cast<int>(isa)][gt][ot];
    if (known && b.mt == DType::kBF16 && !roof) fns[i] = kTableBf16State[static_cast<int>(isa)][gt][ot];
    if (fns[i] == nullptr)
      throw std::invalid_argument("cpu_adam: unsupported grad/output/moment dtypes for tensor " + std::to_string(i));
    if (b.mt == DType::kBF16 && b.n >= (int64_t{1} << 32))  // element indices of the rounding are 32-bit
      throw std::invalid_argument("cpu_adam: tensor " + std::to_string(i) + " has " + std::to_string(b.n) +
                                  " elements; bf16 moments allow fewer than 2^32");
    if (!roof && (b.hyper < 0 || static_cast<size_t>(b.hyper) >= hypers.size()))
      throw std::invalid_argument("cpu_adam: hyper-parameter index out of range for tensor " + std::to_string(i));
  }
  const WorkList w = make_work_list(bufs);
  const int64_t items = static_cast<int64_t>(w.item_start.size()) - 1;
  if (items <= 0) return;
  if (items >= (int64_t{1} << 32))  // item indices are packed into 32 bits (see ItemRange)
    throw std::invalid_argument("cpu_adam: more than 2^32 work items in one call");
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, items)));
  const Hyper unused{};
  const int64_t phases = static_cast<int64_t>(w.phase_start.size()) - 1;
  auto run_item = [&](int64_t j) {
    for (int64_t s = w.item_start[j]; s < w.item_start[j + 1]; ++s) {
      const Slice& sl = w.slices[s];
      const Buffers& b = bufs[sl.tensor];
      const char* g = static_cast<const char*>(b.g) + sl.begin * elem_size(b.gt);
      char* out = b.out ? static_cast<char*>(b.out) + sl.begin * elem_size(b.ot) : nullptr;
      char* m = static_cast<char*>(b.m) + sl.begin * elem_size(b.mt);
      char* v = static_cast<char*>(b.v) + sl.begin * elem_size(b.mt);
      fns[sl.tensor](b.p + sl.begin, g, m, v, out, sl.len, static_cast<uint32_t>(sl.begin), b.sr_key,
                     roof ? unused : hypers[b.hyper]);
    }
  };
  // Each phase's items are split into `threads` contiguous ranges, one per thread, so every thread
  // streams through one run of memory as a static split does (what the hardware prefetcher and
  // the DRAM pages favour); a thread done with its own range takes items one by one from the back
  // of the others', so a thread whose core is shared with other work (I/O threads, another rank)
  // does not hold the whole step back. Every phase's ranges are set before the region starts, so
  // a thread starts on its range without waiting for the others to arrive; a barrier ends each
  // phase but the last (the region's own join ends that one).
  std::vector<ItemRange> ranges(static_cast<size_t>(threads * phases));
  for (int64_t k = 0; k < phases; ++k) {
    const int64_t lo = w.phase_start[k], count = w.phase_start[k + 1] - lo;
    for (int t = 0; t < threads; ++t)
      ranges[k * threads + t].reset(lo + count * t / threads, lo + count * (t + 1) / threads);
  }
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int me = omp_get_thread_num();
    for (int64_t k = 0; k < phases; ++k) {
      ItemRange* phase = &ranges[k * threads];
      int64_t j;
      while (phase[me].take_front(j)) run_item(j);
      for (int d = 1; d < threads; ++d) {
        ItemRange& other = phase[(me + d) % threads];
        while (other.take_back(j)) run_item(j);
      }
      if (k + 1 < phases) {
#pragma omp barrier
      }
    }
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

void adam_update(Isa isa, const std::vector<Buffers>& bufs, const std::vector<Hyper>& hypers, int nthreads) {
  run(false, isa, bufs, hypers, nthreads);
}

void stream_rmw(Isa isa, const std::vector<Buffers>& bufs, int nthreads) {
  run(true, isa, bufs, {}, nthreads);
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

uint32_t sr_key(uint64_t seed, int64_t step) {
  return static_cast<uint32_t>(splitmix64(splitmix64(seed) + static_cast<uint64_t>(step)));
}

void round_bf16_stochastic(Isa isa, const float* src, uint16_t* dst, int64_t n, uint32_t key, int nthreads) {
  const std::string why = isa_unsupported_reason(isa);
  if (!why.empty()) throw std::invalid_argument(why);
  if (n >= (int64_t{1} << 32))
    throw std::invalid_argument("round_bf16_stochastic: " + std::to_string(n) + " elements; fewer than 2^32 allowed");
  const RoundFn fn = kRound[static_cast<int>(isa)];
  auto* out = reinterpret_cast<simd::bf16_t*>(dst);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(std::max(1, nthreads)) if (nthreads > 1 && chunks > 1) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, len = std::min(kChunk, n - lo);
    fn(src + lo, out + lo, len, static_cast<uint32_t>(lo), key);
  }
}

}  // namespace adam
}  // namespace zeroinf
