// specd/bindings/module.cpp: the only C++ <-> Python boundary. `worker/engine.py` is the
// only importer. Converts Python values to the C++ structs, releases the GIL inside
// every heavy call, and maps specd::Error to one Python exception (EngineError, a
// subclass of worker.errors.SpecdError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "common/parallel.h"
#include "common/types.h"
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "cpu/quants.h"
#include "engine/accept.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/dflash.h"
#include "model/model.h"

namespace py = pybind11;
using namespace specd;

#if SPECD_WITH_GPU
void register_gpu_ops(py::module_& m);  // bindings/gpu_ops.cpp
#endif

namespace {

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

template <class T>
T get_or(const py::dict& d, const char* key, T dflt) {
  return d.contains(key) ? d[key].cast<T>() : dflt;
}

template <class T>
T need(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw Error(std::string("model config is missing '") + key + "'");
  return d[key].cast<T>();
}

SamplingParams sampling_from_dict(const py::dict& d) {
  static const char* kKeys[] = {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                "presence_penalty", "frequency_penalty", "seed"};
  for (auto item : d) {
    const auto key = item.first.cast<std::string>();
    bool known = false;
    for (const char* k : kKeys) known |= key == k;
    if (!known) throw Error("unknown sampling parameter '" + key + "'");
  }
  SamplingParams p;
  p.temperature = get_or<float>(d, "temperature", p.temperature);
  p.top_k = get_or<int32_t>(d, "top_k", p.top_k);
  p.top_p = get_or<float>(d, "top_p", p.top_p);
  p.min_p = get_or<float>(d, "min_p", p.min_p);
  p.repetition_penalty = get_or<float>(d, "repetition_penalty", p.repetition_penalty);
  p.presence_penalty = get_or<float>(d, "presence_penalty", p.presence_penalty);
  p.frequency_penalty = get_or<float>(d, "frequency_penalty", p.frequency_penalty);
  p.seed = get_or<uint64_t>(d, "seed", p.seed);
  p.validate();
  return p;
}

ModelConfig config_from_dict(const py::dict& d) {
  ModelConfig c;
  const auto arch = need<std::string>(d, "arch");
  if (arch == "llama") c.arch = Arch::Llama;
  else if (arch == "qwen2") c.arch = Arch::Qwen2;
  else if (arch == "qwen3") c.arch = Arch::Qwen3;
  else throw Error("unsupported architecture '" + arch + "'; supported: llama, qwen2, qwen3");
  c.n_layers = need<int32_t>(d, "n_layers");
  c.dim = need<int32_t>(d, "dim");
  c.n_heads = need<int32_t>(d, "n_heads");
  c.n_kv_heads = need<int32_t>(d, "n_kv_heads");
  c.head_dim = need<int32_t>(d, "head_dim");
  c.ffn_dim = need<int32_t>(d, "ffn_dim");
  c.n_vocab = need<int32_t>(d, "n_vocab");
  c.n_ctx_train = need<int32_t>(d, "n_ctx_train");
  c.norm_eps = need<float>(d, "norm_eps");
  c.rope.n_dims = need<int32_t>(d, "rope_dims");
  c.rope.freq_base = need<float>(d, "rope_base");
  c.rope.freq_scale = get_or<float>(d, "rope_scale", 1.0f);
  const auto mode = need<std::string>(d, "rope_mode");
  if (mode == "normal") c.rope.mode = RopeMode::Normal;
  else if (mode == "neox") c.rope.mode = RopeMode::Neox;
  else throw Error("rope_mode must be 'normal' or 'neox', got '" + mode + "'");
  c.validate();
  return c;
}

// A buffer's bytes as (pointer, size); must be C-contiguous.
std::pair<const uint8_t*, size_t> bytes_of(const py::buffer& b, const std::string& what) {
  py::buffer_info info = b.request();
  ssize_t expect = info.itemsize;
  for (ssize_t i = info.ndim - 1; i >= 0; --i) {
    if (info.strides[i] != expect) throw Error(what + ": buffer is not C-contiguous");
    expect *= info.shape[i];
  }
  return {static_cast<const uint8_t*>(info.ptr), (size_t)(info.size * info.itemsize)};
}

// Engine + the Python objects owning the memory its tensors point into.
struct PyEngine {
  std::unique_ptr<DFlashModel> dflash;  // declared first: outlives the engine's drafters
  std::unique_ptr<Engine> engine;
  py::list keep_alive;
};

WeightView weight_from(int32_t type, const py::buffer& data, int64_t n_in, int64_t n_out) {
  const TypeTraits& t = type_traits(type);
  auto [ptr, size] = bytes_of(data, "weight");
  WeightView w;
  w.type = t.type;
  w.n_in = n_in;
  w.n_out = n_out;
  w.data = ptr;
  w.row_stride = row_bytes(t.type, n_in);
  if (size != w.row_stride * (size_t)n_out)
    throw Error("weight buffer holds " + std::to_string(size) + " bytes, expected " +
                std::to_string(w.row_stride * (size_t)n_out) + " for " + std::to_string(n_out) +
                " rows of " + std::to_string(n_in) + " " + t.name + " elements");
  return w;
}

// (name, type, ne, buffer) tuples -> TensorRefs; the buffers are appended to keep_alive.
std::vector<TensorRef> tensor_refs(const py::list& tensors, py::list& keep_alive) {
  std::vector<TensorRef> refs;
  for (auto item : tensors) {
    auto tup = item.cast<py::tuple>();
    if (tup.size() != 4) throw Error("tensor entries are (name, type, ne, buffer)");
    TensorRef r;
    r.name = tup[0].cast<std::string>();
    const TypeTraits& t = type_traits(tup[1].cast<int32_t>());
    r.type = t.type;
    r.ne = tup[2].cast<std::vector<int64_t>>();
    auto [ptr, size] = bytes_of(tup[3].cast<py::buffer>(), r.name);
    r.data = ptr;
    r.nbytes = size;
    int64_t rows = 1;
    for (size_t i = 1; i < r.ne.size(); ++i) rows *= r.ne[i];
    const size_t expect = r.ne.empty() ? 0 : row_bytes(r.type, r.ne[0]) * (size_t)rows;
    if (expect != size)
      throw Error("tensor '" + r.name + "' holds " + std::to_string(size) + " bytes, its shape and type need " +
                  std::to_string(expect) + " (truncated or corrupt file?)");
    keep_alive.append(tup[3]);
    refs.push_back(std::move(r));
  }
  return refs;
}

SpecParams spec_from_dict(const py::dict& d) {
  static const char* kKeys[] = {"mode", "k", "ngram_min", "ngram_max"};
  for (auto item : d) {
    const auto key = item.first.cast<std::string>();
    bool known = false;
    for (const char* k : kKeys) known |= key == k;
    if (!known) throw Error("unknown speculation parameter '" + key + "'; known: mode, k, ngram_min, ngram_max");
  }
  SpecParams p;
  p.mode = get_or<std::string>(d, "mode", p.mode);
  p.k = get_or<int32_t>(d, "k", p.k);
  p.ngram_min = get_or<int32_t>(d, "ngram_min", p.ngram_min);
  p.ngram_max = get_or<int32_t>(d, "ngram_max", p.ngram_max);
  p.validate();
  return p;
}

}  // namespace

// ---- DFlash: config dict -> DFlashConfig, and a one-sequence drafter for tests ----
namespace {

DFlashConfig dflash_config_from_dict(const py::dict& d) {
  const auto arch = need<std::string>(d, "arch");
  if (arch != "dflash") throw Error("a DFlash config has arch 'dflash', got '" + arch + "'");
  DFlashConfig c;
  c.n_layers = need<int32_t>(d, "n_layers");
  c.dim = need<int32_t>(d, "dim");
  c.n_heads = need<int32_t>(d, "n_heads");
  c.n_kv_heads = need<int32_t>(d, "n_kv_heads");
  c.head_dim = need<int32_t>(d, "head_dim");
  c.ffn_dim = need<int32_t>(d, "ffn_dim");
  c.n_vocab = need<int32_t>(d, "n_vocab");
  c.norm_eps = need<float>(d, "norm_eps");
  c.rope.n_dims = need<int32_t>(d, "rope_dims");
  c.rope.freq_base = need<float>(d, "rope_base");
  c.rope.freq_scale = get_or<float>(d, "rope_scale", 1.0f);
  c.rope.mode = RopeMode::Neox;
  c.block_size = need<int32_t>(d, "block_size");
  c.mask_token_id = need<int32_t>(d, "mask_token_id");
  c.target_layer_ids = need<std::vector<int32_t>>(d, "target_layer_ids");
  c.target_dim = need<int32_t>(d, "target_dim");
  c.input_embedding_scale = get_or<float>(d, "input_embedding_scale", 1.0f);
  c.output_multiplier = get_or<float>(d, "output_multiplier", 1.0f);
  c.logit_softcap = get_or<float>(d, "logit_softcap", 0.0f);
  for (bool b : need<std::vector<bool>>(d, "layer_causal")) c.layer_causal.push_back(b ? 1 : 0);
  c.layer_window = need<std::vector<int32_t>>(d, "layer_window");
  c.validate();
  return c;
}

// One DFlash drafter (engine/dflash_drafter.cpp) over its own target Model, driven
// through the Drafter interface exactly as the engine drives it (tests only).
struct PyDFlash {
  py::list keep_alive;  // first: the tensors outlive the models
  std::unique_ptr<Model> target;
  std::unique_ptr<DFlashModel> model;
  std::unique_ptr<Drafter> drafter;
  Rng rng{0};
};

}  // namespace

PYBIND11_MODULE(_specd, m) {
  m.doc() = "specd native engine (see worker/engine.py; do not import directly)";
  py::object base = py::module_::import("worker.errors").attr("SpecdError");
  py::register_exception<Error>(m, "EngineError", base);
  m.attr("backend") = SPECD_BACKEND_NAME;
  m.attr("max_draft") = kMaxDraft;               // largest k of set_speculation
  m.attr("max_run_ahead") = KvStore::kMaxAhead;  // forwards a greedy step may queue ahead
  m.def("simd_path", &simd_path);
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("num_threads", &num_threads);
  m.def("supported_types", &supported_type_names);
#if SPECD_WITH_GPU
  register_gpu_ops(m);
#endif

  py::class_<PyEngine>(m, "Engine")
      .def("set_dflash",
           [](PyEngine& e, const py::dict& config, const py::list& tensors) {
             // Loads a DFlash drafter and offers it as speculation mode "dflash".
             if (e.dflash) throw Error("the engine already has a DFlash drafter");
             DFlashConfig c = dflash_config_from_dict(config);
             std::vector<TensorRef> refs = tensor_refs(tensors, e.keep_alive);
             auto dm_owned = std::make_unique<DFlashModel>(c, refs);
             dm_owned->check_target(e.engine->config());
             e.dflash = std::move(dm_owned);
             const DFlashModel* dm = e.dflash.get();
             e.engine->register_drafter("dflash",
                                        [dm](const DrafterEnv& env) { return make_dflash_drafter(*dm, env); });
           },
           py::arg("config"), py::arg("tensors"))
      .def(py::init([](const py::dict& config, const py::list& tensors, const py::dict& options,
                       const py::object& draft_config, const py::object& draft_tensors) {
             auto pe = std::make_unique<PyEngine>();
             ModelConfig cfg = config_from_dict(config);
             std::vector<TensorRef> refs = tensor_refs(tensors, pe->keep_alive);
             const bool has_draft = !draft_config.is_none();
             if (has_draft != !draft_tensors.is_none())
               throw Error("draft_config and draft_tensors go together");
             ModelConfig dcfg;
             std::vector<TensorRef> drefs;
             if (has_draft) {
               dcfg = config_from_dict(draft_config.cast<py::dict>());
               drefs = tensor_refs(draft_tensors.cast<py::list>(), pe->keep_alive);
             }
             EngineOptions opt;
             opt.n_ctx = get_or<int64_t>(options, "n_ctx", opt.n_ctx);
             opt.n_threads = get_or<int32_t>(options, "n_threads", opt.n_threads);
             opt.kv_f16 = get_or<std::string>(options, "kv_type", "f16") == "f16";
             if (options.contains("kv_type")) {
               const auto kv = options["kv_type"].cast<std::string>();
               if (kv != "f16" && kv != "f32") throw Error("kv_type must be 'f16' or 'f32', got '" + kv + "'");
             }
             opt.max_batch = get_or<int64_t>(options, "max_batch", opt.max_batch);
             opt.device = get_or<std::string>(options, "device", opt.device);
             opt.tensor_cores = get_or<bool>(options, "tensor_cores", opt.tensor_cores);
             opt.run_ahead = get_or<int32_t>(options, "run_ahead", opt.run_ahead);
             {
               py::gil_scoped_release nogil;
               pe->engine = std::make_unique<Engine>(cfg, refs, opt);
               if (has_draft) pe->engine->set_draft_model(dcfg, drefs);
             }
             return pe;
           }),
           py::arg("config"), py::arg("tensors"), py::arg("options") = py::dict(),
           py::arg("draft_config") = py::none(), py::arg("draft_tensors") = py::none())
      .def_property_readonly("has_draft_model", [](PyEngine& e) { return e.engine->has_draft_model(); })
      .def("set_speculation",
           [](PyEngine& e, int32_t seq, const py::dict& p) { e.engine->set_speculation(seq, spec_from_dict(p)); })
      .def("speculation_pausable", [](PyEngine& e, int32_t seq) { return e.engine->speculation_pausable(seq); })

      .def_property_readonly("n_ctx", [](PyEngine& e) { return e.engine->n_ctx(); })
      .def_property_readonly("device", [](PyEngine& e) { return e.engine->device(); })
      .def_property(
          "run_ahead", [](PyEngine& e) { return e.engine->run_ahead(); },
          [](PyEngine& e, int32_t depth) {
            py::gil_scoped_release nogil;
            e.engine->set_run_ahead(depth);
          })
      .def(
          "bench_forward",
          [](PyEngine& e, int64_t n, int64_t pos0, int32_t reps, bool all_rows) {
            py::gil_scoped_release nogil;
            return e.engine->bench_forward(n, pos0, reps, all_rows);
          },
          py::arg("n"), py::arg("pos0"), py::arg("reps"), py::arg("all_rows") = true)
      .def("memory",
           [](PyEngine& e) {
             const MemoryInfo m = e.engine->memory();
             py::dict d;
             d["weights_bytes"] = m.weights_bytes;
             d["kv_bytes"] = m.kv_bytes;
             d["scratch_bytes"] = m.scratch_bytes;
             d["device_total_bytes"] = m.device_total_bytes;
             d["device_free_bytes"] = m.device_free_bytes;
             d["device_name"] = m.device_name;
             return d;
           })
      .def_property_readonly("n_vocab", [](PyEngine& e) { return e.engine->config().n_vocab; })
      .def("new_sequence", [](PyEngine& e) { return e.engine->new_sequence(); })
      .def("free_sequence", [](PyEngine& e, int32_t s) { e.engine->free_sequence(s); })
      .def(
          "prefill",
          [](PyEngine& e, int32_t seq, const i32_array& tokens, bool all_logits, bool want_logits) {
            const int64_t n = tokens.size();
            const int64_t nv = e.engine->config().n_vocab;
            py::array_t<float> out;
            float* dst = nullptr;
            if (want_logits) {
              out = all_logits ? py::array_t<float>({n, nv}) : py::array_t<float>(nv);
              dst = out.mutable_data();
            }
            const int32_t* tok = tokens.data();
            {
              py::gil_scoped_release nogil;
              e.engine->prefill(seq, tok, n, dst, all_logits);
            }
            return want_logits ? py::object(out) : py::object(py::none());
          },
          py::arg("seq"), py::arg("tokens"), py::arg("all_logits") = false,
          py::arg("want_logits") = true)
      .def("set_sampling",
           [](PyEngine& e, int32_t seq, const py::dict& p) {
             e.engine->set_sampling(seq, sampling_from_dict(p));
           })
      .def("step",
           [](PyEngine& e, int32_t seq) {
             std::vector<int32_t> out;
             {
               py::gil_scoped_release nogil;
               out = e.engine->step(seq);
             }
             return out;
           })
      .def("truncate", [](PyEngine& e, int32_t seq, int64_t n) { e.engine->truncate(seq, n); })
      .def("stats", [](PyEngine& e, int32_t seq) {
        const SeqStats s = e.engine->stats(seq);
        py::dict d;
        d["n_past"] = s.n_past;
        d["n_prompt"] = s.n_prompt;
        d["n_generated"] = s.n_generated;
        d["n_steps"] = s.n_steps;
        d["prefill_seconds"] = s.prefill_seconds;
        d["decode_seconds"] = s.decode_seconds;
        d["spec_steps"] = s.spec_steps;
        d["spec_tokens"] = s.spec_tokens;
        d["drafted"] = s.drafted;
        d["accepted"] = s.accepted;
        d["acceptance_length"] = s.spec_steps > 0 ? (double)s.spec_tokens / (double)s.spec_steps : 0.0;
        // per draft position i (0-based): steps that drafted / accepted draft i+1, trimmed
        // to the positions ever drafted
        size_t used = 0;
        while (used < s.drafted_at.size() && s.drafted_at[used] > 0) ++used;
        d["drafted_per_position"] = std::vector<int64_t>(s.drafted_at.begin(), s.drafted_at.begin() + used);
        d["accepted_per_position"] = std::vector<int64_t>(s.accepted_at.begin(), s.accepted_at.begin() + used);
        d["draft_seconds"] = s.draft_seconds;
        d["verify_seconds"] = s.verify_seconds;
        return d;
      });

  // ---- single ops, for tests and benchmarks (fresh random inputs vs numpy float64) ----
  py::module_ ops = m.def_submodule("ops", "single CPU ops (tests compare them with numpy)");
  ops.def("dequantize", [](int32_t type, const py::buffer& data, int64_t n) {
    auto [ptr, size] = bytes_of(data, "data");
    const TypeTraits& t = type_traits(type);
    if (row_bytes(t.type, n) != size) throw Error("buffer size does not match n elements");
    py::array_t<float> out(n);
    dequantize_row(t.type, ptr, out.mutable_data(), n);
    return out;
  });
  auto dot = [](bool scalar) {
    return [scalar](int32_t type, const py::buffer& row, const f32_array& x) {
      auto [ptr, size] = bytes_of(row, "row");
      const TypeTraits& t = type_traits(type);
      if (row_bytes(t.type, x.size()) != size) throw Error("row size does not match len(x)");
      return scalar ? dot_row_scalar(t.type, ptr, x.data(), x.size())
                    : dot_row(t.type, ptr, x.data(), x.size());
    };
  };
  ops.def("dot_row", dot(false));
  ops.def("dot_row_scalar", dot(true));
  ops.def("matmul", [](int32_t type, const py::buffer& w, int64_t n_in, int64_t n_out, const f32_array& x) {
    WeightView wv = weight_from(type, w, n_in, n_out);
    if (x.ndim() != 2 || x.shape(1) != n_in) throw Error("x must be [m, n_in]");
    const int64_t mrows = x.shape(0);
    py::array_t<float> y({mrows, n_out});
    float* yp = y.mutable_data();
    const float* xp = x.data();
    {
      py::gil_scoped_release nogil;
      matmul(wv, xp, mrows, yp);
    }
    return y;
  });
  ops.def("rmsnorm", [](const f32_array& x, const f32_array& w, float eps) {
    if (x.ndim() != 2 || w.ndim() != 1 || w.shape(0) != x.shape(1)) throw Error("x [n, dim], w [dim]");
    py::array_t<float> y({x.shape(0), x.shape(1)});
    rmsnorm(x.data(), w.data(), y.mutable_data(), x.shape(0), x.shape(1), eps);
    return y;
  });
  ops.def(
      "rope",
      [](const f32_array& x, const i32_array& pos, int32_t n_dims, float base, float scale,
         const std::string& mode, py::object factors) {
        if (x.ndim() != 3 || pos.ndim() != 1 || pos.shape(0) != x.shape(0))
          throw Error("x [n_tok, n_heads, head_dim], pos [n_tok]");
        py::array_t<float> y({x.shape(0), x.shape(1), x.shape(2)});
        std::memcpy(y.mutable_data(), x.data(), sizeof(float) * x.size());
        RopeParams p;
        p.n_dims = n_dims;
        p.freq_base = base;
        p.freq_scale = scale;
        if (mode == "normal") p.mode = RopeMode::Normal;
        else if (mode == "neox") p.mode = RopeMode::Neox;
        else throw Error("mode must be 'normal' or 'neox'");
        f32_array f;
        if (!factors.is_none()) {
          f = factors.cast<f32_array>();
          if (f.size() != n_dims / 2) throw Error("freq_factors must have n_dims/2 entries");
          p.freq_factors = f.data();
        }
        rope(y.mutable_data(), pos.data(), x.shape(0), x.shape(1), x.shape(2), p);
        return y;
      },
      py::arg("x"), py::arg("pos"), py::arg("n_dims"), py::arg("base"), py::arg("scale") = 1.0f,
      py::arg("mode") = "normal", py::arg("freq_factors") = py::none());
  ops.def(
      "attention",
      [](const f32_array& q, const py::array& kc, const py::array& vc, int64_t pos0, float scale) {
        // q: [n_tok, n_heads, hd]; kc, vc: [n_pos, n_kv_heads, hd] float32 or float16
        if (q.ndim() != 3 || kc.ndim() != 3 || vc.ndim() != 3) throw Error("q, k, v must be 3-D");
        const bool f16 = kc.dtype().is(py::dtype("float16"));
        if (f16 != vc.dtype().is(py::dtype("float16")) ||
            (!f16 && !kc.dtype().is(py::dtype::of<float>())))
          throw Error("k and v must both be float16 or both float32");
        const int64_t n_tok = q.shape(0), n_pos = kc.shape(0);
        if (pos0 + n_tok > n_pos) throw Error("cache shorter than pos0 + n_tok");
        if (!(kc.flags() & py::array::c_style) || !(vc.flags() & py::array::c_style))
          throw Error("k and v must be C-contiguous");
        KvView k{kc.data(), f16, kc.shape(1) * kc.shape(2)}, v{vc.data(), f16, vc.shape(1) * vc.shape(2)};
        py::array_t<float> out({q.shape(0), q.shape(1), q.shape(2)});
        attention(q.data(), k, v, n_tok, pos0, (int32_t)q.shape(1), (int32_t)kc.shape(1),
                  (int32_t)q.shape(2), scale, out.mutable_data());
        return out;
      });
  ops.def("softmax", [](const f32_array& x) {
    py::array_t<float> y(x.size());
    std::memcpy(y.mutable_data(), x.data(), sizeof(float) * x.size());
    softmax(y.mutable_data(), x.size());
    return y;
  });
  ops.def("swiglu", [](const f32_array& g, const f32_array& u) {
    if (g.size() != u.size()) throw Error("gate and up differ in size");
    py::array_t<float> y(g.size());
    swiglu(g.data(), u.data(), y.mutable_data(), g.size());
    return y;
  });
  ops.def("apply_penalties", [](const f32_array& logits, const py::dict& p, const i32_array& prompt,
                                const i32_array& generated) {
    py::array_t<float> y(logits.size());
    std::memcpy(y.mutable_data(), logits.data(), sizeof(float) * logits.size());
    apply_penalties(y.mutable_data(), logits.size(), sampling_from_dict(p), prompt.data(),
                    prompt.size(), generated.data(), generated.size());
    return y;
  });
  ops.def("sampling_probs", [](const f32_array& logits, const py::dict& p) {
    py::array_t<float> y(logits.size());
    sampling_probs(logits.data(), logits.size(), sampling_from_dict(p), y.mutable_data());
    return y;
  });
  ops.def("argmax", [](const f32_array& x) { return argmax(x.data(), x.size()); });
  ops.def(
      "verify_position",
      [](const f32_array& p, const py::object& q, int32_t draft, bool greedy, double u_accept, double u_resample) {
        // The accept rule of one verified position (engine/accept.h) -> (accepted, token).
        f32_array qa;
        if (!q.is_none()) {
          qa = q.cast<f32_array>();
          if (qa.size() != p.size()) throw Error("p and q must have the same length");
        }
        std::vector<float> residual((size_t)p.size());
        const Verdict v = verify_position(p.data(), q.is_none() ? nullptr : qa.data(), p.size(), draft, greedy,
                                          u_accept, u_resample, residual.data());
        return py::make_tuple(v.accepted, v.token);
      },
      py::arg("p"), py::arg("q"), py::arg("draft"), py::arg("greedy"), py::arg("u_accept") = 0.0,
      py::arg("u_resample") = 0.0);
  ops.def("sample_from", [](const f32_array& p, double u) { return sample_from(p.data(), p.size(), u); });
  ops.def("rng_uniform", [](uint64_t seed, int64_t n) {
    Rng r(seed);
    py::array_t<double> y(n);
    for (int64_t i = 0; i < n; ++i) y.mutable_data()[i] = r.uniform();
    return y;
  });
  // ---- DFlash: one sequence's drafter driven through the Drafter interface (tests) ----
  py::class_<PyDFlash>(m, "DFlash")
      .def(py::init([](const py::dict& config, const py::list& tensors, const py::dict& target_config,
                       const py::list& target_tensors, int64_t n_ctx, const std::string& kv_type) {
             auto p = std::make_unique<PyDFlash>();
             if (kv_type != "f16" && kv_type != "f32") throw Error("kv_type must be 'f16' or 'f32'");
             const DFlashConfig c = dflash_config_from_dict(config);
             const ModelConfig tc = config_from_dict(target_config);
             std::vector<TensorRef> refs = tensor_refs(tensors, p->keep_alive);
             std::vector<TensorRef> trefs = tensor_refs(target_tensors, p->keep_alive);
             p->target = std::make_unique<Model>(tc, trefs);
             p->model = std::make_unique<DFlashModel>(c, refs);
             DrafterEnv env;
             env.target = p->target.get();
             env.n_ctx = n_ctx;
             env.kv_f16 = kv_type == "f16";
             p->drafter = make_dflash_drafter(*p->model, env);
             return p;
           }),
           py::arg("config"), py::arg("tensors"), py::arg("target_config"), py::arg("target_tensors"),
           py::arg("n_ctx"), py::arg("kv_type") = "f32")
      .def_property_readonly("hidden_layers", [](PyDFlash& p) { return p.drafter->hidden_layers(); })
      .def(
          "commit",
          [](PyDFlash& p, int64_t n_past, const f32_array& hidden) {
            // hidden [n_new, L, dim]: the target states of positions n_past - n_new .. n_past - 1
            if (hidden.ndim() != 3) throw Error("hidden must be [n_new, n_layers, dim]");
            HiddenStates hs;
            hs.data = hidden.data();
            hs.n_pos = hidden.shape(0);
            hs.n_layers = (int32_t)hidden.shape(1);
            hs.dim = (int32_t)hidden.shape(2);
            hs.pos0 = n_past - hs.n_pos;
            CommitInfo info;
            info.n_past = n_past;
            info.n_new = hs.n_pos;
            info.hidden = &hs;
            py::gil_scoped_release nogil;
            p.drafter->commit(info);
          },
          py::arg("n_past"), py::arg("hidden"))
      .def("rollback", [](PyDFlash& p, int64_t n_past) { p.drafter->rollback(n_past); })
      .def(
          "draft",
          [](PyDFlash& p, const i32_array& tokens, int k, const py::object& sampling) {
            // tokens: the target's n_past tokens + the pending one -> (drafts, q [n, n_vocab] or None)
            SamplingParams sp;
            sp.temperature = 0.0f;
            if (!sampling.is_none()) sp = sampling_from_dict(sampling.cast<py::dict>());
            if (!sampling.is_none()) p.rng = Rng(sp.seed);
            DraftContext ctx;
            ctx.tokens = tokens.data();
            ctx.n_tokens = tokens.size();
            ctx.n_past = ctx.n_tokens - 1;
            ctx.prompt = tokens.data();
            ctx.n_prompt = ctx.n_past;
            ctx.generated = tokens.data() + ctx.n_past;  // the pending token
            ctx.n_generated = ctx.n_tokens > 0 ? 1 : 0;
            ctx.params = &sp;
            ctx.rng = &p.rng;
            std::vector<int32_t> out;
            std::vector<float> q;
            {
              py::gil_scoped_release nogil;
              p.drafter->draft(ctx, k, out, q);
            }
            py::object qa = py::none();
            if (!q.empty()) {
              const int64_t nv = p.model->config().n_vocab;
              py::array_t<float> a({(int64_t)out.size(), nv});
              std::memcpy(a.mutable_data(), q.data(), sizeof(float) * q.size());
              qa = a;
            }
            return py::make_tuple(out, qa);
          },
          py::arg("tokens"), py::arg("k"), py::arg("sampling") = py::none());

  // The target forward with its residual stream captured after `layers` (tests only).
  ops.def(
      "forward_hidden",
      [](const py::dict& config, const py::list& tensors, const i32_array& tokens,
         const std::vector<int32_t>& layers, const std::string& kv_type) {
        py::list keep;
        ModelConfig cfg = config_from_dict(config);
        std::vector<TensorRef> refs = tensor_refs(tensors, keep);
        Model model(cfg, refs);
        const int64_t n = tokens.size();
        KvCache kv(cfg.n_layers, n, model.kv_dim(), kv_type == "f16");
        py::array_t<float> logits({n, (int64_t)cfg.n_vocab});
        py::array_t<float> hidden({n, (int64_t)layers.size(), (int64_t)cfg.dim});
        HiddenCapture cap;
        cap.layers = layers.data();
        cap.n_layers = (int32_t)layers.size();
        cap.out = hidden.mutable_data();
        model.forward(kv, tokens.data(), n, 0, logits.mutable_data(), true, layers.empty() ? nullptr : &cap);
        return py::make_tuple(logits, hidden);
      },
      py::arg("config"), py::arg("tensors"), py::arg("tokens"), py::arg("layers"), py::arg("kv_type") = "f32");
}
