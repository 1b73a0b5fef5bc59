// specd/cpu/matmul.cpp: y[m, n_out] = x[m, n_in] @ W^T for a stored (possibly quantized)
// weight, threaded over output rows with parallel_for. Chooses the SIMD path at run time.
//   m <= 5 (decode, speculative verify): each weight row is decoded in registers and
//          dotted with every activation row (avx2::dot_rows, several weight rows
//          interleaved) - bound by decode work and DRAM; m = 1 is the product's hot loop.
//   m > 5 (prefill): a panel of kPanel rows is dequantized once into a float32 scratch
//          buffer, then register tiles of 3 activation rows x 4 weight rows reuse it for
//          all m rows (avx2::gemm_f32) - compute-bound, near the FMA peak (3x4 measured
//          faster than 2x6 and 4x3 tiles).
// All paths give bit-identical results per output element (see quants_impl.h).
#include "cpu/matmul.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/parallel.h"
#include "cpu/quants.h"
#include "cpu/quants_impl.h"

namespace specd {

namespace {

constexpr int64_t kPanel = 16;        // weight rows dequantized together (m > 1)
constexpr int64_t kGrainDecode = 16;  // rows per parallel_for grain, m = 1
constexpr int64_t kGrainPrefill = kPanel;

// Per-thread scratch for dequantized panels: [kPanel, n_in] float32. Pool threads are
// persistent, so this is allocated once per thread and reused across calls.
float* panel_scratch(int64_t n_floats) {
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < n_floats) buf.resize((size_t)n_floats);
  return buf.data();
}

// Portable path: dequantize each row, then scalar dots (same values whatever m).
void matmul_scalar(const WeightView& w, const float* x, int64_t m, float* y, int64_t r0, int64_t r1) {
  float* row = panel_scratch(w.n_in);  // [n_in]
  for (int64_t r = r0; r < r1; ++r) {
    scalar::dequantize_row(w.type, w.row(r), row, w.n_in);
    for (int64_t a = 0; a < m; ++a) y[a * w.n_out + r] = scalar::dot_f32(row, x + a * w.n_in, w.n_in);
  }
}

#if SPECD_HAVE_X86
void matmul_avx2_rows(const WeightView& w, const float* x, int64_t m, float* y, int64_t r0, int64_t r1) {
  if (m <= avx2::kMaxFusedRows) {
    avx2::dot_rows(w.type, w.row(r0), w.row_stride, r1 - r0, x, m, w.n_in, y + r0, w.n_out);
    return;
  }
  // F32 weights are used in place when they are float-aligned.
  const bool in_place = w.type == GgmlType::F32 && w.row_stride % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(w.data) % 4 == 0;
  float* panel = in_place ? nullptr : panel_scratch(kPanel * w.n_in);  // [kPanel, n_in]
  for (int64_t p0 = r0; p0 < r1; p0 += kPanel) {
    const int64_t rows = r1 - p0 < kPanel ? r1 - p0 : kPanel;
    const float* wp;
    int64_t ldw;
    if (in_place) {
      wp = reinterpret_cast<const float*>(w.row(p0));
      ldw = (int64_t)(w.row_stride / 4);
    } else {
      for (int64_t r = 0; r < rows; ++r) avx2::dequantize_row(w.type, w.row(p0 + r), panel + r * w.n_in, w.n_in);
      wp = panel;
      ldw = w.n_in;
    }
    avx2::gemm_f32(wp, ldw, rows, x, w.n_in, m, w.n_in, y + p0, w.n_out);
  }
}
#endif

}  // namespace

void matmul(const WeightView& w, const float* x, int64_t m, float* y) {
  const TypeTraits& t = type_traits((int32_t)w.type);  // throws naming supported types
  SPECD_CHECK(w.valid(), "matmul: the weight view has no data");
  SPECD_CHECK(w.n_in > 0 && w.n_out >= 0 && m >= 0,
              "matmul: bad shape n_in=" + std::to_string(w.n_in) + " n_out=" + std::to_string(w.n_out) +
                  " m=" + std::to_string(m) + " (need n_in > 0, n_out >= 0, m >= 0)");
  const size_t rb = row_bytes(w.type, w.n_in);  // throws unless n_in % block size == 0
  SPECD_CHECK(w.row_stride >= rb, std::string("matmul: row stride ") + std::to_string(w.row_stride) +
                                      " bytes is smaller than one " + t.name + " row of " +
                                      std::to_string(w.n_in) + " elements (" + std::to_string(rb) + " bytes)");
  if (m == 0 || w.n_out == 0) return;
  SPECD_CHECK(x != nullptr && y != nullptr, "matmul: null activation or output buffer");
#if SPECD_HAVE_X86
  if (cpu_has_avx2()) {
    parallel_for(w.n_out, m == 1 ? kGrainDecode : kGrainPrefill,
                 [&](int64_t r0, int64_t r1) { matmul_avx2_rows(w, x, m, y, r0, r1); });
    return;
  }
#endif
  parallel_for(w.n_out, kGrainDecode, [&](int64_t r0, int64_t r1) { matmul_scalar(w, x, m, y, r0, r1); });
}

}  // namespace specd
