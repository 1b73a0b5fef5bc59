// specd/cuda/testing.h: host-pointer entry points to each GPU op, for the tests
// (bindings/gpu_ops.cpp exposes them as worker._specd.gpu_ops). Plain C++: no GPU headers,
// so the bindings compile with the host compiler. Each copies its inputs to the current
// device, runs the op once, synchronises and copies the outputs back; errors throw Error.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/matmul.h"  // WeightView (host bytes, GGUF layout)
#include "cpu/ops.h"     // RopeParams

namespace specd {
namespace gpu {
namespace testing {

int device_count();                      // 0 when no usable device (or no driver)
std::string device_name(int device);
bool wgmma();  // the current device takes the sm_90a prefill GEMM (dev_limits().wgmma)

// cuda/trace.cuh: records of the traced kernels (a SPECD_GPU_TRACE=1 build) from now on, at
// most cap; false (and nothing recorded) in other builds. trace_end(): waits for the device,
// stops recording and returns the records (kTraceWords words each).
bool trace_begin(int64_t cap);
std::vector<uint64_t> trace_end();

// cuda/linear.cuh with host arrays. ws: 1..3 host weights; biases: same length as ws, each
// null or [n_out_j]; x [n, K]; norm_w null or [K]; y [n, ldy] (read too for Accumulate);
// tensor_cores: LinearArgs's.
void linear(const std::vector<WeightView>& ws, const std::vector<const float*>& biases, const float* x,
            int64_t n, const float* norm_w, float eps, int32_t epilogue, float* y, int64_t ldy,
            bool tensor_cores = false);
void embed_rows(const WeightView& w, const int32_t* tokens, int64_t n, float* out);  // out [n, n_in]

// cuda/norm.cuh
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps);

// cuda/rope_kv.cuh. qkv [n, ld_qkv] in/out (q part roped in place); k_cache/v_cache: the
// layer's cache [n_ctx, n_kv*hd] as raw bytes (uint16 fp16 bits when kv_f16, else float),
// in/out. rope.freq_factors: host pointer or null. q_norm/k_norm: host or null.
void rope_kv(float* qkv, int64_t ld_qkv, int64_t n, int32_t pos0, int32_t n_heads, int32_t n_kv_heads,
             int32_t head_dim, const float* q_norm, const float* k_norm, float eps, const RopeParams& rope,
             void* k_cache, void* v_cache, bool kv_f16, int64_t n_ctx);

// cuda/attention.cuh. q [n, n_heads*hd]; caches as in rope_kv (input only); out [n, n_heads*hd].
// Runs the op twice on one workspace and returns the second output (its counters must be back
// at 0 after every call).
void attention(const float* q, const void* k_cache, const void* v_cache, bool kv_f16, int64_t n_ctx, int64_t n,
               int32_t pos0, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float scale, float* out);

// cuda/attention.cuh with its rope_kv step (AttnArgs::rope): qkv [n, ld_qkv] raw rows (input
// only), the rest as rope_kv, then out [n, n_heads*hd]. Fused inside the attention kernel for
// n <= kAttnMaxFusedRows (decode; unless SPECD_GPU_FUSE_ROPE=0), else rope_kv's kernel first.
void rope_attention(const float* qkv, int64_t ld_qkv, int64_t n, int32_t pos0, int32_t n_heads, int32_t n_kv_heads,
                    int32_t head_dim, const float* q_norm, const float* k_norm, float eps, const RopeParams& rope,
                    void* k_cache, void* v_cache, bool kv_f16, int64_t n_ctx, float scale, float* out);

// cuda/sample.cuh
void argmax_rows(const float* logits, int64_t n, int64_t nv, int32_t* out);
void softmax_rows(float* x, int64_t n, int64_t nv);

}  // namespace testing
}  // namespace gpu
}  // namespace specd
