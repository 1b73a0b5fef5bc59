// specd/cuda/gpu_model.cu: the llama-family forward pass on one GPU (the maths of
// model/model.h), sequencing the ops of cuda/*.cuh on one stream.
//
// Small forwards (n <= kMaxSmallBatch: decode and speculative verify) run the batch-
// invariant float32 path with fused launches, five per layer in decode:
//   qkv  = linear([Wq|Wk|Wv], rmsnorm(h))        (norm fused into the matrix-vector kernel)
//   att  = attention(rope_kv(qkv), cache)        (per-head norm, RoPE and the K/V row into this
//                                                 sequence's cache fused in for one row, else
//                                                 rope_kv's own launch; fixed chunks:
//                                                 batch-invariant)
//   h   += linear(Wo, att)                        (residual add fused)
//   act  = silu(Wgate f) * (Wup f), f = rmsnorm(h) (norm and SwiGLU fused)
//   h   += linear(Wdown, act)
// then the head (rmsnorm fused) and the argmax of every row, all captured once per
// (cache, n, head) in a GPU graph whose inputs (tokens, position) live in device memory,
// so a decode step is one H2D copy, one graph launch and one D2H copy of n token ids. A
// freed sequence's cache is kept, graphs and all, for the next sequence (KvPool).
// Large forwards (prefill chunks) run the tensor-core path with separate RMSNorm launches.
#include "cuda/gpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/device.cuh"
#include "cuda/linear.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope_kv.cuh"
#include "cuda/sample.cuh"
#include "model/model.h"

namespace specd {
namespace {

using gpu::DeviceBuffer;
using gpu::GpuWeight;

constexpr size_t kAlign = 256;
// A forward's inputs, one int32 buffer on the device and in pinned memory: the position at 0,
// the tokens from kTok0 on (16-byte aligned), so that one copy carries both.
constexpr int64_t kTok0 = 4;

size_t weight_bytes(const WeightView& w) { return w.valid() ? w.row_stride * (size_t)w.n_out : 0; }
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

enum class Head : int32_t { None = 0, Last = 1, All = 2 };

struct GpuLayer {
  const float *attn_norm, *ffn_norm;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  GpuWeight wq, wk, wv, wo, w_gate, w_up, w_down;
};

// Pinned host staging for one forward's inputs and outputs.
struct Staging {
  int32_t* host = nullptr;  // [kTok0 + cap] : pos0, (unused), tokens from kTok0
  int32_t* tops = nullptr;  // [cap] argmax rows
  int64_t cap = 0;
  ~Staging() {
    if (host) (void)gpuFreeHost(host);
    if (tops) (void)gpuFreeHost(tops);
  }
  void reserve(int64_t n) {
    if (n <= cap) return;
    if (host) (void)gpuFreeHost(host);
    if (tops) (void)gpuFreeHost(tops);
    host = tops = nullptr;
    cap = std::max<int64_t>(n, 256);
    SPECD_GPU_CHECK(gpuHostAlloc((void**)&host, sizeof(int32_t) * (size_t)(kTok0 + cap), gpuHostAllocDefault));
    std::memset(host, 0, sizeof(int32_t) * (size_t)kTok0);
    SPECD_GPU_CHECK(gpuHostAlloc((void**)&tops, sizeof(int32_t) * (size_t)cap, gpuHostAllocDefault));
  }
};

// Logits buffers of a KV store: the current one and one per forward queued ahead.
constexpr int kSlots = 1 + KvStore::kMaxAhead;

// A graph captured for one KV store (small forwards; key: ((n * 4 + head) * 2 + apart) * kSlots +
// logits buffer, apart: a decode step from gpu::kAttnApartFrom on) and the scratch epoch it was
// captured in.
struct KvGraph {
  gpuGraphExec_t exec = nullptr;
  uint64_t epoch = 0;
};
using KvGraphs = std::map<int64_t, KvGraph>;
inline void destroy_graphs(KvGraphs& g) {
  for (auto& e : g)
    if (e.second.exec) (void)gpuGraphExecDestroy(e.second.exec);
  g.clear();
}

// A cache's device memory and its graphs, apart from any sequence.
struct KvParts {
  int64_t n_ctx = 0;
  bool f16 = true;
  size_t layer_bytes = 0;
  DeviceBuffer k, v, logits[kSlots];
  KvGraphs graphs;
  size_t bytes() const {
    size_t b = k.size() + v.size();
    for (const DeviceBuffer& l : logits) b += l.size();
    return b;
  }
};

// Caches of freed sequences, kept for the next ones of the same size: their memory is not
// allocated (nor freed, which waits for the device) again, and the graphs captured for them
// stay valid (the same addresses), so a new sequence's first steps capture nothing. At most
// kKept caches (their bytes count as the model's scratch in memory()); SPECD_GPU_KV_POOL=0
// keeps none (for benchmarks).
class KvPool {
 public:
  static constexpr size_t kKept = 2;
  KvPool() : on_(gpu::env_value("SPECD_GPU_KV_POOL") != "0") {}
  ~KvPool() {
    for (KvParts& p : kept_) destroy_graphs(p.graphs);
  }
  bool take(int64_t n_ctx, bool f16, KvParts& out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i].n_ctx == n_ctx && kept_[i].f16 == f16) {
        out = std::move(kept_[i]);
        kept_.erase(kept_.begin() + (std::ptrdiff_t)i);
        return true;
      }
    return false;
  }
  void give(KvParts&& p) {
    if (!on_) {
      destroy_graphs(p.graphs);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.size() >= kKept) {  // the oldest goes
      destroy_graphs(kept_.front().graphs);
      kept_.erase(kept_.begin());
    }
    kept_.push_back(std::move(p));
  }
  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t b = 0;
    for (const KvParts& p : kept_) b += p.bytes();
    return b;
  }

 private:
  const bool on_;
  mutable std::mutex mu_;
  std::vector<KvParts> kept_;
};

// One sequence's cache on the device, with the logits of its last small forward and the
// graphs captured for it (they bake in the cache's and the scratch's addresses). Freed, it
// goes back to the model's pool with its graphs.
class GpuKv final : public KvStore {
 public:
  GpuKv(KvParts&& parts, std::shared_ptr<KvPool> pool) : p_(std::move(parts)), pool_(std::move(pool)) {}
  static KvParts allocate(int32_t n_layers, int64_t n_ctx, int64_t kv_dim, bool f16) {
    KvParts p;
    p.n_ctx = n_ctx;
    p.f16 = f16;
    p.layer_bytes = (size_t)n_ctx * (size_t)kv_dim * (f16 ? 2 : 4);
    p.k.resize(p.layer_bytes * (size_t)n_layers);
    p.v.resize(p.layer_bytes * (size_t)n_layers);
    return p;
  }
  ~GpuKv() override {
    if (pool_) pool_->give(std::move(p_));
    else destroy_graphs(p_.graphs);
  }

  int64_t n_ctx() const override { return p_.n_ctx; }
  size_t bytes() const override { return p_.bytes(); }
  bool f16() const { return p_.f16; }
  void* k(int32_t l) const { return p_.k.get<uint8_t>() + (size_t)l * p_.layer_bytes; }
  void* v(int32_t l) const { return p_.v.get<uint8_t>() + (size_t)l * p_.layer_bytes; }

  // Device logits rows of the last small forward, in one of kSlots buffers: `cur`, the one
  // read_logits reads, which a forward overwrites; forward i queued ahead (start_argmax)
  // writes buffer (cur + 1 + i) % kSlots, so that dropping them leaves the sequence's logits
  // as they were, and keeping the oldest (keep_ahead) makes its buffer current. Growing a
  // buffer invalidates the graphs.
  float* logits(int slot, int64_t rows, int64_t nv) {
    const size_t need = sizeof(float) * (size_t)(rows * nv);
    if (need > p_.logits[slot].size()) {
      destroy_graphs(p_.graphs);
      p_.logits[slot].resize(need);
    }
    return p_.logits[slot].get<float>();
  }
  const float* logits_ptr() const { return p_.logits[cur].get<float>(); }
  int cur = 0;
  int64_t device_rows = 0;  // rows of logits[cur] valid for read_logits

  KvGraphs& graphs() { return p_.graphs; }

 private:
  KvParts p_;
  std::shared_ptr<KvPool> pool_;
};

class GpuModel final : public ForwardModel {
 public:
  GpuModel(const ModelConfig& cfg, const std::vector<TensorRef>& tensors, int device_index, bool tensor_cores)
      : host_(cfg, tensors), index_(device_index), tensor_cores_(tensor_cores) {
    info_ = gpu::select_device(device_index);
    const ModelConfig& c = host_.config();
    // ---- what it needs: weights + small vectors, then a working margin
    size_t total = 0;
    auto count = [&](const WeightView& w) { total += align_up(weight_bytes(w)); };
    count(host_.token_embedding());
    if (host_.output_head().data != host_.token_embedding().data) count(host_.output_head());
    for (const LayerWeights& L : host_.layers())
      for (const WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) count(*w);
    const size_t vec_bytes = align_up(sizeof(float) * (size_t)(c.dim + c.rope.n_dims)) +
                             (size_t)c.n_layers * 8 * align_up(sizeof(float) * (size_t)std::max<int64_t>(
                                                                   c.dim, (int64_t)c.n_heads * c.head_dim));
    total += vec_bytes;
    const size_t margin = 256ull << 20;
    if (total + margin > info_.free_bytes)
      throw Error(std::string(SPECD_GPU_NAME) + ":" + std::to_string(index_) + " (" + info_.name +
                  "): the model needs " + std::to_string((total >> 20) + 1) + " MiB of device memory for its weights (+" +
                  std::to_string(margin >> 20) + " MiB working space, + the KV cache per sequence), but only " +
                  std::to_string(info_.free_bytes >> 20) + " MiB of " + std::to_string(info_.total_bytes >> 20) +
                  " MiB are free; use a smaller or more quantized model, or another device");
    arena_.resize(total);
    weights_bytes_ = total;
    SPECD_GPU_CHECK(gpuStreamCreateWithFlags(&stream_, gpuStreamNonBlocking));

    // ---- upload
    uint8_t* cursor = arena_.get<uint8_t>();
    auto upload = [&](const void* src, size_t bytes) -> uint8_t* {
      uint8_t* dst = cursor;
      gpu::to_device(dst, src, bytes);
      cursor += align_up(bytes);
      return dst;
    };
    auto weight = [&](const WeightView& w) {
      GpuWeight g;
      g.type = w.type;
      g.n_in = w.n_in;
      g.n_out = w.n_out;
      g.row_stride = w.row_stride;
      g.data = upload(w.data, weight_bytes(w));
      return g;
    };
    auto vec = [&](const float* v, int64_t n) -> const float* {
      return v ? reinterpret_cast<const float*>(upload(v, sizeof(float) * (size_t)n)) : nullptr;
    };
    const int64_t q_dim = (int64_t)c.n_heads * c.head_dim, kvd = kv_dim();
    tok_embd_ = weight(host_.token_embedding());
    output_ = host_.output_head().data == host_.token_embedding().data ? tok_embd_ : weight(host_.output_head());
    output_norm_ = vec(host_.output_norm(), c.dim);
    rope_ = c.rope;
    rope_.freq_factors = vec(c.rope.freq_factors, c.rope.n_dims / 2);
    for (const LayerWeights& L : host_.layers()) {
      GpuLayer g;
      g.attn_norm = vec(L.attn_norm, c.dim);
      g.ffn_norm = vec(L.ffn_norm, c.dim);
      g.bq = vec(L.bq, q_dim);
      g.bk = vec(L.bk, kvd);
      g.bv = vec(L.bv, kvd);
      g.q_norm = vec(L.q_norm, c.head_dim);
      g.k_norm = vec(L.k_norm, c.head_dim);
      g.wq = weight(L.wq);
      g.wk = weight(L.wk);
      g.wv = weight(L.wv);
      g.wo = weight(L.wo);
      g.w_gate = weight(L.w_gate);
      g.w_up = weight(L.w_up);
      g.w_down = weight(L.w_down);
      layers_.push_back(g);
    }
    SPECD_CHECK(cursor <= arena_.get<uint8_t>() + arena_.size(), "gpu model: arena overflow (bug)");
  }

  ~GpuModel() override {
    for (auto& pair : ahead_ev_)
      for (gpuEvent_t e : pair)
        if (e) (void)gpuEventDestroy(e);
    if (ahead_io_) (void)gpuFreeHost(ahead_io_);
    if (stream_) (void)gpuStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return host_.config(); }
  std::string device() const override { return std::string(SPECD_GPU_NAME) + ":" + std::to_string(index_); }
  const WeightView& token_embedding() const override { return host_.token_embedding(); }
  const WeightView& output_head() const override { return host_.output_head(); }

  std::unique_ptr<KvStore> new_kv(int64_t n_ctx, bool f16) const override {
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    KvParts parts;
    if (!pool_->take(n_ctx, f16, parts)) parts = GpuKv::allocate(config().n_layers, n_ctx, kv_dim(), f16);
    return std::make_unique<GpuKv>(std::move(parts), pool_);
  }

  MemoryInfo memory() const override {
    MemoryInfo m;
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    m.weights_bytes = weights_bytes_;
    m.scratch_bytes = scratch_bytes() + pool_->bytes();  // (with the kept caches of freed sequences)
    SPECD_GPU_CHECK(gpuMemGetInfo(&m.device_free_bytes, &m.device_total_bytes));
    m.device_name = info_.name;
    return m;
  }

  void forward(KvStore& kvs, const int32_t* tokens, int64_t n, int64_t pos0, float* logits, bool all_logits,
               const HiddenCapture* capture) const override {
    GpuKv& kv = cast(kvs);
    const Head head = logits == nullptr ? Head::None : all_logits ? Head::All : Head::Last;
    const float* dl = run(kv, tokens, n, pos0, head, capture);
    if (logits != nullptr) {
      const int64_t nv = config().n_vocab, rows = all_logits ? n : 1;
      SPECD_GPU_CHECK(gpuMemcpyAsync(logits, dl, sizeof(float) * (size_t)(rows * nv), gpuMemcpyDeviceToHost, stream_));
    }
    SPECD_GPU_CHECK(gpuStreamSynchronize(stream_));
  }

  void forward_argmax(KvStore& kvs, const int32_t* tokens, int64_t n, int64_t pos0, int32_t* out) const override {
    GpuKv& kv = cast(kvs);
    run(kv, tokens, n, pos0, Head::All, nullptr, /*argmax=*/true);
    SPECD_GPU_CHECK(gpuMemcpyAsync(staging_.tops, tops_.get(), sizeof(int32_t) * (size_t)n, gpuMemcpyDeviceToHost,
                                   stream_));
    SPECD_GPU_CHECK(gpuStreamSynchronize(stream_));
    std::memcpy(out, staging_.tops, sizeof(int32_t) * (size_t)n);
    kv.last_rows = n;
  }

  // Run-ahead: a decode step is queued (its argmax copied to its slot's pinned memory behind
  // it) and start_argmax returns; its logits go to the KV store's buffer of that slot. A
  // chained one (token < 0) takes the argmax the forward before it leaves on the device.
  bool queues_forwards() const override { return true; }
  // (events around each time the forward for the engine's decode_seconds)
  void start_argmax(KvStore& kvs, int32_t token, int64_t pos0) const override {
    GpuKv& kv = cast(kvs);
    SPECD_CHECK(kv.ahead_n < KvStore::kMaxAhead, "start_argmax: " + std::to_string(KvStore::kMaxAhead) +
                                                    " forwards are queued ahead already");
    SPECD_CHECK(token >= 0 || kv.ahead_n > kv.ahead_fin,
                "start_argmax: a chained forward needs an unfinished one before it");
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    if (ahead_io_ == nullptr) {
      SPECD_GPU_CHECK(gpuHostAlloc((void**)&ahead_io_, sizeof(AheadIo) * kSlots, gpuHostAllocDefault));
      std::memset(ahead_io_, 0, sizeof(AheadIo) * kSlots);
      for (auto& pair : ahead_ev_)
        for (gpuEvent_t& e : pair) SPECD_GPU_CHECK(gpuEventCreate(&e));
    }
    // The buffers of every forward ahead get their row now, while none is in flight (growing
    // one destroys the graphs, which a queued forward may still be running).
    if (kv.ahead_n == 0)
      for (int k = 1; k < kSlots; ++k) kv.logits((kv.cur + k) % kSlots, 1, config().n_vocab);
    const int slot = (kv.cur + 1 + kv.ahead_n) % kSlots;
    SPECD_GPU_CHECK(gpuEventRecord(ahead_ev_[slot][0], stream_));
    run(kv, token >= 0 ? &token : nullptr, 1, pos0, Head::All, nullptr, /*argmax=*/true, slot);
    SPECD_GPU_CHECK(gpuMemcpyAsync(&ahead_io_[slot].top, tops_.get(), sizeof(int32_t), gpuMemcpyDeviceToHost, stream_));
    SPECD_GPU_CHECK(gpuEventRecord(ahead_ev_[slot][1], stream_));
    kv.ahead_n += 1;
  }
  int32_t finish_argmax(KvStore& kvs, double* seconds) const override {
    GpuKv& kv = cast(kvs);
    SPECD_CHECK(kv.ahead_fin < kv.ahead_n, "finish_argmax: no unfinished forward is queued ahead");
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    const int slot = (kv.cur + 1 + kv.ahead_fin) % kSlots;
    SPECD_GPU_CHECK(gpuEventSynchronize(ahead_ev_[slot][1]));
    float ms = 0.f;
    SPECD_GPU_CHECK(gpuEventElapsedTime(&ms, ahead_ev_[slot][0], ahead_ev_[slot][1]));
    *seconds = 1e-3 * (double)ms;
    kv.ahead_fin += 1;
    return ahead_io_[slot].top;
  }
  void keep_ahead(KvStore& kvs) const override {
    GpuKv& kv = cast(kvs);
    SPECD_CHECK(kv.ahead_fin >= 1, "keep_ahead: no finished forward is queued ahead");
    kv.cur = (kv.cur + 1) % kSlots;
    kv.ahead_n -= 1;
    kv.ahead_fin -= 1;
    kv.device_rows = 1;
    kv.last_rows = 1;
  }

  void read_logits(const KvStore& kvs, int64_t row, float* out) const override {
    const GpuKv& kv = cast(const_cast<KvStore&>(kvs));
    SPECD_CHECK(row >= 0 && row < kv.device_rows, "read_logits: row " + std::to_string(row) +
                                                      " is not kept on the device (the last forward kept " +
                                                      std::to_string(kv.device_rows) + " rows)");
    const int64_t nv = config().n_vocab;
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    SPECD_GPU_CHECK(gpuMemcpy(out, kv.logits_ptr() + row * nv, sizeof(float) * (size_t)nv, gpuMemcpyDeviceToHost));
  }

 private:
  static GpuKv& cast(KvStore& kv) {
    auto* g = dynamic_cast<GpuKv*>(&kv);
    SPECD_CHECK(g != nullptr, "the GPU model got a KV store of another device");
    return *g;
  }

  size_t scratch_bytes() const {
    return h_.size() + xn_.size() + qkv_.size() + att_.size() + act_.size() + work_.size() + lin_work_.size() +
           big_logits_.size() + inputs_.size() + tops_.size() + argmax_work_.size();
  }

  // The linear() workspace for n rows: the largest of the layers' products (x in fp16 and,
  // for quantized weights, the weights decoded to fp16 for a large prefill; for 2..64 rows,
  // x in digits for the tensor-core digit reader; the output head's K is the layers' dim).
  size_t linear_work_bytes(int64_t n) const {
    const ModelConfig& c = config();
    auto rows_of = [](std::initializer_list<const GpuWeight*> ws) {
      int64_t r = 0;
      bool f16 = true;
      for (const GpuWeight* w : ws) {
        r += w->n_out;
        f16 = f16 && w->type == GgmlType::F16;
      }
      return f16 ? 0 : r;
    };
    size_t b = 0;
    for (const GpuLayer& L : layers_) {
      b = std::max({b, gpu::linear_work_bytes(n, c.dim, rows_of({&L.wq, &L.wk, &L.wv})),
                    gpu::linear_work_bytes(n, L.wo.n_in, rows_of({&L.wo})),
                    gpu::linear_work_bytes(n, c.dim, rows_of({&L.w_gate, &L.w_up})),
                    gpu::linear_work_bytes(n, c.ffn_dim, rows_of({&L.w_down}))});
    }
    return b;
  }

  // Grows the activation scratch for n rows; growing invalidates every captured graph
  // (they hold the old addresses), which the epoch tells them.
  void reserve(int64_t n, int64_t n_ctx) const {
    const ModelConfig& c = config();
    const int64_t q_dim = (int64_t)c.n_heads * c.head_dim, qkv_ld = q_dim + 2 * kv_dim();
    auto grow = [&](DeviceBuffer& b, size_t bytes) {
      if (bytes > b.size()) {
        b.resize(bytes);
        ++epoch_;
      }
    };
    grow(h_, sizeof(float) * (size_t)(n * c.dim));
    grow(xn_, sizeof(float) * (size_t)(n * std::max<int64_t>(c.dim, q_dim)));
    grow(qkv_, sizeof(float) * (size_t)(n * qkv_ld));
    grow(att_, sizeof(float) * (size_t)(n * q_dim));
    grow(act_, sizeof(float) * (size_t)(n * c.ffn_dim));
    grow(inputs_, sizeof(int32_t) * (size_t)(kTok0 + n));  // position, then the tokens
    grow(tops_, sizeof(int32_t) * (size_t)n);
    if (gpu::argmax_workspace_bytes(n, c.n_vocab) > argmax_work_.size()) {
      grow(argmax_work_, gpu::argmax_workspace_bytes(n, c.n_vocab));
      SPECD_GPU_CHECK(gpuMemsetAsync(argmax_work_.get(), 0, argmax_work_.size(), stream_));  // counters at 0
    }
    if (gpu::attention_workspace_bytes(n, n_ctx, c.n_heads, c.head_dim) > work_.size()) {
      grow(work_, gpu::attention_workspace_bytes(n, n_ctx, c.n_heads, c.head_dim));
      SPECD_GPU_CHECK(gpuMemsetAsync(work_.get(), 0, work_.size(), stream_));  // the fold's counters at 0
    }
    grow(lin_work_, linear_work_bytes(n));
    staging_.reserve(n);
  }

  // Enqueues the forward of tokens at pos0.. on the stream (no synchronisation) and returns
  // the device logits: [n or 1, n_vocab] (kv-owned for small n, model scratch for large n).
  // slot >= 0: a forward ahead (small, every row's logits) into the KV store's logits buffer
  // `slot`, not the current one (keep_ahead makes it current), its inputs from that slot's
  // pinned memory; tokens == nullptr (one token, ahead only): the argmax the forward before it
  // left on the device (tops_[0]).
  const float* run(GpuKv& kv, const int32_t* tokens, int64_t n, int64_t pos0, Head head,
                   const HiddenCapture* capture, bool argmax = false, int slot = -1) const {
    const bool ahead = slot >= 0;
    const ModelConfig& c = config();
    SPECD_CHECK(n > 0, "forward needs at least one token");
    SPECD_CHECK(pos0 >= 0 && pos0 + n <= kv.n_ctx(),
                "forward of positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) +
                    " past the KV cache's " + std::to_string(kv.n_ctx()) + " positions");
    SPECD_CHECK(tokens != nullptr || (ahead && n == 1), "forward: tokens missing");
    for (int64_t i = 0; tokens != nullptr && i < n; ++i)
      SPECD_CHECK(tokens[i] >= 0 && tokens[i] < c.n_vocab, "token id " + std::to_string(tokens[i]) +
                                                               " is out of range [0, " + std::to_string(c.n_vocab) + ")");
    if (capture) {
      SPECD_CHECK(capture->n_layers > 0 && capture->layers && capture->out, "hidden capture needs layers and an output");
      for (int32_t j = 0; j < capture->n_layers; ++j)
        SPECD_CHECK(capture->layers[j] >= 0 && capture->layers[j] < c.n_layers,
                    "hidden capture of layer " + std::to_string(capture->layers[j]) + ": the model has layers 0.." +
                        std::to_string(c.n_layers - 1));
    }
    if (argmax) SPECD_CHECK(head == Head::All, "argmax needs every row's logits");
    if (ahead) SPECD_CHECK(head == Head::All && n == 1 && capture == nullptr,
                           "a forward ahead is one position, with its logits");
    SPECD_GPU_CHECK(gpuSetDevice(index_));
    reserve(n, kv.n_ctx());
    const bool small = n <= gpu::kMaxSmallBatch;
    const int64_t nv = c.n_vocab, head_rows = head == Head::All ? n : 1;
    float* logits = nullptr;
    if (!ahead) slot = kv.cur;  // the logits buffer this forward writes
    if (head != Head::None) {
      if (small) {
        logits = kv.logits(slot, head_rows, nv);
      } else {
        const size_t need = sizeof(float) * (size_t)(head_rows * nv);
        if (need > big_logits_.size()) big_logits_.resize(need);
        logits = big_logits_.get<float>();
      }
    }
    // inputs: position and tokens, in one copy from pinned memory (a forward ahead: its slot's,
    // which no other queued copy reads; chained: the position, then the token on the device)
    int32_t* in = ahead ? ahead_io_[slot].in : staging_.host;
    in[0] = (int32_t)pos0;
    if (tokens != nullptr) std::memcpy(in + kTok0, tokens, sizeof(int32_t) * (size_t)n);
    SPECD_GPU_CHECK(gpuMemcpyAsync(inputs_.get(), in, sizeof(int32_t) * (size_t)(tokens ? kTok0 + n : 1),
                                   gpuMemcpyHostToDevice, stream_));
    if (tokens == nullptr)
      SPECD_GPU_CHECK(gpuMemcpyAsync(inputs_.get<int32_t>() + kTok0, tops_.get(), sizeof(int32_t),
                                     gpuMemcpyDeviceToDevice, stream_));
    if (!ahead) kv.device_rows = 0;
    // a decode step from gpu::kAttnApartFrom on (past the first attention chunk) combines the
    // chunks in its own launch (AttnArgs::combine_apart): another graph
    const bool apart = n == 1 && pos0 >= std::max(gpu::kAttnChunk, gpu::kAttnApartFrom);
    if (small && capture == nullptr) {
      const int64_t key = ((n * 4 + (int64_t)head) * 2 + apart) * kSlots + slot;
      KvGraph& g = kv.graphs()[key];
      if (g.exec == nullptr || g.epoch != epoch_) {
        if (g.exec) (void)gpuGraphExecDestroy(g.exec);
        g.exec = nullptr;
        gpuGraph_t graph;
        SPECD_GPU_CHECK(gpuStreamBeginCapture(stream_, gpuStreamCaptureModeThreadLocal));
        try {
          enqueue(kv, n, head, logits, nullptr, head == Head::All, apart);
        } catch (...) {
          (void)gpuStreamEndCapture(stream_, &graph);
          (void)gpuGetLastError();
          throw;
        }
        SPECD_GPU_CHECK(gpuStreamEndCapture(stream_, &graph));
        const gpuError_t e = gpuGraphInstantiate(&g.exec, graph);
        (void)gpuGraphDestroy(graph);
        SPECD_GPU_CHECK(e);
        g.epoch = epoch_;
      }
      SPECD_GPU_CHECK(gpuGraphLaunch(g.exec, stream_));
    } else {
      enqueue(kv, n, head, logits, capture, head == Head::All, apart);
    }
    if (small && head != Head::None && !ahead) kv.device_rows = head_rows;
    return logits;
  }

  // The forward's launches (captured into a graph for small n).
  void enqueue(GpuKv& kv, int64_t n, Head head, float* logits, const HiddenCapture* capture, bool argmax,
               bool apart) const {
    const ModelConfig& c = config();
    const int64_t dim = c.dim, hd = c.head_dim, q_dim = (int64_t)c.n_heads * hd, kvd = kv_dim();
    const int64_t qkv_ld = q_dim + 2 * kvd;
    const float eps = c.norm_eps;
    gpuStream_t s = stream_;
    float *h = h_.get<float>(), *xn = xn_.get<float>(), *qkv = qkv_.get<float>(), *att = att_.get<float>();
    float* act = act_.get<float>();
    const int32_t* d_pos = inputs_.get<int32_t>();  // [0]: pos0; tokens from kTok0

    // The arguments every product of this forward shares: this model's reader choice, the
    // epilogue and the output.
    auto linear_args = [&](gpu::Epilogue ep, float* y, int64_t ldy, int64_t rows) {
      gpu::LinearArgs a;
      a.tensor_cores = tensor_cores_;
      a.ep = ep;
      a.y = y;
      a.ldy = ldy;
      a.n = rows;
      a.work = lin_work_.get();
      a.work_bytes = lin_work_.size();
      return a;
    };
    // h += x W^T: the residual add fused into the product
    auto add_to_h = [&](const GpuWeight& w, const float* x) {
      gpu::LinearArgs a = linear_args(gpu::Epilogue::Accumulate, h, dim, n);
      a.w[0] = &w;
      a.x = x;
      gpu::linear(a, s);
    };
    // RMSNorm(x) * w as the input of `a`: fused into the matrix kernel for small forwards
    // (batch-invariant path), a separate launch into xn for the tensor-core path.
    auto normed_input = [&](gpu::LinearArgs& a, const float* x, const float* w, int64_t rows) {
      if (rows <= gpu::kMaxSmallBatch) {
        a.x = x;
        a.norm_w = w;
        a.eps = eps;
      } else {
        gpu::rmsnorm(x, w, xn, rows, dim, eps, s);
        a.x = xn;
      }
    };

    gpu::embed_rows(tok_embd_, d_pos + kTok0, n, h, s);
    for (int32_t l = 0; l < c.n_layers; ++l) {
      const GpuLayer& L = layers_[(size_t)l];
      // ---- attention block
      gpu::LinearArgs a = linear_args(gpu::Epilogue::Store, qkv, qkv_ld, n);
      a.w[0] = &L.wq;
      a.w[1] = &L.wk;
      a.w[2] = &L.wv;
      a.n_w = 3;
      a.bias[0] = L.bq;
      a.bias[1] = L.bk;
      a.bias[2] = L.bv;
      normed_input(a, h, L.attn_norm, n);
      gpu::linear(a, s);

      gpu::RopeKvArgs r;
      r.qkv = qkv;
      r.ld_qkv = qkv_ld;
      r.n = n;
      r.d_pos0 = d_pos;
      r.n_heads = c.n_heads;
      r.n_kv_heads = c.n_kv_heads;
      r.head_dim = c.head_dim;
      r.q_norm = L.q_norm;
      r.k_norm = L.k_norm;
      r.eps = eps;
      r.rope = rope_;
      r.k_cache = kv.k(l);
      r.v_cache = kv.v(l);
      r.kv_f16 = kv.f16();
      r.n_ctx = kv.n_ctx();
      gpu::AttnArgs at = gpu::attention_args(r);  // rope_kv(r) then attention: one kernel in decode
      at.scale = 1.0f / std::sqrt((float)hd);
      at.out = att;
      at.work = work_.get();
      at.combine_apart = apart;
      gpu::attention(at, s);

      add_to_h(L.wo, att);

      // ---- FFN block
      gpu::LinearArgs f = linear_args(gpu::Epilogue::SwiGLU, act, c.ffn_dim, n);
      f.w[0] = &L.w_gate;
      f.w[1] = &L.w_up;
      f.n_w = 2;
      normed_input(f, h, L.ffn_norm, n);
      gpu::linear(f, s);

      add_to_h(L.w_down, act);

      if (capture) {  // h after block l -> out[i, j] for every j with layers[j] == l
        const int32_t nc = capture->n_layers;
        for (int32_t j = 0; j < nc; ++j) {
          if (capture->layers[j] != l) continue;
          SPECD_GPU_CHECK(cudaMemcpy2DAsync_compat(capture->out + j * dim, nc * dim, h, dim, dim, n, s,
                                                   /*to_host=*/true));
        }
      }
    }
    if (head == Head::None) return;
    const int64_t rows = head == Head::All ? n : 1;
    const float* hx = head == Head::All ? h : h + (n - 1) * dim;
    gpu::LinearArgs out = linear_args(gpu::Epilogue::Store, logits, c.n_vocab, rows);
    out.w[0] = &output_;
    normed_input(out, hx, output_norm_, rows);
    gpu::linear(out, s);
    if (argmax) gpu::argmax_rows(logits, rows, c.n_vocab, tops_.get<int32_t>(), argmax_work_.get(), s);
  }

  // Strided row copy (rows of `width` floats) on the stream, device->device or to the host.
  static gpuError_t cudaMemcpy2DAsync_compat(float* dst, int64_t dst_ld, const float* src, int64_t src_ld,
                                             int64_t width, int64_t rows, gpuStream_t s, bool to_host = false) {
#if SPECD_HIP
    return hipMemcpy2DAsync(dst, sizeof(float) * (size_t)dst_ld, src, sizeof(float) * (size_t)src_ld,
                            sizeof(float) * (size_t)width, (size_t)rows,
                            to_host ? hipMemcpyDeviceToHost : hipMemcpyDeviceToDevice, s);
#else
    return cudaMemcpy2DAsync(dst, sizeof(float) * (size_t)dst_ld, src, sizeof(float) * (size_t)src_ld,
                             sizeof(float) * (size_t)width, (size_t)rows,
                             to_host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice, s);
#endif
  }

  Model host_;  // resolved and checked host views (the memmapped file)
  int index_;
  bool tensor_cores_;  // small forwards read the weights on tensor cores where they can
  gpu::DeviceInfo info_;
  gpuStream_t stream_ = nullptr;
  DeviceBuffer arena_;  // every weight and vector
  size_t weights_bytes_ = 0;
  GpuWeight tok_embd_, output_;
  const float* output_norm_ = nullptr;
  RopeParams rope_;
  std::vector<GpuLayer> layers_;
  // scratch (grown on demand; forward() is not re-entrant: the engine serialises calls)
  mutable DeviceBuffer h_, xn_, qkv_, att_, act_, work_, lin_work_, big_logits_, inputs_, tops_, argmax_work_;
  mutable Staging staging_;
  mutable uint64_t epoch_ = 1;
  std::shared_ptr<KvPool> pool_ = std::make_shared<KvPool>();  // freed sequences' caches
  // forwards queued ahead, per logits slot: events around each, pinned inputs and argmax
  struct AheadIo {
    int32_t in[kTok0 + 1];  // pos0, (unused), the token at kTok0
    int32_t top;
  };
  mutable gpuEvent_t ahead_ev_[kSlots][2] = {};
  mutable AheadIo* ahead_io_ = nullptr;
};

}  // namespace

std::unique_ptr<ForwardModel> make_gpu_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors,
                                             int device_index, bool tensor_cores) {
  return std::make_unique<GpuModel>(cfg, tensors, device_index, tensor_cores);
}

}  // namespace specd
