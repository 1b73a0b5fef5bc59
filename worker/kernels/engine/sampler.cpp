// specd/engine/sampler.cpp: logits -> token (see sampler.h for the contract).
// Token order for top-k / top-p is by scaled logit z = logit / T, descending, ties to the
// lower id: a strict total order, so the kept set never depends on the algorithm.
// Costs at vocab 49k-152k (no full sort of the vocabulary, ever):
//   - top-k: one pass with a k-heap (small k; most tokens fail one compare), else nth_element;
//   - top-p without top-k: probability mass per bin of z (1/16 nat wide) finds the bin
//     where the cumulative mass crosses top_p; only that bin's tokens get sorted;
//   - min-p is a threshold (p >= min_p * p_max), no order needed. top-p and min-p both keep
//     a prefix of the same order, so applying both keeps the shorter prefix.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/types.h"
#include "cpu/ops.h"

namespace specd {

namespace {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// One candidate token: its scaled logit, probability (before the final renormalisation), id.
struct Cand {
  float z;
  float p;
  int32_t id;
};

// Strict total order: larger z first, then lower id.
inline bool before(const Cand& a, const Cand& b) { return a.z > b.z || (a.z == b.z && a.id < b.id); }

// Scratch reused across calls (one per thread: sequences may be sampled concurrently).
thread_local std::vector<Cand> t_cands;  // [<= n_vocab] candidates
thread_local std::vector<float> t_z;     // [<= n_vocab] scaled logits
thread_local std::vector<uint16_t> t_bin;  // [n_vocab] top-p bin of each token
thread_local std::vector<float> t_pk;      // [k] probabilities of the top-k set

// max of x[0..n): four lanes the compiler can keep in one vector register.
float max_of(const float* x, int64_t n) {
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  for (; i < n; ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  return std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
}

// Keep the shortest prefix (in `before` order) of c[0..n) whose mass, added to `cum0`,
// reaches top_p of `total`; returns its length (n if never reached: rounding). Sorts only
// as far as needed: each round sorts the next block (nth_element on the rest), growing 4x.
int64_t top_p_cut(Cand* c, int64_t n, double top_p, double cum0, double total) {
  double cum = cum0;
  int64_t done = 0, want = std::min<int64_t>(n, 64);
  while (done < n) {
    if (want < n) std::nth_element(c + done, c + want, c + n, before);
    std::sort(c + done, c + want, before);
    for (; done < want; ++done) {
      cum += c[done].p;
      if (cum / total >= top_p) return done + 1;
    }
    want = std::min<int64_t>(n, want * 4);
  }
  return n;
}

// The k first of all tokens in `before` order (z: [n] scaled logits), into c[0..k), unordered.
void select_top_k(const float* z, int64_t n, int64_t k, std::vector<Cand>& c) {
  if (k <= 1024 && k * 8 <= n) {
    // A heap whose front is the worst kept token: a later token (higher id) enters only
    // with a strictly larger z, which is exactly `before` for ids scanned in order.
    c.resize((size_t)k);
    for (int64_t i = 0; i < k; ++i) c[i] = Cand{z[i], 0.f, (int32_t)i};
    std::make_heap(c.begin(), c.end(), before);
    float worst = c.front().z;
    for (int64_t i = k; i < n; ++i) {
      if (!(z[i] > worst)) continue;
      std::pop_heap(c.begin(), c.end(), before);
      c.back() = Cand{z[i], 0.f, (int32_t)i};
      std::push_heap(c.begin(), c.end(), before);
      worst = c.front().z;
    }
    return;
  }
  c.resize((size_t)n);
  for (int64_t i = 0; i < n; ++i) c[i] = Cand{z[i], 0.f, (int32_t)i};
  std::nth_element(c.begin(), c.begin() + k, c.end(), before);
  c.resize((size_t)k);
}

// The largest scaled logit: -inf means nothing can be sampled (throws); +inf means the
// temperature is so small that z overflowed, and the caller falls back to greedy.
bool finite_max(float zmax) {
  if (zmax == -INFINITY || std::isnan(zmax))
    throw Error("sampling_probs: every logit is -inf or NaN; nothing can be sampled");
  return zmax != INFINITY;
}

}  // namespace

void SamplingParams::validate() const {
  if (!(temperature >= 0.f) || !std::isfinite(temperature))
    throw Error("temperature must be >= 0 and finite (0 = greedy), got " + num(temperature));
  if (top_k < 0) throw Error("top_k must be >= 0 (0 = off), got " + std::to_string(top_k));
  if (!(top_p > 0.f && top_p <= 1.f))
    throw Error("top_p must be in (0, 1] (1 = off), got " + num(top_p));
  if (!(min_p >= 0.f && min_p <= 1.f))
    throw Error("min_p must be in [0, 1] (0 = off), got " + num(min_p));
  if (!(repetition_penalty > 0.f) || !std::isfinite(repetition_penalty))
    throw Error("repetition_penalty must be > 0 and finite (1 = off), got " + num(repetition_penalty));
  if (!(std::fabs(presence_penalty) <= 2.f))
    throw Error("presence_penalty must be in [-2, 2], got " + num(presence_penalty));
  if (!(std::fabs(frequency_penalty) <= 2.f))
    throw Error("frequency_penalty must be in [-2, 2], got " + num(frequency_penalty));
}

void apply_penalties(float* logits, int64_t n_vocab, const SamplingParams& p,
                     const int32_t* prompt, int64_t n_prompt, const int32_t* generated,
                     int64_t n_generated) {
  const bool rep = p.repetition_penalty != 1.f;
  const bool pf = p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
  if (!rep && !pf) return;
  auto check = [&](int32_t t) {
    if (t < 0 || t >= n_vocab)
      throw Error("apply_penalties: token id " + std::to_string(t) + " is outside [0, " +
                  std::to_string(n_vocab) + ")");
  };
  // Sorted copies give the distinct tokens (and their counts) without a vocab-sized table.
  std::vector<int32_t> gen(generated, generated + n_generated);
  std::sort(gen.begin(), gen.end());
  if (rep) {
    std::vector<int32_t> seen(prompt, prompt + n_prompt);
    seen.insert(seen.end(), gen.begin(), gen.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    const float r = p.repetition_penalty;
    for (int32_t t : seen) {
      check(t);
      float& l = logits[t];
      l = l > 0.f ? l / r : l * r;  // CTRL: always towards "less likely"
    }
  }
  if (pf) {
    for (size_t i = 0; i < gen.size();) {
      size_t j = i;
      while (j < gen.size() && gen[j] == gen[i]) ++j;
      check(gen[i]);
      const double count = (double)(j - i);
      float& l = logits[gen[i]];
      l = (float)((double)l - ((double)p.presence_penalty + (double)p.frequency_penalty * count));
      i = j;
    }
  }
}

int32_t argmax(const float* x, int64_t n) {
  if (n <= 0) throw Error("argmax of an empty array");
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;  // strict: the lowest index wins ties
  return (int32_t)best;
}

void sampling_probs(const float* logits, int64_t n_vocab, const SamplingParams& p, float* probs) {
  if (n_vocab <= 0) throw Error("sampling_probs: empty vocabulary");
  auto one_hot = [&] {
    std::memset(probs, 0, sizeof(float) * n_vocab);
    probs[argmax(logits, n_vocab)] = 1.f;
  };
  if (p.greedy()) return one_hot();
  const float temp = p.temperature;
  const bool min_p = p.min_p > 0.f, top_p = p.top_p < 1.f;

  if (p.top_k > 0 && p.top_k < n_vocab) {
    // top-k candidates, their softmax, then min-p and top-p among them.
    std::vector<Cand>& c = t_cands;
    const int64_t k = p.top_k;
    std::vector<float>& z = t_z;  // [n_vocab]
    z.resize((size_t)n_vocab);
    for (int64_t i = 0; i < n_vocab; ++i) z[i] = logits[i] / temp;  // vectorised
    select_top_k(z.data(), n_vocab, k, c);
    std::vector<float>& pk = t_pk;  // [k]
    pk.resize((size_t)k);
    for (int64_t j = 0; j < k; ++j) pk[j] = c[j].z;
    if (!finite_max(max_of(pk.data(), k))) return one_hot();  // z overflowed: the T -> 0 limit
    softmax(pk.data(), k);
    double total = 0.0;
    float p_max = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      c[j].p = pk[j];
      total += pk[j];
      p_max = std::max(p_max, pk[j]);
    }
    const float thr = min_p ? p.min_p * p_max : 0.f;
    int64_t n_c = 0;
    for (int64_t j = 0; j < k; ++j)
      if (c[j].p >= thr) c[n_c++] = c[j];
    if (top_p) n_c = top_p_cut(c.data(), n_c, (double)p.top_p, 0.0, total);
    double kept = 0.0;
    for (int64_t j = 0; j < n_c; ++j) kept += c[j].p;
    std::memset(probs, 0, sizeof(float) * n_vocab);
    for (int64_t j = 0; j < n_c; ++j) probs[c[j].id] = (float)(c[j].p / kept);
    return;
  }

  // Whole vocabulary: probs = softmax(z); z kept for top-p's token order.
  std::vector<float>& z = t_z;  // [n_vocab]
  z.resize((size_t)n_vocab);
  for (int64_t i = 0; i < n_vocab; ++i) z[i] = probs[i] = logits[i] / temp;  // vectorised
  const float zmax = max_of(z.data(), n_vocab);
  if (!finite_max(zmax)) return one_hot();  // z overflowed: the T -> 0 limit
  softmax(probs, n_vocab);
  if (!min_p && !top_p) return;
  const float p_max = probs[std::find(z.begin(), z.end(), zmax) - z.begin()];
  const float thr = min_p ? p.min_p * p_max : 0.f;  // min-p: keep p >= min_p * p_max

  if (top_p) {
    // Bin b holds the tokens with zmax - z in [b/16, (b+1)/16) nats (the last bin: all
    // beyond). Bins follow the token order, so the kept set is: every bin before the one
    // where the cumulative mass crosses top_p, plus a sorted prefix of that bin.
    constexpr int kBins = 1024;
    std::vector<uint16_t>& bin = t_bin;  // [n_vocab]
    bin.resize((size_t)n_vocab);
    for (int64_t i = 0; i < n_vocab; ++i) {
      const float d = std::min((zmax - z[i]) * 16.f, (float)(kBins - 1));  // monotone in z; -inf -> last
      bin[i] = (uint16_t)(int32_t)d;
    }
    double mass[kBins] = {0.0};
    for (int64_t i = 0; i < n_vocab; ++i) mass[bin[i]] += probs[i];
    double total = 0.0;
    for (double m : mass) total += m;
    double cum = 0.0;
    int cross = 0;
    for (; cross < kBins - 1; ++cross) {
      if ((cum + mass[cross]) / total >= (double)p.top_p) break;
      cum += mass[cross];
    }
    std::vector<Cand>& c = t_cands;
    c.clear();
    for (int64_t i = 0; i < n_vocab; ++i) {
      if (bin[i] < cross && probs[i] >= thr) continue;  // kept
      if (bin[i] == cross && probs[i] >= thr) c.push_back(Cand{z[i], probs[i], (int32_t)i});
      probs[i] = 0.f;  // the crossing bin's kept prefix is restored below
    }
    const int64_t n_c = top_p_cut(c.data(), (int64_t)c.size(), (double)p.top_p, cum, total);
    for (int64_t j = 0; j < n_c; ++j) probs[c[j].id] = c[j].p;
  } else {
    for (int64_t i = 0; i < n_vocab; ++i)
      if (probs[i] < thr) probs[i] = 0.f;
  }
  double kept4[4] = {0.0, 0.0, 0.0, 0.0};  // four chains of adds, not one long one
  int64_t i = 0;
  for (; i + 4 <= n_vocab; i += 4)
    for (int j = 0; j < 4; ++j) kept4[j] += probs[i + j];
  for (; i < n_vocab; ++i) kept4[0] += probs[i];
  const double inv = 1.0 / ((kept4[0] + kept4[1]) + (kept4[2] + kept4[3]));
  for (int64_t i = 0; i < n_vocab; ++i) probs[i] = (float)(probs[i] * inv);
}

int32_t sample_from(const float* probs, int64_t n, double u) {
  if (n <= 0) throw Error("sample_from: empty distribution");
  if (!(u >= 0.0 && u < 1.0)) throw Error("sample_from: u must be in [0, 1), got " + num(u));
  // Zeros are skipped (adding 0.0 changes nothing): the serial double sums then only run
  // over the kept tokens, which after top-k / top-p are few.
  double total = 0.0;
  int64_t last = -1;  // last index with mass, in case rounding leaves cum <= target at the end
  for (int64_t i = 0; i < n; ++i)
    if (probs[i] != 0.f) {
      total += probs[i];
      last = i;
    }
  if (!(total > 0.0) || !std::isfinite(total))
    throw Error("sample_from: probabilities sum to " + num(total) + ", expected a positive finite sum");
  const double target = u * total;
  double cum = 0.0;
  for (int64_t i = 0; i < n; ++i)
    if (probs[i] != 0.f) {
      cum += probs[i];
      if (cum > target) return (int32_t)i;
    }
  return (int32_t)last;
}

// splitmix64 expands the seed into xoshiro's 256-bit state (never all zero).
Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (uint64_t& s : s_) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    s = z ^ (z >> 31);
  }
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// xoshiro256** (Blackman & Vigna).
uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

// The top 53 bits as a multiple of 2^-53: uniform on [0, 1), never 1.
double Rng::uniform() { return (double)(next_u64() >> 11) * 0x1.0p-53; }

}  // namespace specd
