// specd/cuda/sample.cuh: what runs on the logits on the device so only tokens cross to the
// host: argmax per row (greedy decoding and greedy verification) and a row softmax.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

// out[r] = the lowest index of the largest logit of row r (as the CPU sampler's argmax;
// i.e. the same result as its strict-greater scan). logits: device [n, nv]; out: device [n];
// work: device, argmax_workspace_bytes(n, nv) bytes, zeroed once before the first call (each
// call leaves it ready for the next, also for calls with fewer rows: row r's part of it is
// the same for every n); one call at a time per workspace.
size_t argmax_workspace_bytes(int64_t n, int64_t nv);
void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out, void* work, gpuStream_t s);

// In place, max-subtracted, each of n rows of nv. x: device [n, nv].
void softmax_rows(float* x, int64_t n, int64_t nv, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
