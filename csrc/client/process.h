// What the training process has loaded that its sidecar must match.

#pragma once

#include <string>

namespace gocomm {

// The libnccl this process has loaded (torch's), else the one torch's wheel would load (the
// NVIDIA NCCL wheel beside torch, where torch's own run path looks), else "": the sidecar
// loads the same file (Attach), so both sides speak one NCCL version.
std::string nccl_path();

}  // namespace gocomm
