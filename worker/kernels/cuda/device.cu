// specd/cuda/device.cu: device selection and the testing entry points that need no op.
#include "cuda/device.cuh"
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

}  // namespace testing
}  // namespace gpu
}  // namespace specd
