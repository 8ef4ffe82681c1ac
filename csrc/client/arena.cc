#include "arena.h"

#include "shm_file.h"

#include <sys/mman.h>

#include <stdexcept>

namespace gocomm {
namespace {

size_t rounded(size_t n) {
  size_t want = (n + Arena::kAlign - 1) / Arena::kAlign * Arena::kAlign;
  return want < Arena::kAlign ? Arena::kAlign : want;
}

}  // namespace

Arena::Arena(Grow grow, size_t first) : grow_(std::move(grow)), next_size_(first) {
  std::lock_guard<std::mutex> lock(mu_);
  this->grow(first);
}

Arena::~Arena() {
  for (auto& [id, s] : segs_) {
    ::munmap(s.base, s.size);
  }
}

uint32_t Arena::grow(size_t need) {
  const NewSegment ns = grow_(need > next_size_ ? need : next_size_);
  uint8_t* base = map_shared_file(ns.path, ns.bytes, "segment").data;
  Segment& s = segs_[ns.id];
  s.base = base;
  s.size = ns.bytes;
  s.free = {{0, ns.bytes}};
  next_size_ = 2 * ns.bytes;
  return ns.id;
}

Arena::Block Arena::alloc(size_t nbytes) {
  const size_t want = rounded(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  Block b;
  auto take = [&](uint32_t id, Segment& s) {
    for (auto it = s.free.begin(); it != s.free.end(); ++it) {
      if (it->second >= want) {
        const size_t off = it->first, n = it->second;
        s.free.erase(it);
        if (n > want) {
          s.free.emplace(off + want, n - want);
        }
        b = Block{id, off, nbytes, s.base + off};
        return true;
      }
    }
    return false;
  };
  for (auto& [id, s] : segs_) {
    if (take(id, s)) {
      return b;
    }
  }
  const uint32_t id = grow(want);
  if (!take(id, segs_.at(id))) {
    throw std::runtime_error("gocomm: the sidecar's new segment does not hold " + std::to_string(want) + " bytes");
  }
  return b;
}

void Arena::release(const Block& b) {
  const size_t want = rounded(b.bytes);
  std::lock_guard<std::mutex> lock(mu_);
  auto sit = segs_.find(b.segment);
  if (sit == segs_.end()) {
    return;
  }
  auto& free = sit->second.free;
  auto it = free.emplace(b.offset, want).first;
  auto next = std::next(it);
  if (next != free.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free.erase(next);
  }
  if (it != free.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free.erase(it);
    }
  }
}

uint8_t* Arena::at(uint32_t segment, size_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = segs_.find(segment);
  if (it == segs_.end() || offset > it->second.size) {
    return nullptr;
  }
  return it->second.base + offset;
}

std::vector<std::pair<uint32_t, size_t>> Arena::segments() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint32_t, size_t>> out;
  for (const auto& [id, s] : segs_) {
    out.emplace_back(id, s.size);
  }
  return out;
}

size_t Arena::free_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [id, s] : segs_) {
    for (const auto& [off, len] : s.free) {
      n += len;
    }
  }
  return n;
}

}  // namespace gocomm
