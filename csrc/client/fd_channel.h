// The client's end of its sidecar's fd socket (pg/fdchan.go, which gives the message layout
// and invariants): a SOCK_SEQPACKET unix socket over which the POSIX file descriptors of the
// physical memory chunks a CUDA tensor lives in (torch's expandable segments) reach the
// sidecar in SCM_RIGHTS, since neither gRPC nor the ring can carry them
// (docs/decisions/0029-expandable-segments.md).
//
//  1. The connection is opened at the first registration and names the session with the
//     token its Attach returned; the sidecar also checks that this process runs under its uid.
//  2. send returns only once the sidecar answered: the segment is mapped there (or the error
//     says why not), so an op naming it may be written to the ring after it.
//  3. Every fd handed to send is closed exactly once, by send, whatever happens.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gocomm {

class FdChannel {
 public:
  // The message layout's constants (pg/fdchan.go).
  static constexpr uint32_t kHello = 0x4f4c4548, kRegister = 0x53474552, kReply = 0x594c5052, kVersion = 1;
  static constexpr size_t kPerMessage = 240, kTokenLen = 32, kRegHeader = 24;

  // path: the fd socket; session and token: what Attach returned. An answer that does not
  // come within timeout_s is an error.
  FdChannel(std::string path, uint64_t session, std::string token, double timeout_s = 60);
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Has the sidecar map the chunks (fds[i], sizes[i] bytes each, back to back) as CUDA
  // segment seg, and waits for its answer; throws std::runtime_error with its words. Closes
  // every fd of fds (invariant 3).
  void send(uint32_t seg, const std::vector<int>& fds, const std::vector<uint64_t>& sizes);
  // Closes the connection (a later send opens a new one).
  void close();
  // In a child forked from the process that made it: drops the connection (the parent's)
  // without the lock, which a parent's thread may have held at the fork; later sends raise.
  void forget_after_fork();
  bool configured() const { return !path_.empty(); }

 private:
  void connect_locked();
  void drop_locked();
  void write_locked(const std::vector<uint8_t>& msg, const int* fds, size_t nfds);
  // The answer's status text: "" where the sidecar did what was asked.
  std::string answer_locked(uint32_t* seg);

  const std::string path_;
  const uint64_t session_;
  const std::string token_;
  const double timeout_s_;
  std::mutex mu_;
  int sock_ = -1;
  bool forked_ = false;  // forget_after_fork ran: the session is another process's
};

}  // namespace gocomm
