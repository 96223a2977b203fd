// Fused KV materialization epilogue for DFlash drafters:
// torch.ops.specattn.materialize_kv_epilogue.
//
// The caller (specattn/ops/kv_materialize.py, impl "cuda") runs ONE GEMM through torch
// (cuBLAS), kv = hidden @ w_kv^T in the input dtype, whose row t is laid out as
// [layer][K|V][head][dim].  This file is the single launch that follows: for every token t,
// draft layer l, K/V and KV head h (D dims, rotary dim R <= D, even):
//
//   K:  x = kv[t, l, 0, h] (+ kv_bias);  y = x * rsqrt(mean(x^2) + eps) * k_norm_weight[l]
//       neox RoPE at positions[t]:  o[i]     = y[i] cos_i - y[i + R/2] sin_i   (i < R/2)
//                                   o[i+R/2] = y[i + R/2] cos_i + y[i] sin_i
//       dims >= R pass through;  k_buffers[l][out_cache_loc[t], h] = cast(o / k_scale)
//   V:  v = kv[t, l, 1, h] (+ kv_bias);  v_buffers[l][out_cache_loc[t], h] = cast(v / v_scale)
//
// (the scales apply to float8_e4m3fn caches only; other caches need 1.0).  All math is
// float32; the one rounding is the store: round-to-nearest-even to bf16/fp16, or the
// saturating e4m3 conversion (cvt.rn.satfinite.e4m3x2.f32), which equals the reference's
// clamp(x, -448, 448) followed by an RTNE cast.  "x / scale" is x * (1 / scale) with the
// reciprocal rounded to float32 once on the host: what torch's CUDA division by a Python
// scalar computes (so what the reference computes on the GPU), within one float32 ulp of
// the IEEE quotient.  Semantics: the reference materialize_kv_reference in
// specattn/ops/kv_materialize.py.
//
// Two kernels, both in GEMM-output order (t major, then layer, head), so a block reads one
// contiguous stretch of kv and writes contiguous (slot, all heads) runs of the caches:
//
// * kv_epilogue_pair_kernel (the hot path; the host takes it when D % 16 == 0, R % 16 == 0,
//   kv and every cache 16-byte aligned, and k_norm_weight / cos_sin_cache / kv_bias rows
//   contiguous and 16-byte aligned: every shape of the Qwen3 / Llama drafters).  One
//   (t, l, h) per group of G = next_pow2(D / 16) lanes doing BOTH its K and its V row; lane
//   c < R/16 owns the rotation-pair chunks [8c, 8c+8) and [R/2 + 8c, R/2 + 8c + 8), so RoPE
//   partners meet in registers and one 8-wide cos run + one sin run serve both chunks;
//   lanes [R/16, D/16) own pass-through chunks.  Per lane: the index loads and 4 x 16-byte
//   K/V loads issued back to back; V stored as soon as it lands (a bit copy when the cache
//   has the input dtype); K: sum of squares, butterfly over the G lanes, then the norm
//   weights and cos/sin (L1-resident, 16-byte loads), RoPE, 2 stores.
// * kv_epilogue_kernel (generic: odd head / rotary dims, strided or unaligned inputs).  One
//   (t, l, K|V, h) row per group of G = next_pow2(ceil(D / 8)) lanes, lane c holding dims
//   [8c, 8c + 8) (16-byte accesses when D % 8 == 0 and the pointers allow: Params::vec,
//   else element by element); RMSNorm by a butterfly; RoPE partners i +- R/2 by
//   __shfl_sync from lane c +- R/16 when (R/2) % 8 == 0, else re-read from kv (L1 hits) and
//   normalized by the lane itself.  Any strides for everything but kv's columns.
// Both: every lane executes every shuffle with the full mask (no early exit before the last
// shuffle): rows past the end and masked lanes compute on zeros and store nothing.  D <= 256.
// 2 x 12 instantiations (3 input x 4 cache dtypes).  sm_90 (ptxas -v, CUDA 13.0): generic
// 64 registers; pair 64 registers with 16-bit input and cache (4 blocks of 256 threads per
// SM), <= 80 with a float32 input or cache (3 blocks); no spills, no stack anywhere.
//
// Per-layer destinations: the K and V base pointers of every layer are a kernel-parameter
// table (__grid_constant__ Params, < 4 KiB), so nothing is copied host-to-device and the
// launch is CUDA-graph capturable.  More than kMaxLayers layers run as several launches
// (chunks of layers).  Input dtypes (kv, kv_bias, k_norm_weight, cos_sin_cache) of float32 /
// float16 / bfloat16 and int32 / int64 indices are handled.  Indices outside [0, num_slots) /
// [0, max_pos) make the row skip its stores (the Python wrapper rejects them before the
// call); the kernels never read or write out of bounds.  No host sync, no allocation, T == 0
// launches nothing.
//
// PERFORMANCE NOTES ("predicted -> why"; no GPU here, reasoned from bytes, the
// ptxas report and the SASS).  Qwen3-8B drafter: hidden 4096, 5 layers x 8 KV heads x 128,
// bf16.  The epilogue must move kv (T x 10240 x 2 B) once and write the same bytes of bf16
// cache (half for fp8): 4096 tokens -> 83.9 + 83.9 MB = 168 MB, 55.6 us at the measured 3017
// GB/s copy ceiling (fp8 cache: 126 MB, 41.7 us).  First GPU run (H100, 2026-11-22, generic
// kernel only): 142 us of epilogue at 4096 tokens (595.2 - 453.0), 24 us at 512.
//   1. Memory-level parallelism.  Before: each thread issued ONE 16-byte load (K or V row
//      chunk), then a dependent chain (butterfly, 8 partner shuffles, 8 scalar norm-weight
//      and 16 scalar cos/sin loads with per-element runtime-kind branches and int64 stride
//      multiplies, sqrt + division with slow-path calls) before its store: <= 32 warps x
//      512 B = 16 KB in flight per SM, and only during the first part of each thread's life.
//      Little's law wants 3.0 TB/s / 132 SMs x ~0.8-1 us DRAM latency = 18-23 KB in flight per
//      SM all the time; measured 168 MB / 142 us = 1.2 TB/s fits "about half of that".
//      Now: 4 x 16-byte K/V loads per thread issued before any use (SASS: 4 LDG.E.128 back to
//      back after the 2 index loads), 32 warps x 2 KB = 64 KB per SM at issue.
//      -> predicted epilogue ~58 us at 4096 tokens (within 1.05x of the 55.6 us floor), i.e.
//      the op ~510 us (GEMM 453 us); why: bandwidth-bound once >= ~25 KB/SM stay in flight.
//   2. Pair layout instead of partner shuffles: 0 SHFL.IDX (was 8 per thread), 3 SHFL.BFLY
//      for D = 128 (was 4), one cos run + one sin run per lane for both halves.
//      -> fewer instructions (~1000 static SASS instructions vs ~2300 for the bf16 -> bf16
//      variant), no change in bytes; why: issue slots were not the limit (estimated <= 20%
//      of the issue rate used), but the dependent latency per thread drops.
//   3. Side inputs as 16-byte loads issued AFTER the butterfly: norm weights (5 x 256 B) and
//      the token's cos/sin row (512 B, shared by the 40 (l, h) items of a token) are L1 hits;
//      loading them with K/V kept 32 more registers live across the DRAM wait and made ptxas
//      spill K/V load destinations (an STL right after an LDG waits for the DRAM data:
//      measured 144 B stack in a first version).  -> 64 registers, no spills, 4 blocks/SM;
//      why: the ~40-cycle L1 latency is hidden by the other 31 warps.
//   4. V stored as soon as it lands, as a bit copy when the cache has the input's dtype (bf16
//      -> bf16: 2 STG.128 of the loaded registers, no conversions).  -> frees 8 registers
//      before the K math and halves V's instructions.
//   5. fp8: x * (1/scale) instead of 16 IEEE divisions per thread (each MUFU.RCP + 2 FFMA +
//      a slow-path CALL), and one cvt...e4m3x2 per pair.  -> no CALLs, no stack (the first
//      version had 40 B of stack around 16 call sites); predicted fp8 epilogue ~45 us at
//      4096 tokens (op ~498 us), vs ~67 us for Triton's bit-twiddling fp8 rounding.
//   6. Grid: T x L x Hkv x G threads, G = 8 for D = 128: 1.31M threads = 5120 blocks at 4096
//      tokens (9.7 waves of 4 x 132 resident blocks), 640 blocks at 512 tokens (1.2 waves).
//      One 32-bit decode (2 divisions) per (t, l, h), int64 only for row/slot offsets; the
//      layer table is one LDC with a warp-uniform index (4 heads per warp share (t, l)).
//      -> 512 tokens: 21 MB moved, ~7 us at the copy ceiling, plus a tail of about one
//      block lifetime (~1-2 us): predicted epilogue ~8-9 us, the op ~73-74 us (GEMM 65.2 us);
//      why: with 1.2 waves the second wave runs latency-bound; the data is partly L2-resident
//      at this size (kv just written by the GEMM: 10.5 MB; caches 22 MB) which helps.
//   MEASURED (H100, bench/results/h100/kv_ops.json, epilogue alone on a
//   precomputed GEMM output): 76.6 us at 4096 tokens (2.19 TB/s, 72.5 % of copy bandwidth;
//   predicted ~58), 14.2 us at 512 (predicted 8-9, L2 flushed between iterations); whole op
//   498.0 / 72.3 us.  Triton's epilogue took 65.7 / 14.3 us in the same run, so at 4096 tokens
//   the prediction missed by 1.3x and Triton's epilogue alone is ahead; the whole op was
//   still 1.2 % faster through CUDA (498.0 vs 504.0 us; both within the bars), so "auto"
//   keeps CUDA.  Next: (a)/(b) below.
//   Risks to check on the GPU: (a) if the 512-token figure is tail-bound, 128-thread blocks
//   (kMinBlocks 8) balance the 1.2 waves better; (b) if DRAM efficiency at 4096 tokens is
//   below ~90%, streaming stores (st.global.cs) for the cache writes and evict-first loads of
//   kv are the next knobs (kv is read once, the cache rows are not re-read by this op).
//
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h), like kv_move.cu: this file also
// compiles against a CPU-only torch with a bare nvcc (tests/test_csrc_compiles.py).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "specattn_ops.h"

namespace specattn {
namespace {

constexpr int kThreads = 256;
constexpr int kMinBlocks = 4;  // blocks per SM: caps registers at 64 (no spills; 48 spills)
constexpr int kElems = 8;        // dims per lane
constexpr int kMaxGroup = 32;    // lanes per row at most -> D <= 256
constexpr int kMaxLayers = 64;   // layers per launch (parameter table size)
constexpr unsigned kFull = 0xffffffffu;

enum FloatKind : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct Params {
  void* k_base[kMaxLayers];  // k_buffers[layer0 + j] data pointer
  void* v_base[kMaxLayers];
  const void* kv;            // GEMM output [T, >= L*2*Hkv*D], unit column stride
  const void* bias;          // kv_bias [L*2*Hkv*D] or nullptr
  const void* norm_w;        // k_norm_weight [L, D]
  const void* cs;            // cos_sin_cache [max_pos, R]
  const void* pos;           // positions [T]
  const void* loc;           // out_cache_loc [T]
  int64_t kv_ld, bias_s, w_s0, w_s1, cs_s0, cs_s1, pos_s, loc_s;
  int64_t num_tokens, num_slots, max_pos;
  int32_t layer0, layers;    // this launch: layers [layer0, layer0 + layers)
  int32_t hkv, d, half, rot;
  int32_t group_log2;        // G = 1 << group_log2 lanes per row
  int32_t kv_kind, bias_kind, w_kind, cs_kind;
  int32_t pos64, loc64;
  int32_t vec;               // 1: 8-element chunks are 16-byte aligned (vector access)
  float eps;
  float k_inv_scale, v_inv_scale;  // float32 1 / scale (fp8 caches; 1 otherwise)
};
static_assert(sizeof(Params) + 64 <= 4096, "kernel parameters must stay under 4 KiB");

__device__ __forceinline__ float load_float(const void* p, int64_t i, int kind) {
  if (kind == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (kind == kF16) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// 8 consecutive input values starting at element `off` of a row of type In, as floats.
template <typename In, bool kVec>
__device__ __forceinline__ void load8(const In* __restrict__ src, int n_valid, float (&x)[kElems]);

template <>
__device__ __forceinline__ void load8<float, true>(const float* __restrict__ src, int,
                                                   float (&x)[kElems]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

template <>
__device__ __forceinline__ void load8<__nv_bfloat16, true>(const __nv_bfloat16* __restrict__ src,
                                                           int, float (&x)[kElems]) {
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void load8<__half, true>(const __half* __restrict__ src, int,
                                                    float (&x)[kElems]) {
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  const __half2* p = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(p[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename In>
__device__ __forceinline__ void load8_scalar(const In* __restrict__ src, int n_valid,
                                             float (&x)[kElems]) {
#pragma unroll
  for (int i = 0; i < kElems; ++i) x[i] = i < n_valid ? to_float(src[i]) : 0.f;
}

template <>
__device__ __forceinline__ void load8<float, false>(const float* __restrict__ src, int n,
                                                    float (&x)[kElems]) {
  load8_scalar(src, n, x);
}
template <>
__device__ __forceinline__ void load8<__nv_bfloat16, false>(const __nv_bfloat16* __restrict__ src,
                                                            int n, float (&x)[kElems]) {
  load8_scalar(src, n, x);
}
template <>
__device__ __forceinline__ void load8<__half, false>(const __half* __restrict__ src, int n,
                                                     float (&x)[kElems]) {
  load8_scalar(src, n, x);
}

// Store 8 floats (already divided by the fp8 scale where that applies) as type Out.
__device__ __forceinline__ void put(float* dst, int i, float v) { dst[i] = v; }
__device__ __forceinline__ void put(__nv_bfloat16* dst, int i, float v) {
  dst[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void put(__half* dst, int i, float v) { dst[i] = __float2half_rn(v); }
__device__ __forceinline__ void put(__nv_fp8_e4m3* dst, int i, float v) {
  dst[i].__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename Out, bool kVec>
struct Store8 {
  __device__ __forceinline__ static void run(Out* __restrict__ dst, int n_valid,
                                             const float (&o)[kElems]) {
#pragma unroll
    for (int i = 0; i < kElems; ++i)
      if (i < n_valid) put(dst, i, o[i]);
  }
};

template <>
struct Store8<float, true> {
  __device__ __forceinline__ static void run(float* __restrict__ dst, int,
                                             const float (&o)[kElems]) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(o[0], o[1], o[2], o[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(o[4], o[5], o[6], o[7]);
  }
};

template <>
struct Store8<__nv_bfloat16, true> {
  __device__ __forceinline__ static void run(__nv_bfloat16* __restrict__ dst, int,
                                             const float (&o)[kElems]) {
    uint4 u;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(o[2 * i], o[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = u;
  }
};

template <>
struct Store8<__half, true> {
  __device__ __forceinline__ static void run(__half* __restrict__ dst, int,
                                             const float (&o)[kElems]) {
    uint4 u;
    __half2* p = reinterpret_cast<__half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __floats2half2_rn(o[2 * i], o[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = u;
  }
};

template <>
struct Store8<__nv_fp8_e4m3, true> {
  __device__ __forceinline__ static void run(__nv_fp8_e4m3* __restrict__ dst, int,
                                             const float (&o)[kElems]) {
    // one cvt.rn.satfinite.e4m3x2.f32 per pair (same rounding as the scalar conversion;
    // the first value lands in the low byte, i.e. at the lower address)
    uint2 u;
    uint16_t* b = reinterpret_cast<uint16_t*>(&u);
#pragma unroll
    for (int i = 0; i < kElems / 2; ++i)
      b[i] = __nv_cvt_float2_to_fp8x2(make_float2(o[2 * i], o[2 * i + 1]), __NV_SATFINITE,
                                      __NV_E4M3);
    *reinterpret_cast<uint2*>(dst) = u;
  }
};

template <typename Out>
constexpr bool kIsFp8 = std::is_same_v<Out, __nv_fp8_e4m3>;

// ---- generic kernel: one (t, l, K|V, h) row per group of G lanes, 8 dims per lane.  Runs
// the shapes the pair kernel below does not take (D or R not multiples of 16, unaligned
// pointers); semantics identical.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    kv_epilogue_kernel(const __grid_constant__ Params p) {
  const int g_log2 = p.group_log2;
  const int G = 1 << g_log2;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = gtid >> g_log2;
  const int c = static_cast<int>(gtid & (G - 1));
  const int lane = threadIdx.x & 31;
  const int group_base = lane & ~(G - 1);

  // row -> (t, l, s, h) in GEMM-output order (the host keeps rows < 2^31: 32-bit division)
  const uint32_t r32 = static_cast<uint32_t>(row);
  const int h = static_cast<int>(r32 % static_cast<uint32_t>(p.hkv));
  uint32_t q = r32 / static_cast<uint32_t>(p.hkv);
  const int s = static_cast<int>(q & 1u);  // 0: K, 1: V
  q >>= 1;
  const int l = static_cast<int>(q % static_cast<uint32_t>(p.layers));
  const int64_t t = static_cast<int64_t>(q / static_cast<uint32_t>(p.layers));
  const int layer = p.layer0 + l;

  const int D = p.d;
  const int d0 = c * kElems;
  const int n_valid = max(0, min(kElems, D - d0));

  // The data loads depend on the row only (not on the indices), so they issue together.
  const bool in_range = t < p.num_tokens && n_valid > 0;
  const int64_t tt = in_range ? t : 0;
  const int64_t col = ((static_cast<int64_t>(layer) * 2 + s) * p.hkv + h) * D;
  const In* src = static_cast<const In*>(p.kv) + tt * p.kv_ld + col + d0;
  float x[kElems];
  if (in_range) {
    if (p.vec) load8<In, true>(src, n_valid, x);
    else load8<In, false>(src, n_valid, x);
    if (p.bias != nullptr) {
#pragma unroll
      for (int i = 0; i < kElems; ++i)
        if (i < n_valid) x[i] += load_float(p.bias, (col + d0 + i) * p.bias_s, p.bias_kind);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kElems; ++i) x[i] = 0.f;
  }
  const int64_t slot = in_range ? load_index(p.loc, tt * p.loc_s, p.loc64) : -1;
  const int64_t pos = in_range ? load_index(p.pos, tt * p.pos_s, p.pos64) : -1;
  // rows with an index out of range skip their store (the wrapper rejects such indices)
  const bool live = in_range && slot >= 0 && slot < p.num_slots && pos >= 0 && pos < p.max_pos;

  // ---- RMSNorm (meaningful for K rows; every lane runs the shuffles)
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kElems; ++i) ss += x[i] * x[i];
  for (int off = G >> 1; off > 0; off >>= 1) ss += __shfl_xor_sync(kFull, ss, off);
  const bool is_k = s == 0;
  // IEEE sqrt and division (not rsqrtf): closer to the float32 reference
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + p.eps);
  float y[kElems];
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    float w = 0.f;
    if (in_range && is_k && i < n_valid)
      w = load_float(p.norm_w, layer * p.w_s0 + (d0 + i) * p.w_s1, p.w_kind);
    y[i] = is_k ? x[i] * inv * w : x[i];
  }

  // ---- neox RoPE partner values
  const int half = p.half, rot = p.rot;
  float partner[kElems];
  if ((half & (kElems - 1)) == 0) {  // uniform across the grid: all lanes take this branch
    const int shift = half / kElems;  // partner lane distance within the group
    int pc = c;
    if (d0 < half) pc = c + shift;
    else if (d0 < rot) pc = c - shift;
    const int src_lane = group_base + pc;  // pc < G since d0 + half < rot <= D
#pragma unroll
    for (int i = 0; i < kElems; ++i) partner[i] = __shfl_sync(kFull, y[i], src_lane);
  } else {
    // rotary half not a multiple of 8: re-read and normalize the partner dims (K rows only)
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      partner[i] = 0.f;
      const int d = d0 + i;
      if (in_range && is_k && i < n_valid && d < rot) {
        const int pd = d < half ? d + half : d - half;
        float v = load_float(p.kv, tt * p.kv_ld + col + pd, p.kv_kind);
        if (p.bias != nullptr) v += load_float(p.bias, (col + pd) * p.bias_s, p.bias_kind);
        partner[i] = v * inv * load_float(p.norm_w, layer * p.w_s0 + pd * p.w_s1, p.w_kind);
      }
    }
  }
  if (!live) return;  // all shuffles are done

  float o[kElems];
  if (is_k) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      const int d = d0 + i;
      o[i] = y[i];
      if (i < n_valid && d < rot) {
        const int j = d < half ? d : d - half;
        const int64_t cs_row = pos * p.cs_s0;
        const float cs_c = load_float(p.cs, cs_row + j * p.cs_s1, p.cs_kind);
        const float cs_s = load_float(p.cs, cs_row + (half + j) * p.cs_s1, p.cs_kind);
        // explicit roundings (no FMA contraction), as the float32 reference computes it
        const float a = __fmul_rn(y[i], cs_c), b = __fmul_rn(partner[i], cs_s);
        o[i] = d < half ? __fsub_rn(a, b) : __fadd_rn(a, b);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kElems; ++i) o[i] = y[i];
  }
  if constexpr (kIsFp8<Out>) {
    const float inv_scale = is_k ? p.k_inv_scale : p.v_inv_scale;
#pragma unroll
    for (int i = 0; i < kElems; ++i) o[i] = __fmul_rn(o[i], inv_scale);
  }
  Out* dst = static_cast<Out*>(is_k ? p.k_base[l] : p.v_base[l]) +
             (slot * p.hkv + h) * static_cast<int64_t>(D) + d0;
  if (p.vec) Store8<Out, true>::run(dst, n_valid, o);
  else Store8<Out, false>::run(dst, n_valid, o);
}

// ---- pair kernel (the hot path: D % 16 == 0, R % 16 == 0, 16-byte aligned kv and caches)
// One (t, l, h) per group of G = next_pow2(D / 16) lanes doing BOTH its K and its V row.
// Lane c < R/16 owns the rotation pair chunks [8c, 8c+8) and [R/2 + 8c, R/2 + 8c + 8), so the
// RoPE partners meet in registers (no partner shuffle) and one 8-wide cos run + one 8-wide
// sin run serve both chunks; lane c in [R/16, D/16) owns the pass-through chunks
// [R + 16k, R + 16k + 8) and [R + 16k + 8, R + 16k + 16) (k = c - R/16); lanes >= D/16
// (D/16 not a power of 2) only join the shuffles.  Every lane first issues its 4 x 16-byte
// K/V loads (2 x 16 B each for float32 input) and the index loads, before any use.

// 8 values of type In as raw 16-byte words (one uint4 for 16-bit types, two for float32).
template <typename In>
struct Raw8 {
  uint4 u[sizeof(In) / 2];
};

template <typename In>
__device__ __forceinline__ Raw8<In> ldg8(const In* src) {
  Raw8<In> r;
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < int(sizeof(In) / 2); ++i) r.u[i] = __ldg(s + i);
  return r;
}

__device__ __forceinline__ void unpack8(const Raw8<float>& r, float (&x)[kElems]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    x[4 * i] = __uint_as_float(r.u[i].x);
    x[4 * i + 1] = __uint_as_float(r.u[i].y);
    x[4 * i + 2] = __uint_as_float(r.u[i].z);
    x[4 * i + 3] = __uint_as_float(r.u[i].w);
  }
}

__device__ __forceinline__ void unpack8(const Raw8<__nv_bfloat16>& r, float (&x)[kElems]) {
  // bf16 -> float32 is exact: the 16 bits become the high half of the float
  const uint32_t w[4] = {r.u[0].x, r.u[0].y, r.u[0].z, r.u[0].w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void unpack8(const Raw8<__half>& r, float (&x)[kElems]) {
  const __half2* p = reinterpret_cast<const __half2*>(&r.u[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(p[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// x[i] = tensor[off + i] for i < 8 from a float32/float16/bfloat16 tensor (`kind`, uniform
// per launch) whose 8-element run at `off` is contiguous and 16-byte aligned (the host sends
// other layouts to the generic kernel): one 16-byte load (two for float32).
__device__ __forceinline__ void load8_kind(const void* base, int64_t off, int kind,
                                           float (&x)[kElems]) {
  if (kind == kBF16) unpack8(ldg8(static_cast<const __nv_bfloat16*>(base) + off), x);
  else if (kind == kF16) unpack8(ldg8(static_cast<const __half*>(base) + off), x);
  else unpack8(ldg8(static_cast<const float*>(base) + off), x);
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads, sizeof(In) == 4 || sizeof(Out) == 4 ? 3 : kMinBlocks)
    kv_epilogue_pair_kernel(const __grid_constant__ Params p) {
  const int g_log2 = p.group_log2;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  // item = (t, l, h) in GEMM-output order (the host keeps items < 2^31: 32-bit division)
  const uint32_t item = static_cast<uint32_t>(gtid >> g_log2);
  const int c = static_cast<int>(gtid) & ((1 << g_log2) - 1);
  const uint32_t hkv = static_cast<uint32_t>(p.hkv), nl = static_cast<uint32_t>(p.layers);
  const uint32_t q = item / hkv;
  const int h = static_cast<int>(item - q * hkv);
  const uint32_t tq = q / nl;
  const int l = static_cast<int>(q - tq * nl);
  const int64_t t = tq;
  const int layer = p.layer0 + l;

  const int D = p.d, half = p.half, rot = p.rot;
  const int n_pair = half / kElems;  // lanes owning rotation pairs
  const bool pair = c < n_pair;
  const int da = pair ? kElems * c : rot + 2 * kElems * (c - n_pair);  // first dim of chunk A
  const int db = pair ? half + da : da + kElems;                       // ... of chunk B
  const bool in_range = t < p.num_tokens && c < D / (2 * kElems);
  const int64_t col_k = (static_cast<int64_t>(layer) * 2 * p.hkv + h) * D;
  const int64_t col_v = col_k + static_cast<int64_t>(p.hkv) * D;

  // 1. the long-latency loads first: the indices and K and V (DRAM); nothing is consumed
  //    before all of them are in flight.
  int64_t slot = -1, pos = -1;
  Raw8<In> ka{}, kb{}, va{}, vb{};
  if (in_range) {
    slot = load_index(p.loc, t * p.loc_s, p.loc64);
    pos = load_index(p.pos, t * p.pos_s, p.pos64);
    const In* row = static_cast<const In*>(p.kv) + t * p.kv_ld;
    ka = ldg8(row + col_k + da);
    kb = ldg8(row + col_k + db);
    va = ldg8(row + col_v + da);
    vb = ldg8(row + col_v + db);
  }
  // rows with an index out of range skip their stores (the wrapper rejects such indices)
  const bool live = in_range && slot >= 0 && slot < p.num_slots && pos >= 0 && pos < p.max_pos;
  const int64_t dst_row = (slot * p.hkv + h) * static_cast<int64_t>(D);

  // 2. V: cast and store as soon as it is here (frees its registers before the K math); a bit
  //    copy when the cache has the input's type and there is no bias
  if (live) {
    Out* vdst = static_cast<Out*>(p.v_base[l]) + dst_row;
    bool copied = false;
    if constexpr (std::is_same_v<In, Out>) {
      if (p.bias == nullptr) {
#pragma unroll
        for (int i = 0; i < int(sizeof(In) / 2); ++i) {
          reinterpret_cast<uint4*>(vdst + da)[i] = va.u[i];
          reinterpret_cast<uint4*>(vdst + db)[i] = vb.u[i];
        }
        copied = true;
      }
    }
    if (!copied) {
      float fa[kElems], fb[kElems];
      unpack8(va, fa);
      unpack8(vb, fb);
      if (p.bias != nullptr) {  // rare: kv_bias adds an L2 round trip
        float ba[kElems], bb[kElems];
        load8_kind(p.bias, col_v + da, p.bias_kind, ba);
        load8_kind(p.bias, col_v + db, p.bias_kind, bb);
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
          fa[i] += ba[i];
          fb[i] += bb[i];
        }
      }
      if constexpr (kIsFp8<Out>) {
#pragma unroll
        for (int i = 0; i < kElems; ++i) {
          fa[i] = __fmul_rn(fa[i], p.v_inv_scale);
          fb[i] = __fmul_rn(fb[i], p.v_inv_scale);
        }
      }
      Store8<Out, true>::run(vdst + da, kElems, fa);
      Store8<Out, true>::run(vdst + db, kElems, fb);
    }
  }

  // 3. K: RMSNorm over the D dims of the head (G lanes), then RoPE on the pairs
  float xa[kElems], xb[kElems];
  unpack8(ka, xa);
  unpack8(kb, xb);
  if (p.bias != nullptr && in_range) {
    float ba[kElems], bb[kElems];
    load8_kind(p.bias, col_k + da, p.bias_kind, ba);
    load8_kind(p.bias, col_k + db, p.bias_kind, bb);
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      xa[i] += ba[i];
      xb[i] += bb[i];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kElems; ++i) ss += xa[i] * xa[i];
#pragma unroll
  for (int i = 0; i < kElems; ++i) ss += xb[i] * xb[i];
  for (int off = (1 << g_log2) >> 1; off > 0; off >>= 1) ss += __shfl_xor_sync(kFull, ss, off);
  if (!live) return;  // all shuffles are done
  // the small, L1-resident side inputs (this layer's norm weights, the token's cos/sin) only
  // now: loading them with K and V would keep 32 more registers live across the DRAM wait
  float wa[kElems], wb[kElems], cs_c[kElems], cs_s[kElems];
  {
    const int64_t wrow = static_cast<int64_t>(layer) * p.w_s0;
    load8_kind(p.norm_w, wrow + da, p.w_kind, wa);
    load8_kind(p.norm_w, wrow + db, p.w_kind, wb);
  }
  if (pair) {
    const int64_t crow = pos * p.cs_s0;
    load8_kind(p.cs, crow + da, p.cs_kind, cs_c);
    load8_kind(p.cs, crow + db, p.cs_kind, cs_s);
  } else {
#pragma unroll
    for (int i = 0; i < kElems; ++i) cs_c[i] = cs_s[i] = 0.f;
  }
  // IEEE sqrt and division (not rsqrtf): closer to the float32 reference
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + p.eps);
  float oa[kElems], ob[kElems];
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    const float ya = xa[i] * inv * wa[i];
    const float yb = xb[i] * inv * wb[i];
    // explicit roundings (no FMA contraction), as the float32 reference computes it
    const float ra = __fsub_rn(__fmul_rn(ya, cs_c[i]), __fmul_rn(yb, cs_s[i]));
    const float rb = __fadd_rn(__fmul_rn(yb, cs_c[i]), __fmul_rn(ya, cs_s[i]));
    oa[i] = pair ? ra : ya;
    ob[i] = pair ? rb : yb;
  }
  if constexpr (kIsFp8<Out>) {
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      oa[i] = __fmul_rn(oa[i], p.k_inv_scale);
      ob[i] = __fmul_rn(ob[i], p.k_inv_scale);
    }
  }
  Out* kdst = static_cast<Out*>(p.k_base[l]) + dst_row;
  Store8<Out, true>::run(kdst + da, kElems, oa);
  Store8<Out, true>::run(kdst + db, kElems, ob);
}

int float_kind(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default:
      TORCH_CHECK(false, "specattn::materialize_kv_epilogue: ", name,
                  " must be float32/float16/bfloat16, got ", t.scalar_type());
  }
  return kF32;
}

template <typename In, typename Out>
void launch_typed(const Params& p, bool pair, int64_t blocks, cudaStream_t stream) {
  if (pair) {
    kv_epilogue_pair_kernel<In, Out><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  } else {
    kv_epilogue_kernel<In, Out><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In>
void launch_in(const Params& p, bool pair, at::ScalarType cache, int64_t blocks,
               cudaStream_t stream) {
  switch (cache) {
    case at::kFloat: launch_typed<In, float>(p, pair, blocks, stream); break;
    case at::kHalf: launch_typed<In, __half>(p, pair, blocks, stream); break;
    case at::kBFloat16: launch_typed<In, __nv_bfloat16>(p, pair, blocks, stream); break;
    case at::kFloat8_e4m3fn: launch_typed<In, __nv_fp8_e4m3>(p, pair, blocks, stream); break;
    default:
      TORCH_CHECK(false, "specattn::materialize_kv_epilogue: cache dtype must be float32, "
                  "float16, bfloat16 or float8_e4m3fn, got ", cache);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void materialize_kv_epilogue_cuda(const at::Tensor& kv, const at::Tensor& k_norm_weight,
                                  const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                  const at::Tensor& out_cache_loc, at::TensorList k_buffers,
                                  at::TensorList v_buffers, double eps,
                                  const std::optional<at::Tensor>& kv_bias, double k_scale,
                                  double v_scale) {
  constexpr const char* kName = "specattn::materialize_kv_epilogue: ";
  TORCH_CHECK(!k_buffers.empty() && k_buffers.size() == v_buffers.size(), kName,
              "need as many v_buffers as k_buffers (>= 1), got ", k_buffers.size(), " and ",
              v_buffers.size());
  const at::Tensor& b0 = k_buffers[0];
  TORCH_CHECK(b0.is_cuda() && b0.dim() == 3, kName, "k_buffers[0] must be a 3-D CUDA tensor");
  const int64_t num_layers = static_cast<int64_t>(k_buffers.size());
  const int64_t num_slots = b0.size(0), hkv = b0.size(1), D = b0.size(2);
  const at::ScalarType cache = b0.scalar_type();
  for (size_t i = 0; i < k_buffers.size(); ++i) {
    for (const at::Tensor* b : {&k_buffers[i], &v_buffers[i]}) {
      TORCH_CHECK(b->device() == b0.device() && b->sizes() == b0.sizes() &&
                      b->scalar_type() == cache && b->is_contiguous(),
                  kName, "every cache buffer must be a contiguous ", b0.sizes(), " ", cache,
                  " tensor on ", b0.device(), "; layer ", i, " has ", b->sizes(), " ",
                  b->scalar_type(), " on ", b->device());
    }
  }
  TORCH_CHECK(hkv >= 1 && D >= 2 && D <= kElems * kMaxGroup, kName,
              "head dim must be in [2, ", kElems * kMaxGroup, "], got ", D);
  const int64_t rows = num_layers * 2 * hkv * D;
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == rows && kv.stride(1) == 1 &&
                  kv.device() == b0.device(),
              kName, "kv must be [T, ", rows, "] with unit column stride on ", b0.device(),
              ", got ", kv.sizes(), " strides ", kv.strides());
  const int64_t T = kv.size(0);
  TORCH_CHECK(k_norm_weight.dim() == 2 && k_norm_weight.size(0) == num_layers &&
                  k_norm_weight.size(1) == D && k_norm_weight.device() == b0.device(),
              kName, "k_norm_weight must be [", num_layers, ", ", D, "], got ",
              k_norm_weight.sizes());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.device() == b0.device(), kName,
              "cos_sin_cache must be 2-D on ", b0.device());
  const int64_t max_pos = cos_sin_cache.size(0), rot = cos_sin_cache.size(1);
  TORCH_CHECK(rot >= 2 && rot % 2 == 0 && rot <= D, kName,
              "rotary dim must be even and in [2, ", D, "], got ", rot);
  for (const at::Tensor* idx : {&positions, &out_cache_loc}) {
    TORCH_CHECK(idx->dim() == 1 && idx->size(0) == T && idx->device() == b0.device() &&
                    (idx->scalar_type() == at::kInt || idx->scalar_type() == at::kLong),
                kName, "positions / out_cache_loc must be int32/int64 [", T, "] on ",
                b0.device(), ", got ", idx->sizes(), " ", idx->scalar_type());
  }
  if (kv_bias.has_value()) {
    TORCH_CHECK(kv_bias->dim() == 1 && kv_bias->size(0) == rows &&
                    kv_bias->device() == b0.device(),
                kName, "kv_bias must be [", rows, "] on ", b0.device());
  }
  const bool fp8 = cache == at::kFloat8_e4m3fn;
  TORCH_CHECK(eps > 0 && k_scale > 0 && v_scale > 0, kName, "eps and scales must be > 0");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), kName,
              "k_scale / v_scale apply to float8_e4m3fn caches only (pass 1.0)");
  if (T == 0) return;

  const c10::cuda::CUDAGuard guard(b0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  Params p{};
  p.kv = kv.data_ptr();
  p.kv_kind = float_kind(kv, "kv");
  p.kv_ld = kv.stride(0);
  p.bias = kv_bias.has_value() ? kv_bias->data_ptr() : nullptr;
  p.bias_kind = kv_bias.has_value() ? float_kind(*kv_bias, "kv_bias") : kF32;
  p.bias_s = kv_bias.has_value() ? kv_bias->stride(0) : 0;
  p.norm_w = k_norm_weight.data_ptr();
  p.w_kind = float_kind(k_norm_weight, "k_norm_weight");
  p.w_s0 = k_norm_weight.stride(0);
  p.w_s1 = k_norm_weight.stride(1);
  p.cs = cos_sin_cache.data_ptr();
  p.cs_kind = float_kind(cos_sin_cache, "cos_sin_cache");
  p.cs_s0 = cos_sin_cache.stride(0);
  p.cs_s1 = cos_sin_cache.stride(1);
  p.pos = positions.data_ptr();
  p.pos64 = positions.scalar_type() == at::kLong;
  p.pos_s = positions.stride(0);
  p.loc = out_cache_loc.data_ptr();
  p.loc64 = out_cache_loc.scalar_type() == at::kLong;
  p.loc_s = out_cache_loc.stride(0);
  p.num_tokens = T;
  p.num_slots = num_slots;
  p.max_pos = max_pos;
  p.hkv = static_cast<int32_t>(hkv);
  p.d = static_cast<int32_t>(D);
  p.half = static_cast<int32_t>(rot / 2);
  p.rot = static_cast<int32_t>(rot);
  p.eps = static_cast<float>(eps);
  // x / scale as torch's CUDA division by a Python scalar computes it (what the reference
  // runs on the GPU, and SGLang's set_kv_buffer): x * (1 / scale), the reciprocal rounded to
  // float32 once (within one float32 ulp of the IEEE quotient; no per-element division)
  p.k_inv_scale = 1.0f / static_cast<float>(k_scale);
  p.v_inv_scale = 1.0f / static_cast<float>(v_scale);

  // 8-element chunks are vector-accessible when D is a multiple of 8 and every base pointer
  // and row stride keeps 16-byte alignment (fp8 stores need 8).
  bool vec = D % kElems == 0 && aligned16(p.kv) && (p.kv_ld * kv.element_size()) % 16 == 0;
  for (size_t i = 0; i < k_buffers.size(); ++i) {
    vec = vec && aligned16(k_buffers[i].data_ptr()) && aligned16(v_buffers[i].data_ptr());
  }
  p.vec = vec;
  // The pair kernel needs whole 16-dim lane shares (D and R multiples of 16, so R/2 and
  // every chunk start are multiples of 8) and loads 8-element runs of every input as 16-byte
  // vectors: k_norm_weight / cos_sin_cache / kv_bias rows contiguous and 16-byte aligned.
  // Anything else (odd head or rotary dims, strided or unaligned side inputs) takes the
  // generic kernel.
  const auto rows16 = [](const void* ptr, int64_t s0, int64_t s1, int64_t esize) {
    return s1 == 1 && aligned16(ptr) && (s0 * esize) % 16 == 0;
  };
  const bool pair = vec && D % (2 * kElems) == 0 && rot % (2 * kElems) == 0 &&
                    rows16(p.norm_w, p.w_s0, p.w_s1, k_norm_weight.element_size()) &&
                    rows16(p.cs, p.cs_s0, p.cs_s1, cos_sin_cache.element_size()) &&
                    (!kv_bias.has_value() || rows16(p.bias, 0, p.bias_s, 1));
  // lanes per (t, l, h) (pair kernel: 16 dims per lane) or per row (generic: 8 per lane)
  const int64_t dims_per_lane = pair ? 2 * kElems : kElems;
  int g_log2 = 0;
  while ((dims_per_lane << g_log2) < D) ++g_log2;
  p.group_log2 = g_log2;

  for (int64_t l0 = 0; l0 < num_layers; l0 += kMaxLayers) {
    const int64_t nl = std::min<int64_t>(kMaxLayers, num_layers - l0);
    p.layer0 = static_cast<int32_t>(l0);
    p.layers = static_cast<int32_t>(nl);
    for (int64_t j = 0; j < nl; ++j) {
      p.k_base[j] = k_buffers[l0 + j].data_ptr();
      p.v_base[j] = v_buffers[l0 + j].data_ptr();
    }
    // generic: one thread group per (t, l, K|V, h) row; pair: per (t, l, h), K and V
    const int64_t total_rows = T * nl * (pair ? 1 : 2) * hkv;
    const int64_t threads = total_rows << g_log2;
    const int64_t blocks = (threads + kThreads - 1) / kThreads;
    TORCH_CHECK(blocks * kThreads / (int64_t(1) << g_log2) <= std::numeric_limits<int32_t>::max(),
                kName, "too many tokens (", T, ") for one launch");
    switch (kv.scalar_type()) {
      case at::kFloat: launch_in<float>(p, pair, cache, blocks, stream); break;
      case at::kHalf: launch_in<__half>(p, pair, cache, blocks, stream); break;
      case at::kBFloat16: launch_in<__nv_bfloat16>(p, pair, cache, blocks, stream); break;
      default: TORCH_CHECK(false, kName, "kv must be float32/float16/bfloat16");
    }
  }
}

}  // namespace specattn
