// Python bindings of the aio engine. zeroinf/io/handle.py is the public face: it opens the
// files, checks sizes and turns failed Completion records into OSError subclasses.
#include <torch/extension.h>

#include "aio_handle.h"
#include "crc32c.h"

namespace py = pybind11;
using zeroinf::aio::Backend;
using zeroinf::aio::Completion;
using zeroinf::aio::Engine;

namespace {

py::tuple to_tuple(const Completion& c) {
  py::list crcs;
  for (uint32_t v : c.crcs) crcs.append(v);
  return py::make_tuple(c.id, c.is_read, c.bytes_requested, c.bytes_done, c.err, c.err_offset, c.what, crcs);
}

// Deletes engines, except in a process forked from the one that built the engine: there the
// workers, their locks and their condition-variable waiters belong to the parent, and destroying
// the object could block forever, so it is leaked (the process is about to use its own engines).
struct EngineDeleter {
  void operator()(Engine* e) const noexcept {
    if (e != nullptr && !e->forked_child()) delete e;
  }
};
using EnginePtr = std::unique_ptr<Engine, EngineDeleter>;

EnginePtr make_engine(const std::string& backend, int64_t block_size, int queue_depth,
                                    int intra_op_parallelism, bool single_submit, bool overlap_events,
                                    const std::string& fault) {
  Backend b;
  if (backend == "libaio") {
    b = Backend::kLibaio;
  } else if (backend == "threads") {
    b = Backend::kThreads;
  } else {
    throw py::value_error("backend must be 'libaio' or 'threads', got '" + backend + "'");
  }
  return EnginePtr(new Engine(b, block_size, queue_depth, intra_op_parallelism, single_submit,
                             overlap_events, fault));
}

int64_t submit(Engine& e, bool is_read, const torch::Tensor& buffer, int64_t nbytes, int fd_direct,
               int fd_buffered, int64_t file_offset, int64_t checksum_chunk) {
  TORCH_CHECK(buffer.device().is_cpu(), "aio buffer must be a CPU tensor, got ", buffer.device());
  TORCH_CHECK(buffer.is_contiguous(), "aio buffer must be contiguous");
  const int64_t have = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  TORCH_CHECK(nbytes >= 0 && nbytes <= have, "aio request of ", nbytes, " bytes but the buffer holds ", have);
  TORCH_CHECK(file_offset >= 0, "file_offset must be >= 0, got ", file_offset);
  TORCH_CHECK(fd_buffered >= 0, "a buffered file descriptor is required");
  char* ptr = static_cast<char*>(buffer.data_ptr());
  return e.submit(is_read, ptr, nbytes, fd_direct, fd_buffered, file_offset, checksum_chunk);
}

// CRC-32C of a contiguous CPU tensor's bytes, continuing `value`; the GIL is released.
uint32_t tensor_crc32c(const torch::Tensor& t, uint32_t value) {
  TORCH_CHECK(t.device().is_cpu(), "crc32c: expected a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "crc32c: expected a contiguous tensor");
  const char* p = static_cast<const char*>(t.data_ptr());
  const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
  py::gil_scoped_release nogil;
  return zeroinf::aio::crc32c(value, p, n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroinf async file I/O engine (libaio or a pread/pwrite thread pool)";
  m.attr("ALIGN") = zeroinf::aio::kAlign;
  py::class_<Engine, EnginePtr>(m, "Engine")
      .def(py::init(&make_engine), py::arg("backend"), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("intra_op_parallelism"), py::arg("single_submit"), py::arg("overlap_events"),
           py::arg("fault") = "")
      .def("submit", &submit, py::arg("is_read"), py::arg("buffer"), py::arg("nbytes"),
           py::arg("fd_direct"), py::arg("fd_buffered"), py::arg("file_offset"), py::arg("checksum_chunk") = 0,
           "Queue a transfer of the buffer's first nbytes; returns the request id. checksum_chunk > 0: "
           "the record's last field lists one CRC-32C per checksum_chunk bytes.")
      .def(
          "wait_one",
          [](Engine& e, int64_t id) {
            Completion c;
            {
              py::gil_scoped_release nogil;
              c = e.wait_one(id);
            }
            return to_tuple(c);
          },
          py::arg("id"),
          "Block until request id finished: (id, is_read, requested, done, errno, err_offset, what, crcs).")
      .def(
          "wait_all",
          [](Engine& e) {
            std::vector<Completion> cs;
            {
              py::gil_scoped_release nogil;
              cs = e.wait_all();
            }
            py::list out;
            for (const auto& c : cs) out.append(to_tuple(c));
            return out;
          },
          "Block until nothing is in flight; list of finished records not yet collected.")
      .def("in_flight", &Engine::in_flight)
      .def(
          "shutdown",
          [](Engine& e) {
            py::gil_scoped_release nogil;
            e.shutdown();
          },
          "Finish queued jobs, then stop and join the worker threads; idempotent. Later submits raise.")
      .def_property_readonly("is_shut_down", &Engine::is_shut_down);
  m.def("crc32c", &tensor_crc32c, py::arg("tensor"), py::arg("value") = 0,
        "CRC-32C of a contiguous CPU tensor's bytes, continuing value (0 to start).");
  m.def("crc32c_combine", &zeroinf::aio::crc32c_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"),
        "CRC-32C of A || B from crc32c(A), crc32c(B) and len(B) in bytes.");
  m.def("crc32c_hardware", &zeroinf::aio::crc32c_hardware, "True when crc32c uses the SSE4.2 instruction here.");
  m.def(
      "libaio_status",
      []() {
        std::string why;
        bool ok = zeroinf::aio::libaio_usable(&why);
        return py::make_tuple(ok, why);
      },
      "(usable, why): libaio compiled in and io_setup accepted.");
}
