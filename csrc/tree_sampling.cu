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
// One launch, one block of kThreads threads per request, no host sync, current stream
// (CUDA-graph capturable), no atomics: every reduction has a fixed order that depends on V
// only, so results are deterministic and independent of the batch.
//
//   1. The block stages the request's tree rows (tokens, retrive rows, links, coins) in
//      shared memory as int32 / float (index tensors may be int32 or int64, any mix;
//      values outside their range are treated as missing links / zero probability, so the
//      kernel never reads out of bounds).
//   2. Warp 0 walks the tree.  Per node, lane 0 lists the children (sibling chain in
//      shared memory, at most D), the lanes load q[tok] of up to 32 children at once (one
//      global-latency round per node instead of one per child), then every lane runs the
//      same sequential float32 sum in sibling order (values broadcast by shuffles), so the
//      decisions are bit-identical to the reference's (IEEE add and division: this file
//      must not be built with --use_fast_math).  When no child is accepted, lane 0 sorts
//      the rejected tokens.
//   3. The whole block draws the bonus token over V in steps of kThreads * kChunk tokens,
//      each thread owning kChunk = 16 consecutive tokens of a step (four float4 loads, all
//      in flight before use, when the rows are 16-byte aligned and V % 4 == 0; else scalar
//      loads):
//        pass 1: per-thread float32 sums, then a fixed-order block reduction -> total;
//        pass 2: per step, one block-wide exclusive scan of the chunk sums (warp shuffles +
//                one warp over the warp totals) gives each token's
//                cdf = running + (chunk prefix + in-chunk prefix); the block stops at the
//                first step holding a token with r > 0 and cdf > u (block min of the
//                candidates), keeping the last r > 0 index for the fallback.
//      The rejected tokens (sorted) are zeroed by a per-thread cursor: each thread's
//      positions grow step by step, so the cursor only moves forward (amortised O(1)).
//   4. Outputs: accept_length, all S columns of accept_index (-1 past the path), and the
//      request's D rows of predicts (path rows get the next path token / the bonus, every
//      other row 0).  Assumes, as SGLang and specattn.ops.build_tree, that
//      retrive_index[b, :] lies in request b's rows [b*D, b*D + D).
//
// Exactness vs the reference: accept_index / accept_length / the accepted drafts in
// predicts are bit-exact; the bonus token may differ only when u lies within float rounding
// of a cdf boundary (the reference's CPU cumsum accumulates in double, this kernel in
// float32 in tile order), and is then a neighbouring token with positive residual.
//
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h): the file also compiles against a
// CPU-only torch with a bare nvcc (CI), like kv_move.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "specattn_ops.h"

namespace specattn {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr size_t kMaxSmemBytes = 47 * 1024;  // dynamic; 48 KiB per block without opt-in

// An int32 or int64 index tensor, read as int64 (dtype picked at run time: the rows are read
// once per block, so a branch costs less than 16 template instantiations).
struct IdxView {
  const void* ptr;
  int64_t s0, s1;
  bool is64;
  __device__ __forceinline__ int64_t operator()(int64_t i, int64_t j) const {
    const int64_t off = i * s0 + j * s1;
    return is64 ? static_cast<const int64_t*>(ptr)[off]
                : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[off]);
  }
};

struct Params {
  int32_t* predicts;
  int64_t pred_s0;
  int32_t* accept_index;
  int64_t acc_s0, acc_s1;
  int32_t* accept_length;
  int64_t al_s0;
  IdxView cand, ridx, nxt, sib;
  const float* coins;
  int64_t coin_s0, coin_s1;
  const float* final_coins;
  int64_t fc_s0;
  const float* target;
  int64_t tp_s0, tp_s1;
  const float* draft;  // nullptr: zeros
  int64_t dp_s0, dp_s1;
  float th_single, th_acc;
  int D, S, V;
};

// Shared-memory layout (dynamic part, 28 * D + 8 * min(S, D) bytes): int32 cand, ridx, nxt,
// sib, kids, rej [D]; float coin [D]; int32 path_row, path_tok [min(S, D)].

// ------------------------------------------------------------------ block primitives
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Sum over the block, same value in every thread; fixed order.  Ends with a barrier after
// the last read of `scratch`.
__device__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float t = lane < kWarps ? scratch[lane] : 0.f;
  t = warp_sum(t);  // every warp reduces the warp totals in the same order
  __syncthreads();
  return t;
}

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

// ------------------------------------------------------------------ residual chunks
// Each thread owns kChunk consecutive tokens per step of kThreads * kChunk tokens, so a
// step's inclusive cdf is one block-wide scan of the per-thread chunk sums.
constexpr int kChunk = 16;
constexpr int kStep = kThreads * kChunk;

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

// ------------------------------------------------------------------ kernel
template <int VEC>
__global__ void __launch_bounds__(kThreads) tree_sampling_kernel(const Params P) {
  extern __shared__ int32_t smem[];
  __shared__ float s_scratch[kWarps];
  __shared__ int s_iscratch[kWarps];
  __shared__ int s_state[3];  // accepted count, final node, number of rejected tokens

  const int D = P.D, S = P.S, V = P.V;
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
  const int tid = threadIdx.x;

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

  // ---- 2. the walk, by warp 0
  if (tid < 32) {
    const int lane = tid;
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

  // ---- 3. the bonus draw over V
  const float* __restrict__ q_row = P.target + b * P.tp_s0 + node * P.tp_s1;
  const float* __restrict__ p_row =
      (P.draft != nullptr && n != S - 1) ? P.draft + b * P.dp_s0 + node * P.dp_s1 : nullptr;
  float part = 0.f;
  int cur = 0;
  for (int64_t v = static_cast<int64_t>(tid) * kChunk; v < V; v += kStep) {
    float r[kChunk];
    load_chunk<VEC>(r, q_row, p_row, v, V);
    if (nrej > 0) zero_rejected(r, v, s_rej, nrej, cur);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) part += r[j];
  }
  const float total = block_sum(part, s_scratch);
  const float u = __fmul_rn(P.final_coins[b * P.fc_s0], total);

  float running = 0.f;  // sum of the previous steps (same value in every thread)
  int found = -1, last_pos = -1;
  cur = 0;
  for (int64_t base = 0; base < V; base += kStep) {  // block-uniform trip count
    const int64_t v = base + static_cast<int64_t>(tid) * kChunk;
    float r[kChunk];
    load_chunk<VEC>(r, q_row, p_row, v, V);
    if (nrej > 0) zero_rejected(r, v, s_rej, nrej, cur);
    float incl[kChunk];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) incl[j] = acc = acc + r[j];
    float step_total;
    const float excl = block_exclusive_scan(acc, s_scratch, &step_total);
    int mine = std::numeric_limits<int>::max();
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (r[j] > 0.f) {
        last_pos = static_cast<int>(v) + j;
        if (mine == std::numeric_limits<int>::max() && running + (excl + incl[j]) > u)
          mine = static_cast<int>(v) + j;
      }
    }
    // barrier: also orders the scan's reads of s_scratch before the next step's writes
    if (__syncthreads_or(mine != std::numeric_limits<int>::max())) {
      found = block_minmax<false>(mine, s_iscratch);
      break;
    }
    running += step_total;
  }
  int bonus = found;
  if (bonus < 0) {
    bonus = block_minmax<true>(last_pos, s_iscratch);
    if (bonus < 0) bonus = V - 1;
  }

  // ---- 4. outputs
  if (tid == 0) {
    P.accept_length[b * P.al_s0] = n;
    s_path_tok[n] = bonus;
  }
  for (int k = tid; k < S; k += kThreads)
    P.accept_index[b * P.acc_s0 + k * P.acc_s1] = k <= n ? s_path_row[k] : -1;
  __syncthreads();
  for (int j = tid; j < D; j += kThreads) {
    const int64_t row = b * D + j;
    int32_t val = 0;
    for (int k = 0; k <= n; ++k)
      if (s_path_row[k] == row) val = s_path_tok[k];
    P.predicts[row * P.pred_s0] = val;
  }
}

bool aligned16(const float* p, int64_t s0, int64_t s1, int64_t V) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && s0 % 4 == 0 && s1 % 4 == 0 && V % 4 == 0;
}

IdxView index_view(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.scalar_type() == at::kLong};
}

}  // namespace

void tree_speculative_sampling_cuda(
    const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_length,
    const at::Tensor& candidates, const at::Tensor& retrive_index,
    const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
    const at::Tensor& uniform_samples, const at::Tensor& uniform_samples_for_final_sampling,
    const at::Tensor& target_probs, double threshold_single, double threshold_acc,
    const std::optional<at::Tensor>& draft_probs) {
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
  P.predicts = predicts.data_ptr<int32_t>();
  P.pred_s0 = predicts.stride(0);
  P.accept_index = accept_index.data_ptr<int32_t>();
  P.acc_s0 = accept_index.stride(0);
  P.acc_s1 = accept_index.stride(1);
  P.accept_length = accept_length.data_ptr<int32_t>();
  P.al_s0 = accept_length.stride(0);
  P.cand = index_view(candidates);
  P.ridx = index_view(retrive_index);
  P.nxt = index_view(retrive_next_token);
  P.sib = index_view(retrive_next_sibling);
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
  const dim3 grid(static_cast<unsigned>(bs));
  if (vec4) {
    tree_sampling_kernel<4><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(P);
  } else {
    tree_sampling_kernel<1><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace specattn
