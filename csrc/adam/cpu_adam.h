// Fused Adam / AdamW over flat fp32 buffers: the kernel API (no torch types; see bindings.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroinf {
namespace adam {

// Instruction-set paths, widest last. All give identical bits (see csrc/includes/simd.h).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// Element type of the gradient input, of the moments (kF32 or kBF16) and of the optional 16-bit
// parameter output.
enum class DType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

const char* isa_name(Isa isa);
// Empty string when `isa` can run on this CPU, else the reason it cannot.
std::string isa_unsupported_reason(Isa isa);
// The widest supported path, probed once with __builtin_cpu_supports and cached.
Isa best_isa();

// Per-call hyper-parameters, already folded into single-precision coefficients by the caller
// (bindings.cpp computes them in double precision from lr, betas, step, ...). One element update:
//   g  = grad / grad_scale                         (only when divide_grad)
//   p  = p * decay                                 (AdamW; decay = 1 - lr * weight_decay)
//   g  = g + p * l2                                (Adam with L2; l2 = weight_decay)
//   m  = m * beta1 + g * (1 - beta1)
//   v  = v * beta2 + ((1 - beta2) * g) * g
//   p  = p - step_size * (m / (sqrt(v) * inv_bc2_sqrt + eps))
//   out = p rounded to bf16/fp16                   (when an output is given)
// with step_size = lr / (1 - beta1^step), inv_bc2_sqrt = 1 / sqrt(1 - beta2^step) (both 1-based
// step, or lr and 1 without bias correction); formula of Loshchilov & Hutter, "Decoupled Weight
// Decay Regularization" (2019), Algorithm 2, in the operation order of torch.optim.AdamW.
struct Hyper {
  float step_size, inv_bc2_sqrt, eps;
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float decay, l2, grad_scale;
  bool use_decay, use_l2, divide_grad;
};

// One tensor's buffers: n elements each; `g`, `m` and `v`, and `out` of element type `gt`, `mt` and
// `ot` (out may be nullptr with ot == kNone); `hyper` indexes the hyper-parameter list of the call.
// With mt == kBF16 the moments are read exactly, updated in fp32 and written back with stochastic
// rounding whose random bits are a hash of (element index, sr_key) (csrc/includes/simd.h), so the
// result depends on nothing else (not on the isa, the threads or the work list); n < 2^32 then.
struct Buffers {
  float* p;
  const void* g;
  void* m;
  void* v;
  void* out;
  int64_t n;
  DType gt, ot, mt;
  int32_t hyper;
  uint32_t sr_key;
};

// The rounding key of one tensor at one step: the low 32 bits of splitmix64(splitmix64(seed) + step)
// (Steele et al. 2014, "Fast Splittable Pseudorandom Number Generators"), step the 1-based step.
uint32_t sr_key(uint64_t seed, int64_t step);

// In-place update of every tensor of `bufs` with hypers[bufs[i].hyper], as if each were updated
// alone in list order: one OpenMP parallel region of `nthreads` threads runs one flat work list
// of cache-sized chunks over all tensors; a tensor whose memory overlaps that of an earlier one
// starts a new phase (a barrier), so aliased tensors are stepped one after the other.
// Throws std::invalid_argument for an unsupported isa, dtype pair or hyper index.
void adam_update(Isa isa, const std::vector<Buffers>& bufs, const std::vector<Hyper>& hypers, int nthreads);

// dst[i] = src[i] rounded to bf16 stochastically, with the random bits adam_update uses for exp_avg
// element i under `key`: n < 2^32 elements, `nthreads` OpenMP threads.
void round_bf16_stochastic(Isa isa, const float* src, uint16_t* dst, int64_t n, uint32_t key, int nthreads);

// The bandwidth roof of the same memory traffic, over the same work list: reads grads, params,
// exp_avg, exp_avg_sq, writes params, exp_avg, exp_avg_sq (+ out), with one add per stream
// instead of Adam's math. Hyper indices are ignored; moments must be fp32.
void stream_rmw(Isa isa, const std::vector<Buffers>& bufs, int nthreads);

}  // namespace adam
}  // namespace zeroinf
