// specd/model/forward.h: a model resident on one device (the CPU Model, or the GPU model of
// cuda/gpu_model.cu), as the engine and the drafters see it: per-sequence KV stores, a
// forward pass over n tokens, and a greedy fast path that leaves the logits where they
// were computed and returns only the argmax of each row (on a GPU only those tokens cross
// to the host).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/matmul.h"
#include "model/config.h"

namespace specd {

// Optional output of a forward: the residual stream after chosen layers, for drafters
// conditioned on target hidden states (DFlash). Off (null) by default, costing nothing.
struct HiddenCapture {
  const int32_t* layers = nullptr;  // [n_layers] block indices in [0, model n_layers), any order
  int32_t n_layers = 0;
  float* out = nullptr;             // [n, n_layers, dim]: out[i, j] = h after block layers[j],
                                    // position pos0 + i (the input of block layers[j] + 1)
};

// One sequence's K/V for every layer, on the model's device. Rolling back is lowering the
// sequence's length (kept by the engine): rows past it are overwritten by later writes.
class KvStore {
 public:
  virtual ~KvStore() = default;
  virtual int64_t n_ctx() const = 0;
  virtual size_t bytes() const = 0;
  // Host copy of the logits of the last forward_argmax (the CPU path keeps them here).
  std::vector<float> last_logits;
  int64_t last_rows = 0;
  // Forwards queued ahead (ForwardModel::start_argmax), oldest first: ahead_n queued and not
  // yet kept or dropped, the first ahead_fin of them finished. The default start_argmax's
  // logits, argmax and duration of each.
  static constexpr int kMaxAhead = 2;
  int ahead_n = 0, ahead_fin = 0;
  std::vector<float> ahead_logits[kMaxAhead];
  int32_t ahead_top[kMaxAhead] = {-1, -1};
  double ahead_seconds[kMaxAhead] = {0, 0};
};

struct MemoryInfo {
  size_t weights_bytes = 0, kv_bytes = 0, scratch_bytes = 0;
  size_t device_total_bytes = 0, device_free_bytes = 0;
  std::string device_name;
};

class ForwardModel {
 public:
  virtual ~ForwardModel() = default;

  virtual const ModelConfig& config() const = 0;
  virtual std::string device() const = 0;  // "cpu", "cuda:0", "hip:1"

  virtual std::unique_ptr<KvStore> new_kv(int64_t n_ctx, bool f16) const = 0;

  // Runs tokens[0..n) at positions pos0..pos0+n-1, writing their K/V into `kv`.
  // logits (host): [n, n_vocab] when all_logits, else [n_vocab] for the last token only;
  // null skips the output head. capture (optional): also the residual stream after layers.
  virtual void forward(KvStore& kv, const int32_t* tokens, int64_t n, int64_t pos0, float* logits,
                       bool all_logits, const HiddenCapture* capture = nullptr) const = 0;

  // The same forward with every row's logits, but only argmax(row) (lowest id on ties)
  // comes back: out[n] (host). The logits stay with the model; read_logits() copies row
  // `row` of the last forward_argmax on this kv to the host. The default runs forward()
  // and keeps the logits in kv.last_logits.
  virtual void forward_argmax(KvStore& kv, const int32_t* tokens, int64_t n, int64_t pos0, int32_t* out) const;
  virtual void read_logits(const KvStore& kv, int64_t row, float* out) const;

  // Decode steps queued ahead (the engine's run-ahead, EngineOptions::run_ahead), up to
  // KvStore::kMaxAhead per KV store, oldest first: start_argmax forwards `token` at pos0 like
  // forward_argmax (token < 0: the argmax of the forward queued just before it on this kv,
  // not yet finished, taken on the device: a chain of steps with no host round trip), but
  // where queues_forwards() it returns once the work is queued on the device; finish_argmax
  // waits for the oldest not yet finished and returns its argmax, and in *seconds how long
  // that forward took on the device (not the wait). Their logits do not replace those
  // read_logits reads until keep_ahead(kv), which makes the oldest finished one's current and
  // removes it; drop_ahead(kv) forgets them all (finished: the K/V rows they wrote are past
  // the sequence's length). Between start and finish the caller makes no other call on this
  // model. The defaults run the forward inside start_argmax.
  virtual bool queues_forwards() const { return false; }
  virtual void start_argmax(KvStore& kv, int32_t token, int64_t pos0) const;
  virtual int32_t finish_argmax(KvStore& kv, double* seconds) const;
  virtual void keep_ahead(KvStore& kv) const;
  virtual void drop_ahead(KvStore& kv) const { kv.ahead_n = kv.ahead_fin = 0; }

  // Host views of the token embedding and output head (drafters such as DFlash reuse them).
  virtual const WeightView& token_embedding() const = 0;
  virtual const WeightView& output_head() const = 0;

  virtual MemoryInfo memory() const { return {}; }

  int64_t kv_dim() const { return (int64_t)config().n_kv_heads * config().head_dim; }
};

// "cpu" -> the CPU Model; "cuda:N" / "hip:N" -> the GPU model (when built with that
// backend; otherwise an Error saying how to build it). The tensors must outlive the model.
// tensor_cores (GPU only): read the weights of decode/verify forwards on tensor cores where
// the GPU reader exists (cuda/linear.cuh); a speculative engine wants it.
std::unique_ptr<ForwardModel> make_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors,
                                         const std::string& device, bool tensor_cores = false);

// Parses "cpu" | "cuda" | "cuda:N" | "hip" | "hip:N"; throws Error otherwise.
struct DeviceSpec {
  std::string kind = "cpu";  // "cpu" | "cuda" | "hip"
  int index = 0;
};
DeviceSpec parse_device(const std::string& device);

}  // namespace specd
