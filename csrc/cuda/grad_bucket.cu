// Kernels of the fused gradient-bucket pass; see grad_bucket.h for the contract.
//
// Two launches on the caller's stream:
//   1. grad_bucket_pass_kernel: grid-stride over the bucket; each thread converts and stores its
//      elements, squares them into an fp32 accumulator and counts non-finite values; each block
//      reduces its threads and writes one partial sum and one count to the workspace.
//   2. finalize_kernel: one block adds the per-block partials in a fixed order.
// No atomics: with the grid fixed by (numel, SM count) the result is bit-reproducible.
//
// Loads and stores are 4-wide packs when both pointers are aligned to the pack size (16 bytes for
// fp32, 8 for 16-bit types), else scalar. When `out` is mapped pinned host memory the stores go
// over PCIe as posted writes; no separate device staging buffer or cudaMemcpy is needed.
#include "grad_bucket.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace zeroinf {
namespace cuda_grad {
namespace {

constexpr int kThreads = 256;           // threads per block (8 warps)
constexpr int kPack = 4;                // elements per vector load/store
constexpr int kBlocksPerSm = 8;         // 8 x 256 = 2048 resident threads per SM

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename OutT>
__device__ __forceinline__ OutT from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Same dtype: copy the bits (keeps NaN payloads); otherwise widen to fp32 and round to nearest
// even, which is what torch's Tensor.to() does for these pairs.
template <typename InT, typename OutT>
__device__ __forceinline__ OutT convert(InT x) {
  if constexpr (std::is_same<InT, OutT>::value) {
    return x;
  } else {
    return from_float<OutT>(to_float(x));
  }
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// Sum `acc` and `bad` over the block; the totals are valid in thread 0.
__device__ __forceinline__ void block_sum(float& acc, unsigned long long& bad) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_acc[kWarps];
  __shared__ unsigned long long s_bad[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  acc = warp_sum(acc);
  bad = warp_sum(bad);
  if (lane == 0) {
    s_acc[warp] = acc;
    s_bad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    acc = lane < kWarps ? s_acc[lane] : 0.0f;
    bad = lane < kWarps ? s_bad[lane] : 0ull;
    acc = warp_sum(acc);
    bad = warp_sum(bad);
  }
}

template <typename InT, typename OutT>
__device__ __forceinline__ void visit(InT x, OutT& y, float& acc, unsigned long long& bad) {
  const float f = to_float(x);
  acc = fmaf(f, f, acc);
  bad += isfinite(f) ? 0ull : 1ull;
  y = convert<InT, OutT>(x);
}

template <typename InT, typename OutT, int N>
__global__ void __launch_bounds__(kThreads)
grad_bucket_pass_kernel(const InT* __restrict__ grad, OutT* __restrict__ out, int64_t numel,
                        float* __restrict__ partial_sq, unsigned long long* __restrict__ partial_bad) {
  float acc = 0.0f;
  unsigned long long bad = 0ull;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;

  const int64_t npacks = numel / N;
  const auto* gp = reinterpret_cast<const Pack<InT, N>*>(grad);
  auto* op = reinterpret_cast<Pack<OutT, N>*>(out);
  for (int64_t i = tid; i < npacks; i += stride) {
    const Pack<InT, N> g = gp[i];
    Pack<OutT, N> o;
#pragma unroll
    for (int k = 0; k < N; ++k) visit(g.v[k], o.v[k], acc, bad);
    op[i] = o;
  }
  // Tail of fewer than N elements.
  for (int64_t i = npacks * N + tid; i < numel; i += stride) visit(grad[i], out[i], acc, bad);

  block_sum(acc, bad);
  if (threadIdx.x == 0) {
    partial_sq[blockIdx.x] = acc;
    partial_bad[blockIdx.x] = bad;
  }
}

__global__ void __launch_bounds__(kThreads)
finalize_kernel(const float* __restrict__ partial_sq, const unsigned long long* __restrict__ partial_bad,
                int num_blocks, float* __restrict__ sq_norm, int64_t* __restrict__ nonfinite) {
  float acc = 0.0f;
  unsigned long long bad = 0ull;
  for (int i = threadIdx.x; i < num_blocks; i += kThreads) {
    acc += partial_sq[i];
    bad += partial_bad[i];
  }
  block_sum(acc, bad);
  if (threadIdx.x == 0) {
    *sq_norm = acc;
    *nonfinite = static_cast<int64_t>(bad);
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename InT, typename OutT>
cudaError_t launch_typed(const void* grad, void* out, int64_t numel, float* partial_sq,
                         unsigned long long* partial_bad, int num_blocks, float* sq_norm,
                         int64_t* nonfinite, cudaStream_t stream) {
  const auto* g = static_cast<const InT*>(grad);
  auto* o = static_cast<OutT*>(out);
  if (aligned(grad, sizeof(Pack<InT, kPack>)) && aligned(out, sizeof(Pack<OutT, kPack>))) {
    grad_bucket_pass_kernel<InT, OutT, kPack>
        <<<num_blocks, kThreads, 0, stream>>>(g, o, numel, partial_sq, partial_bad);
  } else {
    grad_bucket_pass_kernel<InT, OutT, 1>
        <<<num_blocks, kThreads, 0, stream>>>(g, o, numel, partial_sq, partial_bad);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  finalize_kernel<<<1, kThreads, 0, stream>>>(partial_sq, partial_bad, num_blocks, sq_norm, nonfinite);
  return cudaGetLastError();
}

template <typename InT>
cudaError_t dispatch_out(DType out_dtype, const void* grad, void* out, int64_t numel, float* partial_sq,
                         unsigned long long* partial_bad, int num_blocks, float* sq_norm,
                         int64_t* nonfinite, cudaStream_t stream) {
  switch (out_dtype) {
    case DType::kFloat32:
      return launch_typed<InT, float>(grad, out, numel, partial_sq, partial_bad, num_blocks, sq_norm,
                                      nonfinite, stream);
    case DType::kBFloat16:
      return launch_typed<InT, __nv_bfloat16>(grad, out, numel, partial_sq, partial_bad, num_blocks,
                                              sq_norm, nonfinite, stream);
    case DType::kFloat16:
      return launch_typed<InT, __half>(grad, out, numel, partial_sq, partial_bad, num_blocks, sq_norm,
                                       nonfinite, stream);
  }
  return cudaErrorInvalidValue;
}

size_t partial_sq_bytes(int num_blocks) {
  // Round up so the int64 counts that follow are 8-byte aligned.
  return (static_cast<size_t>(num_blocks) * sizeof(float) + 7) / 8 * 8;
}

}  // namespace

int pass_num_blocks(int64_t numel, int sm_count) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * kPack;
  const int64_t wanted = (numel + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * kBlocksPerSm;
  const int64_t blocks = wanted < cap ? wanted : cap;
  return blocks > 0 ? static_cast<int>(blocks) : 1;
}

size_t pass_workspace_bytes(int num_blocks) {
  return partial_sq_bytes(num_blocks) + static_cast<size_t>(num_blocks) * sizeof(unsigned long long);
}

cudaError_t launch_grad_bucket_pass(const void* grad, DType grad_dtype, void* out, DType out_dtype,
                                    int64_t numel, void* workspace, int num_blocks, float* sq_norm,
                                    int64_t* nonfinite, cudaStream_t stream) {
  if (numel < 0 || num_blocks < 1 || sq_norm == nullptr || nonfinite == nullptr) return cudaErrorInvalidValue;
  if (numel == 0) {
    cudaError_t err = cudaMemsetAsync(sq_norm, 0, sizeof(float), stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(nonfinite, 0, sizeof(int64_t), stream);
  }
  if (grad == nullptr || out == nullptr || workspace == nullptr || !aligned(workspace, 8)) {
    return cudaErrorInvalidValue;
  }
  auto* partial_sq = static_cast<float*>(workspace);
  auto* partial_bad = reinterpret_cast<unsigned long long*>(static_cast<char*>(workspace) +
                                                            partial_sq_bytes(num_blocks));
  switch (grad_dtype) {
    case DType::kFloat32:
      return dispatch_out<float>(out_dtype, grad, out, numel, partial_sq, partial_bad, num_blocks, sq_norm,
                                 nonfinite, stream);
    case DType::kBFloat16:
      return dispatch_out<__nv_bfloat16>(out_dtype, grad, out, numel, partial_sq, partial_bad, num_blocks,
                                         sq_norm, nonfinite, stream);
    case DType::kFloat16:
      return dispatch_out<__half>(out_dtype, grad, out, numel, partial_sq, partial_bad, num_blocks, sq_norm,
                                  nonfinite, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_grad
}  // namespace zeroinf
