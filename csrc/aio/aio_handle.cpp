// Asynchronous file I/O engine (see aio_handle.h for the contract and the alignment rules).
#include "aio_handle.h"

#include "crc32c.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <system_error>

#ifndef ZEROINF_NO_LIBAIO
#include <libaio.h>
#endif

namespace zeroinf {
namespace aio {

struct Request {
  int64_t id = 0;
  bool is_read = false;
  int64_t nbytes = 0;
  int64_t file_offset = 0;
  // Checksum pieces: the buffer [0, nbytes) cut at job ends and at multiples of crc_chunk, in
  // order; piece i is [piece_start[i], piece_start[i + 1]) (the last one ends at nbytes). Each
  // piece_crc element is written by the one worker that runs its job, read after the last job.
  int64_t crc_chunk = 0;
  std::vector<int64_t> piece_start;
  std::vector<uint32_t> piece_crc;
  std::atomic<int64_t> jobs_left{0};
  std::atomic<int64_t> bytes_done{0};
  std::mutex mu;
  int err = 0;
  int64_t err_offset = -1;
  std::string what;

  // Record a failure; the one at the lowest file offset wins, so the report is deterministic.
  // Never throws: if the message cannot be copied the errno and offset are still recorded.
  void fail(int e, int64_t offset, const char* w) noexcept {
    std::lock_guard<std::mutex> lock(mu);
    if (err == 0 || offset < err_offset) {
      err = e;
      err_offset = offset;
      try {
        what = w;
      } catch (...) {
        what.clear();
      }
    }
  }
};

namespace {

struct AlignedFree {
  void operator()(char* p) const { free(p); }
};
using AlignedBuf = std::unique_ptr<char, AlignedFree>;

AlignedBuf aligned_buffer(int64_t nbytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, static_cast<size_t>(nbytes)) != 0) return AlignedBuf(nullptr);
  return AlignedBuf(static_cast<char*>(p));
}

bool is_aligned(int64_t v) { return (v % kAlign) == 0; }

// CRC-32C of each checksum piece of `job`, whose bytes are at `data` (the caller's buffer or
// the bounce buffer holding the same bytes). No-op for a request without checksums.
void checksum_job(const Job& job, const char* data) noexcept {
  Request& r = *job.req;
  if (r.crc_chunk <= 0) return;
  const int64_t pos = job.file_offset - r.file_offset;  // the job's offset in the buffer
  const int64_t end = pos + job.nbytes;
  const int64_t n = static_cast<int64_t>(r.piece_start.size());
  for (int64_t i = job.first_piece; i < n && r.piece_start[i] < end; ++i) {
    const int64_t a = r.piece_start[i];
    const int64_t b = i + 1 < n ? r.piece_start[i + 1] : r.nbytes;
    r.piece_crc[i] = crc32c(0, data + (a - pos), static_cast<size_t>(b - a));
  }
}

// One CRC-32C per chunk of a finished request, merged from its pieces in order.
std::vector<uint32_t> chunk_crcs(const Request& r) {
  const int64_t n = static_cast<int64_t>(r.piece_start.size());
  std::vector<uint32_t> out(static_cast<size_t>((r.nbytes + r.crc_chunk - 1) / r.crc_chunk), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = r.piece_start[i];
    const int64_t b = i + 1 < n ? r.piece_start[i + 1] : r.nbytes;
    uint32_t& c = out[static_cast<size_t>(a / r.crc_chunk)];
    c = (a % r.crc_chunk == 0) ? r.piece_crc[i] : crc32c_combine(c, r.piece_crc[i], static_cast<uint64_t>(b - a));
  }
  return out;
}

}  // namespace

FaultSpec FaultSpec::parse(const std::string& text) {
  FaultSpec f;
  if (text.empty()) return f;
  std::string kind = text, arg;
  auto colon = text.find(':');
  if (colon != std::string::npos) {
    kind = text.substr(0, colon);
    arg = text.substr(colon + 1);
  }
  if (kind == "enospc") {
    f.kind = kEnospc;
  } else if (kind == "eio") {
    f.kind = kEio;
  } else if (kind == "short") {
    f.kind = kShort;
  } else {
    throw std::invalid_argument("fault spec '" + text + "': kind must be enospc, eio or short");
  }
  if (!arg.empty()) {
    char* end = nullptr;
    long long v = strtoll(arg.c_str(), &end, 10);
    if (end == arg.c_str() || *end != '\0' || v < 0) {
      throw std::invalid_argument("fault spec '" + text + "': offset must be a non-negative integer");
    }
    f.offset = v;
  }
  return f;
}

int64_t fault_clip(const FaultSpec& f, bool is_write, int64_t offset, int64_t nbytes, bool direct) {
  switch (f.kind) {
    case FaultSpec::kNone:
      return nbytes;
    case FaultSpec::kShort: {
      int64_t half = nbytes / 2;
      if (direct) half &= ~(kAlign - 1);
      return half > 0 ? half : nbytes;
    }
    case FaultSpec::kEnospc:
    case FaultSpec::kEio: {
      if (f.kind == FaultSpec::kEnospc && !is_write) return nbytes;
      const int e = f.kind == FaultSpec::kEnospc ? ENOSPC : EIO;
      if (offset >= f.offset) return -e;
      if (offset + nbytes <= f.offset) return nbytes;
      int64_t n = f.offset - offset;
      if (direct) n &= ~(kAlign - 1);
      return n > 0 ? n : -e;
    }
  }
  return nbytes;
}

bool libaio_compiled(std::string* why) {
#ifdef ZEROINF_NO_LIBAIO
  if (why) *why = "built without libaio (libaio.h or libaio.so missing at build time; install libaio-dev)";
  return false;
#else
  if (why) why->clear();
  return true;
#endif
}

bool libaio_usable(std::string* why) {
  if (!libaio_compiled(why)) return false;
#ifndef ZEROINF_NO_LIBAIO
  io_context_t ctx = nullptr;
  int rc = io_setup(8, &ctx);
  if (rc < 0) {
    if (why) *why = std::string("io_setup refused: ") + strerror(-rc);
    return false;
  }
  io_destroy(ctx);
#endif
  return true;
}

Engine::Engine(Backend backend, int64_t block_size, int queue_depth, int intra_op_parallelism,
               bool single_submit, bool overlap_events, const std::string& fault)
    : backend_(backend),
      block_size_(block_size),
      queue_depth_(queue_depth),
      parallelism_(intra_op_parallelism),
      single_submit_(single_submit),
      overlap_events_(overlap_events),
      fault_(FaultSpec::parse(fault)) {
  if (block_size <= 0 || !is_aligned(block_size)) {
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes, got " +
                                std::to_string(block_size));
  }
  if (queue_depth < 1) throw std::invalid_argument("queue_depth must be >= 1, got " + std::to_string(queue_depth));
  if (intra_op_parallelism < 1) {
    throw std::invalid_argument("intra_op_parallelism must be >= 1, got " + std::to_string(intra_op_parallelism));
  }
  if (backend == Backend::kLibaio) {
    std::string why;
    if (!libaio_compiled(&why)) throw std::runtime_error(why);
#ifndef ZEROINF_NO_LIBAIO
    for (int i = 0; i < parallelism_; ++i) {
      io_context_t ctx = nullptr;
      int rc = io_setup(queue_depth_, &ctx);
      if (rc < 0) {
        for (void* c : ctxs_) io_destroy(static_cast<io_context_t>(c));
        ctxs_.clear();
        throw std::runtime_error(std::string("io_setup(") + std::to_string(queue_depth_) +
                                 ") refused: " + strerror(-rc));
      }
      ctxs_.push_back(ctx);
    }
#endif
  }
  owner_pid_ = static_cast<int>(getpid());
  start_workers();
}

// Checksum threads per libaio thread: one reads cold bytes at about 6 GB/s, slower than the
// device's 4 GB/s writes once DMA shares the memory bus; two keep up.
constexpr int kChecksumThreads = 2;

// Starting a thread can fail (EAGAIN under thread or memory limits). Unwinding out of the
// constructor with joinable threads in workers_ would call std::terminate, so the threads already
// started are stopped and joined first, and the failure is reported as std::runtime_error.
void Engine::start_workers() {
  // libaio: one thread per io context, then kChecksumThreads per context; threads: one blocking
  // thread per outstanding transfer (each checksums its own jobs).
  const int io = backend_ == Backend::kLibaio ? static_cast<int>(ctxs_.size()) : parallelism_ * queue_depth_;
  const int n = backend_ == Backend::kLibaio ? io + kChecksumThreads * io : io;
  io_workers_ = io;
  std::string failure;
  try {
    workers_.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      if (backend_ == Backend::kLibaio) {
        if (i < io) {
          workers_.emplace_back(&Engine::libaio_worker, this, i);
        } else {
          workers_.emplace_back(&Engine::crc_worker, this);
        }
      } else {
        workers_.emplace_back(&Engine::threads_worker, this);
      }
    }
    return;
  } catch (const std::exception& e) {
    failure = std::string("could not start aio worker thread ") + std::to_string(workers_.size() + 1) +
              " of " + std::to_string(n) + ": " + e.what();
  }
  shutdown();
  throw std::runtime_error(failure);
}

Engine::~Engine() {
  if (forked_child()) {
    // The workers live only in the parent; joining them here is undefined. Move the handles to a
    // leaked vector so no joinable std::thread is destroyed (std::terminate). The condition
    // variables may still block in their destructors (glibc counts the parent's waiters), which
    // is why the Python binding never deletes an engine in a forked child (see bindings.cpp).
    new (std::nothrow) std::vector<std::thread>(std::move(workers_));
    for (auto& t : workers_) {  // only if the leak above could not allocate
      try {
        if (t.joinable()) t.detach();
      } catch (...) {
      }
    }
    return;
  }
  shutdown();
}

bool Engine::forked_child() const { return static_cast<int>(getpid()) != owner_pid_; }

bool Engine::is_shut_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_;
}

void Engine::shutdown() noexcept {
  // In a forked child the workers, and any lock they held at fork time, belong to the parent:
  // touching mu_ or notifying the condition variables could block forever. submit() refuses
  // there, so there is nothing to stop.
  if (forked_child()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (joined_) return;
    joined_ = true;
  }
  work_cv_.notify_all();
  const auto self = std::this_thread::get_id();
  // I/O workers drain the queue before they exit; the checksum workers after them drain theirs,
  // which only the I/O workers fill, so they are told to stop once every I/O worker is joined.
  for (size_t i = 0; i < workers_.size(); ++i) {
    auto& t = workers_[i];
    if (static_cast<int>(i) == io_workers_) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        crc_stop_ = true;
      }
      crc_cv_.notify_all();
    }
    if (!t.joinable()) continue;
    try {
      if (t.get_id() == self) {  // cannot join itself; never expected, but do not terminate
        t.detach();
      } else {
        t.join();
      }
    } catch (const std::system_error&) {
      try {
        t.detach();
      } catch (...) {  // nothing left to try; the handle is leaked below rather than destroyed
      }
    }
    if (t.joinable()) new (std::nothrow) std::thread(std::move(t));
  }
  workers_.clear();
#ifndef ZEROINF_NO_LIBAIO
  for (void* c : ctxs_) io_destroy(static_cast<io_context_t>(c));
#endif
  ctxs_.clear();
}

int64_t Engine::submit(bool is_read, char* buffer, int64_t nbytes, int fd_direct, int fd_buffered,
                       int64_t file_offset, int64_t checksum_chunk) {
  if (checksum_chunk < 0) {
    throw std::invalid_argument("checksum_chunk must be >= 0 bytes, got " + std::to_string(checksum_chunk));
  }
  auto req = std::make_shared<Request>();
  req->is_read = is_read;
  req->nbytes = nbytes;
  req->file_offset = file_offset;
  req->crc_chunk = checksum_chunk;
  std::vector<Job> jobs;
  auto add = [&](int64_t start, int64_t len, int fd, bool direct) {
    for (int64_t pos = start; pos < start + len; pos += block_size_) {
      Job j;
      j.req = req;
      j.buf = buffer + pos;
      j.nbytes = std::min(block_size_, start + len - pos);
      j.file_offset = file_offset + pos;
      if (checksum_chunk > 0) {
        j.first_piece = static_cast<int64_t>(req->piece_start.size());
        for (int64_t a = pos; a < pos + j.nbytes; a = std::min(pos + j.nbytes, (a / checksum_chunk + 1) * checksum_chunk)) {
          req->piece_start.push_back(a);
        }
      }
      j.fd = fd;
      j.direct = direct;
      j.bounce = direct && !is_aligned(reinterpret_cast<intptr_t>(j.buf));
      jobs.push_back(std::move(j));
    }
  };
  if (fd_direct >= 0 && is_aligned(file_offset)) {
    const int64_t aligned = nbytes & ~(kAlign - 1);
    add(0, aligned, fd_direct, true);
    add(aligned, nbytes - aligned, fd_buffered, false);
  } else {
    add(0, nbytes, fd_buffered, false);
  }
  req->piece_crc.assign(req->piece_start.size(), 0);
  req->jobs_left = static_cast<int64_t>(jobs.size());
  if (forked_child()) {
    throw std::runtime_error("aio engine was created in process " + std::to_string(owner_pid_) +
                             " and cannot be used in a forked child; create a new one");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("aio engine is shut down");
    req->id = next_id_++;
    if (jobs.empty()) {
      Completion c;
      c.id = req->id;
      c.is_read = is_read;
      done_[req->id] = c;
      return req->id;
    }
    running_[req->id] = req;
    for (auto& j : jobs) queue_.push_back(std::move(j));
  }
  work_cv_.notify_all();
  return req->id;
}

void Engine::job_finished(const std::shared_ptr<Request>& req) noexcept {
  if (--req->jobs_left != 0) return;
  Completion c;
  c.id = req->id;
  c.is_read = req->is_read;
  c.bytes_requested = req->nbytes;
  c.bytes_done = req->bytes_done.load();
  {
    std::lock_guard<std::mutex> lock(req->mu);
    c.err = req->err;
    c.err_offset = req->err_offset;
    try {
      c.what = req->what;
    } catch (...) {  // keep the errno; lose only the text
    }
  }
  if (c.err == 0 && req->crc_chunk > 0) {
    try {
      c.crcs = chunk_crcs(*req);
    } catch (...) {  // no memory for the list: the request cannot be reported verified
      c.err = ENOMEM;
      c.err_offset = req->file_offset;
      c.what = "out of memory collecting the request's checksums";
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_.erase(req->id);
    try {
      done_[req->id] = std::move(c);
    } catch (...) {
      // No memory for the record: waiters report the request as failed (see wait_one/wait_all).
      ++unrecorded_;
    }
  }
  done_cv_.notify_all();
}

Completion Engine::wait_one(int64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!running_.count(id) && !done_.count(id)) {
    Completion c;
    c.id = id;
    c.err = EINVAL;
    c.what = "unknown or already collected request id";
    return c;
  }
  done_cv_.wait(lock, [&] { return done_.count(id) > 0 || running_.count(id) == 0; });
  if (done_.count(id) == 0) {  // finished, but job_finished could not store its record
    if (unrecorded_ > 0) --unrecorded_;
    Completion c;
    c.id = id;
    c.err = ENOMEM;
    c.what = "out of memory recording the request's completion; its outcome is unknown";
    return c;
  }
  Completion c = std::move(done_[id]);
  done_.erase(id);
  return c;
}

std::vector<Completion> Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return running_.empty(); });
  std::vector<Completion> out;
  out.reserve(done_.size());
  for (auto& kv : done_) out.push_back(std::move(kv.second));
  done_.clear();
  for (; unrecorded_ > 0; --unrecorded_) {
    Completion c;  // id -1: the caller cannot tell which request it was, so it must raise
    c.err = ENOMEM;
    c.what = "out of memory recording a request's completion; its outcome is unknown";
    out.push_back(std::move(c));
  }
  return out;
}

int64_t Engine::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(running_.size());
}

bool Engine::pop_job(Job* job, bool block) {
  std::unique_lock<std::mutex> lock(mu_);
  if (block) {
    work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
  }
  if (queue_.empty()) return false;
  *job = std::move(queue_.front());
  queue_.pop_front();
  return true;
}

// Blocking transfer of one job with pread/pwrite, retrying short transfers and EINTR.
void Engine::run_sync_job(Job& job, char* bounce) {
  Request& req = *job.req;
  const bool rd = req.is_read;
  char* base = job.bounce ? bounce : job.buf;
  if (job.bounce && bounce == nullptr) {
    req.fail(ENOMEM, job.file_offset, "could not allocate an aligned bounce buffer");
    return;
  }
  if (job.bounce && !rd) memcpy(bounce, job.buf, job.nbytes);
  if (!rd) checksum_job(job, base);
  int64_t done = 0;
  int zero_writes = 0;
  while (done < job.nbytes) {
    const int64_t off = job.file_offset + done;
    const int64_t want = fault_clip(fault_, !rd, off, job.nbytes - done, job.direct);
    ssize_t r;
    if (want < 0) {
      r = want;
    } else {
      r = rd ? pread(job.fd, base + done, want, off) : pwrite(job.fd, base + done, want, off);
      if (r < 0) r = -errno;
    }
    if (r == -EINTR) continue;
    if (r < 0) {
      req.fail(static_cast<int>(-r), off, rd ? "pread failed" : "pwrite failed");
      break;
    }
    if (r == 0) {
      if (rd) {
        req.fail(ENODATA, off, "pread returned 0 bytes: the file ends before the requested range");
        break;
      }
      if (++zero_writes >= 3) {
        req.fail(EIO, off, "pwrite wrote 0 bytes three times");
        break;
      }
      continue;
    }
    done += r;
    if (job.direct && done < job.nbytes && !is_aligned(r)) {
      req.fail(rd ? ENODATA : EIO, off + r,
               rd ? "short O_DIRECT read: the file ends before the requested range"
                  : "short unaligned O_DIRECT write");
      break;
    }
  }
  if (job.bounce && rd && done == job.nbytes) memcpy(job.buf, bounce, job.nbytes);
  if (rd && done == job.nbytes) checksum_job(job, job.buf);
  req.bytes_done += done;
}

// run_sync_job, then job_finished exactly once; an exception fails the job's request instead of
// leaving the worker thread (which would call std::terminate).
void Engine::run_sync_job_guarded(Job& job, char* bounce) noexcept {
  try {
    run_sync_job(job, bounce);
  } catch (const std::exception& e) {
    job.req->fail(EIO, job.file_offset, e.what());
  } catch (...) {
    job.req->fail(EIO, job.file_offset, "unknown exception in an aio worker");
  }
  job_finished(job.req);
}

void Engine::threads_worker() {
  AlignedBuf bounce;
  Job job;
  while (true) {
    try {
      if (!pop_job(&job, /*block=*/true)) break;
      if (job.bounce && !bounce) bounce = aligned_buffer(block_size_);
    } catch (...) {  // pop_job's lock cannot fail in practice; never let it end the thread
      if (!job.req) {
        std::this_thread::yield();
        continue;
      }
    }
    run_sync_job_guarded(job, bounce.get());
    job = Job();
  }
}

// Hands a finished job of a checksummed request to the checksum threads, which checksum it (when
// `complete`: every byte moved) and then call job_finished; without memory for the queue entry
// it is done here.
void Engine::checksum_later(Job&& job, bool complete) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      crc_queue_.push_back(CrcTask{job, complete});  // a copy: `job` stays whole if this throws
    }
    crc_cv_.notify_one();
    return;
  } catch (...) {
  }
  if (complete) checksum_job(job, job.buf);
  job_finished(job.req);
}

void Engine::crc_worker() {
  while (true) {
    CrcTask task;
    try {
      std::unique_lock<std::mutex> lock(mu_);
      crc_cv_.wait(lock, [&] { return crc_stop_ || !crc_queue_.empty(); });
      if (crc_queue_.empty()) break;
      task = std::move(crc_queue_.front());
      crc_queue_.pop_front();
    } catch (...) {  // the lock cannot fail in practice; never let it end the thread
      std::this_thread::yield();
      continue;
    }
    if (task.complete) checksum_job(task.job, task.job.buf);
    job_finished(task.job.req);
  }
}

#ifdef ZEROINF_NO_LIBAIO
void Engine::libaio_worker(int) {}
#else
namespace {
struct Slot {
  Job job;
  int64_t done = 0;
  int zero_writes = 0;
  AlignedBuf bounce;
  struct iocb cb;
};
}  // namespace

void Engine::libaio_worker_body(int index) {
  io_context_t ctx = static_cast<io_context_t>(ctxs_[index]);
  std::vector<Slot> slots(queue_depth_);
  std::vector<Slot*> free_slots;
  for (auto& s : slots) free_slots.push_back(&s);
  std::vector<Slot*> to_submit;
  std::vector<struct iocb*> cbs;
  std::vector<struct io_event> events(queue_depth_);
  int inflight = 0;
  bool stopping = false;

  auto finish = [&](Slot* s) noexcept {
    Request& req = *s->job.req;
    if (s->job.bounce && req.is_read && s->done == s->job.nbytes) {
      memcpy(s->job.buf, s->bounce.get(), s->job.nbytes);
    }
    req.bytes_done += s->done;
    if (req.crc_chunk > 0) {  // checksummed by a checksum thread, so this one keeps the device busy
      const bool complete = s->done == s->job.nbytes;
      Job job = std::move(s->job);
      s->job = Job();
      free_slots.push_back(s);
      checksum_later(std::move(job), complete);
      return;
    }
    std::shared_ptr<Request> keep = std::move(s->job.req);
    s->job = Job();
    free_slots.push_back(s);
    job_finished(keep);
  };
  // Prepare the iocb for the slot's remaining bytes; false (slot finished) if the fault hook fails it.
  auto prep = [&](Slot* s) -> bool {
    const Job& j = s->job;
    const bool rd = j.req->is_read;
    const int64_t off = j.file_offset + s->done;
    const int64_t want = fault_clip(fault_, !rd, off, j.nbytes - s->done, true);
    if (want < 0) {
      j.req->fail(static_cast<int>(-want), off, rd ? "io_submit read failed" : "io_submit write failed");
      return false;
    }
    char* base = (j.bounce ? s->bounce.get() : j.buf) + s->done;
    if (rd) {
      io_prep_pread(&s->cb, j.fd, base, want, off);
    } else {
      io_prep_pwrite(&s->cb, j.fd, base, want, off);
    }
    s->cb.data = s;
    return true;
  };

  // An exception inside the loop must not end the thread: wait for the transfers the kernel still
  // owns (their buffers live in `slots`), then fail every job that was in a slot.
  auto recover = [&](const char* what) noexcept {
    while (inflight > 0) {
      int got = io_getevents(ctx, 1, queue_depth_, events.data(), nullptr);
      if (got == -EINTR) continue;
      if (got < 0) break;
      inflight -= got;
    }
    inflight = 0;
    to_submit.clear();
    free_slots.clear();  // capacity queue_depth_: the push_backs below never allocate
    for (auto& s : slots) {
      if (s.job.req) {
        s.job.req->fail(EIO, s.job.file_offset + s.done, what);
        finish(&s);  // pushes the slot back on free_slots
      } else {
        free_slots.push_back(&s);
      }
    }
  };

  while (true) {
    try {
      if (overlap_events_ || inflight == 0) {
        while (!free_slots.empty()) {
          const bool block = inflight == 0 && to_submit.empty();
          Job job;
          if (!pop_job(&job, block)) {
            if (block) stopping = true;
            break;
          }
          if (!job.direct) {  // buffered tail: a small blocking transfer
            run_sync_job_guarded(job, nullptr);
            continue;
          }
          Slot* s = free_slots.back();
          free_slots.pop_back();
          s->job = std::move(job);
          s->done = 0;
          s->zero_writes = 0;
          if (s->job.bounce) {
            if (!s->bounce) s->bounce = aligned_buffer(block_size_);
            if (!s->bounce) {
              s->job.req->fail(ENOMEM, s->job.file_offset, "could not allocate an aligned bounce buffer");
              finish(s);
              continue;
            }
            if (!s->job.req->is_read) memcpy(s->bounce.get(), s->job.buf, s->job.nbytes);
          }
          if (prep(s)) {
            to_submit.push_back(s);
          } else {
            finish(s);
          }
        }
      }
      if (inflight == 0 && to_submit.empty()) {
        if (stopping) break;
        continue;
      }
      // Submit: all at once, or one iocb per io_submit call with single_submit.
      size_t pos = 0;
      int again = 0;
      while (pos < to_submit.size()) {
        const size_t n = single_submit_ ? 1 : to_submit.size() - pos;
        cbs.clear();
        for (size_t i = 0; i < n; ++i) cbs.push_back(&to_submit[pos + i]->cb);
        int rc = io_submit(ctx, static_cast<long>(n), cbs.data());
        if (rc > 0) {
          pos += rc;
          inflight += rc;
          again = 0;
          continue;
        }
        if ((rc == -EAGAIN || rc == -EINTR || rc == 0) && ++again < 1000) {
          std::this_thread::yield();
          continue;
        }
        // The kernel refused the rest: fail those jobs (their bytes were never transferred).
        for (size_t i = pos; i < to_submit.size(); ++i) {
          Slot* s = to_submit[i];
          s->job.req->fail(rc < 0 ? -rc : EIO, s->job.file_offset + s->done, "io_submit refused the request");
          finish(s);
        }
        pos = to_submit.size();
      }
      to_submit.clear();
      if (inflight == 0) continue;

      const long min_nr = overlap_events_ ? 1 : inflight;
      int got = io_getevents(ctx, min_nr, queue_depth_, events.data(), nullptr);
      if (got == -EINTR) continue;
      if (got < 0) {
        // Cannot tell which transfers finished; the context is unusable. Fail what is in flight.
        for (auto& s : slots) {
          if (s.job.req) {
            s.job.req->fail(-got, s.job.file_offset + s.done, "io_getevents failed");
            finish(&s);
          }
        }
        inflight = 0;
        continue;
      }
      inflight -= got;
      for (int e = 0; e < got; ++e) {
        Slot* s = static_cast<Slot*>(events[e].data);
        Request& req = *s->job.req;
        const bool rd = req.is_read;
        const long res = static_cast<long>(events[e].res);
        const int64_t off = s->job.file_offset + s->done;
        if (res < 0) {
          req.fail(static_cast<int>(-res), off, rd ? "aio read failed" : "aio write failed");
          finish(s);
          continue;
        }
        if (res == 0) {
          if (rd) {
            req.fail(ENODATA, off, "aio read returned 0 bytes: the file ends before the requested range");
            finish(s);
          } else if (++s->zero_writes >= 3) {
            req.fail(EIO, off, "aio write wrote 0 bytes three times");
            finish(s);
          } else if (prep(s)) {
            to_submit.push_back(s);
          } else {
            finish(s);
          }
          continue;
        }
        s->done += res;
        if (s->done == s->job.nbytes) {
          finish(s);
        } else if (!is_aligned(res)) {
          req.fail(rd ? ENODATA : EIO, off + res,
                   rd ? "short O_DIRECT read: the file ends before the requested range"
                      : "short unaligned O_DIRECT write");
          finish(s);
        } else if (prep(s)) {  // short but aligned: resubmit the remainder
          to_submit.push_back(s);
        } else {
          finish(s);
        }
      }
    } catch (const std::exception& e) {
      recover(e.what());
    } catch (...) {
      recover("unknown exception in an aio worker");
    }
  }
}

void Engine::libaio_worker(int index) {
  try {
    libaio_worker_body(index);
  } catch (...) {
    // Setting up the worker failed (no memory for its slots): serve the queue with blocking
    // pread/pwrite instead, so queued requests still finish.
    threads_worker();
  }
}
#endif

}  // namespace aio
}  // namespace zeroinf
