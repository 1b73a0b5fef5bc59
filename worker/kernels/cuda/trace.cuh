// specd/cuda/trace.cuh: per-CTA phase timestamps of the decode kernels, for finding where a
// decode step's time goes inside the captured graph (programmatic dependent launch and all,
// which Nsight Compute cannot show: it runs each kernel alone). Compiled in only with
// SPECD_GPU_TRACE=1 (a build of its own: CUDAFLAGS=-DSPECD_GPU_TRACE=1 tools/dev_build.sh
// trace); without it every macro below is empty and no kernel changes.
//
// A traced kernel keeps five marks in thread 0 of each CTA (TraceMarks: entry, the grid
// dependency wait returned, x prepared, its loop done, exit after a barrier) and writes one
// record of kTraceWords words per CTA into the buffer that testing::trace_begin() set:
//   0: %globaltimer at entry (ns)         4: %globaltimer after the wait (ns)
//   1: %globaltimer at exit (ns)          5: tag << 56 | smid << 40 | blockIdx.x
//   2: clock64 mark 1 - entry, mark 2 - entry (32 bits each, low first)
//   3: clock64 mark 3 - entry, exit - entry   6: key (the launch's output pointer ^ K << 48;
//                                                  kq_mma_kernel also ^ its weight type << 40)
//   7: gridDim.x | gridDim.y << 32
// Records of one launch share (tag, key, grid); tools/device/trace_decode.py reads them. A
// kernel with no x preparation or loop of its own sets marks 2 and 3 where it ends, except
// attn_decode_kernel: mark 2 after its stage (the query heads normed and roped, the new K / V
// row), mark 3 after its scores and softmax (so its "tail" is the weighted sum of V); a CTA
// that returns early (an attention CTA with no live item) writes no record.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

#ifndef SPECD_GPU_TRACE
#define SPECD_GPU_TRACE 0
#endif

namespace specd {
namespace gpu {

constexpr int kTraceWords = 8;
struct TraceBuf {
  unsigned long long* rec = nullptr;  // cap records of kTraceWords words
  unsigned int* count = nullptr;      // records written (may pass cap: the rest are dropped)
  unsigned int cap = 0;
};
// Registers a translation unit's setter of its TraceBuf (device.cu); trace_begin/end call them all.
void trace_register(void (*set)(const TraceBuf&));

enum TraceTag : unsigned {  // (tools/device/trace_decode.py names them)
  kTraceDirect = 1,      // matvec_direct.cuh direct_kernel
  kTraceAttnDecode = 2,  // attention.cu attn_decode_kernel
  kTraceKqDigits = 3,    // matvec_kq_mma.cu digits_kernel (marks 2, 3: its end)
  kTraceKqMma = 4,       // matvec_kq_mma.cu kq_mma_kernel
  kTraceAttnChunk = 5,   // attention.cu attn_chunk_kernel (marks 2, 3: its end)
};

#if SPECD_GPU_TRACE && !SPECD_HIP
namespace {
__device__ TraceBuf g_trace;  // one per translation unit (no relocatable device code)
struct TraceRegistration {
  TraceRegistration() {
    trace_register([](const TraceBuf& b) { SPECD_GPU_CHECK(cudaMemcpyToSymbol(g_trace, &b, sizeof b)); });
  }
};
const TraceRegistration g_trace_registration;
}  // namespace

struct TraceMarks {
  unsigned long long g0 = 0, g1 = 0;
  long long c[5] = {0, 0, 0, 0, 0};
};
__device__ __forceinline__ unsigned long long trace_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void trace_mark(TraceMarks& m, int i) {
  m.c[i] = clock64();
  if (i == 0) m.g0 = trace_globaltimer();
  if (i == 1) m.g1 = trace_globaltimer();
}
// Thread 0's record of the CTA (after a barrier: every warp is done).
__device__ __forceinline__ void trace_record(TraceMarks& m, unsigned tag, unsigned long long key) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  trace_mark(m, 4);
  const unsigned long long g4 = trace_globaltimer();
  const TraceBuf b = g_trace;
  if (b.rec == nullptr) return;
  const unsigned i = atomicAdd(b.count, 1u);
  if (i >= b.cap) return;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  const auto d = [&m](int k) { return (unsigned long long)(unsigned)(m.c[k] - m.c[0]); };
  unsigned long long* r = b.rec + (size_t)i * kTraceWords;
  r[0] = m.g0;
  r[1] = g4;
  r[2] = d(1) | d(2) << 32;
  r[3] = d(3) | d(4) << 32;
  r[4] = m.g1;
  r[5] = (unsigned long long)tag << 56 | (unsigned long long)smid << 40 | blockIdx.x;
  r[6] = key;
  r[7] = gridDim.x | (unsigned long long)gridDim.y << 32;
}
#define SPECD_TRACE_DECL ::specd::gpu::TraceMarks specd_trace_marks_
#define SPECD_TRACE_MARK(i) \
  do {                      \
    if (threadIdx.x == 0) ::specd::gpu::trace_mark(specd_trace_marks_, (i)); \
  } while (0)
#define SPECD_TRACE_RECORD(tag, key) ::specd::gpu::trace_record(specd_trace_marks_, (tag), (key))
#else
#define SPECD_TRACE_DECL
#define SPECD_TRACE_MARK(i) \
  do {                      \
  } while (0)
#define SPECD_TRACE_RECORD(tag, key) \
  do {                               \
  } while (0)
#endif

}  // namespace gpu
}  // namespace specd
