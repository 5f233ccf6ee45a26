// The native backend of DeepSpeedIOEngine: one io_uring ring driven by one worker thread, with raw system calls
// (no liburing, no libaio). Python plans the blocks (fd, address, length, offset; see kernels/_aio.py) and this file
// keeps up to queue_depth of them in flight, resubmits partial transfers, and records the first error of each
// request (errno and failing file offset) for Python to raise as AIOError.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "zl_kernels.h"

namespace zl {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) { return static_cast<int>(syscall(__NR_io_uring_setup, entries, p)); }
constexpr unsigned kRegisterIowqMaxWorkers = 19;  // IORING_REGISTER_IOWQ_MAX_WORKERS (an enum: no #ifdef), 5.15+

int sys_register(int fd, unsigned opcode, void* arg, unsigned nr) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, opcode, arg, nr));
}
int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, nullptr, 0));
}

struct Request {
  bool write = false;
  std::vector<AioBlock> blocks;
  size_t next = 0;         // first block not yet submitted
  int64_t inflight = 0;
  int err = 0;             // first errno
  uint64_t fail_offset = 0;
  int64_t short_bytes = -1;  // >= 0: a read hit end of file after this many bytes of the failing block
  bool done = false;
};

struct Slot {  // one in-flight SQE; user_data is the slot index
  Request* req = nullptr;
  AioBlock block{};
  uint64_t done_bytes = 0;
};

}  // namespace

class AioRing {
 public:
  AioRing(unsigned depth, bool single_submit, int* err) : single_submit_(single_submit) {
    // [Note: io-wq workers] A read or write the kernel cannot issue without blocking (its non-blocking attempt
    // answers -EAGAIN; on this project's virtio VM that is every O_DIRECT block) runs on the ring's io-wq kernel
    // threads instead, each doing one blocking call. io-wq caps these "bounded" workers (regular-file I/O) at 4 per
    // CPU, so on 2 CPUs only 8 of queue_depth 32 blocks were really in flight. The cap is raised to the ring's depth
    // (measured in one run, 1 GiB at depth 32: write 4.47 -> 5.38 GB/s, read 2.10 -> 2.32). COOP_TASKRUN (5.19+)
    // spares an inter-processor interrupt per completion; older kernels refuse the flag and get a plain ring.
    io_uring_params p{};
#ifdef IORING_SETUP_COOP_TASKRUN
    p.flags = IORING_SETUP_COOP_TASKRUN;
#endif
    fd_ = sys_setup(depth, &p);
    if (fd_ < 0 && errno == EINVAL) { p = io_uring_params{}; fd_ = sys_setup(depth, &p); }
    if (fd_ < 0) { *err = errno; return; }
    unsigned workers[2] = {depth, 0};  // {bounded, unbounded (0: unchanged)}; kernels < 5.15 refuse: defaults stay
    (void)sys_register(fd_, kRegisterIowqMaxWorkers, workers, 2);
    size_t sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single_mmap = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single_mmap) sq_sz = cq_sz = std::max(sq_sz, cq_sz);
    sq_sz_ = sq_sz; cq_sz_ = cq_sz;
    sq_ptr_ = mmap(nullptr, sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) { *err = errno; sq_ptr_ = nullptr; return; }
    cq_ptr_ = single_mmap ? sq_ptr_
                          : mmap(nullptr, cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_CQ_RING);
    if (cq_ptr_ == MAP_FAILED) { *err = errno; cq_ptr_ = nullptr; return; }
    sqes_sz_ = p.sq_entries * sizeof(io_uring_sqe);
    void* s = mmap(nullptr, sqes_sz_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
    if (s == MAP_FAILED) { *err = errno; return; }
    sqes_ = static_cast<io_uring_sqe*>(s);
    char* sq = static_cast<char*>(sq_ptr_);
    char* cq = static_cast<char*>(cq_ptr_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    unsigned nslots = std::min(depth, p.sq_entries);
    slots_.resize(nslots);
    for (unsigned i = 0; i < nslots; ++i) free_.push_back(nslots - 1 - i);
    *err = 0;
    worker_ = std::thread([this] { loop(); });
  }

  ~AioRing() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (auto& kv : reqs_) delete kv.second;
    if (sqes_) munmap(sqes_, sqes_sz_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_sz_);
    if (sq_ptr_) munmap(sq_ptr_, sq_sz_);
    if (fd_ >= 0) close(fd_);
  }

  int64_t submit(bool write, const AioBlock* blocks, int64_t n) {
    auto* r = new Request();
    r->write = write;
    r->blocks.assign(blocks, blocks + n);
    int64_t id;
    {
      std::lock_guard<std::mutex> g(mu_);
      id = next_id_++;
      reqs_[id] = r;
      if (n == 0) r->done = true; else queue_.push_back(r);
    }
    cv_work_.notify_one();
    return id;
  }

  int wait(int64_t id, uint64_t* fail_offset, int64_t* short_bytes) {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = reqs_.find(id);
    if (it == reqs_.end()) return EINVAL;
    Request* r = it->second;
    cv_done_.wait(lk, [r] { return r->done; });
    int err = r->err;
    *fail_offset = r->fail_offset;
    *short_bytes = r->short_bytes;
    reqs_.erase(it);
    delete r;
    return err;
  }

  bool done(int64_t id) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = reqs_.find(id);
    return it == reqs_.end() || it->second->done;
  }

 private:
  // Puts one SQE for `slot` into the ring (worker thread only).
  void prepare(unsigned slot_idx) {
    Slot& s = slots_[slot_idx];
    unsigned tail = *sq_tail_;
    unsigned idx = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = s.req->write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = s.block.fd;
    sqe->addr = s.block.addr + s.done_bytes;
    sqe->len = static_cast<uint32_t>(s.block.len - s.done_bytes);
    sqe->off = s.block.offset + s.done_bytes;
    sqe->user_data = slot_idx;
    sq_array_[idx] = idx;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++to_submit_;
    if (single_submit_) enter(0);
  }

  void enter(unsigned min_complete) {
    for (;;) {
      int ret = sys_enter(fd_, to_submit_, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0);
      if (ret >= 0) { to_submit_ -= std::min<unsigned>(to_submit_, static_cast<unsigned>(ret)); return; }
      if (errno == EINTR || errno == EAGAIN || errno == EBUSY) { if (!min_complete && to_submit_ == 0) return; continue; }
      fatal_ = errno;  // the ring itself failed: fail everything in flight (should not happen)
      return;
    }
  }

  void fail(Request* r, int err, uint64_t offset, int64_t short_bytes) {
    if (r->err) return;
    r->err = err;
    r->fail_offset = offset;
    r->short_bytes = short_bytes;
    r->next = r->blocks.size();  // submit nothing more of a failed request
  }

  // Completes one CQE (worker thread, lock held). Returns true if the slot was resubmitted.
  void complete(const io_uring_cqe& cqe, std::vector<unsigned>& retry) {
    unsigned slot_idx = static_cast<unsigned>(cqe.user_data);
    Slot& s = slots_[slot_idx];
    Request* r = s.req;
    uint64_t at = s.block.offset + s.done_bytes;
    if (cqe.res < 0) {
      fail(r, -cqe.res, at, -1);
    } else if (cqe.res == 0) {
      fail(r, EIO, at, r->write ? -1 : static_cast<int64_t>(s.done_bytes));
    } else {
      s.done_bytes += static_cast<uint64_t>(cqe.res);
      if (s.done_bytes < s.block.len && !r->err) {
        struct stat st{};
        const uint64_t pos = s.block.offset + s.done_bytes;
        if (!r->write && fstat(s.block.fd, &st) == 0 && pos >= static_cast<uint64_t>(st.st_size)) {
          fail(r, EIO, pos, static_cast<int64_t>(s.done_bytes));  // end of file inside the block: short read
        } else {
          retry.push_back(slot_idx);
          return;
        }
      }
    }
    --r->inflight;
    s.req = nullptr;
    free_.push_back(slot_idx);
  }

  void finish_done_requests() {
    bool any = false;
    while (!queue_.empty()) {
      Request* r = queue_.front();
      if (r->next < r->blocks.size() || r->inflight > 0) break;
      r->done = true;
      queue_.pop_front();
      any = true;
    }
    // requests behind the front may also be complete
    for (auto it = queue_.begin(); it != queue_.end();) {
      Request* r = *it;
      if (r->next >= r->blocks.size() && r->inflight == 0) { r->done = true; it = queue_.erase(it); any = true; }
      else ++it;
    }
    if (any) cv_done_.notify_all();
  }

  void loop() {
    std::vector<unsigned> retry;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      unsigned inflight = static_cast<unsigned>(slots_.size() - free_.size());
      if (inflight == 0 && retry.empty()) {
        cv_work_.wait(lk, [this] {
          if (stop_) return true;
          for (Request* r : queue_) if (r->next < r->blocks.size()) return true;
          return false;
        });
        if (stop_ && slots_.size() == free_.size()) return;
      }
      for (unsigned idx : retry) prepare(idx);
      retry.clear();
      for (Request* r : queue_) {
        while (r->next < r->blocks.size() && !free_.empty()) {
          unsigned idx = free_.back();
          free_.pop_back();
          slots_[idx] = Slot{r, r->blocks[r->next++], 0};
          ++r->inflight;
          prepare(idx);
        }
        if (free_.empty()) break;
      }
      finish_done_requests();
      inflight = static_cast<unsigned>(slots_.size() - free_.size());
      if (inflight == 0) continue;
      lk.unlock();
      enter(1);
      lk.lock();
      if (fatal_) {
        for (Slot& s : slots_) if (s.req) { fail(s.req, fatal_, s.block.offset, -1); --s.req->inflight; s.req = nullptr; }
        free_.clear();
        for (unsigned i = 0; i < slots_.size(); ++i) free_.push_back(i);
        fatal_ = 0;
      }
      unsigned head = *cq_head_;
      unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      while (head != tail) {
        complete(cqes_[head & cq_mask_], retry);
        ++head;
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      finish_done_requests();
    }
  }

  int fd_ = -1;
  bool single_submit_;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_sz_ = 0, cq_sz_ = 0, sqes_sz_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned to_submit_ = 0;
  int fatal_ = 0;

  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Request*> queue_;
  std::unordered_map<int64_t, Request*> reqs_;
  std::vector<Slot> slots_;
  std::vector<unsigned> free_;
  int64_t next_id_ = 1;
  bool stop_ = false;
  std::thread worker_;
};

AioRing* aio_ring_create(unsigned queue_depth, bool single_submit, int* err) {
  auto* ring = new AioRing(queue_depth, single_submit, err);
  if (*err) { delete ring; return nullptr; }
  return ring;
}
void aio_ring_destroy(AioRing* r) { delete r; }
int64_t aio_ring_submit(AioRing* r, bool write, const AioBlock* b, int64_t n) { return r->submit(write, b, n); }
int aio_ring_wait(AioRing* r, int64_t id, uint64_t* off, int64_t* sb) { return r->wait(id, off, sb); }
bool aio_ring_done(AioRing* r, int64_t id) { return r->done(id); }
bool aio_uring_supported() {
  int err = 0;
  AioRing* r = aio_ring_create(2, false, &err);
  if (!r) return false;
  delete r;
  return true;
}

}  // namespace zl
