// The data-plane wire format shared with pgserver: ring record types, op kinds, the op
// descriptor and the completion. Every number mirrors wire/descriptor.go and wire/dtype.go
// (python/tests/test_wire.py pins this encoder against the Go decoder's field table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gocomm::wire {

// Ring record types (the ring reserves types below 16).
constexpr uint16_t kRecOp = 16;
constexpr uint16_t kRecDone = 17;
constexpr uint16_t kRecIpc = 18;
constexpr uint16_t kRecIpcDrop = 19;
// An op captured in a CUDA graph (docs/decisions/0020): u32 trigger, u32 segment and u64
// offset of the trigger page, then the op's descriptor; answered by a kRecDone of its seq.
constexpr uint16_t kRecGraphOp = 24;
// The graph holding a trigger's op is gone: u32 trigger.
constexpr uint16_t kRecGraphDrop = 25;
constexpr size_t kGraphOpHeader = 16;
// Graph triggers: T words in a page of the arena, D words in the counter memory after the
// stream counters (gpu.TriggerSlots, gpu.TriggerOffset).
constexpr uint32_t kTriggerSlots = 1024;
constexpr size_t kTriggerOffset = 4096;
// The counter memory's size: the slots, then D[t] of every trigger (gpu.CounterMemBytes).
constexpr size_t kCounterMemBytes = kTriggerOffset + 4 * kTriggerSlots;

// CUDA allocations registered with kRecIpc carry this bit in their segment id.
constexpr uint32_t kCudaSegment = 1u << 31;

enum Kind : uint8_t {
  kAllReduce = 1,
  kBroadcast = 2,
  kReduce = 3,
  kAllGather = 4,
  kReduceScatter = 5,
  kAllToAll = 6,
  kGather = 7,
  kScatter = 8,
  kSend = 9,
  kRecv = 10,
  kBarrier = 11,
  kAllToAllV = 12,
};

constexpr uint8_t kDeviceHost = 0;
constexpr uint8_t kDeviceCuda = 1;

// Reduce ops (wire.RedOp).
enum RedOp : uint8_t { kSum = 1, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

// Completion statuses (pg.Status*).
constexpr int32_t kStatusOk = 0;

// The name of a completion status, as the errors raised from wait() say it.
std::string status_name(int32_t status);

struct BufRef {
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// An op descriptor (wire.Desc): see wire/descriptor.go for the byte layout.
struct Desc {
  uint64_t seq = 0;
  uint32_t group = 0;
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t redop = 0;
  uint8_t device = kDeviceHost;
  int32_t root = 0;
  int32_t tag = 0;
  uint64_t count = 0;
  uint64_t timeout_ms = 0;
  uint32_t stream_value = 0;
  std::vector<BufRef> bufs;
  std::vector<int64_t> splits;
};

constexpr size_t kDescHeader = 56;
constexpr size_t kBufRefSize = 24;
constexpr size_t kDoneHeader = 16;
constexpr size_t kIpcHeader = 16;  // u32 segment, u32 reserved, u64 size; then 64 handle bytes

// The payload of a kRecOp record for d.
std::vector<uint8_t> encode(const Desc& d);

struct Done {
  uint64_t seq = 0;
  int32_t status = 0;
  int32_t source = -1;
  std::string message;
};

// Parses a kRecDone payload; false when it is shorter than the fixed part.
bool decode_done(const uint8_t* p, size_t n, Done* out);

// The payload of a kRecIpc record: segment, size and the 64-byte CUDA IPC handle.
std::vector<uint8_t> encode_ipc(uint32_t segment, uint64_t size, const uint8_t handle[64]);
// The payload of a kRecIpcDrop record.
std::vector<uint8_t> encode_ipc_drop(uint32_t segment);

}  // namespace gocomm::wire
