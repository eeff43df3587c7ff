// Asynchronous file I/O engine: libaio or a thread pool of blocking pread/pwrite.
//
// The engine knows nothing about tensors or Python. A request is (buffer, nbytes, fds, offset);
// it is split into jobs of at most `block_size` bytes which worker threads run. File
// descriptors are opened and closed by the caller (zeroinf/io/handle.py), which also decides
// whether O_DIRECT is usable for the file.
//
// Alignment rules (kAlign = 4096 bytes):
//   * With a direct fd and an aligned file offset, the aligned prefix (nbytes rounded down to
//     kAlign) goes through O_DIRECT; the remaining tail (< kAlign bytes) through the buffered fd.
//     The file therefore holds exactly nbytes bytes at [offset, offset + nbytes): nothing is
//     padded and nothing is written past the caller's bytes.
//   * A caller buffer whose address is not kAlign-aligned is staged through an aligned bounce
//     buffer (one per in-flight slot, block_size bytes).
//   * Without a direct fd, or with an unaligned file offset, every job uses the buffered fd.
//
// Checksums: a request submitted with checksum_chunk > 0 gets one CRC-32C (crc32c.h) per
// checksum_chunk bytes of the buffer ([0, chunk), [chunk, 2 chunk), ..., the last one shorter),
// in Completion::crcs, always of the caller's buffer (which holds the bytes written, or read
// once the read completed: the caller leaves it alone until the request is waited for).
//   * threads backend, and buffered tails: the worker that moves a job checksums it, a write
//     right before its first transfer, a read right after its last one (after the bounce copy),
//     while the bytes are in cache.
//   * libaio: a job that completed goes to one of 2 checksum threads per libaio thread, which
//     checksum it and finish it; the libaio thread goes straight back to feeding the device
//     (done inline, the pass over the bytes stalled the queue: writes went from 3.8 to 2.5 GB/s).
//     O_DIRECT moves bytes by DMA, so they are in cache only after a bounce copy either way.
// A job's bytes are cut at chunk boundaries into pieces; the pieces of one chunk (from jobs of
// block_size < chunk, or the O_DIRECT prefix and the buffered tail) are merged with
// crc32c_combine when the request ends. A failed request carries no checksums.
//
// Every completion is checked against the bytes asked for: a short transfer is resubmitted for
// the remainder; a zero-byte transfer or a negative result fails the request with its errno.
// Nothing here throws after construction: failures are returned as Completion records.
//
// Lifetime: shutdown() (also run by the destructor) finishes every queued job, then stops and
// joins the workers; it never throws and may be called more than once. Worker bodies catch every
// exception and fail the job's request with it, so no exception leaves a thread. In a process
// forked from the owner the workers do not exist: shutdown() there does nothing and the destructor
// abandons the thread handles instead of joining them (a joinable std::thread is never destroyed,
// so std::terminate cannot run); the Python binding does not delete an engine in a forked child.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zeroinf {
namespace aio {

constexpr int64_t kAlign = 4096;

enum class Backend { kLibaio, kThreads };

// Test hook: deterministic fault injection, parsed from "kind:offset" (see FaultSpec::parse).
struct FaultSpec {
  enum Kind { kNone, kEnospc, kEio, kShort } kind = kNone;
  int64_t offset = 0;  // enospc/eio: transfers touching file bytes >= offset fail
  static FaultSpec parse(const std::string& text);  // throws std::invalid_argument
};

// Outcome of one request, as returned by wait_one / wait_all.
struct Completion {
  int64_t id = -1;
  bool is_read = false;
  int64_t bytes_requested = 0;
  int64_t bytes_done = 0;
  int err = 0;              // 0 on success, else an errno value
  int64_t err_offset = -1;  // file offset where the failing transfer started
  std::string what;         // short description of the failure ("" on success)
  std::vector<uint32_t> crcs;  // CRC-32C per checksum chunk (empty: not asked for, or failed)
};

struct Request;

struct Job {
  std::shared_ptr<Request> req;
  char* buf = nullptr;      // caller memory for this job
  int64_t nbytes = 0;
  int64_t file_offset = 0;
  int64_t first_piece = 0;  // index of the job's first checksum piece in its Request
  int fd = -1;
  bool direct = false;      // fd is O_DIRECT: length/offset are kAlign multiples
  bool bounce = false;      // direct and buf is unaligned: stage through an aligned buffer
};

class Engine {
 public:
  // Throws std::invalid_argument on bad knobs, std::runtime_error if the backend cannot start
  // (libaio not compiled in, io_setup refused, a worker thread could not be created: the threads
  // already started are joined before it throws).
  Engine(Backend backend, int64_t block_size, int queue_depth, int intra_op_parallelism,
         bool single_submit, bool overlap_events, const std::string& fault);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Finish queued jobs, stop and join the workers, release io contexts. Idempotent, never throws.
  void shutdown() noexcept;
  bool is_shut_down() const;
  // True in a process forked from the one that built the engine (its workers do not exist here).
  bool forked_child() const;

  // Queue a request; returns its id at once. `buffer` must stay valid until it is waited for.
  // checksum_chunk > 0 (bytes): fill Completion::crcs (see the top of this file); 0: none.
  // Throws std::runtime_error after shutdown() or in a process forked from the owner,
  // std::invalid_argument for a negative checksum_chunk.
  int64_t submit(bool is_read, char* buffer, int64_t nbytes, int fd_direct, int fd_buffered,
                 int64_t file_offset, int64_t checksum_chunk = 0);
  // Block until request `id` finished; returns its record (err = EINVAL if id is unknown).
  Completion wait_one(int64_t id);
  // Block until nothing is in flight; return every finished, not yet collected record.
  std::vector<Completion> wait_all();
  int64_t in_flight() const;

  Backend backend() const { return backend_; }

  // Called by workers; never throws.
  void job_finished(const std::shared_ptr<Request>& req) noexcept;

 private:
  void threads_worker();
  void libaio_worker(int index);
  void libaio_worker_body(int index);
  bool pop_job(Job* job, bool block);
  void crc_worker();
  void checksum_later(Job&& job, bool complete) noexcept;
  void run_sync_job(Job& job, char* bounce);
  void run_sync_job_guarded(Job& job, char* bounce) noexcept;
  void start_workers();

  Backend backend_;
  int64_t block_size_;
  int queue_depth_;
  int parallelism_;
  bool single_submit_;
  bool overlap_events_;
  FaultSpec fault_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Job> queue_;
  struct CrcTask {
    Job job;
    bool complete = false;  // every byte of the job moved: checksum it
  };
  std::deque<CrcTask> crc_queue_;  // libaio: finished jobs of checksummed requests
  std::condition_variable crc_cv_;
  bool crc_stop_ = false;          // set once every I/O worker is joined
  int io_workers_ = 0;             // workers_[0, io_workers_) move bytes; the rest checksum
  std::map<int64_t, std::shared_ptr<Request>> running_;
  std::map<int64_t, Completion> done_;
  int64_t next_id_ = 1;
  bool stop_ = false;
  bool joined_ = false;
  int64_t unrecorded_ = 0;   // finished requests whose record could not be stored (bad_alloc)
  int owner_pid_ = 0;        // getpid() of the constructing process
  std::vector<std::thread> workers_;
  std::vector<void*> ctxs_;  // io_context_t per libaio worker
};

// Applies the fault spec to one transfer: returns the bytes to transfer (possibly fewer than
// asked, to produce a short transfer) or -errno to fail it.
int64_t fault_clip(const FaultSpec& f, bool is_write, int64_t offset, int64_t nbytes, bool direct);

// True when compiled with libaio; `why` says why not.
bool libaio_compiled(std::string* why);
// io_setup/io_destroy round trip: false with `why` when the kernel or container refuses it.
bool libaio_usable(std::string* why);

}  // namespace aio
}  // namespace zeroinf
