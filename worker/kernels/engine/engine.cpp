// specd/engine/engine.cpp: sequences (KV cache + sampler state + counters) and the
// decode protocol of engine.h: prefill keeps the last logits; step() forwards the
// pending token if any, samples the next one from the current logits and leaves it
// pending. Every public call holds mu_ for its whole duration.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "common/parallel.h"

namespace specd {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

struct Engine::Sequence {
  Sequence(const ModelConfig& c, int64_t n_ctx, bool kv_f16)
      : kv(c.n_layers, n_ctx, (int64_t)c.n_kv_heads * c.head_dim, kv_f16),
        logits((size_t)c.n_vocab),
        work((size_t)c.n_vocab),
        probs((size_t)c.n_vocab) {}

  KvCache kv;
  int64_t n_past = 0;                // positions in the KV cache
  // What the KV holds, position by position, and where each token came from; the
  // penalties read prompt (prefilled) and generated (stepped) tokens separately.
  std::vector<int32_t> history;      // [n_past]
  std::vector<uint8_t> from_step;    // [n_past] 1 = returned by step(), 0 = prefilled
  std::vector<int32_t> prompt;       // prefilled tokens still in the KV
  std::vector<int32_t> generated;    // stepped tokens still in the KV, then the pending one
  int32_t pending = -1;              // sampled by step(), not yet forwarded; -1 = none
  bool has_logits = false;           // logits belong to position n_past - 1
  std::vector<float> logits;         // [n_vocab]
  std::vector<float> work, probs;    // [n_vocab] penalised logits, sampling distribution
  SamplingParams params;
  Rng rng{0};
  SeqStats stats;                    // counters are cumulative over the sequence's life

  // Notes that the next history slot holds `token` (n_past is advanced by the forward).
  void record(int32_t token, bool stepped) {
    history.push_back(token);
    from_step.push_back(stepped ? 1 : 0);
    if (!stepped) prompt.push_back(token);  // stepped tokens are in `generated` already
  }

  // Keeps the first n positions; drops any pending token. The logits stay valid only if
  // the last kept position is still the last forwarded one.
  void keep(int64_t n) {
    has_logits = has_logits && n == n_past;
    pending = -1;
    n_past = n;
    history.resize((size_t)n);
    from_step.resize((size_t)n);
    prompt.clear();
    generated.clear();
    for (size_t i = 0; i < (size_t)n; ++i) (from_step[i] ? generated : prompt).push_back(history[i]);
  }
};

Engine::Engine(const ModelConfig& cfg, const std::vector<TensorRef>& tensors, const EngineOptions& opt)
    : model_(cfg, tensors), opt_(opt) {
  const ModelConfig& c = model_.config();
  SPECD_CHECK(opt.n_ctx >= 0, "n_ctx must be >= 0 (0 = min(n_ctx_train, 4096)), got " + std::to_string(opt.n_ctx));
  SPECD_CHECK(opt.max_batch > 0, "max_batch must be positive, got " + std::to_string(opt.max_batch));
  SPECD_CHECK(opt.n_threads >= 0, "n_threads must be >= 0 (0 = all cores), got " + std::to_string(opt.n_threads));
  n_ctx_ = opt.n_ctx > 0 ? opt.n_ctx : std::min<int64_t>(c.n_ctx_train, 4096);
  SPECD_CHECK(n_ctx_ <= INT32_MAX, "n_ctx must fit positions in int32, got " + std::to_string(n_ctx_));
  set_num_threads(opt.n_threads);
}

Engine::~Engine() = default;

Engine::Sequence& Engine::get(int32_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error("unknown sequence id " + std::to_string(seq) + " (already freed?)");
  return *it->second;
}

const Engine::Sequence& Engine::get(int32_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error("unknown sequence id " + std::to_string(seq) + " (already freed?)");
  return *it->second;
}

int32_t Engine::new_sequence() {
  std::lock_guard<std::mutex> lock(mu_);
  const int32_t id = next_id_++;
  seqs_.emplace(id, std::make_unique<Sequence>(model_.config(), n_ctx_, opt_.kv_f16));
  return id;
}

void Engine::free_sequence(int32_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (seqs_.erase(seq) == 0) throw Error("unknown sequence id " + std::to_string(seq) + " (already freed?)");
}

// Runs tokens through the model in chunks of at most max_batch positions, starting at
// s.n_past, and advances n_past (the caller records where the tokens came from).
// logits_out: [n, n_vocab] when all_logits, else the last position's [n_vocab]; may be
// null. s.logits always gets the last row.
void Engine::forward_chunked(Sequence& s, const int32_t* tokens, int64_t n, float* logits_out,
                             bool all_logits) {
  const int64_t nv = model_.config().n_vocab;
  const bool rows = all_logits && logits_out != nullptr;
  s.has_logits = false;  // the KV is about to move past the logits' position
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min(opt_.max_batch, n - done);
    const bool last = done + m == n;
    // Only chunks whose logits someone reads run the output head.
    float* dst = rows ? logits_out + done * nv : last ? s.logits.data() : nullptr;
    model_.forward(s.kv, tokens + done, m, s.n_past, dst, rows);
    s.n_past += m;
    done += m;
  }
  if (rows) std::memcpy(s.logits.data(), logits_out + (n - 1) * nv, sizeof(float) * (size_t)nv);
  else if (logits_out) std::memcpy(logits_out, s.logits.data(), sizeof(float) * (size_t)nv);
  s.has_logits = true;
}

namespace {

[[noreturn]] void context_exceeded(int64_t would_hold, int64_t n_ctx) {
  throw Error("context length exceeded: the sequence would hold " + std::to_string(would_hold) +
              " tokens but the engine's context is " + std::to_string(n_ctx) +
              " tokens; shorten the prompt or max_tokens, or raise n_ctx");
}

}  // namespace

void Engine::prefill(int32_t seq, const int32_t* tokens, int64_t n, float* logits_out, bool all_logits) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& s = get(seq);
  const int32_t nv = model_.config().n_vocab;
  SPECD_CHECK(n > 0, "prefill needs at least one token");
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= nv)
      throw Error("token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                  " is out of range: the model's vocabulary has " + std::to_string(nv) + " tokens (ids 0.." +
                  std::to_string(nv - 1) + ")");
  const int64_t extra = s.pending >= 0 ? 1 : 0;
  if (s.n_past + extra + n > n_ctx_) context_exceeded(s.n_past + extra + n, n_ctx_);

  const auto t0 = Clock::now();
  const int32_t p = s.pending;
  const int64_t n_past0 = s.n_past;
  try {
    if (p >= 0 && !all_logits) {
      // The pending (generated) token goes in first, folded into the prompt's chunks so
      // the weights are read once.
      std::vector<int32_t> both;
      both.reserve((size_t)n + 1);
      both.push_back(p);
      both.insert(both.end(), tokens, tokens + n);
      forward_chunked(s, both.data(), n + 1, logits_out, false);
    } else {
      if (p >= 0) {
        // all_logits returns rows for `tokens` only: run the pending token on its own,
        // without the output head.
        s.has_logits = false;
        model_.forward(s.kv, &p, 1, s.n_past, nullptr, false);
        s.n_past += 1;
      }
      forward_chunked(s, tokens, n, logits_out, all_logits);
    }
  } catch (...) {
    s.has_logits = false;
    s.keep(n_past0);  // forget the pending token too: its state is unknown now
    throw;
  }
  s.pending = -1;
  if (p >= 0) s.record(p, true);
  for (int64_t i = 0; i < n; ++i) s.record(tokens[i], false);
  s.stats.n_prompt += n;
  s.stats.prefill_seconds += seconds_since(t0);
}

void Engine::set_sampling(int32_t seq, const SamplingParams& p) {
  p.validate();
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& s = get(seq);
  s.params = p;
  s.rng = Rng(p.seed);
}

std::vector<int32_t> Engine::step(int32_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& s = get(seq);
  if (!s.has_logits)
    throw Error("step() needs logits to sample from: call prefill() first (a new or truncated sequence has none)");
  const int64_t nv = model_.config().n_vocab;
  const auto t0 = Clock::now();
  if (s.pending >= 0) {
    if (s.n_past + 1 > n_ctx_) context_exceeded(s.n_past + 1, n_ctx_);
    const int32_t p = s.pending;
    try {
      model_.forward(s.kv, &p, 1, s.n_past, s.logits.data(), false);
    } catch (...) {
      s.has_logits = false;  // partly overwritten
      s.keep(s.n_past);
      throw;
    }
    s.pending = -1;
    s.n_past += 1;
    s.record(p, true);
  }
  // penalties -> (greedy: argmax | temperature, top-k, top-p, min-p -> draw)
  std::memcpy(s.work.data(), s.logits.data(), sizeof(float) * (size_t)nv);
  apply_penalties(s.work.data(), nv, s.params, s.prompt.data(), (int64_t)s.prompt.size(), s.generated.data(),
                  (int64_t)s.generated.size());
  int32_t tok;
  if (s.params.greedy()) {
    tok = argmax(s.work.data(), nv);
  } else {
    sampling_probs(s.work.data(), nv, s.params, s.probs.data());
    tok = sample_from(s.probs.data(), nv, s.rng.uniform());
  }
  s.pending = tok;
  s.generated.push_back(tok);
  s.stats.n_generated += 1;
  s.stats.n_steps += 1;
  s.stats.decode_seconds += seconds_since(t0);
  return {tok};
}

void Engine::truncate(int32_t seq, int64_t n_past) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& s = get(seq);
  if (n_past < 0 || n_past > s.n_past)
    throw Error("truncate(" + std::to_string(n_past) + "): the sequence holds " + std::to_string(s.n_past) +
                " positions; keep between 0 and that many");
  s.keep(n_past);
}

SeqStats Engine::stats(int32_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& s = get(seq);
  SeqStats out = s.stats;
  out.n_past = s.n_past;
  return out;
}

}  // namespace specd
