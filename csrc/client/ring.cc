#include "ring.h"

#include "shm_file.h"

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <stdexcept>

namespace gocomm {
namespace {

constexpr uint64_t kMagic = 0x31524D4D4F434F47ULL;  // "GOCOMMR1"
constexpr uint32_t kVersion = 1;

// Shared futexes (no FUTEX_PRIVATE_FLAG): the waiter and the waker are different processes.
long futex(uint32_t* addr, int op, uint32_t val, const struct timespec* ts) {
  return syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

}  // namespace

uint32_t Ring::rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

uint16_t Ring::rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

Ring::Ring(const std::string& path, size_t size) : size_(size) {
  mem_ = map_shared_file(path, size, "the ring").data;
  uint64_t magic;
  uint32_t version;
  std::memcpy(&magic, mem_, 8);
  std::memcpy(&version, mem_ + 8, 4);
  if (size < 4096 || magic != kMagic || version != kVersion) {
    ::munmap(mem_, size_);
    mem_ = nullptr;
    throw std::runtime_error(path + " is not a gocomm ring of version " + std::to_string(kVersion));
  }
  uint64_t q[4];
  std::memcpy(q, mem_ + 16, sizeof q);
  sub_off_ = q[0], sub_size_ = q[1], cmp_off_ = q[2], cmp_size_ = q[3];
  for (auto [off, n] : {std::pair{sub_off_, sub_size_}, std::pair{cmp_off_, cmp_size_}}) {
    if (n < 4096 || (n & (n - 1)) != 0 || off + n > size) {
      ::munmap(mem_, size_);
      mem_ = nullptr;
      throw std::runtime_error(path + ": queue at " + std::to_string(off) + " of " + std::to_string(n) +
                               " bytes in a " + std::to_string(size) + "-byte file");
    }
  }
  sub_tail_ = __atomic_load_n(word64(kSubTail), __ATOMIC_ACQUIRE);
  cmp_head_ = __atomic_load_n(word64(kCmpHead), __ATOMIC_ACQUIRE);
}

Ring::~Ring() {
  if (mem_ != nullptr) {
    ::munmap(mem_, size_);
  }
}

bool Ring::submit(uint16_t type, const uint8_t* p, size_t n) {
  const size_t size = 8 + ((n + 7) & ~size_t(7));
  if (size > sub_size_ / 4) {
    throw std::length_error("gocomm: op descriptor of " + std::to_string(n) + " bytes exceeds the ring's limit");
  }
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t tail = sub_tail_;
  const uint64_t head = __atomic_load_n(word64(kSubHead), __ATOMIC_ACQUIRE);
  size_t off = tail & (sub_size_ - 1);
  const size_t rest = sub_size_ - off;
  const size_t pad = rest < size ? rest : 0;
  if (sub_size_ - (tail - head) < pad + size) {
    return false;
  }
  uint8_t* base = mem_ + sub_off_;
  if (pad != 0) {
    const uint32_t len = uint32_t(pad - 8);
    const uint32_t zero = 0;
    std::memcpy(base + off, &len, 4);
    std::memcpy(base + off + 4, &zero, 4);  // type Pad, flags 0
    off = 0;
  }
  const uint32_t len = uint32_t(n);
  const uint16_t typ = type, flags = 0;
  std::memcpy(base + off, &len, 4);
  std::memcpy(base + off + 4, &typ, 2);
  std::memcpy(base + off + 6, &flags, 2);
  std::memcpy(base + off + 8, p, n);
  tail += pad + size;
  sub_tail_ = tail;
  __atomic_store_n(word64(kSubTail), tail, __ATOMIC_RELEASE);
  __atomic_fetch_add(word32(kSubNotify), 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(word32(kSubWaiters), __ATOMIC_SEQ_CST) != 0) {
    futex(word32(kSubNotify), FUTEX_WAKE, 1, nullptr);
  }
  return true;
}

void Ring::wait(double timeout_s, const std::function<bool()>& busy) {
  __atomic_fetch_add(word32(kCmpWaiters), 1u, __ATOMIC_SEQ_CST);
  const uint32_t notify = __atomic_load_n(word32(kCmpNotify), __ATOMIC_SEQ_CST);
  if (__atomic_load_n(word64(kCmpTail), __ATOMIC_SEQ_CST) == cmp_head_ && !(busy && busy())) {
    struct timespec ts;
    ts.tv_sec = time_t(timeout_s);
    ts.tv_nsec = long((timeout_s - double(ts.tv_sec)) * 1e9);
    futex(word32(kCmpNotify), FUTEX_WAIT, notify, &ts);
  }
  __atomic_fetch_sub(word32(kCmpWaiters), 1u, __ATOMIC_SEQ_CST);
}

void Ring::nudge() {
  __atomic_fetch_add(word32(kCmpNotify), 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(word32(kCmpWaiters), __ATOMIC_SEQ_CST) > 0) {
    futex(word32(kCmpNotify), FUTEX_WAKE, 1, nullptr);
  }
}

}  // namespace gocomm
