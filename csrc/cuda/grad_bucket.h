// Fused pass over one gradient bucket on the GPU: count non-finite values, accumulate the
// squared L2 norm in fp32, and write a converted copy (fp32 / bf16 / fp16) to a destination the
// device can address -- typically the pinned host staging buffer read by the CPU optimizer, so
// the gradient is read from device memory once instead of three times (isfinite, norm, copy).
//
// This header and grad_bucket.cu use only the CUDA runtime API: no torch headers, so the kernel
// file compiles with plain nvcc (the compile check in tests/test_cuda.py). The torch binding is
// bindings.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace zeroinf {
namespace cuda_grad {

// Element types, numbered like nothing else on purpose: the binding maps torch dtypes to these.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Number of blocks the pass launches for `numel` elements on a device with `sm_count`
// multiprocessors (at least 1). The grid depends only on these two numbers, so the partial sums
// are combined in the same order on every call: the norm is deterministic for a given device.
int pass_num_blocks(int64_t numel, int sm_count);

// Bytes of device workspace the pass needs for `num_blocks` blocks (per-block partial sums and
// non-finite counts).
size_t pass_workspace_bytes(int num_blocks);

// Enqueue the fused pass on `stream`; returns immediately.
//
//   grad       device pointer, `numel` contiguous elements of `grad_dtype`
//   out        pointer the device can write (device memory, or the device alias of mapped pinned
//              host memory), `numel` contiguous elements of `out_dtype`; out[i] = convert(grad[i])
//              with round-to-nearest-even, bit-identical to torch's Tensor.to(out_dtype) for
//              finite values (same-dtype copies are bit-identical for every value)
//   workspace  device memory of pass_workspace_bytes(num_blocks) bytes, 8-byte aligned
//   num_blocks from pass_num_blocks()
//   sq_norm    device pointer to one float: sum of grad[i]^2, accumulated in fp32 (inf/nan if a
//              value is non-finite or the sum overflows)
//   nonfinite  device pointer to one int64: number of inf/nan elements in grad
//
// Returns cudaSuccess, cudaErrorInvalidValue for an unknown dtype, a null pointer with numel > 0,
// numel < 0 or num_blocks < 1, or the launch error reported by the runtime.
cudaError_t launch_grad_bucket_pass(const void* grad, DType grad_dtype, void* out, DType out_dtype,
                                    int64_t numel, void* workspace, int num_blocks, float* sq_norm,
                                    int64_t* nonfinite, cudaStream_t stream);

}  // namespace cuda_grad
}  // namespace zeroinf
