#include "shm_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace gocomm {

SharedFile map_shared_file(const std::string& path, size_t size, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error("gocomm: cannot open " + what + " " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("gocomm: cannot stat " + what + " " + path + ": " + std::strerror(err));
  }
  void* m = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (m == MAP_FAILED) {
    throw std::runtime_error("gocomm: cannot map " + what + " " + path + ": " + std::strerror(err));
  }
  ::unlink(path.c_str());
  return SharedFile{static_cast<uint8_t*>(m), static_cast<size_t>(st.st_size)};
}

}  // namespace gocomm
