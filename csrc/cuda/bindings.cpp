// Torch binding of the fused gradient-bucket pass (kernels: grad_bucket.cu).
//
// Only light CUDA headers from c10 (stream, guard) are used, not ATen/cuda/CUDAContext.h, so the
// binding does not need the cuBLAS/cuSPARSE headers at build time.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <string>
#include <tuple>

#include "grad_bucket.h"

namespace {

using zeroinf::cuda_grad::DType;

DType to_kernel_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "grad_bucket_pass: ", what, " must be float32, bfloat16 or float16, got ",
                       t.scalar_type());
  }
  return DType::kFloat32;  // unreachable
}

int sm_count(int device) {
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "grad_bucket_pass: cannot read the SM count of cuda:", device, ": ",
              cudaGetErrorString(err));
  return count;
}

// The address the kernel stores to: `out` itself on the device, or the device alias of a pinned
// (page-locked, mapped) host buffer.
void* device_address_of_out(const at::Tensor& out, const at::Tensor& grad) {
  if (out.is_cuda()) {
    TORCH_CHECK(out.device() == grad.device(), "grad_bucket_pass: out is on ", out.device(),
                " but grad is on ", grad.device(), "; they must share a device");
    return out.data_ptr();
  }
  TORCH_CHECK(out.is_cpu() && out.is_pinned(), "grad_bucket_pass: out must be a CUDA tensor on ",
              grad.device(), " or a pinned CPU tensor (Tensor.pin_memory()), got a ",
              out.is_cpu() ? "pageable CPU tensor" : out.device().str());
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, out.data_ptr());
  TORCH_CHECK(err == cudaSuccess && attr.devicePointer != nullptr,
              "grad_bucket_pass: the pinned out buffer is not mapped into the device address space (",
              err == cudaSuccess ? "no device pointer" : cudaGetErrorString(err),
              "); allocate it with pin_memory() on a system with unified addressing");
  return attr.devicePointer;
}

// Returns (sq_norm, nonfinite): 0-dim float32 and int64 tensors on grad's device, filled
// asynchronously on the current stream.
std::tuple<at::Tensor, at::Tensor> grad_bucket_pass(const at::Tensor& grad, at::Tensor out) {
  TORCH_CHECK(grad.is_cuda(), "grad_bucket_pass: grad must be a CUDA tensor, got ", grad.device());
  TORCH_CHECK(grad.is_contiguous(), "grad_bucket_pass: grad must be contiguous");
  TORCH_CHECK(out.is_contiguous(), "grad_bucket_pass: out must be contiguous");
  TORCH_CHECK(out.numel() == grad.numel(), "grad_bucket_pass: out has ", out.numel(),
              " elements but grad has ", grad.numel());
  const DType grad_dtype = to_kernel_dtype(grad, "grad");
  const DType out_dtype = to_kernel_dtype(out, "out");

  const c10::cuda::CUDAGuard guard(grad.device());
  void* out_ptr = device_address_of_out(out, grad);
  const int device = grad.get_device();
  const int blocks = zeroinf::cuda_grad::pass_num_blocks(grad.numel(), sm_count(device));
  const auto opts = grad.options();
  at::Tensor workspace = at::empty({static_cast<int64_t>(zeroinf::cuda_grad::pass_workspace_bytes(blocks))},
                                   opts.dtype(at::kByte));
  at::Tensor sq_norm = at::empty({}, opts.dtype(at::kFloat));
  at::Tensor nonfinite = at::empty({}, opts.dtype(at::kLong));
  const cudaError_t err = zeroinf::cuda_grad::launch_grad_bucket_pass(
      grad.data_ptr(), grad_dtype, out_ptr, out_dtype, grad.numel(), workspace.data_ptr(), blocks,
      sq_norm.data_ptr<float>(), nonfinite.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream(device).stream());
  TORCH_CHECK(err == cudaSuccess, "grad_bucket_pass: kernel launch failed: ", cudaGetErrorString(err));
  return {sq_norm, nonfinite};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroinf CUDA ops: fused gradient-bucket pass (non-finite count, squared norm, staging copy)";
  m.def("grad_bucket_pass", &grad_bucket_pass, py::arg("grad"), py::arg("out"),
        "Fused pass over a contiguous CUDA gradient bucket: writes out[i] = grad[i] converted to "
        "out.dtype (out on the same device or pinned CPU memory) and returns 0-dim tensors "
        "(sum of squares in fp32, count of inf/nan) on grad's device. Asynchronous on the current stream.");
}
