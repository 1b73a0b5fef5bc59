// specd/model/forward.cpp: the ForwardModel defaults (greedy fast path on the host), device
// strings, and the factory choosing the CPU or the GPU model.
#include "model/forward.h"

#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "engine/sampler.h"
#include "model/model.h"

#if SPECD_WITH_GPU
#include "cuda/gpu_model.h"
#endif

namespace specd {

void ForwardModel::forward_argmax(KvStore& kv, const int32_t* tokens, int64_t n, int64_t pos0, int32_t* out) const {
  const int64_t nv = config().n_vocab;
  kv.last_logits.resize((size_t)(n * nv));
  kv.last_rows = 0;
  forward(kv, tokens, n, pos0, kv.last_logits.data(), true);
  kv.last_rows = n;
  for (int64_t i = 0; i < n; ++i) out[i] = argmax(kv.last_logits.data() + i * nv, nv);
}

void ForwardModel::start_argmax(KvStore& kv, int32_t token, int64_t pos0) const {
  SPECD_CHECK(kv.ahead_n < KvStore::kMaxAhead, "start_argmax: " + std::to_string(KvStore::kMaxAhead) +
                                                  " forwards are queued ahead already");
  const int i = kv.ahead_n;
  if (token < 0) {
    SPECD_CHECK(i > kv.ahead_fin, "start_argmax: a chained forward needs an unfinished one before it");
    token = kv.ahead_top[i - 1];  // (computed already: the defaults run the forward in start_argmax)
  }
  const int64_t nv = config().n_vocab;
  kv.ahead_logits[i].resize((size_t)nv);
  const auto t0 = std::chrono::steady_clock::now();
  forward(kv, &token, 1, pos0, kv.ahead_logits[i].data(), true);
  kv.ahead_top[i] = argmax(kv.ahead_logits[i].data(), nv);
  kv.ahead_seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kv.ahead_n = i + 1;
}

int32_t ForwardModel::finish_argmax(KvStore& kv, double* seconds) const {
  SPECD_CHECK(kv.ahead_fin < kv.ahead_n, "finish_argmax: no unfinished forward is queued ahead");
  const int i = kv.ahead_fin++;
  *seconds = kv.ahead_seconds[i];
  return kv.ahead_top[i];
}

void ForwardModel::keep_ahead(KvStore& kv) const {
  SPECD_CHECK(kv.ahead_fin >= 1, "keep_ahead: no finished forward is queued ahead");
  std::swap(kv.last_logits, kv.ahead_logits[0]);
  for (int i = 0; i + 1 < kv.ahead_n; ++i) {
    std::swap(kv.ahead_logits[i], kv.ahead_logits[i + 1]);
    kv.ahead_top[i] = kv.ahead_top[i + 1];
    kv.ahead_seconds[i] = kv.ahead_seconds[i + 1];
  }
  kv.ahead_n -= 1;
  kv.ahead_fin -= 1;
  kv.last_rows = 1;
}

void ForwardModel::read_logits(const KvStore& kv, int64_t row, float* out) const {
  SPECD_CHECK(row >= 0 && row < kv.last_rows, "read_logits: row " + std::to_string(row) + " of a forward of " +
                                                  std::to_string(kv.last_rows) + " rows");
  const int64_t nv = config().n_vocab;
  std::memcpy(out, kv.last_logits.data() + row * nv, sizeof(float) * (size_t)nv);
}

DeviceSpec parse_device(const std::string& device) {
  DeviceSpec d;
  const auto colon = device.find(':');
  d.kind = device.substr(0, colon);
  const bool known = d.kind == "cpu" || d.kind == "cuda" || d.kind == "hip";
  bool ok = known;
  if (ok && colon != std::string::npos) {
    const std::string idx = device.substr(colon + 1);
    ok = d.kind != "cpu" && !idx.empty() && idx.size() < 6 && idx.find_first_not_of("0123456789") == std::string::npos;
    if (ok) d.index = std::stoi(idx);
  }
  if (!ok)
    throw Error("device '" + device + "' is not one of: cpu, cuda, cuda:N, hip, hip:N (N = the device index)");
  return d;
}

std::unique_ptr<ForwardModel> make_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors,
                                         const std::string& device, bool tensor_cores) {
  const DeviceSpec d = parse_device(device);
  if (d.kind == "cpu") return std::make_unique<Model>(cfg, tensors);
#if SPECD_WITH_GPU
  if (d.kind == SPECD_BACKEND_NAME) return make_gpu_model(cfg, tensors, d.index, tensor_cores);
#else
  (void)tensor_cores;
#endif
  throw Error("device '" + device + "': this specd was built with SPECD_BACKEND=" + SPECD_BACKEND_NAME +
              "; rebuild it with SPECD_BACKEND=" + d.kind + " (pip install . with that environment variable) or use "
              "--device cpu");
}

}  // namespace specd
