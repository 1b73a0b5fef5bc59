// specd/cuda/linear.cuh: y = x W^T for stored (possibly quantized) GGUF weights, every type
// the CPU backend supports (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K), and the
// token-embedding lookup. Implemented in matvec_tc.cu / matvec_kq.cu / matvec_f16.cu / matvec.cu (n <=
// kMaxSmallBatch) and matmul.cu (n > kMaxSmallBatch, tensor cores); the block decoders are in
// quants.cuh.
//
// Two paths, chosen by n (rows of x):
//  * n <= kMaxSmallBatch (decode, speculative verify): float32-accurate and BATCH-INVARIANT:
//    row r of y is bit-identical whatever n is and whatever the other rows hold (each row's
//    dot products use the same mapping and reduction order). Lossless speculation needs
//    this: verifying k+1 positions must give the logits one decode step gives. Two readers,
//    chosen by LinearArgs::tensor_cores, the weight types and the device (never by n):
//    tensor cores when asked and every weight is F16 (with SPECD_GPU_TC=all also Q8_0, Q4_K,
//    Q6_K) on NVIDIA sm_80+ (matvec_tc.cu: x split into two fp16 halves, exact weights,
//    float32 MMA accumulation; a verify of 16 positions costs ~2 decode steps), else the
//    CUDA cores (matvec.cu): Q8_0, Q4_K and Q6_K times x rounded per 32-element block to
//    23-bit integer digits (dp4a, exact integer sums) when tensor_cores is false, float32
//    FMAs otherwise and for the other types. A call whose weights are all Q4_K / Q6_K (or all
//    Q8_0), 16-byte aligned data, rows of whole words (Q6_K: K a multiple of 512), takes the
//    same digits in matvec_kq.cu whatever tensor_cores says
//    (weights loaded straight into registers, no staging), and from 5 rows of x on NVIDIA
//    sm_80+ matvec_kq_mma.cu (int8 MMAs: the same exact sums, the same float order, the same
//    bits; the weights read once per 16 rows of x); all F16 / all BF16 likewise in
//    matvec_f16.cu (float32 fmas) when tensor_cores is false.
//  * n > kMaxSmallBatch (prefill): a GEMM on tensor cores, fp16 x fp16 -> fp32 accumulate,
//    with tiles of W decoded to fp16 in shared memory (F16 weights copied as stored). On
//    NVIDIA sm_80+ x is first rounded to fp16 into LinearArgs::work, then copied in tiles
//    with cp.async through a 3-stage pipeline (mma.sync + ldmatrix); elsewhere (HIP, older
//    GPUs) the wmma kernel, or its FMA fallback on HIP, converts x per tile. Activations are
//    rounded to fp16 (relative error ~1e-3); not batch-invariant.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace specd {
namespace gpu {

constexpr int64_t kMaxSmallBatch = 64;

enum class Epilogue : int32_t {
  Store = 0,       // y[r, off_j + o] = dot(W_j[o], x_r) + bias_j[o]    (off_j = rows of W_0..W_{j-1})
  Accumulate = 1,  // y[r, o] += dot(W_0[o], x_r) + bias_0[o]           (n_w == 1; the residual add)
  SwiGLU = 2,      // y[r, o] = silu(g) * u, g = dot(W_0[o], x_r) + b_0[o], u = dot(W_1[o], x_r) + b_1[o]
                   //           (n_w == 2, W_0 = gate, W_1 = up, same shape; silu(g) = g / (1 + exp(-g)))
};

struct LinearArgs {
  const GpuWeight* w[3] = {nullptr, nullptr, nullptr};  // 1..3 weights, all with the same n_in (K)
  int32_t n_w = 1;
  const float* bias[3] = {nullptr, nullptr, nullptr};   // optional, device, [w[j]->n_out]
  const float* x = nullptr;      // device [n, K] row-major (row stride K)
  int64_t n = 1;                 // rows, >= 1
  // Optional fused input RMSNorm (small path only; throws Error for n > kMaxSmallBatch):
  // x_r is replaced by x_r[i] * inv_r * norm_w[i], inv_r = 1 / sqrt(mean_i(x_r[i]^2) + eps).
  const float* norm_w = nullptr;  // device [K]
  float eps = 0.f;
  float* y = nullptr;            // device [n, ldy]; must not overlap x
  int64_t ldy = 0;               // >= total output columns of the epilogue
  Epilogue ep = Epilogue::Store;
  // Small path on tensor cores (matvec_tc.cu) where the weights' types have a reader there:
  // a verify of 4 positions costs ~1.2-1.4 decode steps, 16 ~2, but one decode step is 10-22 %
  // slower than on the CUDA cores for F16 (H200, 2026-11-30). Batch invariance holds within
  // one choice: a model makes it once.
  // SPECD_GPU_TC overrides it for benchmarks: "0" never, "f16" F16 always, "all" also Q8_0,
  // Q4_K, Q6_K always. On the CUDA cores, false also selects the staged digit reader for Q8_0 /
  // Q4_K / Q6_K weights that matvec_kq.cu does not take (it takes aligned all-K-quant or
  // all-Q8_0 calls in every engine); SPECD_GPU_DIGITS=0 turns the digit readers off.
  bool tensor_cores = false;
  // Workspace: device memory of at least linear_work_bytes(n, K) bytes, 16-byte aligned, not
  // used by anything else during the call (n > kMaxSmallBatch: x in fp16, with
  // linear_work_bytes(n, K, rows) also the weights in fp16; 2..64 rows: x in digits for the
  // tensor-core digit reader, which the call skips without it). May be null when
  // linear_work_bytes is 0.
  void* work = nullptr;
  size_t work_bytes = 0;
};

// Bytes of LinearArgs::work that linear() needs for n rows of K inputs on the current device;
// with dequant_rows (the weights' total output rows, when they are not all F16) it also holds
// them decoded to fp16 for large n, which makes a quantized prefill faster.
size_t linear_work_bytes(int64_t n, int64_t K, int64_t dequant_rows = 0);

// Validates the arguments (throws Error naming the problem) and launches on `s`.
// Launch shapes depend only on (n, weight shapes, types), so the call can be captured in a
// graph.
void linear(const LinearArgs& a, gpuStream_t s);

// out[i, :] = dequantized row tokens[i] of w (n_in floats), i < n. Tokens are read on the
// device (d_tokens is a device pointer) and must be in [0, w.n_out).
void embed_rows(const GpuWeight& w, const int32_t* d_tokens, int64_t n, float* out, gpuStream_t s);

}  // namespace gpu
}  // namespace specd
