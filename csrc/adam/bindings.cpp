// Python bindings of the CPU Adam kernels: tensor checks (ValueError naming the argument), the
// folding of hyper-parameters into single-precision coefficients, and the GIL released while the
// kernel runs. The kernels themselves are in cpu_adam.cpp.
#include <torch/extension.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_adam.h"

namespace za = zeroinf::adam;

namespace {

za::Isa parse_isa(const std::string& isa) {
  if (isa.empty() || isa == "auto") return za::best_isa();
  for (za::Isa i : {za::Isa::kScalar, za::Isa::kAvx2, za::Isa::kAvx512})
    if (isa == za::isa_name(i)) {
      const std::string why = za::isa_unsupported_reason(i);
      TORCH_CHECK_VALUE(why.empty(), "isa='", isa, "' cannot run here: ", why);
      return i;
    }
  TORCH_CHECK_VALUE(false, "isa must be one of 'auto', 'avx512', 'avx2', 'scalar'; got '", isa, "'");
  return za::Isa::kScalar;
}

za::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return za::DType::kF32;
    case at::kBFloat16: return za::DType::kBF16;
    case at::kHalf: return za::DType::kF16;
    default: return za::DType::kNone;
  }
}

// The index suffix of an argument name in messages: nothing for the single-tensor form, "[3]" for
// element 3 of the list form. Streamed only when a check fails, so passing checks build no strings.
struct Sfx {
  int64_t i = -1;
};
std::ostream& operator<<(std::ostream& os, const Sfx& s) {
  if (s.i >= 0) os << '[' << s.i << ']';
  return os;
}

void check_buffer(const at::Tensor& t, const char* name, Sfx sfx, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, sfx, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, sfx, " must be contiguous (the update is written in place; "
                    "a contiguous copy would lose it)");
  TORCH_CHECK_VALUE(t.numel() == numel, name, sfx, " has ", t.numel(), " elements, params has ", numel);
}

struct Checked {
  za::DType gt, ot, mt;
  void* out;
};

Checked check_all(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& params_out, Sfx sfx = {}) {
  const int64_t n = params.numel();
  check_buffer(params, "params", sfx, n);
  TORCH_CHECK_VALUE(params.scalar_type() == at::kFloat, "params", sfx, " must be float32, got ",
                    params.scalar_type());
  check_buffer(grads, "grads", sfx, n);
  Checked c{to_dtype(grads.scalar_type()), za::DType::kNone, to_dtype(exp_avg.scalar_type()), nullptr};
  TORCH_CHECK_VALUE(c.gt != za::DType::kNone, "grads", sfx, " must be float32, bfloat16 or float16, got ",
                    grads.scalar_type());
  check_buffer(exp_avg, "exp_avg", sfx, n);
  TORCH_CHECK_VALUE(c.mt == za::DType::kF32 || c.mt == za::DType::kBF16, "exp_avg", sfx,
                    " must be float32 or bfloat16, got ", exp_avg.scalar_type());
  check_buffer(exp_avg_sq, "exp_avg_sq", sfx, n);
  TORCH_CHECK_VALUE(exp_avg_sq.scalar_type() == exp_avg.scalar_type(), "exp_avg_sq", sfx, " must have exp_avg",
                    sfx, "'s dtype ", exp_avg.scalar_type(), ", got ", exp_avg_sq.scalar_type());
  TORCH_CHECK_VALUE(c.mt == za::DType::kF32 || n < (int64_t{1} << 32), "exp_avg", sfx, ": bf16 moments allow "
                    "fewer than 2^32 elements per tensor, got ", n);
  if (params_out.has_value()) {
    check_buffer(*params_out, "params_out", sfx, n);
    c.ot = to_dtype(params_out->scalar_type());
    TORCH_CHECK_VALUE(c.ot == za::DType::kBF16 || c.ot == za::DType::kF16,
                      "params_out", sfx, " must be bfloat16 or float16, got ", params_out->scalar_type());
    c.out = params_out->data_ptr();
  }
  return c;
}

za::Hyper make_hyper(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool adamw_mode, bool bias_correction, double grad_scale, Sfx sfx = {}) {
  TORCH_CHECK_VALUE(step >= 1, "step", sfx, " must be >= 1 (the step number after increment), got ", step);
  TORCH_CHECK_VALUE(std::isfinite(grad_scale) && grad_scale > 0, "grad_scale must be finite and > 0, got ",
                    grad_scale);
  // Coefficients in double, rounded once to float (torch.optim.AdamW passes the same values as
  // Python floats to its kernels).
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  za::Hyper h{};
  h.step_size = static_cast<float>(lr / bc1);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.use_decay = adamw_mode && weight_decay != 0.0;
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.use_l2 = !adamw_mode && weight_decay != 0.0;
  h.l2 = static_cast<float>(weight_decay);
  h.divide_grad = grad_scale != 1.0;
  h.grad_scale = static_cast<float>(grad_scale);
  return h;
}

za::Buffers buffers(const at::Tensor& params, const at::Tensor& grads, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const Checked& c, int32_t hyper, uint32_t sr_key = 0) {
  return za::Buffers{params.data_ptr<float>(), grads.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                     c.out, params.numel(), c.gt, c.ot, c.mt, hyper, sr_key};
}

// `sr_seed` (any 64-bit value, as an int64) keys the stochastic rounding of bf16 moments together
// with `step`; fp32 moments ignore it.
void adam_step(at::Tensor params, at::Tensor grads, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               c10::optional<at::Tensor> params_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw_mode, bool bias_correction, double grad_scale,
               const std::string& isa, int64_t sr_seed) {
  const Checked c = check_all(params, grads, exp_avg, exp_avg_sq, params_out);
  const std::vector<za::Hyper> h{
      make_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale)};
  const za::Isa path = parse_isa(isa);
  const uint32_t key = za::sr_key(static_cast<uint64_t>(sr_seed), step);
  const std::vector<za::Buffers> bufs{buffers(params, grads, exp_avg, exp_avg_sq, c, 0, key)};
  const int threads = at::get_num_threads();
  py::gil_scoped_release no_gil;
  za::adam_update(path, bufs, h, threads);
}

// One param group's hyper-parameters: (lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction).
using GroupHyper = std::tuple<double, double, double, double, double, bool, bool>;

// The list form's buffers and hyper-parameters: tensor i with step number steps[i] and the
// hyper-parameters groups[group_of[i]]; tensors of one group with one step number share a Hyper
// (the usual case: one per group). Checks every tensor before returning; throws ValueError
// naming the first bad one by its index.
void collect_list(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<c10::optional<at::Tensor>>& params_outs, const std::vector<int64_t>& steps,
                  const std::vector<int64_t>& group_of, const std::vector<GroupHyper>& groups, double grad_scale,
                  std::vector<za::Buffers>& bufs, std::vector<za::Hyper>& hypers) {
  const size_t k = params.size();
  TORCH_CHECK_VALUE(grads.size() == k && exp_avgs.size() == k && exp_avg_sqs.size() == k &&
                        params_outs.size() == k && steps.size() == k && group_of.size() == k,
                    "params, grads, exp_avgs, exp_avg_sqs, params_outs, steps and group_of must have the same "
                    "length; got ", k, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ",
                    params_outs.size(), ", ", steps.size(), ", ", group_of.size());
  bufs.reserve(k);
  std::map<std::pair<int64_t, int64_t>, int32_t> index;
  for (size_t i = 0; i < k; ++i) {
    const Sfx sfx{static_cast<int64_t>(i)};
    const Checked c = check_all(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], params_outs[i], sfx);
    TORCH_CHECK_VALUE(c.mt == za::DType::kF32, "exp_avgs", sfx, " must be float32 in the list form (bf16 "
                      "moments are stepped one tensor at a time, with adam_step and its sr_seed)");
    const int64_t gi = group_of[i];
    TORCH_CHECK_VALUE(gi >= 0 && static_cast<size_t>(gi) < groups.size(), "group_of", sfx, " is ", gi,
                      "; there are ", groups.size(), " groups");
    auto [it, fresh] = index.try_emplace({gi, steps[i]}, static_cast<int32_t>(hypers.size()));
    if (fresh) {
      const auto& [lr, beta1, beta2, eps, wd, adamw_mode, bias_correction] = groups[gi];
      hypers.push_back(make_hyper(steps[i], lr, beta1, beta2, eps, wd, adamw_mode, bias_correction, grad_scale, sfx));
    }
    bufs.push_back(buffers(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], c, it->second));
  }
}

// The list form: one call, and one parallel region, for many tensors of several param groups
// (see collect_list). Every tensor is checked before any is written.
void adam_step_list(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<c10::optional<at::Tensor>>& params_outs, const std::vector<int64_t>& steps,
                    const std::vector<int64_t>& group_of, const std::vector<GroupHyper>& groups,
                    double grad_scale, const std::string& isa) {
  const za::Isa path = parse_isa(isa);
  std::vector<za::Buffers> bufs;
  std::vector<za::Hyper> hypers;
  collect_list(params, grads, exp_avgs, exp_avg_sqs, params_outs, steps, group_of, groups, grad_scale, bufs, hypers);
  const int threads = at::get_num_threads();
  py::gil_scoped_release no_gil;
  za::adam_update(path, bufs, hypers, threads);
}

// The list form with torch.optim's step counters: step_counts[i] is tensor i's count of steps
// taken (a one-element float32 CPU tensor holding a whole number >= 0, as torch.optim.AdamW keeps
// state["step"]); tensor i is stepped with step number count + 1, and every count is incremented
// once all tensors are stepped. Returns -1 then. Returns the index of the first tensor with a
// buffer that is not contiguous, stepping nothing and leaving the counts as they are: the caller
// steps such lists through contiguous copies. Throws ValueError for any other bad argument, before
// anything is written.
int64_t adam_step_counted(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<c10::optional<at::Tensor>>& params_outs,
                          const std::vector<at::Tensor>& step_counts, const std::vector<int64_t>& group_of,
                          const std::vector<GroupHyper>& groups, double grad_scale, const std::string& isa) {
  const size_t k = params.size();
  TORCH_CHECK_VALUE(step_counts.size() == k, "step_counts has ", step_counts.size(), " tensors, params ", k);
  std::vector<int64_t> steps(k);
  for (size_t i = 0; i < k; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]})
      if (!t->is_contiguous()) return static_cast<int64_t>(i);
    if (params_outs[i].has_value() && !params_outs[i]->is_contiguous()) return static_cast<int64_t>(i);
    const at::Tensor& c = step_counts[i];
    TORCH_CHECK_VALUE(c.device().is_cpu() && c.scalar_type() == at::kFloat && c.numel() == 1, "step_counts[", i,
                      "] must be a one-element float32 CPU tensor, got ", c.scalar_type(), " with ", c.numel(),
                      " elements on ", c.device());
    const float count = *c.data_ptr<float>();
    // from 2^24 on, count + 1 rounds back to count in float32: the count stays there, as
    // torch.optim.AdamW's float32 state["step"] does (the bias corrections are 1 by then)
    TORCH_CHECK_VALUE(count >= 0.0f && count < 0x1p62f && count == std::floor(count), "step_counts[", i,
                      "] is ", count, "; a step count is a whole number in [0, 2^62)");
    steps[i] = static_cast<int64_t>(count) + 1;
  }
  adam_step_list(params, grads, exp_avgs, exp_avg_sqs, params_outs, steps, group_of, groups, grad_scale, isa);
  // a counter shared by several tensors (one state for tied entries) counts once per step
  for (size_t i = 0; i < k; ++i) *step_counts[i].data_ptr<float>() = static_cast<float>(steps[i]);
  return -1;
}

void stream_rmw(at::Tensor params, at::Tensor grads, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                c10::optional<at::Tensor> params_out, const std::string& isa) {
  const Checked c = check_all(params, grads, exp_avg, exp_avg_sq, params_out);
  TORCH_CHECK_VALUE(c.mt == za::DType::kF32, "exp_avg must be float32 for stream_rmw, got ", exp_avg.scalar_type());
  const za::Isa path = parse_isa(isa);
  const std::vector<za::Buffers> bufs{buffers(params, grads, exp_avg, exp_avg_sq, c, 0)};
  const int threads = at::get_num_threads();
  py::gil_scoped_release no_gil;
  za::stream_rmw(path, bufs, threads);
}

// dst = src rounded to bf16 stochastically, with the bits adam_step uses for exp_avg at (sr_seed, step).
void round_bf16_stochastic(at::Tensor src, at::Tensor dst, int64_t sr_seed, int64_t step, const std::string& isa) {
  check_buffer(src, "src", {}, src.numel());
  TORCH_CHECK_VALUE(src.scalar_type() == at::kFloat, "src must be float32, got ", src.scalar_type());
  check_buffer(dst, "dst", {}, src.numel());
  TORCH_CHECK_VALUE(dst.scalar_type() == at::kBFloat16, "dst must be bfloat16, got ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.numel() < (int64_t{1} << 32), "src: fewer than 2^32 elements allowed, got ", src.numel());
  const za::Isa path = parse_isa(isa);
  const uint32_t key = za::sr_key(static_cast<uint64_t>(sr_seed), step);
  const float* s = src.data_ptr<float>();
  auto* d = static_cast<uint16_t*>(dst.data_ptr());
  const int64_t n = src.numel();
  const int threads = at::get_num_threads();
  py::gil_scoped_release no_gil;
  za::round_bf16_stochastic(path, s, d, n, key, threads);
}

// MKL's matmuls keep a per-thread count of their own. Torch reaches MKL through libtorch_cpu when
// built with it (x86-64 wheels); elsewhere the symbol is absent and there is nothing to cap.
using MklSetLocal = int (*)(int);

MklSetLocal mkl_set_local() {
  static const MklSetLocal fn = []() -> MklSetLocal {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    // the C entry point (mkl.h maps mkl_set_num_threads_local to it); the lower-case symbol
    // exported beside it is the Fortran one, which takes a pointer
    return lib ? reinterpret_cast<MklSetLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local")) : nullptr;
  }();
  return fn;
}

// Caps the threads of parallel regions started from the calling thread (OpenMP: this op's kernels
// and torch's element-wise ops; MKL: torch's matmuls) at n, never above the thread's count now;
// other threads keep theirs. Torch's per-thread initialisation runs first, or its first parallel
// op in this thread would reset the cap to the process-wide count.
int64_t limit_thread_parallelism(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "n must be >= 1, got ", n);
  const int now = at::get_num_threads();
  const int cap = static_cast<int>(std::min<int64_t>(n, now));
#ifdef _OPENMP
  omp_set_num_threads(cap);
#endif
  if (MklSetLocal set_local = mkl_set_local()) set_local(cap);
  return at::get_num_threads();
}

py::dict isa_info() {
  py::dict d;
  d["chosen"] = za::isa_name(za::best_isa());
  py::dict paths;
  for (za::Isa i : {za::Isa::kAvx512, za::Isa::kAvx2, za::Isa::kScalar})
    paths[za::isa_name(i)] = za::isa_unsupported_reason(i);
  d["unsupported"] = paths;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroinf fused CPU Adam (see zeroinf.optim for the documented Python API)";
  m.def("adam_step", &adam_step, "In-place fused Adam/AdamW step over flat contiguous CPU buffers",
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("params_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("isa"), py::arg("sr_seed") = 0);
  m.def("adam_step_list", &adam_step_list,
        "adam_step over lists of tensors in one parallel region (a step number and a group each; groups "
        "are (lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction) tuples)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("params_outs"), py::arg("steps"), py::arg("group_of"), py::arg("groups"),
        py::arg("grad_scale"), py::arg("isa"));
  m.def("adam_step_counted", &adam_step_counted,
        "adam_step_list with torch.optim's step counters: steps with each count + 1, then increments the counts; "
        "returns -1, or the index of the first tensor with a non-contiguous buffer (nothing stepped)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("params_outs"), py::arg("step_counts"), py::arg("group_of"), py::arg("groups"),
        py::arg("grad_scale"), py::arg("isa"));
  m.def("stream_rmw", &stream_rmw, "Bandwidth roof: the Adam step's loads and stores, one add each",
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("params_out"), py::arg("isa"));
  m.def("round_bf16_stochastic", &round_bf16_stochastic,
        "dst (bf16) = src (fp32) with stochastic rounding keyed by (sr_seed, step), as adam_step rounds exp_avg",
        py::arg("src"), py::arg("dst"), py::arg("sr_seed"), py::arg("step"), py::arg("isa"));
  m.def("limit_thread_parallelism", &limit_thread_parallelism,
        "Cap the OpenMP and MKL threads of parallel regions started from the calling thread; returns torch's count there",
        py::arg("n"));
  m.def("isa_info", &isa_info, "{'chosen': name, 'unsupported': {name: reason or ''}}");
}
