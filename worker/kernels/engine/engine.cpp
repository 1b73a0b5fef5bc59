// specd/engine/engine.cpp: sequences (KV cache + sampler state + drafter + counters) and
// the decode protocol of engine.h: prefill keeps the last logits; step() forwards the
// pending token if any, samples the next one from the current logits and leaves it
// pending, or (speculation on) drafts, verifies in one forward and accepts a prefix.
// Every public call holds mu_ for its whole duration.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "common/parallel.h"
#include "engine/accept.h"

namespace specd {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

struct Engine::Sequence {
  Sequence(const ForwardModel& m, int64_t n_ctx, bool kv_f16)
      : kv(m.new_kv(n_ctx, kv_f16)),
        logits((size_t)m.config().n_vocab),
        work((size_t)m.config().n_vocab),
        probs((size_t)m.config().n_vocab) {
    stats.drafted_at.assign(kMaxDraft, 0);
    stats.accepted_at.assign(kMaxDraft, 0);
  }

  std::unique_ptr<KvStore> kv;      // on the model's device
  int64_t n_past = 0;                // positions in the KV cache
  // What the KV holds, position by position, and where each token came from; the
  // penalties read prompt (prefilled) and generated (stepped) tokens separately.
  std::vector<int32_t> history;      // [n_past]
  std::vector<uint8_t> from_step;    // [n_past] 1 = returned by step(), 0 = prefilled
  std::vector<int32_t> prompt;       // prefilled tokens still in the KV
  std::vector<int32_t> generated;    // stepped tokens still in the KV, then the pending one
  int32_t pending = -1;              // sampled by step(), not yet forwarded; -1 = none
  bool has_logits = false;           // logits belong to position n_past - 1
  // Greedy decoding on a device keeps the logits there (ForwardModel::forward_argmax):
  // then `logits` is stale, `top` is their argmax and `logits_row` their row in the KV
  // store's last forward (read_logits fetches them if the sampling changes).
  bool logits_on_host = true;
  int32_t top = -1;
  int64_t logits_row = 0;
  std::vector<int32_t> tops;         // [n + 1] argmax rows of a verify forward
  std::vector<float> logits;         // [n_vocab]
  std::vector<float> work, probs;    // [n_vocab] penalised logits, sampling distribution
  SamplingParams params;
  Rng rng{0};
  SeqStats stats;                    // counters are cumulative over the sequence's life

  // Speculation (null drafter = off). The drafter draws from its own stream, so turning
  // speculation on never shifts the target's uniforms of an unrelated draw.
  std::unique_ptr<Drafter> drafter;
  SpecParams spec;
  // The drafter of the last switch to "none", kept for a switch back to the same settings
  // (Engine::set_speculation): a draft model then catches up only what was decoded plainly.
  std::unique_ptr<Drafter> paused;
  SpecParams paused_spec;
  Rng draft_rng{kDraftStream};
  std::vector<int32_t> drafts;       // [<= k] proposals of the current step
  std::vector<float> q;              // [n, n_vocab] their distributions, or empty (one-hot)
  std::vector<int32_t> verify;       // [n + 1] pending token + drafts
  std::vector<float> vlogits;        // [n + 1, n_vocab] the verify forward's logits
  std::vector<int32_t> gen_ext;      // generated + accepted drafts (penalties at position i)
  std::vector<float> residual;       // [n_vocab] accept-rule scratch
  // Target hidden states for drafters that read them (Drafter::hidden_layers()).
  std::vector<int32_t> hidden_layers;  // [L] target layer ids; empty = capture nothing
  std::vector<float> hidden;           // [n, L, dim] captured by the last target forward

  // Run-ahead (Engine::start_ahead): kv->ahead_n forwards queued when step() returned the
  // pending token, at positions n_past, n_past + 1, ..., the first taking the pending token,
  // each later one the argmax of the one before; the first kv->ahead_fin have been waited
  // for (settled), their argmax in ahead_top. Used (oldest first) by the next step()s;
  // dropped on a change.
  int32_t ahead_top[KvStore::kMaxAhead] = {-1, -1};
  double ahead_seconds[KvStore::kMaxAhead] = {0, 0};  // device time (in decode_seconds when used)

  static constexpr uint64_t kDraftStream = 0xd1b54a32d192ed03ull;  // xored into the seed

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
    : model_(make_model(cfg, tensors, opt.device, opt.tensor_cores)), opt_(opt) {
  const ModelConfig& c = model_->config();
  SPECD_CHECK(opt.n_ctx >= 0, "n_ctx must be >= 0 (0 = min(n_ctx_train, 4096)), got " + std::to_string(opt.n_ctx));
  SPECD_CHECK(opt.max_batch > 0, "max_batch must be positive, got " + std::to_string(opt.max_batch));
  SPECD_CHECK(opt.n_threads >= 0, "n_threads must be >= 0 (0 = all cores), got " + std::to_string(opt.n_threads));
  n_ctx_ = opt.n_ctx > 0 ? opt.n_ctx : std::min<int64_t>(c.n_ctx_train, 4096);
  SPECD_CHECK(n_ctx_ <= INT32_MAX, "n_ctx must fit positions in int32, got " + std::to_string(n_ctx_));
  SPECD_CHECK(opt.run_ahead >= -1 && opt.run_ahead <= KvStore::kMaxAhead,
              "run_ahead must be -1 (auto) or 0.." + std::to_string(KvStore::kMaxAhead) + ", got " +
                  std::to_string(opt.run_ahead));
  run_ahead_ = opt.run_ahead >= 0 ? opt.run_ahead : model_->queues_forwards() ? KvStore::kMaxAhead : 0;
  set_num_threads(opt.n_threads);
}

Engine::~Engine() {
  std::lock_guard<std::mutex> lock(mu_);
  settle();  // the forward ahead still uses a KV store about to be freed
}

// Queues the forward of s's pending token (a plain greedy decode step on the device) so that
// it runs while the caller handles the token step() is returning, and up to run_ahead_
// forwards in all, each of the argmax of the one before (chained on the device while that
// one is unfinished), so the device never waits for the host between steps.
void Engine::start_ahead(Sequence& s) {
  if (run_ahead_ == 0 || s.pending < 0 || s.drafter || !device_greedy(s)) return;
  KvStore& kv = *s.kv;
  while (kv.ahead_n < run_ahead_ && s.n_past + kv.ahead_n + 1 <= n_ctx_) {
    const int i = kv.ahead_n;
    const int32_t token = i == 0 ? s.pending : kv.ahead_fin < i ? -1 : s.ahead_top[i - 1];
    try {
      model_->start_argmax(kv, token, s.n_past + i);  // (counts it in kv.ahead_n)
    } catch (...) {
      return;  // nothing more queued: the next step()s run their forwards themselves (and report errors)
    }
    inflight_ = &s;
  }
}

void Engine::set_run_ahead(int32_t depth) {
  SPECD_CHECK(depth >= 0 && depth <= KvStore::kMaxAhead,
              "run_ahead must be 0.." + std::to_string(KvStore::kMaxAhead) + ", got " + std::to_string(depth));
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  run_ahead_ = depth;  // forwards already queued and settled are still used by their sequence
}

// Waits for the in-flight sequence's queued forwards (all of them, or with `oldest` only the
// first not yet waited for) and keeps their argmax in the sequence.
void Engine::settle(bool oldest) {
  Sequence* s = inflight_;
  if (s == nullptr) return;
  KvStore& kv = *s->kv;
  try {
    while (kv.ahead_fin < kv.ahead_n) {
      const int i = kv.ahead_fin;
      s->ahead_top[i] = model_->finish_argmax(kv, &s->ahead_seconds[i]);  // (counts it in kv.ahead_fin)
      if (oldest) break;
    }
  } catch (...) {
    kv.ahead_n = kv.ahead_fin;  // the rest is lost: its next step()s forward again
  }
  if (kv.ahead_fin == kv.ahead_n) inflight_ = nullptr;
}

// Forgets s's forwards ahead (settled): the K/V rows they wrote from n_past on are past the
// sequence's length (overwritten by whatever goes there next) and their logits were never
// made current.
void Engine::drop_ahead(Sequence& s) {
  if (s.kv->ahead_n > 0) model_->drop_ahead(*s.kv);
}

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
  seqs_.emplace(id, std::make_unique<Sequence>(*model_, n_ctx_, opt_.kv_f16));
  return id;
}

void Engine::free_sequence(int32_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  if (seqs_.erase(seq) == 0) throw Error("unknown sequence id " + std::to_string(seq) + " (already freed?)");
}

// Runs tokens through the model in chunks of at most max_batch positions, starting at
// s.n_past, and advances n_past (the caller records where the tokens came from).
// logits_out: [n, n_vocab] when all_logits, else the last position's [n_vocab]; may be
// null. s.logits always gets the last row.
// Runs tokens through the model in chunks of at most max_batch positions, starting at
// s.n_past, advances n_past and commits each chunk to the drafter (the caller has already
// recorded the tokens in s.history). logits_out: [n, n_vocab] when all_logits, else the
// last position's [n_vocab]; may be null. s.logits always gets the last row.
void Engine::forward_chunked(Sequence& s, const int32_t* tokens, int64_t n, float* logits_out,
                             bool all_logits) {
  const int64_t nv = model_->config().n_vocab;
  const bool rows = all_logits && logits_out != nullptr;
  s.has_logits = false;  // the KV is about to move past the logits' position
  s.logits_on_host = true;
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min(opt_.max_batch, n - done);
    const bool last = done + m == n;
    // Only chunks whose logits someone reads run the output head.
    float* dst = rows ? logits_out + done * nv : last ? s.logits.data() : nullptr;
    target_forward(s, tokens + done, m, dst, rows);
    s.n_past += m;
    commit(s, m);
    done += m;
  }
  if (rows) std::memcpy(s.logits.data(), logits_out + (n - 1) * nv, sizeof(float) * (size_t)nv);
  else if (logits_out) std::memcpy(logits_out, s.logits.data(), sizeof(float) * (size_t)nv);
  s.has_logits = true;
}

// One target forward of tokens at positions s.n_past.. (n_past is not advanced). When the
// sequence's drafter reads hidden states, they are captured into s.hidden [n, L, dim].
void Engine::target_forward(Sequence& s, const int32_t* tokens, int64_t n, float* logits, bool all_logits) {
  if (s.hidden_layers.empty()) {
    model_->forward(*s.kv, tokens, n, s.n_past, logits, all_logits);
    return;
  }
  const size_t row = s.hidden_layers.size() * (size_t)model_->config().dim;
  if (s.hidden.size() < (size_t)n * row) s.hidden.resize((size_t)n * row);
  HiddenCapture cap;
  cap.layers = s.hidden_layers.data();
  cap.n_layers = (int32_t)s.hidden_layers.size();
  cap.out = s.hidden.data();
  model_->forward(*s.kv, tokens, n, s.n_past, logits, all_logits, &cap);
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
  settle();
  Sequence& s = get(seq);
  drop_ahead(s);  // (the pending token is forwarded again, with the prompt's chunk)
  const int32_t nv = model_->config().n_vocab;
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
  // Record first: the drafter is told about each chunk as it lands (commit reads history).
  s.pending = -1;
  if (p >= 0) s.record(p, true);
  for (int64_t i = 0; i < n; ++i) s.record(tokens[i], false);
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
        target_forward(s, &p, 1, nullptr, false);
        s.n_past += 1;
        commit(s, 1);
      }
      forward_chunked(s, tokens, n, logits_out, all_logits);
    }
  } catch (...) {
    s.has_logits = false;
    s.keep(n_past0);  // forget the pending token too: its state is unknown now
    if (s.drafter) s.drafter->rollback(n_past0);
    throw;
  }
  s.stats.n_prompt += n;
  s.stats.prefill_seconds += seconds_since(t0);
}

void Engine::set_sampling(int32_t seq, const SamplingParams& p) {
  p.validate();
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  Sequence& s = get(seq);
  drop_ahead(s);
  s.params = p;
  s.rng = Rng(p.seed);
  s.draft_rng = Rng(p.seed ^ Sequence::kDraftStream);
}

void SpecParams::validate() const {
  if (k < 1 || k > kMaxDraft)
    throw Error("speculation k must be in 1.." + std::to_string(kMaxDraft) + " draft tokens per step, got " +
                std::to_string(k));
  if (ngram_min < 1 || ngram_max < ngram_min)
    throw Error("ngram sizes must satisfy 1 <= ngram_min <= ngram_max, got ngram_min=" + std::to_string(ngram_min) +
                " ngram_max=" + std::to_string(ngram_max));
}

void Engine::set_draft_model(const ModelConfig& cfg, const std::vector<TensorRef>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECD_CHECK(draft_model_ == nullptr, "the engine already has a draft model");
  if (cfg.n_vocab != model_->config().n_vocab)
    throw Error("draft model vocabulary differs from the target's: " + std::to_string(cfg.n_vocab) + " tokens vs " +
                std::to_string(model_->config().n_vocab) + "; use a draft of the same model family and tokenizer");
  // The draft model never verifies: nothing has to match its rows across batch sizes (the
  // target decides every token), so it keeps the faster one-row readers of the CUDA cores
  // (tensor_cores makes an F16 decode step ~1.9x slower, 2026-12-01).
  draft_model_ = make_model(cfg, tensors, opt_.device, /*tensor_cores=*/false);
}

void Engine::register_drafter(const std::string& name, DrafterFactory factory) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECD_CHECK(name != "none" && name != "draft" && name != "ngram" && !name.empty(),
              "drafter name '" + name + "' is reserved or empty");
  SPECD_CHECK(factory != nullptr, "register_drafter: no factory");
  factories_[name] = std::move(factory);
}

void Engine::set_speculation(int32_t seq, const SpecParams& p) {
  p.validate();
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  Sequence& s = get(seq);
  drop_ahead(s);
  const DrafterEnv env{model_.get(), n_ctx_, opt_.kv_f16};
  std::unique_ptr<Drafter> d;
  // Speculation turned off and on again within a generation (SpeculationGovernor in
  // worker/generate.py) keeps its drafter: a draft model's KV cache then still holds the
  // context, and its catch-up (draft_model.cpp: the common prefix kept) forwards only the
  // tokens decoded plainly in between, not the whole context again. The n-gram drafter has
  // no state. A drafter that reads the hidden states of every committed position (DFlash)
  // is not kept: it was not told of the positions decoded plainly, and proposes nothing
  // after such a gap either way.
  const bool resume = s.paused && p.mode == s.paused_spec.mode && p.ngram_min == s.paused_spec.ngram_min &&
                      p.ngram_max == s.paused_spec.ngram_max;
  if (!resume) s.paused.reset();  // (other settings: the kept drafter is not wanted)
  if (p.mode == "none") {
    if (pausable(s)) {
      s.paused = std::move(s.drafter);
      s.paused_spec = s.spec;
    }
  } else if (resume) {
    d = std::move(s.paused);
  } else if (p.mode == "draft") {
    if (!draft_model_)
      throw Error("speculation mode 'draft' needs a draft model, and this engine was built without one; "
                  "load one (Engine(model, draft_model=...)) or use mode 'ngram'");
    d = make_draft_model_drafter(*draft_model_, env);
  } else if (p.mode == "ngram") {
    d = make_ngram_drafter(p.ngram_min, p.ngram_max);
  } else {
    auto it = factories_.find(p.mode);
    if (it == factories_.end()) {
      std::string modes = "none, draft, ngram";
      for (const auto& f : factories_) modes += ", " + f.first;
      throw Error("unknown speculation mode '" + p.mode + "'; available: " + modes);
    }
    d = it->second(env);
    SPECD_CHECK(d != nullptr, "drafter factory '" + p.mode + "' returned nothing");
  }
  std::vector<int32_t> layers;
  if (d) layers = d->hidden_layers();
  for (int32_t l : layers)
    SPECD_CHECK(l >= 0 && l < model_->config().n_layers,
                "drafter '" + p.mode + "' reads target layer " + std::to_string(l) + ", but the target has layers 0.." +
                    std::to_string(model_->config().n_layers - 1));
  s.drafter = std::move(d);
  s.spec = p;
  s.hidden_layers = std::move(layers);
}

// Tells the drafter (if any) that the last n_new positions of the target KV are committed;
// their hidden states (if captured) are rows row0 .. row0 + n_new - 1 of s.hidden.
void Engine::commit(Sequence& s, int64_t n_new, int64_t row0) {
  if (!s.drafter) return;
  CommitInfo info;
  info.tokens = s.history.data();
  info.n_past = s.n_past;
  info.n_new = n_new;
  HiddenStates hs;
  if (!s.hidden_layers.empty()) {
    hs.n_layers = (int32_t)s.hidden_layers.size();
    hs.dim = model_->config().dim;
    hs.data = s.hidden.data() + row0 * hs.n_layers * (int64_t)hs.dim;
    hs.pos0 = s.n_past - n_new;
    hs.n_pos = n_new;
    info.hidden = &hs;
  }
  s.drafter->commit(info);
}

// Forwards the pending token alone (plain decode step), leaving its logits in s.logits.
void Engine::forward_pending(Sequence& s) {
  if (s.n_past + 1 > n_ctx_) context_exceeded(s.n_past + 1, n_ctx_);
  const int32_t p = s.pending;
  try {
    KvStore& kv = *s.kv;
    if (kv.ahead_n > 0) {  // queued when an earlier step() returned p (nothing changed since)
      if (kv.ahead_fin == 0) settle(true);  // (step() normally waited for it already)
      s.stats.decode_seconds += s.ahead_seconds[0];  // (the step's own time is added by step())
      s.top = s.ahead_top[0];
      for (int i = 0; i + 1 < kv.ahead_n; ++i) {
        s.ahead_top[i] = s.ahead_top[i + 1];
        s.ahead_seconds[i] = s.ahead_seconds[i + 1];
      }
      model_->keep_ahead(kv);  // (takes it out of kv's counts)
      s.logits_on_host = false;
      s.logits_row = 0;
    } else if (device_greedy(s)) {
      model_->forward_argmax(*s.kv, &p, 1, s.n_past, &s.top);
      s.logits_on_host = false;
      s.logits_row = 0;
    } else {
      target_forward(s, &p, 1, s.logits.data(), false);
      s.logits_on_host = true;
    }
  } catch (...) {
    s.has_logits = false;  // partly overwritten
    if (inflight_ == &s) settle();
    drop_ahead(s);
    s.keep(s.n_past);
    if (s.drafter) s.drafter->rollback(s.n_past);
    throw;
  }
  s.pending = -1;
  s.n_past += 1;
  s.record(p, true);
  commit(s, 1);
}

// Samples the next token from s.logits (penalties -> greedy argmax | transforms -> draw)
// and leaves it pending.
bool Engine::device_greedy(const Sequence& s) const {
  const SamplingParams& p = s.params;
  return p.greedy() && !p.has_penalties() && s.hidden_layers.empty();
}

int32_t Engine::sample_pending(Sequence& s) {
  const int64_t nv = model_->config().n_vocab;
  if (!s.logits_on_host) {
    if (device_greedy(s)) {  // the argmax came back with the forward
      s.pending = s.top;
      s.generated.push_back(s.top);
      return s.top;
    }
    model_->read_logits(*s.kv, s.logits_row, s.logits.data());  // the sampling changed since
    s.logits_on_host = true;
  }
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
  return tok;
}

// One speculative step (see engine.h) with up to k drafts; false (nothing changed) when
// the drafter proposes none.
bool Engine::speculative_step(Sequence& s, int64_t k, std::vector<int32_t>& out) {
  const int64_t nv = model_->config().n_vocab;
  const bool greedy = s.params.greedy();
  const bool on_device = device_greedy(s);
  const auto t0 = Clock::now();

  // ---- draft: the drafter sees history + pending
  s.history.push_back(s.pending);
  DraftContext ctx;
  ctx.tokens = s.history.data();
  ctx.n_tokens = (int64_t)s.history.size();
  ctx.n_past = s.n_past;
  ctx.prompt = s.prompt.data();
  ctx.n_prompt = (int64_t)s.prompt.size();
  ctx.generated = s.generated.data();  // ends with the pending token
  ctx.n_generated = (int64_t)s.generated.size();
  ctx.params = &s.params;
  ctx.rng = &s.draft_rng;
  s.drafts.clear();
  s.q.clear();
  try {
    s.drafter->draft(ctx, (int)k, s.drafts, s.q);
  } catch (...) {
    s.history.pop_back();
    throw;
  }
  s.history.pop_back();
  const int64_t n = (int64_t)s.drafts.size();
  SPECD_CHECK(n <= k, std::string("drafter '") + s.drafter->name() + "' proposed " + std::to_string(n) +
                          " tokens, more than k=" + std::to_string(k));
  SPECD_CHECK(s.q.empty() || s.q.size() == (size_t)(n * nv),
              std::string("drafter '") + s.drafter->name() + "' returned q of the wrong size");
  for (int32_t d : s.drafts)
    SPECD_CHECK(d >= 0 && d < nv, std::string("drafter '") + s.drafter->name() + "' proposed token id " +
                                      std::to_string(d) + " outside the vocabulary");
  s.stats.draft_seconds += seconds_since(t0);
  if (n == 0) return false;

  // ---- verify: one target forward over [pending, d1..dn] at positions n_past0..n_past0+n
  const auto t1 = Clock::now();
  const int64_t n_past0 = s.n_past;
  const int32_t pending = s.pending;
  s.verify.assign(1, pending);
  s.verify.insert(s.verify.end(), s.drafts.begin(), s.drafts.end());
  s.vlogits.resize((size_t)((n + 1) * nv));
  s.residual.resize((size_t)nv);
  int64_t m = 0;  // accepted drafts
  int32_t bonus = -1;
  try {
    if (on_device) {
      // Greedy without penalties: the accept rule is "d_i == argmax of row i - 1", so only
      // the argmax of each row comes back from the device.
      s.tops.resize((size_t)(n + 1));
      model_->forward_argmax(*s.kv, s.verify.data(), n + 1, n_past0, s.tops.data());
      while (m < n && s.drafts[(size_t)m] == s.tops[(size_t)m]) ++m;
      bonus = s.tops[(size_t)m];
    } else {
      target_forward(s, s.verify.data(), n + 1, s.vlogits.data(), true);  // at n_past0
    }
    // ---- accept: row i is the target's distribution for the token after verify[i]; its
    // penalties see the history extended by d1..di, exactly as plain decoding would.
    s.gen_ext = s.generated;
    for (int64_t i = 0; !on_device; ++i) {
      std::memcpy(s.work.data(), s.vlogits.data() + i * nv, sizeof(float) * (size_t)nv);
      apply_penalties(s.work.data(), nv, s.params, s.prompt.data(), (int64_t)s.prompt.size(), s.gen_ext.data(),
                      (int64_t)s.gen_ext.size());
      const float* p = s.work.data();
      if (!greedy) {
        sampling_probs(s.work.data(), nv, s.params, s.probs.data());
        p = s.probs.data();
      }
      if (i == n) {  // every draft accepted: the bonus is a plain draw from the last row
        bonus = greedy ? argmax(p, nv) : sample_from(p, nv, s.rng.uniform());
        break;
      }
      const double ua = greedy ? 0.0 : s.rng.uniform();
      const double ur = greedy ? 0.0 : s.rng.uniform();
      const Verdict v = verify_position(p, s.q.empty() ? nullptr : s.q.data() + i * nv, nv, s.drafts[(size_t)i],
                                        greedy, ua, ur, s.residual.data());
      if (!v.accepted) {
        bonus = v.token;
        break;
      }
      s.gen_ext.push_back(v.token);
      ++m;
    }
  } catch (...) {
    s.has_logits = false;
    s.keep(n_past0);  // drops the pending token: its KV row may be written
    s.drafter->rollback(n_past0);
    throw;
  }

  // ---- commit: keep pending + d1..dm (rows beyond are overwritten later); bonus pending
  s.n_past = n_past0 + 1 + m;
  s.record(pending, true);
  for (int64_t j = 0; j < m; ++j) {
    s.record(s.drafts[(size_t)j], true);
    s.generated.push_back(s.drafts[(size_t)j]);
    out.push_back(s.drafts[(size_t)j]);
  }
  if (on_device) {  // position n_past - 1 is row m of the verify forward
    s.logits_on_host = false;
    s.logits_row = m;
    s.top = bonus;
  } else {
    std::memcpy(s.logits.data(), s.vlogits.data() + m * nv, sizeof(float) * (size_t)nv);
    s.logits_on_host = true;
  }
  s.has_logits = true;
  s.pending = bonus;
  s.generated.push_back(bonus);
  out.push_back(bonus);

  s.stats.drafted += n;
  s.stats.accepted += m;
  for (int64_t i = 0; i < n; ++i) s.stats.drafted_at[(size_t)i] += 1;
  for (int64_t i = 0; i < m; ++i) s.stats.accepted_at[(size_t)i] += 1;
  s.stats.verify_seconds += seconds_since(t1);
  commit(s, m + 1);
  return true;
}

std::vector<int32_t> Engine::step(int32_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& s = get(seq);
  // another sequence's forwards ahead are waited for; of s's own only the oldest (this step's
  // forward), the next stays queued behind it (before t0: a wait is not the step's work)
  settle(inflight_ == &s);
  if (!s.has_logits)
    throw Error("step() needs logits to sample from: call prefill() first (a new or truncated sequence has none)");
  const auto t0 = Clock::now();
  std::vector<int32_t> out;
  const bool forwards = s.pending >= 0;  // a step right after prefill samples without a forward
  bool done = false;
  if (forwards && s.drafter) {
    // Verify writes positions n_past .. n_past + n: clamp k to the context left.
    const int64_t k = std::min<int64_t>(s.spec.k, n_ctx_ - s.n_past - 1);
    if (k >= 1) done = speculative_step(s, k, out);
  }
  if (!done) {
    if (forwards) forward_pending(s);
    out.push_back(sample_pending(s));
  }
  if (forwards && s.drafter) {
    s.stats.spec_steps += 1;
    s.stats.spec_tokens += (int64_t)out.size();
  }
  s.stats.n_generated += (int64_t)out.size();
  s.stats.n_steps += 1;
  s.stats.decode_seconds += seconds_since(t0);
  start_ahead(s);  // (its forward's time is counted by the step that uses it)
  return out;
}

void Engine::truncate(int32_t seq, int64_t n_past) {
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  Sequence& s = get(seq);
  if (n_past < 0 || n_past > s.n_past)
    throw Error("truncate(" + std::to_string(n_past) + "): the sequence holds " + std::to_string(s.n_past) +
                " positions; keep between 0 and that many");
  drop_ahead(s);
  s.keep(n_past);
  if (s.drafter) s.drafter->rollback(n_past);
}

bool Engine::pausable(const Sequence& s) { return s.drafter && s.drafter->hidden_layers().empty(); }

bool Engine::speculation_pausable(int32_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pausable(get(seq));
}

SeqStats Engine::stats(int32_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& s = get(seq);
  SeqStats out = s.stats;
  out.n_past = s.n_past;
  return out;
}

}  // namespace specd

namespace specd {

std::vector<double> Engine::bench_forward(int64_t n, int64_t pos0, int32_t reps, bool all_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  SPECD_CHECK(n >= 1 && pos0 >= 0 && pos0 + n <= n_ctx_ && reps >= 1,
              "bench_forward needs n >= 1, pos0 >= 0, pos0 + n <= n_ctx and reps >= 1");
  std::unique_ptr<KvStore> kv = model_->new_kv(n_ctx_, opt_.kv_f16);
  const int32_t nv = model_->config().n_vocab;
  Rng rng(12345);
  std::vector<int32_t> tok((size_t)std::max(n, pos0)), top((size_t)n);  // tokens reused: timing only
  for (auto& t : tok) t = (int32_t)(rng.uniform() * nv) % nv;
  for (int64_t done = 0; done < pos0;) {  // fill the context first
    const int64_t m = std::min(opt_.max_batch, pos0 - done);
    model_->forward(*kv, tok.data(), m, done, nullptr, false);
    done += m;
  }
  std::vector<float> last((size_t)nv);
  auto once = [&] {  // returns after the device is done
    if (all_rows) {
      model_->forward_argmax(*kv, tok.data(), n, pos0, top.data());
      return;
    }
    for (int64_t done = 0; done < n;) {
      const int64_t m = std::min(opt_.max_batch, n - done);
      model_->forward(*kv, tok.data() + done, m, pos0 + done, done + m == n ? last.data() : nullptr, false);
      done += m;
    }
  };
  once();  // warm-up (graph capture, scratch growth)
  std::vector<double> out;
  for (int32_t r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    once();
    out.push_back(seconds_since(t0));
  }
  return out;
}

MemoryInfo Engine::memory() const {
  std::lock_guard<std::mutex> lock(mu_);
  MemoryInfo m = model_->memory();
  if (draft_model_) m.weights_bytes += draft_model_->memory().weights_bytes;
  for (const auto& kv : seqs_) m.kv_bytes += kv.second->kv->bytes();
  return m;
}

}  // namespace specd
