#include "process.h"

#include <c10/cuda/CUDAFunctions.h>
#include <dlfcn.h>
#include <link.h>

#include <filesystem>
#include <system_error>

namespace gocomm {

namespace {

// dl_iterate_phdr's callback: stops at the first object named libnccl.so*, its path in *data.
int find_nccl(struct dl_phdr_info* info, size_t, void* data) {
  std::filesystem::path path(info->dlpi_name != nullptr ? info->dlpi_name : "");
  if (path.filename().string().rfind("libnccl.so", 0) != 0) {
    return 0;
  }
  *static_cast<std::filesystem::path*>(data) = path;
  return 1;
}

// The file path names, with symbolic links and ".." resolved (as /proc/self/maps shows it).
std::string real(const std::filesystem::path& path) {
  std::error_code ec;
  auto p = std::filesystem::canonical(path, ec);
  return ec ? path.string() : p.string();
}

}  // namespace

std::string nccl_path() {
  std::filesystem::path loaded;
  dl_iterate_phdr(find_nccl, &loaded);
  if (!loaded.empty()) {
    return real(loaded);
  }
  // torch's libraries (libc10_cuda is one) sit in torch/lib; the NCCL wheel in nvidia/nccl/lib
  // beside torch
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::cuda::device_count), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  auto wheel = std::filesystem::path(info.dli_fname).parent_path() / "../../nvidia/nccl/lib/libnccl.so.2";
  std::error_code ec;
  return std::filesystem::exists(wheel, ec) ? real(wheel) : "";
}

}  // namespace gocomm
