// specd/cuda/device.cuh: choosing a GPU ("cuda:N" / "hip:N") with clear errors, and what
// the engine reports about it.
#pragma once
#include <cstddef>
#include <string>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

struct DeviceInfo {
  int index = 0;
  std::string name;
  size_t total_bytes = 0, free_bytes = 0;
  int sm_count = 0;
  int major = 0, minor = 0;
};

// Makes `index` the calling thread's device; throws Error when it does not exist (saying
// how many there are) or when no driver/device is usable.
DeviceInfo select_device(int index);

}  // namespace gpu
}  // namespace specd
