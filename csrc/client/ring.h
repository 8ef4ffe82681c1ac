// The client half of a session's shared-memory rings (layout and invariants: ring/ring.go):
// this process produces on the submission queue and consumes the completion queue.
//
// Memory ordering (ring.go invariants 2 and 3), with the GCC/Clang __atomic builtins on the
// mapped words:
//   - a record's bytes are plain stores, published by a release store of tail; the other
//     side's acquire load of tail orders its reads of the record after them;
//   - head is stored with release after the records it frees were read, and the producer
//     loads it with acquire before it writes over them;
//   - the producer's notify increment and its load of waiters are sequentially consistent,
//     as the Go consumer's increment of waiters and its load of notify are (Dekker): a
//     consumer about to sleep either sees the new tail or is counted in waiters, so the
//     producer wakes only when waiters > 0 (the Go producer's rule; the former Python
//     producer, which could not fence, woke always).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace gocomm {

class Ring {
 public:
  // Maps the ring file pgserver made (and unlinks it: mapped on both sides, nothing else may
  // open it). Throws std::runtime_error if the file is not a ring of this version.
  Ring(const std::string& path, size_t size);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Appends one record whose payload is p[0:n]; false when the queue is full (the sidecar is
  // behind). Throws std::length_error for a record larger than a quarter of the queue. Safe
  // from any thread.
  bool submit(uint16_t type, const uint8_t* p, size_t n);

  // Hands every completion record waiting to fn(type, payload, length), then frees them.
  // Returns false when the queue is corrupt (a record runs past tail or the data area): the
  // caller stops reading for good. Completion thread only.
  template <typename Fn>
  bool poll(Fn&& fn);

  // The largest record (header included) submit takes: a quarter of the queue.
  size_t max_record() const { return sub_size_ / 4; }

  // Sleeps until a completion may be waiting, at most timeout_s seconds (futex on notify).
  // busy: other work of the caller's, checked after notify was read, so that work queued
  // before a nudge either is seen here or ends the sleep.
  void wait(double timeout_s, const std::function<bool()>& busy = nullptr);
  // Ends a wait that sleeps on the futex as a completion would, without a record (the
  // completion thread's loop finds nothing new in the ring and goes on). Safe from any thread.
  void nudge();

  // Mark word i of the header (ring.Marks: written by the sidecar only, with release; read
  // with acquire), 0 past the last. Safe from any thread.
  uint32_t mark(size_t i) const {
    return i < kMarkWords ? __atomic_load_n(word32(kMarks + 4 * i), __ATOMIC_ACQUIRE) : 0;
  }

 private:
  uint8_t* mem_ = nullptr;
  size_t size_ = 0;
  size_t sub_off_ = 0, sub_size_ = 0, cmp_off_ = 0, cmp_size_ = 0;
  uint64_t sub_tail_ = 0;  // private copies: each side is the only writer of its counter
  uint64_t cmp_head_ = 0;
  std::mutex mu_;  // submitters

  uint64_t* word64(size_t off) const { return reinterpret_cast<uint64_t*>(mem_ + off); }
  uint32_t* word32(size_t off) const { return reinterpret_cast<uint32_t*>(mem_ + off); }
  static uint32_t rd32(const uint8_t* p);
  static uint16_t rd16(const uint8_t* p);

 public:
  static constexpr size_t kSubHead = 64, kSubTail = 128, kSubNotify = 136, kSubWaiters = 140;
  static constexpr size_t kCmpHead = 192, kCmpTail = 256, kCmpNotify = 264, kCmpWaiters = 268;
  static constexpr size_t kMarks = 2048, kMarkWords = 256;
};

template <typename Fn>
bool Ring::poll(Fn&& fn) {
  uint64_t head = cmp_head_;
  const uint64_t tail = __atomic_load_n(word64(kCmpTail), __ATOMIC_ACQUIRE);
  const uint64_t mask = cmp_size_ - 1;
  bool ok = true;
  while (head != tail) {
    const uint64_t avail = tail - head;
    const size_t off = head & mask;
    const uint8_t* rec = mem_ + cmp_off_ + off;
    const uint32_t n = rd32(rec);
    const uint64_t size = 8 + ((uint64_t(n) + 7) & ~uint64_t(7));
    if (avail > cmp_size_ || size > avail || off + size > cmp_size_) {
      ok = false;
      break;
    }
    const uint16_t type = rd16(rec + 4);
    if (type != 0) {
      fn(type, rec + 8, size_t(n));
    }
    head += size;
  }
  if (head != cmp_head_) {
    cmp_head_ = head;
    __atomic_store_n(word64(kCmpHead), head, __ATOMIC_RELEASE);
  }
  return ok;
}

}  // namespace gocomm
