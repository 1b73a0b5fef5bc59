// specd/cuda/device.cu: device selection and the testing entry points that need no op.
#include "cuda/device.cuh"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/testing.h"

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
  }
  return L;
}

namespace testing {

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
