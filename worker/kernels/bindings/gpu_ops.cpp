// specd/bindings/gpu_ops.cpp: worker._specd.gpu_ops, each GPU op on host arrays (tests
// compare them with the CPU ops and numpy float64). Only built with SPECD_BACKEND=cuda|hip.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/types.h"
#include "cuda/testing.h"

namespace py = pybind11;
using namespace specd;
namespace T = specd::gpu::testing;

namespace {

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using u8_array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

// (type, bytes, n_in, n_out) -> WeightView over the (kept alive) uint8 array.
WeightView weight_of(const py::tuple& t, std::vector<u8_array>& keep) {
  if (t.size() != 4) throw Error("a weight is a tuple (type, data, n_in, n_out)");
  const TypeTraits& tr = type_traits(t[0].cast<int32_t>());
  keep.push_back(t[1].cast<u8_array>());
  const u8_array& a = keep.back();
  WeightView w;
  w.type = tr.type;
  w.n_in = t[2].cast<int64_t>();
  w.n_out = t[3].cast<int64_t>();
  w.row_stride = row_bytes(tr.type, w.n_in);
  w.data = a.data();
  if ((size_t)a.size() != w.row_stride * (size_t)w.n_out)
    throw Error("weight holds " + std::to_string(a.size()) + " bytes, expected " +
                std::to_string(w.row_stride * (size_t)w.n_out));
  return w;
}

const float* opt_f32(const py::object& o, std::vector<f32_array>& keep, int64_t n, const char* what) {
  if (o.is_none()) return nullptr;
  keep.push_back(o.cast<f32_array>());
  if (keep.back().size() != n) throw Error(std::string(what) + " must have " + std::to_string(n) + " elements");
  return keep.back().data();
}

// A layer's cache as a contiguous uint16 (fp16 bits) or float32 array [n_ctx, kvd]; copied.
py::array cache_copy(const py::array& c, bool& f16) {
  f16 = c.dtype().is(py::dtype("float16")) || c.dtype().is(py::dtype::of<uint16_t>());
  if (!f16 && !c.dtype().is(py::dtype::of<float>())) throw Error("cache must be float16/uint16 or float32");
  if (c.ndim() != 2) throw Error("cache must be [n_ctx, n_kv_heads*head_dim]");
  py::array out(c.dtype(), {c.shape(0), c.shape(1)});
  py::array src = py::array::ensure(c, py::array::c_style);
  std::memcpy(out.mutable_data(), src.data(), (size_t)src.nbytes());
  return out;
}

void check_cache(const py::array& k, const py::array& v, int32_t n_kv_heads, int32_t head_dim) {
  if (k.shape(1) != (int64_t)n_kv_heads * head_dim || v.shape(1) != k.shape(1) || v.shape(0) != k.shape(0))
    throw Error("caches must both be [n_ctx, n_kv_heads*head_dim] = [n_ctx, " +
                std::to_string((int64_t)n_kv_heads * head_dim) + "]");
}

RopeParams rope_of(const py::dict& d, std::vector<f32_array>& keep) {
  RopeParams p;
  p.n_dims = d["n_dims"].cast<int32_t>();
  p.freq_base = d.contains("freq_base") ? d["freq_base"].cast<float>() : 10000.f;
  p.freq_scale = d.contains("freq_scale") ? d["freq_scale"].cast<float>() : 1.f;
  const std::string mode = d.contains("mode") ? d["mode"].cast<std::string>() : "normal";
  if (mode == "normal") p.mode = RopeMode::Normal;
  else if (mode == "neox") p.mode = RopeMode::Neox;
  else throw Error("rope mode must be 'normal' or 'neox'");
  if (d.contains("freq_factors") && !d["freq_factors"].is_none())
    p.freq_factors = opt_f32(d["freq_factors"], keep, p.n_dims / 2, "freq_factors");
  return p;
}

// Both caches of a layer, copied (the ops write them) and checked: one type, same shape.
struct Caches {
  py::array k, v;
  bool f16 = false;
};
Caches caches_copy(const py::array& k_cache, const py::array& v_cache, int32_t n_kv_heads, int32_t head_dim) {
  Caches c;
  bool f16v;
  c.k = cache_copy(k_cache, c.f16);
  c.v = cache_copy(v_cache, f16v);
  if (c.f16 != f16v) throw Error("k and v caches must have the same type");
  check_cache(c.k, c.v, n_kv_heads, head_dim);
  return c;
}

// rope_kv's per-layer parameters; they point into arrays held by `keep`.
struct RopeInputs {
  const float* q_norm;
  const float* k_norm;
  RopeParams rope;
};
RopeInputs rope_inputs(const py::object& q_norm, const py::object& k_norm, const py::dict& rope, int32_t head_dim,
                       std::vector<f32_array>& keep) {
  const float* qn = opt_f32(q_norm, keep, head_dim, "q_norm");
  const float* kn = opt_f32(k_norm, keep, head_dim, "k_norm");
  return {qn, kn, rope_of(rope, keep)};
}

}  // namespace

void register_gpu_ops(py::module_& m) {
  py::module_ g = m.def_submodule("gpu_ops", "single GPU ops on host arrays (tests compare them with the CPU)");
  g.def("device_count", &T::device_count);
  g.def("device_name", &T::device_name, py::arg("device") = 0);
  g.def("wgmma", &T::wgmma, "whether the current device takes the sm_90a prefill GEMM");
  g.def("trace_begin", &T::trace_begin, py::arg("cap"),
        "record the traced kernels' phase marks (a SPECD_GPU_TRACE=1 build; false in others)");
  g.def("trace_end", [] {
    const std::vector<uint64_t> v = T::trace_end();
    py::array_t<uint64_t> a({(py::ssize_t)(v.size() / 8), (py::ssize_t)8});
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
  }, "the records since trace_begin, [n, 8] uint64 (cuda/trace.cuh)");
  g.def(
      "linear",
      [](const py::list& weights, const py::list& biases, const f32_array& x, py::object norm_w, float eps,
         int32_t epilogue, py::object y_in, bool tensor_cores) {
        std::vector<u8_array> keep;
        std::vector<f32_array> keepf;
        std::vector<WeightView> ws;
        for (auto w : weights) ws.push_back(weight_of(w.cast<py::tuple>(), keep));
        if (ws.empty() || ws.size() > 3) throw Error("linear takes 1..3 weights");
        if (biases.size() != ws.size()) throw Error("give one bias (or None) per weight");
        std::vector<const float*> bs;
        for (size_t j = 0; j < ws.size(); ++j) bs.push_back(opt_f32(biases[j], keepf, ws[j].n_out, "bias"));
        if (x.ndim() != 2 || x.shape(1) != ws[0].n_in) throw Error("x must be [n, n_in]");
        const int64_t n = x.shape(0);
        const float* nw = opt_f32(norm_w, keepf, ws[0].n_in, "norm_w");
        int64_t cols = 0;
        if (epilogue == 0) for (auto& w : ws) cols += w.n_out;
        else cols = ws[0].n_out;
        py::array_t<float> y({n, cols});
        if (epilogue == 1) {
          if (y_in.is_none()) throw Error("Accumulate needs y");
          f32_array yi = y_in.cast<f32_array>();
          if (yi.size() != n * cols) throw Error("y must be [n, n_out]");
          std::memcpy(y.mutable_data(), yi.data(), sizeof(float) * (size_t)(n * cols));
        }
        float* yp = y.mutable_data();
        {
          py::gil_scoped_release nogil;
          T::linear(ws, bs, x.data(), n, nw, eps, epilogue, yp, cols, tensor_cores);
        }
        return y;
      },
      py::arg("weights"), py::arg("biases"), py::arg("x"), py::arg("norm_w") = py::none(), py::arg("eps") = 0.f,
      py::arg("epilogue") = 0, py::arg("y") = py::none(), py::arg("tensor_cores") = false);
  g.def("embed_rows", [](const py::tuple& w, const i32_array& tokens) {
    std::vector<u8_array> keep;
    WeightView wv = weight_of(w, keep);
    py::array_t<float> out({(int64_t)tokens.size(), wv.n_in});
    T::embed_rows(wv, tokens.data(), tokens.size(), out.mutable_data());
    return out;
  });
  g.def("rmsnorm", [](const f32_array& x, const f32_array& w, float eps) {
    if (x.ndim() != 2 || w.ndim() != 1 || w.shape(0) != x.shape(1)) throw Error("x [rows, dim], w [dim]");
    py::array_t<float> y({x.shape(0), x.shape(1)});
    T::rmsnorm(x.data(), w.data(), y.mutable_data(), x.shape(0), x.shape(1), eps);
    return y;
  });
  g.def(
      "rope_kv",
      [](const f32_array& qkv, int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
         py::object q_norm, py::object k_norm, float eps, const py::dict& rope, const py::array& k_cache,
         const py::array& v_cache) {
        std::vector<f32_array> keep;
        if (qkv.ndim() != 2) throw Error("qkv must be [n, ld]");
        py::array_t<float> q({qkv.shape(0), qkv.shape(1)});
        std::memcpy(q.mutable_data(), qkv.data(), sizeof(float) * (size_t)qkv.size());
        const RopeInputs r = rope_inputs(q_norm, k_norm, rope, head_dim, keep);
        Caches c = caches_copy(k_cache, v_cache, n_kv_heads, head_dim);
        T::rope_kv(q.mutable_data(), qkv.shape(1), qkv.shape(0), pos0, n_heads, n_kv_heads, head_dim, r.q_norm,
                   r.k_norm, eps, r.rope, c.k.mutable_data(), c.v.mutable_data(), c.f16, c.k.shape(0));
        return py::make_tuple(q, c.k, c.v);
      },
      py::arg("qkv"), py::arg("pos0"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"),
      py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 0.f, py::arg("rope"),
      py::arg("k_cache"), py::arg("v_cache"));
  g.def(
      "attention",
      [](const f32_array& q, const py::array& k_cache, const py::array& v_cache, int32_t pos0, int32_t n_heads,
         int32_t n_kv_heads, int32_t head_dim, float scale) {
        const Caches c = caches_copy(k_cache, v_cache, n_kv_heads, head_dim);
        if (q.ndim() != 2 || q.shape(1) != (int64_t)n_heads * head_dim) throw Error("q must be [n, n_heads*head_dim]");
        py::array_t<float> out({q.shape(0), q.shape(1)});
        float* op = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          T::attention(q.data(), c.k.data(), c.v.data(), c.f16, c.k.shape(0), q.shape(0), pos0, n_heads, n_kv_heads,
                       head_dim, scale, op);
        }
        return out;
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pos0"), py::arg("n_heads"),
      py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("scale"));
  g.def(
      "rope_attention",
      [](const f32_array& qkv, int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
         py::object q_norm, py::object k_norm, float eps, const py::dict& rope, const py::array& k_cache,
         const py::array& v_cache, float scale) {
        std::vector<f32_array> keep;
        if (qkv.ndim() != 2) throw Error("qkv must be [n, ld]");
        const RopeInputs r = rope_inputs(q_norm, k_norm, rope, head_dim, keep);
        Caches c = caches_copy(k_cache, v_cache, n_kv_heads, head_dim);
        py::array_t<float> out({qkv.shape(0), (py::ssize_t)n_heads * head_dim});
        float* op = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          T::rope_attention(qkv.data(), qkv.shape(1), qkv.shape(0), pos0, n_heads, n_kv_heads, head_dim, r.q_norm,
                            r.k_norm, eps, r.rope, c.k.mutable_data(), c.v.mutable_data(), c.f16, c.k.shape(0), scale,
                            op);
        }
        return py::make_tuple(out, c.k, c.v);
      },
      py::arg("qkv"), py::arg("pos0"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"),
      py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 0.f, py::arg("rope"),
      py::arg("k_cache"), py::arg("v_cache"), py::arg("scale"));
  g.def("argmax_rows", [](const f32_array& logits) {
    if (logits.ndim() != 2) throw Error("logits must be [n, n_vocab]");
    py::array_t<int32_t> out(logits.shape(0));
    T::argmax_rows(logits.data(), logits.shape(0), logits.shape(1), out.mutable_data());
    return out;
  });
  g.def("softmax_rows", [](const f32_array& x) {
    if (x.ndim() != 2) throw Error("x must be [n, nv]");
    py::array_t<float> y({x.shape(0), x.shape(1)});
    std::memcpy(y.mutable_data(), x.data(), sizeof(float) * (size_t)x.size());
    T::softmax_rows(y.mutable_data(), x.shape(0), x.shape(1));
    return y;
  });
}
