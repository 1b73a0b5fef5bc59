// specd/cuda/device.cu: device selection and the testing entry points that need no op.
#include "cuda/device.cuh"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/testing.h"
#include "cuda/trace.cuh"

namespace specd {
namespace gpu {

DeviceInfo select_device(int index) {
  int n = 0;
  const gpuError_t e = gpuGetDeviceCount(&n);
  if (e != gpuSuccess) {
    (void)gpuGetLastError();
    throw Error(std::string("no usable ") + SPECD_GPU_NAME + " device: " + gpuGetErrorString(e) +
                " (is the driver installed and the GPU visible to this process/container?)");
  }
  if (index < 0 || index >= n)
    throw Error(std::string(SPECD_GPU_NAME) + ":" + std::to_string(index) + " does not exist: this machine has " +
                std::to_string(n) + " " + SPECD_GPU_NAME + " device(s)" +
                (n > 0 ? " (" + std::string(SPECD_GPU_NAME) + ":0.." + std::to_string(n - 1) + ")" : std::string()));
  SPECD_GPU_CHECK(gpuSetDevice(index));
  gpuDeviceProp p;
  SPECD_GPU_CHECK(gpuGetDeviceProperties(&p, index));
  DeviceInfo d;
  d.index = index;
  d.name = p.name;
  d.sm_count = p.multiProcessorCount;
  d.major = p.major;
  d.minor = p.minor;
  SPECD_GPU_CHECK(gpuMemGetInfo(&d.free_bytes, &d.total_bytes));
  return d;
}

const DevLimits& dev_limits() {
  static DevLimits cached[64];
  int dev = 0;
  SPECD_GPU_CHECK(gpuGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  DevLimits& L = cached[dev];
  if (!L.sms) {
    gpuDeviceProp p;
    SPECD_GPU_CHECK(gpuGetDeviceProperties(&p, dev));
#if SPECD_HIP
    L.smem_per_block = p.sharedMemPerBlock;  // (no opt-in field in every ROCm; AMD has no opt-in anyway)
    L.pdl = false;
#else
    L.smem_per_block = std::max<size_t>(p.sharedMemPerBlockOptin, p.sharedMemPerBlock);
    L.pdl = p.major >= 9 && env_value("SPECD_GPU_PDL") != "0";
    L.mma = p.major >= 8;
#if defined(SPECD_SM90A)
    L.wgmma = p.major == 9 && p.minor == 0;
#endif
#endif
    L.sms = std::max(1, p.multiProcessorCount);
    L.log = env_value("SPECD_GPU_LOG_LAUNCHES") == "1";
  }
  return L;
}

namespace {
std::vector<void (*)(const TraceBuf&)>& trace_setters() {
  static std::vector<void (*)(const TraceBuf&)> v;
  return v;
}
struct TraceState {
  DeviceBuffer rec, count;
  unsigned cap = 0;
};
TraceState& trace_state() {
  static TraceState s;
  return s;
}
}  // namespace

void trace_register(void (*set)(const TraceBuf&)) { trace_setters().push_back(set); }

namespace testing {

bool trace_begin(int64_t cap) {
  SPECD_CHECK(cap > 0 && cap < (int64_t)1 << 26, "trace_begin: cap must be in 1 .. 2^26 records");
  if (trace_setters().empty()) return false;  // not a SPECD_GPU_TRACE build
  TraceState& st = trace_state();
  st.rec.resize(sizeof(unsigned long long) * kTraceWords * (size_t)cap);
  st.count.resize(sizeof(unsigned));
  SPECD_GPU_CHECK(gpuMemset(st.count.get(), 0, sizeof(unsigned)));
  st.cap = (unsigned)cap;
  TraceBuf b;
  b.rec = st.rec.get<unsigned long long>();
  b.count = st.count.get<unsigned>();
  b.cap = st.cap;
  for (auto set : trace_setters()) set(b);
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  return true;
}

std::vector<uint64_t> trace_end() {
  TraceState& st = trace_state();
  std::vector<uint64_t> out;
  if (st.cap == 0) return out;
  SPECD_GPU_CHECK(gpuDeviceSynchronize());
  for (auto set : trace_setters()) set(TraceBuf());
  unsigned n = 0;
  SPECD_GPU_CHECK(gpuMemcpy(&n, st.count.get(), sizeof n, gpuMemcpyDeviceToHost));
  n = std::min(n, st.cap);
  out.resize((size_t)n * kTraceWords);
  if (n) SPECD_GPU_CHECK(gpuMemcpy(out.data(), st.rec.get(), out.size() * sizeof(uint64_t), gpuMemcpyDeviceToHost));
  st = TraceState();
  return out;
}

int device_count() {
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) {
    (void)gpuGetLastError();
    return 0;
  }
  return n;
}

std::string device_name(int device) { return select_device(device).name; }

bool wgmma() { return dev_limits().wgmma; }

}  // namespace testing
}  // namespace gpu
}  // namespace specd
