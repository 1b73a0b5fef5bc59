// specd/cuda/gpu_model.h: the GPU model factory (plain C++: the engine includes it).
#pragma once
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/forward.h"

namespace specd {

// Uploads the model to GPU `device_index` (cuda:N / hip:N) and returns it as a
// ForwardModel; throws Error when the device is missing or the model does not fit
// (saying how much memory it needs and how much the device has free). tensor_cores: see
// LinearArgs::tensor_cores (cuda/linear.cuh).
std::unique_ptr<ForwardModel> make_gpu_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors,
                                             int device_index, bool tensor_cores = false);

}  // namespace specd
