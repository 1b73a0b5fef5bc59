// specd/model/tensor_table.cpp: checked tensor lookup (see tensor_table.h).
#include "model/tensor_table.h"

#include "cpu/quants.h"

namespace specd {

namespace {

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// Trailing 1s carry no data ([576, 1] is [576]); GGUF writers differ on keeping them.
std::vector<int64_t> squeezed(std::vector<int64_t> ne) {
  while (ne.size() > 1 && ne.back() == 1) ne.pop_back();
  return ne;
}

void check_shape(const TensorRef& t, const std::vector<int64_t>& expect, const char* meaning) {
  if (squeezed(t.ne) != squeezed(expect))
    throw Error("tensor '" + t.name + "' has shape " + shape_str(t.ne) + ", expected " + shape_str(expect) + " (" +
                meaning + "); the file does not match its metadata");
}

void check_bytes(const TensorRef& t, size_t expect) {
  if (t.data == nullptr || t.nbytes != expect)
    throw Error("tensor '" + t.name + "' holds " + std::to_string(t.nbytes) + " bytes, its shape and type need " +
                std::to_string(expect) + " (truncated or corrupt file?)");
}

}  // namespace

TensorTable::TensorTable(const std::vector<TensorRef>& ts, TensorFileHints hints) : hints_(std::move(hints)) {
  for (const auto& t : ts) by_name_.emplace(t.name, &t);
}

const TensorRef* TensorTable::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorRef& TensorTable::need(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorRef* t = find(name);
  if (!t)
    throw Error(hints_.file + " has no tensor '" + name + "' (" + hints_.needed_by + "shape " + shape_str(shape) +
                "); " + hints_.advice);
  return *t;
}

WeightView TensorTable::matrix(const TensorRef& t, int64_t n_in, int64_t n_out, const char* meaning) const {
  check_shape(t, {n_in, n_out}, meaning);
  const TypeTraits& tt = type_traits((int32_t)t.type);
  if (n_in % tt.block_elems != 0)
    throw Error("tensor '" + t.name + "' has rows of " + std::to_string(n_in) + " elements, not a multiple of the " +
                tt.name + " block size " + std::to_string(tt.block_elems));
  WeightView w;
  w.type = t.type;
  w.n_in = n_in;
  w.n_out = n_out;
  w.data = t.data;
  w.row_stride = row_bytes(t.type, n_in);
  check_bytes(t, w.row_stride * (size_t)n_out);
  return w;
}

WeightView TensorTable::matrix(const std::string& name, int64_t n_in, int64_t n_out, const char* meaning) const {
  return matrix(need(name, {n_in, n_out}), n_in, n_out, meaning);
}

const float* TensorTable::vec(const TensorRef& t, int64_t n, const char* meaning) const {
  check_shape(t, {n}, meaning);
  if (t.type != GgmlType::F32)
    throw Error("tensor '" + t.name + "' is stored as " + type_traits((int32_t)t.type).name +
                "; norm weights and biases must be F32");
  check_bytes(t, sizeof(float) * (size_t)n);
  return reinterpret_cast<const float*>(t.data);
}

const float* TensorTable::vec(const std::string& name, int64_t n, const char* meaning) const {
  return vec(need(name, {n}), n, meaning);
}

const float* TensorTable::vec_opt(const std::string& name, int64_t n, const char* meaning) const {
  const TensorRef* t = find(name);
  return t ? vec(*t, n, meaning) : nullptr;
}

}  // namespace specd
