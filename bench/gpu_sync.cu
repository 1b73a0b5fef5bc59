// bench/gpu_sync.cu: what a kernel boundary costs a batch-1 decode step, against a grid
// barrier inside one persistent kernel (bench/bench_sync.py builds and runs this; it is not
// part of the engine).
//
// A decode step of an 8B Q4_K_M model is ~180 dependent matrix-vector launches: each streams
// its weights once and needs the whole output of the launch before it. This program streams
// the same bytes in the same dependent phases (per layer: QKV, attention at 64 positions,
// O, gate/up, down; then the output head) four ways:
//   kernels      one kernel per phase, captured in a CUDA graph;
//   kernels+pdl  the same with programmatic dependent launch, each kernel's first weight loads
//                issued before its grid dependency wait (what the engine does);
//   barrier      one cooperative kernel for the whole step, a grid barrier between phases,
//                the next phase's first weight loads issued before the barrier;
//   stream       that kernel without the barriers (wrong results, a floor: the same bytes
//                and x reads with nothing waiting).
// Every phase reads its whole input vector (x: written by the phase before) per CTA, reduces
// it with one CTA barrier, streams its weights with 16-byte loads (kBatch per thread in
// flight, two batches deep), and writes its output vector. The weights are never reused (4.7
// GB against 50-60 MB of L2). Prints one JSON object on stdout.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o gpu_sync bench/gpu_sync.cu
//   ./gpu_sync [reps] [ctas_per_sm] [layers]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                            \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "gpu_sync: %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

constexpr int kThreads = 256;
constexpr int kBatch = 8;  // 16-byte loads per thread in one batch

struct Phase {
  const uint4* w;  // weights
  size_t n16;      // their size in 16-byte words
  const float* x;  // input vector (the phase before's output)
  float* y;        // output vector
  int nx, ny;
};

struct Batch {
  uint4 v[kBatch];
};

// Batch k of this CTA's share of a phase's words: word (k kBatch + u) G T + cta T + t.
__device__ __forceinline__ void issue(const Phase& p, size_t k, Batch& b) {
  const size_t stride = (size_t)gridDim.x * kThreads;
  const size_t i0 = k * kBatch * stride + (size_t)blockIdx.x * kThreads + threadIdx.x;
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const size_t i = i0 + u * stride;
    b.v[u] = i < p.n16 ? __ldcs(p.w + i) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ uint32_t fold(const Batch& b, uint32_t acc) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) acc ^= b.v[u].x ^ b.v[u].y ^ b.v[u].z ^ b.v[u].w;
  return acc;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) t += red[w];
  __syncthreads();
  return t;
}

// One phase, its first batch already in `first`: x read and reduced, the weights streamed,
// this CTA's share of y written.
__device__ void run_phase(const Phase& p, Batch& first, float* red) {
  float s = 0.f;
  for (int i = threadIdx.x; i < p.nx; i += kThreads) s += __ldcg(p.x + i);
  s = block_sum(s, red);
  const size_t batches = (p.n16 + (size_t)gridDim.x * kThreads * kBatch - 1) / ((size_t)gridDim.x * kThreads * kBatch);
  uint32_t acc = 0;
  for (size_t k = 1; k < batches; ++k) {
    Batch nxt;
    issue(p, k, nxt);
    acc = fold(first, acc);
    first = nxt;
  }
  acc = fold(first, acc);
  const float a = block_sum((float)(acc & 0xFFu), red);
  for (int j = blockIdx.x * kThreads + threadIdx.x; j < p.ny; j += gridDim.x * kThreads) p.y[j] = s * 1e-9f + a;
}

__global__ void __launch_bounds__(kThreads) phase_kernel(Phase p) {
  __shared__ float red[kThreads / 32];
  Batch first;
  issue(p, 0, first);
  cudaGridDependencySynchronize();  // (a no-op without programmatic dependent launch)
  cudaTriggerProgrammaticLaunchCompletion();
  run_phase(p, first, red);
}

__device__ __forceinline__ uint32_t ld_acquire(const unsigned* a) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  return v;
}

// mode 0: the barrier (a counter, zeroed before the launch, that only grows: each CTA adds
// one per barrier, and barrier b waits until it reaches (b + 1) gridDim.x); mode 1: no barrier.
__global__ void __launch_bounds__(kThreads) step_kernel(const Phase* phases, int n, unsigned* count, int mode) {
  __shared__ float red[kThreads / 32];
  Batch first;
  issue(phases[0], 0, first);
  for (int i = 0; i < n; ++i) {
    run_phase(phases[i], first, red);
    if (i + 1 == n) break;
    issue(phases[i + 1], 0, first);
    if (mode == 0) {
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        const unsigned target = (unsigned)(i + 1) * gridDim.x;
        while ((int)(ld_acquire(count) - target) < 0) {
        }
      }
      __syncthreads();
    }
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int per_sm_want = argc > 2 ? std::atoi(argv[2]) : 2;
  const int layers = argc > 3 ? std::atoi(argv[3]) : 36;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0, per_sm_step = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, phase_kernel, kThreads, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_step, step_kernel, kThreads, 0));
  per_sm = std::min({per_sm, per_sm_step, per_sm_want});
  const int ctas = per_sm * prop.multiProcessorCount;

  // The phases of an 8B Q4_K_M decode step (bytes: Q4_K 0.5625 a weight, Q6_K 0.8203; the V
  // projection and half the down projections Q6_K, the head Q6_K).
  struct Shape {
    double bytes;
    int nx, ny;
  };
  const double q4 = 0.5625, q6 = 0.8203125;
  const int dim = 4096, ffn = 12288, kv = 1024, vocab = 151936;
  std::vector<Shape> shapes;
  for (int l = 0; l < layers; ++l) {
    shapes.push_back({dim * (dim + kv) * q4 + dim * kv * q6, dim, dim + 2 * kv});  // QKV
    shapes.push_back({64.0 * 2 * kv * 2, dim + 2 * kv, dim});                      // attention, 64 positions, f16 K/V
    shapes.push_back({dim * (double)dim * q4, dim, dim});                           // O
    shapes.push_back({2.0 * ffn * dim * q4, dim, ffn});                             // gate / up
    shapes.push_back({ffn * (double)dim * (l % 2 ? q6 : q4), ffn, dim});            // down
  }
  shapes.push_back({dim * (double)vocab * q6, dim, vocab});  // head
  const int n = (int)shapes.size();
  size_t total16 = 0, max_y = 0;
  for (const Shape& s : shapes) {
    total16 += ((size_t)s.bytes + 15) / 16;
    max_y = std::max<size_t>(max_y, (size_t)std::max(s.nx, s.ny));
  }
  uint4* w = nullptr;
  float* vec = nullptr;
  CHECK(cudaMalloc(&w, total16 * 16));
  CHECK(cudaMemset(w, 0x11, total16 * 16));
  CHECK(cudaMalloc(&vec, (n + 1) * max_y * sizeof(float)));
  CHECK(cudaMemset(vec, 0, (n + 1) * max_y * sizeof(float)));
  std::vector<Phase> ph(n);
  size_t off = 0;
  for (int i = 0; i < n; ++i) {
    const size_t w16 = ((size_t)shapes[i].bytes + 15) / 16;
    ph[i] = {w + off, w16, vec + i * max_y, vec + (i + 1) * max_y, shapes[i].nx, shapes[i].ny};
    off += w16;
  }
  Phase* d_ph = nullptr;
  unsigned* count = nullptr;
  CHECK(cudaMalloc(&d_ph, n * sizeof(Phase)));
  CHECK(cudaMemcpy(d_ph, ph.data(), n * sizeof(Phase), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&count, sizeof(unsigned)));

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  auto graph_of = [&](bool pdl) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.gridDim = dim3(ctas);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = s;
      cfg.attrs = attr;
      cfg.numAttrs = pdl ? 1 : 0;
      CHECK(cudaLaunchKernelEx(&cfg, phase_kernel, ph[i]));
    }
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaGraphDestroy(g));
    return ge;
  };
  auto step = [&](int mode) {
    CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
    void* args[] = {(void*)&d_ph, (void*)&n, (void*)&count, (void*)&mode};
    CHECK(cudaLaunchCooperativeKernel((void*)step_kernel, dim3(ctas), dim3(kThreads), args, 0, s));
  };
  auto time = [&](auto&& fn) {
    for (int r = 0; r < 3; ++r) fn();
    std::vector<float> us;
    for (int r = 0; r < reps; ++r) {
      CHECK(cudaEventRecord(e0, s));
      fn();
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(ms * 1e3f);
    }
    return us;
  };
  cudaGraphExec_t plain = graph_of(false), pdl = graph_of(true);
  const char* names[4] = {"kernels", "kernels+pdl", "barrier", "stream"};
  std::vector<float> res[4];
  for (int round = 0; round < 2; ++round) {  // two rounds, interleaved: drift shows as spread
    auto a = time([&] { CHECK(cudaGraphLaunch(plain, s)); });
    auto b = time([&] { CHECK(cudaGraphLaunch(pdl, s)); });
    auto c = time([&] { step(0); });
    auto d = time([&] { step(1); });
    res[0].insert(res[0].end(), a.begin(), a.end());
    res[1].insert(res[1].end(), b.begin(), b.end());
    res[2].insert(res[2].end(), c.begin(), c.end());
    res[3].insert(res[3].end(), d.begin(), d.end());
  }
  CHECK(cudaGetLastError());
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"ctas\": %d, \"ctas_per_sm\": %d, \"layers\": %d, \"phases\": %d, "
              "\"bytes\": %zu, \"reps\": %d, \"modes\": {",
              prop.name, prop.multiProcessorCount, ctas, per_sm, layers, n, total16 * 16, 2 * reps);
  for (int m = 0; m < 4; ++m) {
    const auto& v = res[m];
    std::printf("%s\"%s\": {\"median_us\": %.2f, \"min_us\": %.2f}", m ? ", " : "", names[m], median(v),
                *std::min_element(v.begin(), v.end()));
  }
  std::printf("}}\n");
  return 0;
}
