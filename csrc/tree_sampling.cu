// Stochastic tree verification: torch.ops.specattn.tree_speculative_sampling.
//
// Semantics (same as specattn.ops.verify.tree_speculative_sampling_reference, whose
// docstring is the contract): SGLang's tree_speculative_sampling_target_only
// (sgl-kernel/csrc/speculative/speculative_sampling.cuh) with the final draw of FlashInfer's
// sampling-from-probabilities, plus the reference's positive-residual guard and
// last-positive fallback.  Written from those semantics, not from their code.
//
//   walk:  from the root (draft 0), at the last accepted node a with coin = coins[b, a], try
//          a's children in sibling order with a float32 running sum prob_acc += q[tok]
//          (q = target_probs[b, a]); accept the first child with
//          coin <= prob_acc / max(threshold_acc, 1e-9)  or  q[tok] >= threshold_single,
//          and move to it; stop at a leaf, when no child is accepted, or after num_steps =
//          S - 1 accepts.
//   draw:  r = relu(q - p) at the final node a, p = draft_probs[b, a] (zeros when absent or
//          after num_steps accepts), r = 0 at the tokens of a's rejected children;
//          u = coin_final * sum(r); the bonus token is the first index with r > 0 and
//          inclusive cumsum > u, else the last index with r > 0, else V - 1.
//
// One launch (plus, when a request is split over several blocks, a cudaMemsetAsync of bs
// int32 ticket counters before it), no host sync, current stream, CUDA-graph capturable
// (the workspace comes from torch's caching allocator, the memset is a graph node), no
// float atomics: every float reduction has a fixed order that depends on V only, so the
// results are deterministic and independent of the batch, of the SM count and of the
// scheduling.
//
// Grid (bs, C): the vocabulary is cut into T = ceil(V / kTile) tiles of kTile = 8192 tokens
// (kThreads = 512 threads x kChunk = 16 consecutive tokens); block (b, c) owns a contiguous
// range of ceil(T / C) tiles of request b.  C is picked on the host from bs, T and the
// number of co-resident blocks (SMs x occupancy) so that bs * C fills about one wave; the
// arithmetic is defined per TILE, so C changes nothing in the results.
//
//   1. Every block stages the request's tree rows (tokens, retrive rows, links, coins) in
//      shared memory as int32 / float (index tensors may be int32 or int64, any mix;
//      values outside their range are treated as missing links / zero probability, so the
//      kernel never reads out of bounds).
//   2. Warp 0 of every block walks the tree (the C blocks of a request redo the same cheap
//      walk, same inputs, same code: identical result).  Per node, lane 0 lists the children
//      (sibling chain in shared memory, at most D), the lanes load q[tok] of up to 32 children
//      at once (one global-latency round per node instead of one per child), then every lane
//      runs the same sequential float32 sum in sibling order (values broadcast by shuffles),
//      so the decisions are bit-identical to the reference's (IEEE add and division: this
//      file must not be built with --use_fast_math).  When no child is accepted, lane 0 sorts
//      the rejected tokens.
//   3. Per tile t of the block: each thread loads its 16 tokens (four float4 loads, all in
//      flight before use, when the rows are 16-byte aligned and V % 4 == 0; else scalar),
//      zeroes the rejected tokens (sorted; per-thread forward cursor), sums them sequentially
//      (acc_j = acc_{j-1} + r_j), and one block-wide exclusive scan of the thread sums
//      (warp shuffles + one warp over the warp totals) gives excl.  The tile's LOCAL cdf of
//      token j is  loc_j = excl + acc_j  and the tile writes to the workspace:
//        S_t = the scan's block total,
//        M_t = max of loc_j over the tokens with r_j > 0 (exact max; -1 if none),
//        L_t = the last token with r_j > 0 (-1 if none).
//      Then thread 0 publishes: __threadfence(); ticket = atomicAdd(&counter[b], 1) (int).
//      Only the block that draws ticket C - 1 goes on (C == 1: no counter, no memset).
//   4. The last block of request b (warp 0, lanes load 32 tiles at a time, the fold runs in
//      the same order in every lane):
//        P_0 = 0, P_{t+1} = P_t + S_t (float32, tile order);  total = P_T;
//        u = f32(coin_final * total);
//        t* = the first tile with L_t >= 0 and P_t + M_t > u;
//      then the whole block rescans tile t* with the same code as in 3 and takes the first
//      token j with r_j > 0 and P_t* + loc_j > u (block min).  No t*: the largest L_t (the
//      last positive token); all L_t < 0: V - 1.
//   5. Outputs (last block only): accept_length, all S columns of accept_index (-1 past the
//      path), and the request's D rows of predicts (path rows get the next path token / the
//      bonus, every other row 0); counter[b] is reset to 0.  Assumes, as SGLang and
//      specattn.ops.build_tree, that retrive_index[b, :] lies in request b's rows
//      [b*D, b*D + D).
//
// Rounding contract of the draw.  The kernel's cdf of token j (in tile t) is
//     cdf_j = P_t + loc_j                       (float32 adds, exactly as written above)
// and the bonus is the first j with r_j > 0 and cdf_j > u, u = f32(coin * P_T), else the
// last j with r_j > 0, else V - 1: the reference's rule with this cdf and total.  The tile
// selection in 4 is exact, not a heuristic: x -> fl(P_t + x) is monotone, so
// max_j fl(P_t + loc_j) = fl(P_t + M_t), hence "tile t holds a positive j with cdf_j > u"
// iff P_t + M_t > u; the rescan of t* therefore always finds its token, the fallback is
// taken iff no cdf_j exceeds u, and no tile before t* is skipped wrongly.  Every quantity is
// a fixed function of the tile's inputs (same code in the writer and in the rescan), so the
// choice is bit-reproducible whatever C, bs or the order in which blocks finish.
// Vs the reference (double cumsum, float32 torch sum for the total): accept_index /
// accept_length / the accepted drafts in predicts are bit-exact; the bonus token may differ
// only when u lies within float rounding (~1e-6 relative) of a cdf boundary, and is then a
// neighbouring token with positive residual.  When every partial sum is exact in float32
// (the tests' dyadic cases: multiples of 1/32 with small totals) every S_t, P_t, loc_j,
// total and u are exact whatever the order, so cdf_j equals the reference's cumsum and the
// bonus is bit-exact.  Vs the previous one-block-per-request kernel (pass-1 total from
// per-thread strided sums, pass-2 cdf from running step totals) the float bits of the total
// and of the cdf differ, so at boundaries the two may pick neighbouring tokens.
//
// Performance (H100, bench verify_sampling: bs 64, D 64, V 128256 fp32, no draft):
//   predicted: ~15-20 us at bs 64, V 128256 (was 64.4 us), because the 33 MB of residual
//   rows are now streamed by ~2 blocks on every SM (C = 4 here: 256 blocks of 4 tiles, one
//   wave, 64 KB of loads in flight per SM) instead of one block on 64 of 132 SMs, so the
//   stream runs near the copy ceiling: 33 MB / ~2.7-3.0 TB/s = 11-12 us; on top, in series:
//   launch + the memset node (~2-3 us in a graph), the redone walk before the stream (~2-3
//   us: 1 round for the tree rows + 1 per accepted level, L2-shared by the C blocks of a
//   request) and the last block's tail (~1-2 us: ticket, 2 L2 reads of the partials, one
//   8192-token rescan from L2, outputs).  The work per block is T / C tiles, so a request's
//   tail waits for its slowest block; the tail after the stream is what keeps it above the
//   ~11 us floor.
//   measured (H100, bench/results/h100/spec_ops.json): 32.4 us, 1017 GB/s,
//   half of the one-block kernel's 64.4 us but above the prediction: the serial parts (walk
//   before the stream, last block's rescan) cost more than estimated.  Not yet explained.
//
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h): the file also compiles against a
// CPU-only torch with a bare nvcc (CI), like kv_move.cu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "specattn_ops.h"
#include "tensor_views.cuh"

namespace specattn {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// float4 path: at most 64 registers, two blocks (32 warps) per SM; the scalar path (rows
// not 16-byte aligned, V % 4 != 0) keeps its 32 loads in flight in registers, one block.
template <int VEC>
constexpr int kMinBlocksPerSm = VEC == 4 ? 2 : 1;
constexpr unsigned kFull = 0xffffffffu;
constexpr size_t kMaxSmemBytes = 47 * 1024;  // dynamic; 48 KiB per block without opt-in
constexpr int kMaxGridY = 65535;

// An int32 or int64 index tensor, read as int64 (dtype picked at run time: the rows are read
// once per block, so a branch costs less than 16 template instantiations).
struct Params {
  OutView<int32_t> predicts;       // [bs * D]
  OutView<int32_t> accept_index;   // [bs, S]
  OutView<int32_t> accept_length;  // [bs]
  IdxView cand, ridx, nxt, sib;
  const float* coins;
  int64_t coin_s0, coin_s1;
  const float* final_coins;
  int64_t fc_s0;
  const float* target;
  int64_t tp_s0, tp_s1;
  const float* draft;  // nullptr: zeros
  int64_t dp_s0, dp_s1;
  // workspace, [bs, T] each (tile sums S, largest positive local cdf M, last positive L),
  // and the per-request tickets [bs] (zero at launch when gridDim.y > 1)
  float* ws_sum;
  float* ws_max;
  int32_t* ws_last;
  int32_t* counters;
  float th_single, th_acc;
  int D, S, V;
  int T;               // tiles per request
  int tiles_per_block;  // block (b, c) owns tiles [c * tpb, min(T, (c + 1) * tpb))
};

// Shared-memory layout (dynamic part, 28 * D + 8 * min(S, D) bytes): int32 cand, ridx, nxt,
// sib, kids, rej [D]; float coin [D]; int32 path_row, path_tok [min(S, D)].

// ------------------------------------------------------------------ block primitives
template <bool kMax>
__device__ int block_minmax(int x, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(kFull, x, o);
    x = kMax ? max(x, y) : min(x, y);
  }
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  int t = lane < kWarps ? scratch[lane] : (kMax ? std::numeric_limits<int>::min()
                                                 : std::numeric_limits<int>::max());
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(kFull, t, o);
    t = kMax ? max(t, y) : min(t, y);
  }
  __syncthreads();
  return t;
}

// Exclusive scan of one float per thread over the block (thread order); *total gets the
// block's sum.  The caller must pass a barrier before `scratch` is written again.
__device__ float block_exclusive_scan(float x, float* scratch, float* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  float excl = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) excl = 0.f;
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    float w = lane < kWarps ? scratch[lane] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kWarps) scratch[lane] = w;  // inclusive scan of the warp totals
  }
  __syncthreads();
  const float warp_excl = warp > 0 ? scratch[warp - 1] : 0.f;
  *total = scratch[kWarps - 1];
  return warp_excl + excl;
}

// ------------------------------------------------------------------ residual tiles
// Each thread owns kChunk consecutive tokens of a tile of kThreads * kChunk tokens, so a
// tile's local cdf is one block-wide scan of the per-thread chunk sums.
constexpr int kChunk = 16;
constexpr int kTile = kThreads * kChunk;

// relu(q - p) at tokens [v, v + kChunk) (0 past V; p = 0 when p_row is null).  VEC == 4
// (float4 loads) only when V % 4 == 0 and the rows are 16-byte aligned, so each 4-vector
// is either fully inside or fully past V.
template <int VEC>
__device__ __forceinline__ void load_chunk(float (&r)[kChunk], const float* __restrict__ q_row,
                                           const float* __restrict__ p_row, int64_t v, int V) {
  if constexpr (VEC == 4) {
    float4 q[kChunk / 4], p[kChunk / 4];
#pragma unroll
    for (int k = 0; k < kChunk / 4; ++k) {  // all loads issued before any use
      q[k] = p[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (v + 4 * k < V) {
        q[k] = __ldg(reinterpret_cast<const float4*>(q_row + v) + k);
        if (p_row != nullptr) p[k] = __ldg(reinterpret_cast<const float4*>(p_row + v) + k);
      }
    }
#pragma unroll
    for (int k = 0; k < kChunk / 4; ++k) {
      r[4 * k + 0] = fmaxf(q[k].x - p[k].x, 0.f);
      r[4 * k + 1] = fmaxf(q[k].y - p[k].y, 0.f);
      r[4 * k + 2] = fmaxf(q[k].z - p[k].z, 0.f);
      r[4 * k + 3] = fmaxf(q[k].w - p[k].w, 0.f);
    }
  } else {
    float q[kChunk], p[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      q[j] = p[j] = 0.f;
      if (v + j < V) {
        q[j] = __ldg(q_row + v + j);
        if (p_row != nullptr) p[j] = __ldg(p_row + v + j);
      }
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) r[j] = fmaxf(q[j] - p[j], 0.f);
  }
}

// Zero the rejected tokens (sorted ascending in rej[0, nrej)) that fall in [v, v + kChunk);
// `cur` is this thread's cursor into rej (its positions only grow).
__device__ __forceinline__ void zero_rejected(float (&r)[kChunk], int64_t v, const int32_t* rej,
                                              int nrej, int& cur) {
  while (cur < nrej && rej[cur] < v) ++cur;
  for (int k = cur; k < nrej && rej[k] < v + kChunk; ++k) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (rej[k] == v + j) r[j] = 0.f;
  }
}

// This thread's residual at its tokens [v, v + kChunk) of a tile, and their sequential sum.
// The local cdf of token j is  excl + acc_j  with acc_j = ((r_0 + r_1) + ...) + r_j  and
// excl the block's exclusive scan of the thread sums: the writer pass and the rescan call
// this same code, so both see the same floats.
template <int VEC>
__device__ __forceinline__ float load_residual(float (&r)[kChunk], const float* q_row,
                                               const float* p_row, int64_t v, int V,
                                               const int32_t* rej, int nrej, int& cur) {
  load_chunk<VEC>(r, q_row, p_row, v, V);
  if (nrej > 0) zero_rejected(r, v, rej, nrej, cur);
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) acc = acc + r[j];
  return acc;
}

// ------------------------------------------------------------------ kernel
template <int VEC>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<VEC>)
    tree_sampling_kernel(const Params P) {
  extern __shared__ int32_t smem[];
  __shared__ float s_scratch[kWarps];
  __shared__ float s_fscratch[kWarps];
  __shared__ int s_iscratch[kWarps];
  __shared__ int s_state[3];  // accepted count, final node, number of rejected tokens
  __shared__ int s_sel[2];    // last block: tile t* (-1: none), last positive token
  __shared__ float s_selp[2];  // last block: P_t*, u
  __shared__ int s_is_last;

  const int D = P.D, S = P.S, V = P.V, T = P.T;
  const int Pn = min(S, D);
  int32_t* s_cand = smem;
  int32_t* s_ridx = s_cand + D;
  int32_t* s_nxt = s_ridx + D;
  int32_t* s_sib = s_nxt + D;
  int32_t* s_kids = s_sib + D;
  int32_t* s_rej = s_kids + D;
  float* s_coin = reinterpret_cast<float*>(s_rej + D);
  int32_t* s_path_row = reinterpret_cast<int32_t*>(s_coin + D);
  int32_t* s_path_tok = s_path_row + Pn;

  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // ---- 1. stage the tree rows (invalid values -> missing link / token -1)
  for (int j = tid; j < D; j += kThreads) {
    const int64_t c = P.cand(b, j), r = P.ridx(b, j), n = P.nxt(b, j), s = P.sib(b, j);
    s_cand[j] = (c >= 0 && c < V) ? static_cast<int32_t>(c) : -1;
    s_ridx[j] = static_cast<int32_t>(r);
    s_nxt[j] = (n >= 0 && n < D) ? static_cast<int32_t>(n) : -1;
    s_sib[j] = (s >= 0 && s < D) ? static_cast<int32_t>(s) : -1;
    s_coin[j] = P.coins[b * P.coin_s0 + j * P.coin_s1];
  }
  __syncthreads();

  // ---- 2. the walk, by warp 0 (the same in every block of the request)
  if (warp == 0) {
    int node = 0, n = 0, nrej = 0;
    if (lane == 0) s_path_row[0] = s_ridx[0];
    // n + 1 < Pn only matters for invalid (cyclic) links: a tree has at most D - 1 drafts
    while (n < S - 1 && n + 1 < Pn) {
      int nk = 0;
      if (lane == 0) {
        for (int c = s_nxt[node]; c != -1 && nk < D; c = s_sib[c]) s_kids[nk++] = c;
      }
      nk = __shfl_sync(kFull, nk, 0);
      __syncwarp();
      if (nk == 0) break;  // leaf
      const float* q_row = P.target + b * P.tp_s0 + node * P.tp_s1;
      const float coin = s_coin[node];
      float prob_acc = 0.f;
      int hit = -1;
      for (int base = 0; base < nk && hit < 0; base += 32) {
        float q = 0.f;
        if (base + lane < nk) {
          const int tok = s_cand[s_kids[base + lane]];
          if (tok >= 0) q = __ldg(q_row + tok);
        }
        const int cnt = min(32, nk - base);
        for (int i = 0; i < cnt; ++i) {  // same sequence in every lane
          const float qi = __shfl_sync(kFull, q, i);
          prob_acc = __fadd_rn(prob_acc, qi);
          if (coin <= __fdiv_rn(prob_acc, P.th_acc) || qi >= P.th_single) {
            hit = base + i;
            break;
          }
        }
      }
      if (hit < 0) {  // every child rejected: its tokens get p = q
        nrej = nk;
        break;
      }
      const int c = s_kids[hit];
      if (lane == 0) {
        s_path_tok[n] = s_cand[c];
        s_path_row[n + 1] = s_ridx[c];
      }
      ++n;
      node = c;
      __syncwarp();
    }
    if (lane == 0) {
      // sort the rejected tokens ascending (insertion sort; nrej <= D, typically <= topk)
      for (int i = 0; i < nrej; ++i) {
        const int32_t x = s_cand[s_kids[i]];
        int k = i;
        for (; k > 0 && s_rej[k - 1] > x; --k) s_rej[k] = s_rej[k - 1];
        s_rej[k] = x;
      }
      s_state[0] = n;
      s_state[1] = node;
      s_state[2] = nrej;
    }
  }
  __syncthreads();
  const int n = s_state[0], node = s_state[1], nrej = s_state[2];

  // ---- 3. this block's tiles: S_t, M_t, L_t into the workspace
  const float* __restrict__ q_row = P.target + b * P.tp_s0 + node * P.tp_s1;
  const float* __restrict__ p_row =
      (P.draft != nullptr && n != S - 1) ? P.draft + b * P.dp_s0 + node * P.dp_s1 : nullptr;
  float* ws_sum = P.ws_sum + b * T;
  float* ws_max = P.ws_max + b * T;
  int32_t* ws_last = P.ws_last + b * T;
  const int t0 = static_cast<int>(blockIdx.y) * P.tiles_per_block;
  const int t1 = min(T, t0 + P.tiles_per_block);
  int cur = 0;
  for (int t = t0; t < t1; ++t) {  // block-uniform trip count
    const int64_t v = static_cast<int64_t>(t) * kTile + static_cast<int64_t>(tid) * kChunk;
    float r[kChunk];
    const float acc = load_residual<VEC>(r, q_row, p_row, v, V, s_rej, nrej, cur);
    float tile_sum;
    const float excl = block_exclusive_scan(acc, s_scratch, &tile_sum);
    // the largest local cdf of a positive token of this thread: acc_j grows with j and
    // x -> fl(excl + x) is monotone, so it is the one at the last positive token
    float a = 0.f, m = -1.f;
    int l = -1;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      a = a + r[j];
      if (r[j] > 0.f) {
        m = excl + a;
        l = static_cast<int>(v) + j;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
      l = max(l, __shfl_xor_sync(kFull, l, o));
    }
    if (lane == 0) {
      s_fscratch[warp] = m;
      s_iscratch[warp] = l;
    }
    // barrier: also orders the scan's reads of s_scratch before the next tile's writes
    __syncthreads();
    if (warp == 0) {
      m = lane < kWarps ? s_fscratch[lane] : -1.f;
      l = lane < kWarps ? s_iscratch[lane] : -1;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
        l = max(l, __shfl_xor_sync(kFull, l, o));
      }
      if (lane == 0) {  // thread 0 writes every workspace entry of this block
        ws_sum[t] = tile_sum;
        ws_max[t] = m;
        ws_last[t] = l;
      }
    }
    // the next tile's writes of s_fscratch / s_iscratch come after its scan's barriers
  }

  // ---- ticket: only the last block of the request goes on
  if (gridDim.y > 1) {
    if (tid == 0) {
      __threadfence();  // this block's workspace entries before its ticket
      const int ticket = atomicAdd(P.counters + b, 1);
      s_is_last = ticket == static_cast<int>(gridDim.y) - 1;
    }
    __syncthreads();
    if (!s_is_last) return;
    __threadfence();  // the other blocks' entries (read below with ld.cg, past L1)
  } else {
    __syncthreads();  // thread 0's workspace writes before warp 0 reads them
  }

  // ---- 4. the last block: fold the tiles in order, pick the tile, rescan it
  if (warp == 0) {
    const float coin = P.final_coins[b * P.fc_s0];
    float total = 0.f;  // P_T
    int last_pos = -1;
    for (int base = 0; base < T; base += 32) {
      float s = 0.f;
      if (base + lane < T) {
        s = __ldcg(ws_sum + base + lane);
        last_pos = max(last_pos, __ldcg(ws_last + base + lane));
      }
      const int cnt = min(32, T - base);
      for (int i = 0; i < cnt; ++i) total = total + __shfl_sync(kFull, s, i);  // tile order
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last_pos = max(last_pos, __shfl_xor_sync(kFull, last_pos, o));
    const float u = __fmul_rn(coin, total);
    float prefix = 0.f;  // P_t
    int tstar = -1;
    for (int base = 0; base < T && tstar < 0; base += 32) {  // uniform over the warp
      float s = 0.f, m = -1.f;
      int l = -1;
      if (base + lane < T) {
        s = __ldcg(ws_sum + base + lane);
        m = __ldcg(ws_max + base + lane);
        l = __ldcg(ws_last + base + lane);
      }
      const int cnt = min(32, T - base);
      for (int i = 0; i < cnt; ++i) {
        const float si = __shfl_sync(kFull, s, i), mi = __shfl_sync(kFull, m, i);
        const int li = __shfl_sync(kFull, l, i);
        if (li >= 0 && prefix + mi > u) {
          tstar = base + i;
          break;
        }
        prefix = prefix + si;
      }
    }
    if (lane == 0) {
      s_sel[0] = tstar;
      s_sel[1] = last_pos;
      s_selp[0] = prefix;
      s_selp[1] = u;
    }
  }
  __syncthreads();
  const int tstar = s_sel[0], last_pos = s_sel[1];
  int bonus = -1;
  if (tstar >= 0) {  // block-uniform
    const float running = s_selp[0], u = s_selp[1];
    const int64_t v = static_cast<int64_t>(tstar) * kTile + static_cast<int64_t>(tid) * kChunk;
    float r[kChunk];
    int cur2 = 0;
    const float acc = load_residual<VEC>(r, q_row, p_row, v, V, s_rej, nrej, cur2);
    float tile_sum;
    const float excl = block_exclusive_scan(acc, s_scratch, &tile_sum);
    int mine = std::numeric_limits<int>::max();
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      a = a + r[j];
      if (r[j] > 0.f && mine == std::numeric_limits<int>::max()) {
        const float loc = excl + a;
        if (running + loc > u) mine = static_cast<int>(v) + j;
      }
    }
    const int found = block_minmax<false>(mine, s_iscratch);
    // always found (see the rounding contract); the guard keeps a token in range regardless
    bonus = found != std::numeric_limits<int>::max() ? found : last_pos;
  } else {
    bonus = last_pos;
  }
  if (bonus < 0) bonus = V - 1;

  // ---- 5. outputs
  if (tid == 0) {
    P.accept_length(b) = n;
    s_path_tok[n] = bonus;
    if (gridDim.y > 1) P.counters[b] = 0;  // leave the ticket ready for the next launch
  }
  for (int k = tid; k < S; k += kThreads)
    P.accept_index(b, k) = k <= n ? s_path_row[k] : -1;
  __syncthreads();
  for (int j = tid; j < D; j += kThreads) {
    const int64_t row = b * D + j;
    int32_t val = 0;
    for (int k = 0; k <= n; ++k)
      if (s_path_row[k] == row) val = s_path_tok[k];
    P.predicts(row) = val;
  }
}

bool aligned16(const float* p, int64_t s0, int64_t s1, int64_t V) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && s0 % 4 == 0 && s1 % 4 == 0 && V % 4 == 0;
}

// Co-resident blocks on the whole device (SMs x occupancy, queried with the largest dynamic
// shared memory, which never binds at 2 blocks per SM), cached per device and variant.  Only
// the split C depends on it, never the arithmetic.
template <int VEC>
int resident_blocks(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0: not queried yet
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int sms = 0, per_sm = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, tree_sampling_kernel<VEC>, kThreads, kMaxSmemBytes));
  const int c = std::max(1, sms) * std::max(1, per_sm);
  if (cacheable) cache[device].store(c, std::memory_order_relaxed);
  return c;
}

}  // namespace

void tree_speculative_sampling_cuda(
    const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_length,
    const at::Tensor& candidates, const at::Tensor& retrive_index,
    const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
    const at::Tensor& uniform_samples, const at::Tensor& uniform_samples_for_final_sampling,
    const at::Tensor& target_probs, double threshold_single, double threshold_acc,
    const std::optional<at::Tensor>& draft_probs) {
  constexpr const char* kOpName = "specattn::tree_speculative_sampling";
  constexpr const char* kOp = "specattn::tree_speculative_sampling: ";
  TORCH_CHECK(candidates.dim() == 2, kOp, "candidates must be 2-D [bs, D], got ",
              candidates.sizes());
  const int64_t bs = candidates.size(0), D = candidates.size(1);
  TORCH_CHECK(target_probs.is_cuda(), kOp, "target_probs must be a CUDA tensor, got ",
              target_probs.device());
  const auto dev = target_probs.device();
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat && target_probs.dim() == 3 &&
                  target_probs.size(0) == bs && target_probs.size(1) == D,
              kOp, "target_probs must be float32 [", bs, ", ", D, ", V], got ",
              target_probs.scalar_type(), " ", target_probs.sizes());
  const int64_t V = target_probs.size(2);
  TORCH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max(), kOp, "bad vocabulary size ",
              V);
  TORCH_CHECK(V == 1 || target_probs.stride(2) == 1, kOp,
              "target_probs must be contiguous in its last dim");
  TORCH_CHECK(D >= 1, kOp, "candidates must have at least one column (the root)");
  TORCH_CHECK(bs * D <= std::numeric_limits<int32_t>::max(), kOp, "bs * D too large");
  TORCH_CHECK(accept_index.dim() == 2 && accept_index.size(0) == bs && accept_index.size(1) >= 1,
              kOp, "accept_index must be [", bs, ", num_steps + 1], got ", accept_index.sizes());
  const int64_t S = accept_index.size(1);
  TORCH_CHECK(S <= std::numeric_limits<int32_t>::max(), kOp, "num_steps too large");
  TORCH_CHECK(predicts.dim() == 1 && predicts.size(0) == bs * D, kOp, "predicts must be [",
              bs * D, "], got ", predicts.sizes());
  TORCH_CHECK(accept_length.dim() == 1 && accept_length.size(0) == bs, kOp,
              "accept_length must be [", bs, "], got ", accept_length.sizes());
  for (const at::Tensor* o : {&predicts, &accept_index, &accept_length}) {
    TORCH_CHECK(o->scalar_type() == at::kInt, kOp, "outputs must be int32, got ",
                o->scalar_type());
    TORCH_CHECK(o->device() == dev, kOp, "outputs must be on ", dev, ", got ", o->device());
  }
  for (const at::Tensor* t : {&candidates, &retrive_index, &retrive_next_token,
                              &retrive_next_sibling}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, kOp,
                "index tensors must be int32 or int64, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) == bs && t->size(1) == D, kOp,
                "index tensors must be [", bs, ", ", D, "], got ", t->sizes());
    TORCH_CHECK(t->device() == dev, kOp, "index tensors must be on ", dev, ", got ",
                t->device());
  }
  TORCH_CHECK(uniform_samples.scalar_type() == at::kFloat && uniform_samples.dim() == 2 &&
                  uniform_samples.size(0) == bs && uniform_samples.size(1) == D &&
                  uniform_samples.device() == dev,
              kOp, "uniform_samples must be float32 [", bs, ", ", D, "] on ", dev);
  TORCH_CHECK(uniform_samples_for_final_sampling.scalar_type() == at::kFloat &&
                  uniform_samples_for_final_sampling.dim() == 1 &&
                  uniform_samples_for_final_sampling.size(0) == bs &&
                  uniform_samples_for_final_sampling.device() == dev,
              kOp, "uniform_samples_for_final_sampling must be float32 [", bs, "] on ", dev);
  const at::Tensor* dp = draft_probs.has_value() && draft_probs->defined() ? &*draft_probs
                                                                           : nullptr;
  if (dp != nullptr) {
    TORCH_CHECK(dp->scalar_type() == at::kFloat && dp->sizes() == target_probs.sizes() &&
                    dp->device() == dev && (V == 1 || dp->stride(2) == 1),
                kOp, "draft_probs must be float32 ", target_probs.sizes(),
                " contiguous in its last dim on ", dev);
  }
  // dynamic shared memory: layout above the block primitives
  const int64_t smem = 7 * 4 * D + 2 * 4 * std::min(S, D);
  TORCH_CHECK(smem <= static_cast<int64_t>(kMaxSmemBytes), kOp, "D = ", D, " needs ", smem,
              " bytes of shared memory (at most ", kMaxSmemBytes, ")");
  if (bs == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  Params P;
  P.predicts = out_view<int32_t>(predicts);
  P.accept_index = out_view<int32_t>(accept_index);
  P.accept_length = out_view<int32_t>(accept_length);
  P.cand = index_view(candidates, kOpName, "candidates");
  P.ridx = index_view(retrive_index, kOpName, "retrive_index");
  P.nxt = index_view(retrive_next_token, kOpName, "retrive_next_token");
  P.sib = index_view(retrive_next_sibling, kOpName, "retrive_next_sibling");
  P.coins = uniform_samples.data_ptr<float>();
  P.coin_s0 = uniform_samples.stride(0);
  P.coin_s1 = uniform_samples.stride(1);
  P.final_coins = uniform_samples_for_final_sampling.data_ptr<float>();
  P.fc_s0 = uniform_samples_for_final_sampling.stride(0);
  P.target = target_probs.data_ptr<float>();
  P.tp_s0 = target_probs.stride(0);
  P.tp_s1 = target_probs.stride(1);
  P.draft = dp != nullptr ? dp->data_ptr<float>() : nullptr;
  P.dp_s0 = dp != nullptr ? dp->stride(0) : 0;
  P.dp_s1 = dp != nullptr ? dp->stride(1) : 0;
  P.th_single = static_cast<float>(threshold_single);
  P.th_acc = static_cast<float>(std::max(threshold_acc, 1e-9));  // as SGLang
  P.D = static_cast<int>(D);
  P.S = static_cast<int>(S);
  P.V = static_cast<int>(V);

  const bool vec4 = aligned16(P.target, P.tp_s0, P.tp_s1, V) &&
                    (dp == nullptr || aligned16(P.draft, P.dp_s0, P.dp_s1, V));

  // Split: T tiles per request over C blocks of tpb tiles each, C from bs and the number of
  // co-resident blocks (about one wave), every block non-empty.  Results do not depend on it.
  const int64_t T = (V + kTile - 1) / kTile;
  const int64_t resident = vec4 ? resident_blocks<4>(dev.index()) : resident_blocks<1>(dev.index());
  const int64_t want = std::clamp<int64_t>(resident / bs, 1, std::min<int64_t>(T, kMaxGridY));
  const int64_t tpb = (T + want - 1) / want;
  const int64_t C = (T + tpb - 1) / tpb;
  P.T = static_cast<int>(T);
  P.tiles_per_block = static_cast<int>(tpb);

  // Workspace from the caching allocator (stream-ordered: safe under concurrent streams and
  // recorded under graph capture): int32 [bs] tickets, then float S, float M, int32 L
  // [bs, T] each.  The tickets must be 0 at launch: one cudaMemsetAsync on the current
  // stream (a memset node under capture); C == 1 needs no tickets and skips it.
  const at::Tensor ws = at::empty({bs + 3 * bs * T}, target_probs.options().dtype(at::kInt));
  int32_t* w = ws.data_ptr<int32_t>();
  P.counters = w;
  P.ws_sum = reinterpret_cast<float*>(w + bs);
  P.ws_max = reinterpret_cast<float*>(w + bs + bs * T);
  P.ws_last = w + bs + 2 * bs * T;
  if (C > 1) {
    C10_CUDA_CHECK(cudaMemsetAsync(P.counters, 0, static_cast<size_t>(bs) * sizeof(int32_t),
                                   stream));
  }

  const dim3 grid(static_cast<unsigned>(bs), static_cast<unsigned>(C));
  if (vec4) {
    tree_sampling_kernel<4><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(P);
  } else {
    tree_sampling_kernel<1><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specattn
