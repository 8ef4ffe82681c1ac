#include "fd_channel.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>

namespace gocomm {
namespace {

void put32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; i++) {
    b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
}

void put64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 0; i < 8; i++) {
    b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
}

uint32_t get32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

std::string sys_error(const char* what) {
  return std::string("gocomm: the sidecar's fd socket: ") + what + ": " + std::strerror(errno);
}

// Closes every fd of a send when it returns (FdChannel invariant 3).
struct CloseAll {
  const std::vector<int>& fds;
  ~CloseAll() {
    for (int fd : fds) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
  }
};

}  // namespace

FdChannel::FdChannel(std::string path, uint64_t session, std::string token, double timeout_s)
    : path_(std::move(path)), session_(session), token_(std::move(token)), timeout_s_(timeout_s) {}

FdChannel::~FdChannel() {
  close();
}

void FdChannel::close() {
  std::lock_guard<std::mutex> lock(mu_);
  drop_locked();
}

void FdChannel::forget_after_fork() {
  new (&mu_) std::mutex();
  std::lock_guard<std::mutex> lock(mu_);
  drop_locked();
  forked_ = true;
}

void FdChannel::drop_locked() {
  if (sock_ >= 0) {
    ::close(sock_);
    sock_ = -1;
  }
}

void FdChannel::connect_locked() {
  if (sock_ >= 0) {
    return;
  }
  if (forked_) {
    throw std::runtime_error("gocomm: this process was forked from the one whose sidecar session this is");
  }
  if (path_.empty()) {
    throw std::runtime_error("gocomm: the sidecar has no fd socket (a pgserver of an older gocomm?)");
  }
  if (token_.size() != kTokenLen) {
    throw std::runtime_error("gocomm: the sidecar's fd socket token is " + std::to_string(token_.size()) +
                             " bytes, not " + std::to_string(kTokenLen));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path_.size() >= sizeof(addr.sun_path)) {
    throw std::runtime_error("gocomm: the sidecar's fd socket path is too long: " + path_);
  }
  std::memcpy(addr.sun_path, path_.data(), path_.size());
  sock_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (sock_ < 0) {
    throw std::runtime_error(sys_error("socket"));
  }
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s_);
  tv.tv_usec = static_cast<suseconds_t>((timeout_s_ - static_cast<double>(tv.tv_sec)) * 1e6);
  ::setsockopt(sock_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(sock_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int r;
  do {
    r = ::connect(sock_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    std::string err = sys_error(("connect to " + path_).c_str());
    drop_locked();
    throw std::runtime_error(err);
  }
  std::vector<uint8_t> hello;
  put32(hello, kHello);
  put32(hello, kVersion);
  put64(hello, session_);
  hello.insert(hello.end(), token_.begin(), token_.end());
  try {
    write_locked(hello, nullptr, 0);
    uint32_t seg = 0;
    std::string why = answer_locked(&seg);
    if (!why.empty()) {
      throw std::runtime_error("gocomm: the sidecar refused this process on its fd socket: " + why);
    }
  } catch (...) {
    drop_locked();
    throw;
  }
}

void FdChannel::write_locked(const std::vector<uint8_t>& msg, const int* fds, size_t nfds) {
  iovec iov{const_cast<uint8_t*>(msg.data()), msg.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  std::vector<char> ctl;
  if (nfds > 0) {
    ctl.assign(CMSG_SPACE(sizeof(int) * nfds), 0);
    mh.msg_control = ctl.data();
    mh.msg_controllen = ctl.size();
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock_, &mh, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(msg.size())) {
    throw std::runtime_error(n < 0 ? sys_error("send") : "gocomm: the sidecar's fd socket: short send");
  }
}

std::string FdChannel::answer_locked(uint32_t* seg) {
  uint8_t buf[8192];
  ssize_t n;
  do {
    n = ::recv(sock_, buf, sizeof buf, 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    throw std::runtime_error(errno == EAGAIN || errno == EWOULDBLOCK
                                 ? "gocomm: the sidecar did not answer on its fd socket within " +
                                       std::to_string(static_cast<int>(timeout_s_)) + " s"
                                 : sys_error("receive"));
  }
  if (n < 16 || get32(buf) != kReply) {
    throw std::runtime_error(n == 0 ? "gocomm: the sidecar closed its fd socket"
                                    : "gocomm: the sidecar's fd socket sent something other than an answer");
  }
  *seg = get32(buf + 4);
  if (get32(buf + 8) == 0) {
    return "";
  }
  std::string why(reinterpret_cast<const char*>(buf + 16), static_cast<size_t>(n) - 16);
  return why.empty() ? "refused" : why;
}

void FdChannel::send(uint32_t seg, const std::vector<int>& fds, const std::vector<uint64_t>& sizes) {
  CloseAll closer{fds};
  if (fds.empty() || fds.size() != sizes.size()) {
    throw std::runtime_error("gocomm: " + std::to_string(fds.size()) + " chunk fds for " +
                             std::to_string(sizes.size()) + " lengths");
  }
  std::lock_guard<std::mutex> lock(mu_);
  connect_locked();
  try {
    for (size_t first = 0; first < fds.size(); first += kPerMessage) {
      const size_t count = std::min(kPerMessage, fds.size() - first);
      std::vector<uint8_t> msg;
      msg.reserve(kRegHeader + 8 * count);
      put32(msg, kRegister);
      put32(msg, seg);
      put32(msg, static_cast<uint32_t>(fds.size()));
      put32(msg, static_cast<uint32_t>(first));
      put32(msg, static_cast<uint32_t>(count));
      put32(msg, 0);
      for (size_t i = first; i < first + count; i++) {
        put64(msg, sizes[i]);
      }
      write_locked(msg, fds.data() + first, count);
    }
    uint32_t answered = 0;
    std::string why = answer_locked(&answered);
    if (answered != seg) {
      throw std::runtime_error("gocomm: the sidecar's fd socket answered for segment " + std::to_string(answered) +
                               ", not " + std::to_string(seg));
    }
    if (!why.empty()) {
      // a refused registration leaves the connection usable, except where the sidecar closed it
      throw std::runtime_error("gocomm: the sidecar could not map this tensor's memory chunks: " + why);
    }
  } catch (...) {
    drop_locked();  // the connection's state is unknown: the next send opens a new one
    throw;
  }
}

}  // namespace gocomm
