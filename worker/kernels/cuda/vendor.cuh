// specd/cuda/vendor.cuh: the ONLY file that knows whether we compile as CUDA or as HIP.
// Every other .cu/.cuh file uses the gpu* names and macros below, so the same sources build
// for NVIDIA (nvcc, SPECD_BACKEND=cuda) and AMD (hipcc, SPECD_BACKEND=hip).
//
// Warp size: kernels never assume the hardware warp. Cross-lane work is done in GROUPS of
// kGroup = 32 lanes with width-32 shuffles (gpu_shfl_xor(v, mask) below), which is one warp
// on NVIDIA and on RDNA (wave32), and half a wavefront on CDNA (wave64, gfx90a/gfx94x);
// block sizes are multiples of 64 so both wave sizes tile them exactly.
#pragma once
#include <cstdint>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define SPECD_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bfloat16.h>
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
using gpuGraph_t = hipGraph_t;
using gpuGraphExec_t = hipGraphExec_t;
using gpuEvent_t = hipEvent_t;
using gpuDeviceProp = hipDeviceProp_t;
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuSetDevice hipSetDevice
#define gpuGetDevice hipGetDevice
#define gpuMemGetInfo hipMemGetInfo
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpy hipMemcpy
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemset hipMemset
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuHostAlloc hipHostMalloc
#define gpuHostAllocDefault hipHostMallocDefault
#define gpuFreeHost hipHostFree
#define gpuStreamCreate hipStreamCreate
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuStreamBeginCapture hipStreamBeginCapture
#define gpuStreamEndCapture hipStreamEndCapture
#define gpuStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define gpuGraphInstantiate(exec, graph) hipGraphInstantiate(exec, graph, nullptr, nullptr, 0)
#define gpuGraphLaunch hipGraphLaunch
#define gpuGraphExecDestroy hipGraphExecDestroy
#define gpuGraphDestroy hipGraphDestroy
#define gpuEventCreate hipEventCreate
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
#define gpuEventDestroy hipEventDestroy
#define gpuFuncSetAttribute(f, attr, v) hipFuncSetAttribute((const void*)(f), attr, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, threads, smem) \
  hipOccupancyMaxActiveBlocksPerMultiprocessor(n, (const void*)(f), threads, smem)
using gpu_bf16 = hip_bfloat16;
#define SPECD_GPU_NAME "hip"
#define gpu_trap() __builtin_trap()  // device code: abort the kernel (the launch reports an error)
#else
#define SPECD_HIP 0
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
using gpuGraph_t = cudaGraph_t;
using gpuGraphExec_t = cudaGraphExec_t;
using gpuEvent_t = cudaEvent_t;
using gpuDeviceProp = cudaDeviceProp;
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuSetDevice cudaSetDevice
#define gpuGetDevice cudaGetDevice
#define gpuMemGetInfo cudaMemGetInfo
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpy cudaMemcpy
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemset cudaMemset
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuHostAlloc cudaHostAlloc
#define gpuHostAllocDefault cudaHostAllocDefault
#define gpuFreeHost cudaFreeHost
#define gpuStreamCreate cudaStreamCreate
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuStreamBeginCapture cudaStreamBeginCapture
#define gpuStreamEndCapture cudaStreamEndCapture
#define gpuStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define gpuGraphInstantiate(exec, graph) cudaGraphInstantiate(exec, graph, 0)
#define gpuGraphLaunch cudaGraphLaunch
#define gpuGraphExecDestroy cudaGraphExecDestroy
#define gpuGraphDestroy cudaGraphDestroy
#define gpuEventCreate cudaEventCreate
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
#define gpuEventDestroy cudaEventDestroy
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
using gpu_bf16 = __nv_bfloat16;
#define SPECD_GPU_NAME "cuda"
#define gpu_trap() __trap()
#endif

// Tensor-core matrix fragments (nvcuda::wmma) exist on NVIDIA sm_70+ only; the HIP build
// and older targets take the plain FMA path of the same kernels.
#if !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define SPECD_WMMA 1
#else
#define SPECD_WMMA 0
#endif

// Programmatic dependent launch (NVIDIA sm_90+): a kernel launched with it (gpu_launch in
// common.cuh) may start while the kernel before it on the stream is still running.
// gpu_grid_wait() blocks until that kernel has finished and its writes are visible: every
// kernel calls it before it reads anything an earlier kernel wrote or writes anything an
// earlier kernel reads (only immutable data, the weights, may be touched before).
// gpu_grid_launch_dependents() lets the next kernel start launching. Both are no-ops
// elsewhere and when the kernel was launched without the attribute.
#if !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SPECD_PDL_DEVICE 1
#else
#define SPECD_PDL_DEVICE 0
#endif

namespace specd {
namespace gpu {

__device__ __forceinline__ void gpu_grid_wait() {
#if SPECD_PDL_DEVICE
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void gpu_grid_launch_dependents() {
#if SPECD_PDL_DEVICE
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// Launches kernel<<<grid, block, smem, s>>>(args...), with programmatic dependent launch
// where `pdl` is set (CUDA only; the caller decides by the device's compute capability).
template <class... P, class... A>
inline gpuError_t gpu_launch_kernel(bool pdl, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                    gpuStream_t s, A&&... args) {
#if SPECD_HIP
  (void)pdl;
  hipLaunchKernelGGL(kernel, grid, block, smem, s, static_cast<P>(args)...);
  return hipGetLastError();
#else
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
#endif
}

constexpr int kGroup = 32;  // lanes that cooperate through shuffles (see the header)

// Width-32 butterfly shuffle: valid on wave32 and wave64 hardware alike.
template <class T>
__device__ __forceinline__ T gpu_shfl_xor(T v, int mask) {
#if SPECD_HIP
  return __shfl_xor(v, mask, kGroup);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, kGroup);
#endif
}

// A load of data other blocks of the running kernel wrote, after __threadfence(): through L2,
// past this multiprocessor's (incoherent) L1 on NVIDIA; on AMD the fence's acquire side
// already invalidates the vector L1, so a plain load.
template <class T>
__device__ __forceinline__ T gpu_load_l2(const T* p) {
#if SPECD_HIP
  return *p;
#else
  return __ldcg(p);
#endif
}

// c + the dot product of the four bytes of a and of b (int8 when the flag says signed, else
// uint8): dp4a on NVIDIA sm_61+; plain integer arithmetic elsewhere (the same exact sum).
template <bool kASigned, bool kBSigned>
__device__ __forceinline__ int gpu_dot4(uint32_t a, uint32_t b, int c) {
#if !SPECD_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  int r;
  if constexpr (kASigned && kBSigned) asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  else if constexpr (kASigned) asm("dp4a.s32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  else if constexpr (kBSigned) asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  else asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int x = kASigned ? (int)(int8_t)(a >> 8 * i) : (int)((a >> 8 * i) & 0xFF);
    const int y = kBSigned ? (int)(int8_t)(b >> 8 * i) : (int)((b >> 8 * i) & 0xFF);
    c += x * y;
  }
  return c;
#endif
}

}  // namespace gpu
}  // namespace specd
