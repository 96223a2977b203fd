// EAGLE tree ops on CUDA: torch.ops.specattn.build_tree, verify_tree_greedy and
// compact_accepted_path.
//
// Semantics: the reference functions build_tree_reference (specattn/ops/tree.py),
// verify_tree_greedy_reference (specattn/ops/verify.py) and compact_accepted_path_reference
// (specattn/ops/compaction.py), bit for bit; argument order = those functions' (outputs
// first where they have them).  They follow SGLang's sgl-kernel/csrc/speculative/
// eagle_utils.cu (build_tree_efficient, VerifyTreeGreedy) and spec-v2's accepted-path
// compaction; this file was written from those semantics, not from SGLang's code.
//
// Common rules.  Index inputs may be int32 or int64 in any mix (read through IdxView, whose
// dtype is a runtime flag: no template explosion) with arbitrary strides; outputs have the
// dtypes the Python wrappers allocate (TORCH_CHECKed) and arbitrary strides.  Every element
// of every output is written.  One launch per op for the whole batch, sizes are runtime
// arguments (no recompilation per batch size), nothing is allocated and nothing synced on
// the common path, the current stream is used: CUDA-graph capturable.  The Python wrappers
// validate values (host sync, skipped during capture); the kernels still never index out of
// bounds and never loop forever on bad values (walks are bounded by D).
//
// build_tree (one block per request, a thread per draft token, D <= kBuildMaxD = 512):
//   1. the request's selected candidates go to shared memory;
//   2. parent of draft j: the root when its beam (candidate / topk) is 0, else the draft
//      whose candidate equals parent_list[b, beam] (a scan of the shared candidates; none:
//      a missing parent, -1);
//   3. each thread walks its ancestors (pointer chasing in shared memory, at most D steps)
//      setting the bits of its own mask row (shared, W = ceil(D/32) words) and counting the
//      depth; an orphan stops the walk (row {root, itself}, depth 1, descendants count from
//      it); first child / next sibling from per-node child bit sets that step 2 fills with
//      shared atomicOr (first set bit of its own set / of its parent's set above itself:
//      O(W) per thread instead of a scan over all D parents; an orphan has parent -1 so it
//      is in no child set);
//   4. optional FlashInfer packed mask: request b's segment, bytes [indptr[b], indptr[b] +
//      ceil(D*(P+D)/8)) with P = verified_seq_len[b], is the row-major [D, P+D] bit matrix
//      (prefix columns all ones, then the tree row), little-endian bits, padding 0
//      (= backends.tree_mask.tree_mask_to_flashinfer).  The block writes it byte-parallel
//      from the shared mask rows: unaligned head / tail bytes one per thread, the aligned
//      body in 16-byte stores; every byte is written by exactly one thread, nothing outside
//      the segment (or the buffer) is touched.
// verify_tree_greedy (one warp per request): the warp zero-fills its block's predicts rows
//   and (D <= 1024) copies the request's candidates / retrive_* / target rows to shared
//   memory; lane 0 walks the tree (children in sibling order, first match wins, at most
//   S-1 accepts, sibling chains bounded by D+1 steps) writing predicts at the path rows and
//   accept_index[b, 0..n]; the warp fills the rest of accept_index with -1.  As the Triton
//   kernel and SGLang, retrive_index[b, :] must lie in request b's block [b*D, b*D + D)
//   (build_tree guarantees it): predicts rows are zeroed per block.
// compact_accepted_path (grid x: tiles of rows, y: column chunks of hidden rows): every block
//   recomputes src_index for its rows (accept_index[b, k] for k <= accept_length[b], else
//   the row itself); blocks of chunk 0 write src_index / predicts / out_cache_loc / tgt_loc
//   / src_loc; then hidden rows are copied as raw bytes (any dtype) with the widest vector
//   (16/8/4/2/1 bytes) that divides the row size, both row strides and both base pointers,
//   4 independent vectors in flight per thread.  Rows need dense inner dims (any row
//   stride); otherwise the input is read from a contiguous copy and / or the output is
//   written to a contiguous temporary copied back (one extra copy kernel, still capturable).
//
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h), as kv_move.cu: compiles against a
// CPU-only torch with a bare nvcc (tests/test_csrc_compiles.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "specattn_ops.h"
#include "tensor_views.cuh"

namespace specattn {
namespace {

// ------------------------------------------------------------------------------ common
void check_dev(const at::Tensor& t, const char* op, const char* name, const c10::Device& dev) {
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), ", expected ", dev);
}

void check_shape(const at::Tensor& t, const char* op, const char* name,
                 std::initializer_list<int64_t> shape) {
  TORCH_CHECK(t.sizes().equals(shape), op, ": ", name, " must have shape ",
              c10::IntArrayRef(shape), ", got ", t.sizes());
}

void check_out(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
               std::initializer_list<int64_t> shape, const c10::Device& dev) {
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  check_shape(t, op, name, shape);
  check_dev(t, op, name, dev);
}

// ------------------------------------------------------------------------------ build_tree
constexpr int kBuildMaxD = 512;       // mask rows of W <= 16 words; shared memory < 72 KiB
constexpr int kBuildMaxThreads = 512;
constexpr int kBuildFiThreads = 256;  // at least this many threads when writing FlashInfer bytes

struct BuildTreeArgs {
  IdxView parent_list;  // [bs, width]
  IdxView selected;     // [bs, D - 1]
  IdxView seq_len;      // [bs]
  int32_t* mask;        // [bs, D, W]
  int64_t m_s0, m_s1, m_s2;
  int64_t* pos;  // [bs * D]
  int64_t pos_s0;
  int64_t* ridx;  // [bs, D]
  int64_t ri_s0, ri_s1;
  int64_t* nxt;
  int64_t nx_s0, nx_s1;
  int64_t* sib;
  int64_t sb_s0, sb_s1;
  uint8_t* fi;       // FlashInfer packed mask (contiguous bytes) or nullptr
  int64_t fi_numel;  // its length in bytes
  IdxView fi_indptr;  // [bs + 1]
  int64_t topk;
  int64_t width;  // parent_list.size(1)
  int D;
  int W;
};

__device__ __forceinline__ uint32_t low_bits(int n) {
  return n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// n <= 32 consecutive elements, from element e0 on, of one request's flattened row-major
// [D, L] FlashInfer mask (L = P + D: P prefix columns, all ones, then the D tree columns of
// the shared mask row); bit t of the result is element e0 + t, 0 past the end.
__device__ uint32_t fi_bits(const uint32_t* __restrict__ s_mask, int W, int D, int64_t P,
                            int64_t L, int64_t total, int64_t e0, int n, bool narrow) {
  if (e0 >= total) return 0u;
  int64_t j, c;
  if (narrow) {  // total < 2^32: 32-bit division
    const uint32_t q = static_cast<uint32_t>(e0) / static_cast<uint32_t>(L);
    j = q;
    c = e0 - static_cast<int64_t>(q) * L;
  } else {
    j = e0 / L;
    c = e0 - j * L;
  }
  uint32_t out = 0u;
  int got = 0;
  while (got < n && j < D) {
    int run = static_cast<int>(min(static_cast<int64_t>(n - got), L - c));
    if (c < P) {  // prefix columns: ones
      const int pr = static_cast<int>(min(static_cast<int64_t>(run), P - c));
      out |= low_bits(pr) << got;
      got += pr;
      c += pr;
      run -= pr;
    }
    if (run > 0) {  // tree columns k0 .. k0 + run - 1 of row j
      const int k0 = static_cast<int>(c - P);
      const uint32_t* row = s_mask + j * W;
      const int w = k0 >> 5, s = k0 & 31;
      uint32_t v = row[w] >> s;
      if (s != 0 && w + 1 < W) v |= row[w + 1] << (32 - s);
      out |= (v & low_bits(run)) << got;
      got += run;
      c += run;
    }
    if (c >= L) {
      ++j;
      c = 0;
    }
  }
  return out;
}

__global__ void __launch_bounds__(kBuildMaxThreads)
    build_tree_kernel(const __grid_constant__ BuildTreeArgs a) {
  extern __shared__ int64_t s_build[];
  const int D = a.D, W = a.W;
  int64_t* s_sel = s_build;                                   // [D] candidate of draft j
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(s_sel + D);  // [D * W] mask rows
  uint32_t* s_child = s_mask + D * W;                         // [D * W] child bit sets
  int32_t* s_par = reinterpret_cast<int32_t*>(s_child + D * W);  // [D] real parent or -1
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x, nth = blockDim.x;
  const int64_t prefix = a.seq_len(b);  // independent of the rest: issued first

  for (int j = tid; j < D; j += nth) {
    s_sel[j] = j >= 1 ? a.selected(b, j - 1) : -1;
    for (int w = 0; w < W; ++w) s_mask[j * W + w] = s_child[j * W + w] = 0u;
  }
  __syncthreads();

  // 2. parents
  for (int j = tid; j < D; j += nth) {
    int p = -1;
    if (j >= 1) {
      const int64_t f = s_sel[j];
      const int64_t beam = f >= 0 ? f / a.topk : -1;
      if (beam == 0) {
        p = 0;
      } else if (beam > 0 && beam < a.width) {
        const int64_t pc = a.parent_list(b, beam);
        for (int k = 1; k < D; ++k) {  // last match, as the reference's dict (distinct anyway)
          if (s_sel[k] == pc) p = k;
        }
      }  // else: candidate out of range (rejected by the wrapper): treated as missing parent
    }
    s_par[j] = p;
    if (p >= 0) atomicOr(&s_child[p * W + (j >> 5)], 1u << (j & 31));
  }
  __syncthreads();

  // 3. mask rows, depth, links
  for (int j = tid; j < D; j += nth) {
    uint32_t* row = s_mask + j * W;
    row[0] |= 1u;  // the root
    int depth = 0;
    for (int k = j, steps = 0; k > 0 && steps < D; ++steps) {  // itself, then ancestors
      row[k >> 5] |= 1u << (k & 31);
      ++depth;
      k = s_par[k];
    }
    const int p = s_par[j];
    int first_child = -1, next_sib = -1;
    for (int w = 0; w < W; ++w) {  // lowest k with parent j (k >= 1: the root has none)
      const uint32_t v = s_child[j * W + w];
      if (v != 0u) {
        first_child = w * 32 + __ffs(v) - 1;
        break;
      }
    }
    if (p >= 0) {  // lowest k > j with parent p
      const int k0 = j + 1;
      for (int w = k0 >> 5; w < W; ++w) {
        uint32_t v = s_child[p * W + w];
        if (w == (k0 >> 5)) v &= ~low_bits(k0 & 31);
        if (v != 0u) {
          next_sib = w * 32 + __ffs(v) - 1;
          break;
        }
      }
    }
    const int64_t flat = b * D + j;
    a.pos[flat * a.pos_s0] = prefix + depth;
    a.ridx[b * a.ri_s0 + j * a.ri_s1] = flat;
    a.nxt[b * a.nx_s0 + j * a.nx_s1] = first_child;
    a.sib[b * a.sb_s0 + j * a.sb_s1] = next_sib;
    int32_t* out = a.mask + b * a.m_s0 + j * a.m_s1;
    for (int w = 0; w < W; ++w) out[w * a.m_s2] = static_cast<int32_t>(row[w]);
  }

  // 4. FlashInfer packed mask (uniform branch: the barrier is reached by all threads)
  if (a.fi != nullptr) {
    __syncthreads();  // every mask row complete
    const int64_t P = max(prefix, static_cast<int64_t>(0));
    const int64_t L = P + D;
    const int64_t total = L * D;
    const int64_t nbytes = (total + 7) >> 3;
    const int64_t start = a.fi_indptr(b);
    if (start < 0 || start >= a.fi_numel) return;
    const int64_t avail = min(nbytes, a.fi_numel - start);
    const bool narrow = total <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max());
    uint8_t* seg = a.fi + start;
    const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(seg) & 15);
    const int64_t head = min((16 - misalign) & 15, avail);  // bytes before the 16-byte body
    const int64_t nvec = (avail - head) >> 4;
    const int64_t tail0 = head + nvec * 16;
    const int64_t nedge = head + (avail - tail0);
    for (int64_t t = tid; t < nedge; t += nth) {
      const int64_t i = t < head ? t : tail0 + (t - head);
      seg[i] = static_cast<uint8_t>(fi_bits(s_mask, W, D, P, L, total, i * 8, 8, narrow));
    }
    uint4* body = reinterpret_cast<uint4*>(seg + head);
    for (int64_t v = tid; v < nvec; v += nth) {
      const int64_t e = (head + v * 16) * 8;
      uint4 q;
      q.x = fi_bits(s_mask, W, D, P, L, total, e, 32, narrow);
      q.y = fi_bits(s_mask, W, D, P, L, total, e + 32, 32, narrow);
      q.z = fi_bits(s_mask, W, D, P, L, total, e + 64, 32, narrow);
      q.w = fi_bits(s_mask, W, D, P, L, total, e + 96, 32, narrow);
      body[v] = q;
    }
  }
}

// ------------------------------------------------------------------------------ verify
constexpr int kVerifySmemMaxD = 1024;  // 32 B of shared memory per draft token

struct VerifyArgs {
  OutView<int32_t> pred;  // [bs * D]
  OutView<int32_t> acc;   // [bs, S]
  OutView<int32_t> alen;  // [bs]
  IdxView cand, ridx, nxt, sib, tgt;  // [bs, D] each
  int64_t bs;
  int64_t S;
  int D;
};

__device__ __forceinline__ int clamp_link(int64_t v, int D) {
  return (v >= 0 && v < D) ? static_cast<int>(v) : -1;
}

template <bool kSmem>
__global__ void __launch_bounds__(32) verify_greedy_kernel(const __grid_constant__ VerifyArgs a) {
  extern __shared__ int64_t s_verify[];
  const int D = a.D;
  const int64_t b = blockIdx.x;
  const int lane = threadIdx.x;
  const int64_t base = b * D, nrows = a.bs * D;
  int64_t* s_cand = s_verify;
  int64_t* s_ridx = s_verify + D;
  int64_t* s_tgt = s_verify + 2 * D;
  int32_t* s_nxt = reinterpret_cast<int32_t*>(s_verify + 3 * D);
  int32_t* s_sib = s_nxt + D;

  for (int j = lane; j < D; j += 32) {
    if (kSmem) {
      s_cand[j] = a.cand(b, j);
      s_ridx[j] = a.ridx(b, j);
      s_tgt[j] = a.tgt(b, j);
      s_nxt[j] = clamp_link(a.nxt(b, j), D);
      s_sib[j] = clamp_link(a.sib(b, j), D);
    }
    a.pred(base + j) = 0;
  }
  __syncwarp();  // orders the zero fill before lane 0's path writes, publishes the rows

  int64_t n = 0;
  if (lane == 0) {
    auto cand = [&](int j) { return kSmem ? s_cand[j] : a.cand(b, j); };
    auto ridx = [&](int j) { return kSmem ? s_ridx[j] : a.ridx(b, j); };
    auto nxt = [&](int j) { return kSmem ? s_nxt[j] : clamp_link(a.nxt(b, j), D); };
    auto sib = [&](int j) { return kSmem ? s_sib[j] : clamp_link(a.sib(b, j), D); };
    auto target = [&](int64_t row) {  // target_predict.flatten()[row], row in [0, bs*D)
      if (kSmem && row >= base && row < base + D) return s_tgt[row - base];
      const int64_t rb = row / D;
      return a.tgt(rb, row - rb * D);
    };
    int64_t last = ridx(0);
    bool live = last >= 0 && last < nrows;  // an out-of-range row (bad input) ends the walk
    int node = 0;
    a.acc(b, 0) = static_cast<int32_t>(last);
    while (live && n < a.S - 1) {
      const int64_t want = target(last);
      int hit = -1;
      for (int c = nxt(node), guard = 0; c != -1 && guard <= D; c = sib(c), ++guard) {
        if (cand(c) == want) {
          hit = c;
          break;
        }
      }
      if (hit < 0) break;
      a.pred(last) = static_cast<int32_t>(want);
      ++n;
      node = hit;
      last = ridx(hit);
      live = last >= 0 && last < nrows;
      a.acc(b, n) = static_cast<int32_t>(last);
    }
    if (live) a.pred(last) = static_cast<int32_t>(target(last));  // the bonus
    a.alen(b) = static_cast<int32_t>(n);
  }
  n = __shfl_sync(0xffffffffu, n, 0);
  for (int64_t k = n + 1 + lane; k < a.S; k += 32) a.acc(b, k) = -1;
}

// ------------------------------------------------------------------------------ compaction
constexpr int kCompactThreads = 256;
constexpr int kCompactUnroll = 4;
constexpr int kCompactChunk = kCompactThreads * kCompactUnroll;  // vectors per block (one pass)
constexpr int kCompactRowsNoHidden = 1024;                      // rows per block without hidden

struct CompactArgs {
  IdxView accept_index;   // [bs, S]
  IdxView accept_length;  // [bs]
  const char* ocl;        // out_cache_loc [bs * D] (raw elements of ocl_esize bytes)
  int64_t ocl_s0;
  const char* pred;  // predicts [bs * D] or nullptr
  int64_t pred_s0;
  int64_t* src_index;
  int64_t src_s0;
  char* pred_out;
  int64_t pred_out_s0;
  char* ocl_out;
  int64_t ocl_out_s0;
  char* tgt_loc;
  int64_t tgt_s0;
  char* src_loc;
  int64_t srcl_s0;
  const char* hs;  // hidden rows (raw bytes) or nullptr
  char* hs_out;
  int64_t hs_row_stride;      // bytes
  int64_t hs_out_row_stride;  // bytes
  int64_t row_vecs;           // vectors per hidden row
  int64_t chunk_vecs;         // vectors per block column chunk
  int64_t N;                  // bs * D
  int64_t S;
  int D;
  int rows_per_block;
  int ocl_esize;
  int pred_esize;
};

__device__ __forceinline__ void copy_elem(char* dst, const char* src, int esize) {
  if (esize == 8) {
    *reinterpret_cast<int64_t*>(dst) = *reinterpret_cast<const int64_t*>(src);
  } else {
    *reinterpret_cast<int32_t*>(dst) = *reinterpret_cast<const int32_t*>(src);
  }
}

template <typename Vec>
__global__ void __launch_bounds__(kCompactThreads)
    compact_kernel(const __grid_constant__ CompactArgs a) {
  __shared__ int64_t s_src[kCompactRowsNoHidden];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * a.rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(a.rows_per_block), a.N - r0));
  const bool index_outputs = blockIdx.y == 0;
  for (int r = threadIdx.x; r < rows; r += kCompactThreads) {
    const int64_t i = r0 + r;
    const int64_t b = i / a.D;
    const int64_t k = i - b * a.D;
    int64_t src = i;
    if (k < a.S && k <= a.accept_length(b)) {
      const int64_t s = a.accept_index(b, k);
      if (s >= 0 && s < a.N) src = s;  // out of range (bad input): the row itself
    }
    s_src[r] = src;
    if (index_outputs) {
      a.src_index[i * a.src_s0] = src;
      const int oe = a.ocl_esize;
      copy_elem(a.ocl_out + i * a.ocl_out_s0 * oe, a.ocl + src * a.ocl_s0 * oe, oe);
      copy_elem(a.src_loc + i * a.srcl_s0 * oe, a.ocl + src * a.ocl_s0 * oe, oe);
      copy_elem(a.tgt_loc + i * a.tgt_s0 * oe, a.ocl + i * a.ocl_s0 * oe, oe);
      if (a.pred != nullptr) {
        const int pe = a.pred_esize;
        copy_elem(a.pred_out + i * a.pred_out_s0 * pe, a.pred + src * a.pred_s0 * pe, pe);
      }
    }
  }
  if (a.hs == nullptr) return;  // uniform
  __syncthreads();

  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * a.chunk_vecs;
  const uint32_t cv = static_cast<uint32_t>(min(a.chunk_vecs, a.row_vecs - v0));
  // rows * cv <= kCompactChunk (host picks rows_per_block): one pass of kUnroll vectors
  const uint32_t total = static_cast<uint32_t>(rows) * cv;
  for (uint32_t pass = 0; pass < total; pass += kCompactChunk) {
    Vec tmp[kCompactUnroll];
    int64_t dst[kCompactUnroll];
#pragma unroll
    for (int u = 0; u < kCompactUnroll; ++u) {
      const uint32_t w = pass + u * kCompactThreads + threadIdx.x;
      dst[u] = -1;
      if (w < total) {
        const uint32_t r = w / cv;
        const int64_t v = v0 + (w - r * cv);
        tmp[u] = *reinterpret_cast<const Vec*>(a.hs + s_src[r] * a.hs_row_stride +
                                               v * static_cast<int64_t>(sizeof(Vec)));
        dst[u] = (r0 + r) * a.hs_out_row_stride + v * static_cast<int64_t>(sizeof(Vec));
      }
    }
#pragma unroll
    for (int u = 0; u < kCompactUnroll; ++u) {
      if (dst[u] >= 0) *reinterpret_cast<Vec*>(a.hs_out + dst[u]) = tmp[u];
    }
  }
}

// Dims 1.. of t dense in row-major order (any stride of dim 0): rows are byte ranges.
bool rows_dense(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

}  // namespace

// ------------------------------------------------------------------------------ host: build
void build_tree_cuda(const at::Tensor& parent_list, const at::Tensor& selected_index,
                     const at::Tensor& verified_seq_len, const at::Tensor& tree_mask,
                     const at::Tensor& positions, const at::Tensor& retrive_index,
                     const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
                     int64_t topk, int64_t num_steps, int64_t num_draft_tokens,
                     const std::optional<at::Tensor>& flashinfer_packed_mask,
                     const std::optional<at::Tensor>& flashinfer_mask_indptr) {
  const char* op = "specattn::build_tree";
  TORCH_CHECK(verified_seq_len.is_cuda(), op, ": tensors must be CUDA tensors, got ",
              verified_seq_len.device());
  const c10::Device dev = verified_seq_len.device();
  TORCH_CHECK(topk >= 1 && num_steps >= 1 && num_draft_tokens >= 1, op,
              ": topk, num_steps and num_draft_tokens must be >= 1, got ", topk, ", ", num_steps,
              ", ", num_draft_tokens);
  TORCH_CHECK(num_draft_tokens <= kBuildMaxD, op, ": num_draft_tokens = ", num_draft_tokens,
              " exceeds the CUDA kernel's limit of ", kBuildMaxD,
              " (use impl='triton' or impl='reference')");
  const int D = static_cast<int>(num_draft_tokens);
  const int W = (D + 31) / 32;
  TORCH_CHECK(verified_seq_len.dim() == 1, op, ": verified_seq_len must be 1-D, got ",
              verified_seq_len.sizes());
  const int64_t bs = verified_seq_len.size(0);
  const int64_t width = topk * (num_steps - 1) + 1;
  check_shape(parent_list, op, "parent_list", {bs, width});
  check_shape(selected_index, op, "selected_index", {bs, D - 1});
  check_dev(parent_list, op, "parent_list", dev);
  check_dev(selected_index, op, "selected_index", dev);
  const IdxView pl = index_view(parent_list, op, "parent_list");
  const IdxView sel = index_view(selected_index, op, "selected_index");
  const IdxView vsl = index_view(verified_seq_len, op, "verified_seq_len");
  check_out(tree_mask, op, "tree_mask", at::kInt, {bs, D, W}, dev);
  check_out(positions, op, "positions", at::kLong, {bs * D}, dev);
  check_out(retrive_index, op, "retrive_index", at::kLong, {bs, D}, dev);
  check_out(retrive_next_token, op, "retrive_next_token", at::kLong, {bs, D}, dev);
  check_out(retrive_next_sibling, op, "retrive_next_sibling", at::kLong, {bs, D}, dev);
  TORCH_CHECK(flashinfer_packed_mask.has_value() == flashinfer_mask_indptr.has_value(), op,
              ": pass both flashinfer_packed_mask and flashinfer_mask_indptr, or neither");
  const bool fi = flashinfer_packed_mask.has_value();
  uint8_t* fi_ptr = nullptr;
  int64_t fi_numel = 0;
  IdxView fi_indptr{nullptr, 0, 0, false};
  if (fi) {
    const at::Tensor& m = *flashinfer_packed_mask;
    const at::Tensor& ip = *flashinfer_mask_indptr;
    TORCH_CHECK(m.scalar_type() == at::kByte && m.dim() == 1, op,
                ": flashinfer_packed_mask must be a 1-D uint8 tensor, got ", m.scalar_type(), " ",
                m.sizes());
    TORCH_CHECK(m.numel() <= 1 || m.stride(0) == 1, op,
                ": flashinfer_packed_mask must be contiguous");
    check_dev(m, op, "flashinfer_packed_mask", dev);
    check_shape(ip, op, "flashinfer_mask_indptr", {bs + 1});
    check_dev(ip, op, "flashinfer_mask_indptr", dev);
    fi_indptr = index_view(ip, op, "flashinfer_mask_indptr");
    fi_numel = m.numel();
    fi_ptr = fi_numel > 0 ? static_cast<uint8_t*>(m.data_ptr()) : nullptr;
  }
  if (bs == 0) return;
  TORCH_CHECK(bs <= std::numeric_limits<int32_t>::max(), op, ": batch too large (", bs, ")");

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  BuildTreeArgs a;
  a.parent_list = pl;
  a.selected = sel;
  a.seq_len = vsl;
  a.mask = tree_mask.data_ptr<int32_t>();
  a.m_s0 = tree_mask.stride(0);
  a.m_s1 = tree_mask.stride(1);
  a.m_s2 = tree_mask.stride(2);
  a.pos = positions.data_ptr<int64_t>();
  a.pos_s0 = positions.stride(0);
  a.ridx = retrive_index.data_ptr<int64_t>();
  a.ri_s0 = retrive_index.stride(0);
  a.ri_s1 = retrive_index.stride(1);
  a.nxt = retrive_next_token.data_ptr<int64_t>();
  a.nx_s0 = retrive_next_token.stride(0);
  a.nx_s1 = retrive_next_token.stride(1);
  a.sib = retrive_next_sibling.data_ptr<int64_t>();
  a.sb_s0 = retrive_next_sibling.stride(0);
  a.sb_s1 = retrive_next_sibling.stride(1);
  a.fi = fi_ptr;
  a.fi_numel = fi_numel;
  a.fi_indptr = fi_indptr;
  a.topk = topk;
  a.width = width;
  a.D = D;
  a.W = W;
  int threads = std::max(32, (D + 31) / 32 * 32);
  if (fi_ptr != nullptr) threads = std::max(threads, kBuildFiThreads);
  const size_t smem = static_cast<size_t>(D) * (sizeof(int64_t) + sizeof(int32_t)) +
                      2 * static_cast<size_t>(D) * W * sizeof(uint32_t);
  if (smem > 48 * 1024) {  // D > 416: opt in to more than the default dynamic shared memory
    C10_CUDA_CHECK(cudaFuncSetAttribute(build_tree_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  build_tree_kernel<<<static_cast<unsigned>(bs), threads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------ host: verify
void verify_tree_greedy_cuda(const at::Tensor& predicts, const at::Tensor& accept_index,
                             const at::Tensor& accept_length, const at::Tensor& candidates,
                             const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                             const at::Tensor& retrive_next_sibling,
                             const at::Tensor& target_predict) {
  const char* op = "specattn::verify_tree_greedy";
  TORCH_CHECK(candidates.is_cuda(), op, ": tensors must be CUDA tensors, got ",
              candidates.device());
  const c10::Device dev = candidates.device();
  TORCH_CHECK(candidates.dim() == 2, op, ": candidates must be 2-D, got ", candidates.sizes());
  const int64_t bs = candidates.size(0), D64 = candidates.size(1);
  TORCH_CHECK(D64 >= 1 && D64 <= std::numeric_limits<int32_t>::max() / 2, op,
              ": candidates must have 1 .. 2^30 columns, got ", D64);
  const int D = static_cast<int>(D64);
  TORCH_CHECK(accept_index.dim() == 2 && accept_index.size(0) == bs && accept_index.size(1) >= 1,
              op, ": accept_index must be [", bs, ", S >= 1], got ", accept_index.sizes());
  const int64_t S = accept_index.size(1);
  check_out(predicts, op, "predicts", at::kInt, {bs * D}, dev);
  check_out(accept_index, op, "accept_index", at::kInt, {bs, S}, dev);
  check_out(accept_length, op, "accept_length", at::kInt, {bs}, dev);
  const at::Tensor* ins[] = {&retrive_index, &retrive_next_token, &retrive_next_sibling,
                             &target_predict};
  const char* names[] = {"retrive_index", "retrive_next_token", "retrive_next_sibling",
                         "target_predict"};
  for (int k = 0; k < 4; ++k) {
    check_shape(*ins[k], op, names[k], {bs, D});
    check_dev(*ins[k], op, names[k], dev);
  }
  VerifyArgs a;
  a.cand = index_view(candidates, op, "candidates");
  a.ridx = index_view(retrive_index, op, "retrive_index");
  a.nxt = index_view(retrive_next_token, op, "retrive_next_token");
  a.sib = index_view(retrive_next_sibling, op, "retrive_next_sibling");
  a.tgt = index_view(target_predict, op, "target_predict");
  if (bs == 0) return;
  TORCH_CHECK(bs <= std::numeric_limits<int32_t>::max(), op, ": batch too large (", bs, ")");
  a.pred = out_view<int32_t>(predicts);
  a.acc = out_view<int32_t>(accept_index);
  a.alen = out_view<int32_t>(accept_length);
  a.bs = bs;
  a.S = S;
  a.D = D;

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (D <= kVerifySmemMaxD) {
    const size_t smem = static_cast<size_t>(D) * (3 * sizeof(int64_t) + 2 * sizeof(int32_t));
    verify_greedy_kernel<true><<<static_cast<unsigned>(bs), 32, smem, stream>>>(a);
  } else {  // rows read from global memory by the walking lane
    verify_greedy_kernel<false><<<static_cast<unsigned>(bs), 32, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------ host: compact
void compact_accepted_path_cuda(const at::Tensor& accept_index, const at::Tensor& accept_length,
                                const at::Tensor& out_cache_loc,
                                const std::optional<at::Tensor>& predicts,
                                const std::optional<at::Tensor>& hidden_states,
                                const at::Tensor& src_index,
                                const std::optional<at::Tensor>& predicts_out,
                                const std::optional<at::Tensor>& hidden_states_out,
                                const at::Tensor& out_cache_loc_out, const at::Tensor& tgt_loc,
                                const at::Tensor& src_loc) {
  const char* op = "specattn::compact_accepted_path";
  TORCH_CHECK(accept_index.is_cuda(), op, ": tensors must be CUDA tensors, got ",
              accept_index.device());
  const c10::Device dev = accept_index.device();
  TORCH_CHECK(accept_index.dim() == 2 && accept_index.size(1) >= 1, op,
              ": accept_index must be [bs, S >= 1], got ", accept_index.sizes());
  const int64_t bs = accept_index.size(0), S = accept_index.size(1);
  check_shape(accept_length, op, "accept_length", {bs});
  check_dev(accept_length, op, "accept_length", dev);
  TORCH_CHECK(out_cache_loc.dim() == 1 && is_index_dtype(out_cache_loc), op,
              ": out_cache_loc must be a 1-D int32/int64 tensor, got ", out_cache_loc.scalar_type(),
              " ", out_cache_loc.sizes());
  check_dev(out_cache_loc, op, "out_cache_loc", dev);
  const int64_t N = out_cache_loc.size(0);
  if (bs == 0) {
    TORCH_CHECK(N == 0, op, ": out_cache_loc must be empty for an empty batch");
  } else {
    TORCH_CHECK(N % bs == 0 && N > 0, op, ": out_cache_loc has ", N,
                " entries, not a positive multiple of bs = ", bs);
  }
  const int64_t D64 = bs == 0 ? 1 : N / bs;
  TORCH_CHECK(D64 <= std::numeric_limits<int32_t>::max(), op, ": too many tokens per request");
  check_out(src_index, op, "src_index", at::kLong, {N}, dev);
  for (const at::Tensor* t : {&out_cache_loc_out, &tgt_loc, &src_loc}) {
    check_out(*t, op, t == &tgt_loc ? "tgt_loc" : t == &src_loc ? "src_loc" : "out_cache_loc_out",
              out_cache_loc.scalar_type(), {N}, dev);
  }
  TORCH_CHECK(predicts.has_value() == predicts_out.has_value(), op,
              ": predicts and predicts_out must both be given or both be None");
  TORCH_CHECK(hidden_states.has_value() == hidden_states_out.has_value(), op,
              ": hidden_states and hidden_states_out must both be given or both be None");
  if (predicts.has_value()) {
    TORCH_CHECK(predicts->dim() == 1 && is_index_dtype(*predicts), op,
                ": predicts must be a 1-D int32/int64 tensor, got ", predicts->scalar_type(), " ",
                predicts->sizes());
    check_shape(*predicts, op, "predicts", {N});
    check_dev(*predicts, op, "predicts", dev);
    check_out(*predicts_out, op, "predicts_out", predicts->scalar_type(), {N}, dev);
  }
  if (hidden_states.has_value()) {
    const at::Tensor& h = *hidden_states;
    const at::Tensor& ho = *hidden_states_out;
    TORCH_CHECK(h.dim() >= 1 && h.size(0) == N, op, ": hidden_states must be [", N,
                ", ...], got ", h.sizes());
    TORCH_CHECK(ho.scalar_type() == h.scalar_type() && ho.sizes() == h.sizes(), op,
                ": hidden_states_out must match hidden_states (", h.scalar_type(), " ", h.sizes(),
                "), got ", ho.scalar_type(), " ", ho.sizes());
    check_dev(h, op, "hidden_states", dev);
    check_dev(ho, op, "hidden_states_out", dev);
  }
  const IdxView ai = index_view(accept_index, op, "accept_index");
  const IdxView al = index_view(accept_length, op, "accept_length");
  if (N == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  CompactArgs a;
  a.accept_index = ai;
  a.accept_length = al;
  a.ocl = static_cast<const char*>(out_cache_loc.data_ptr());
  a.ocl_s0 = out_cache_loc.stride(0);
  a.ocl_esize = static_cast<int>(out_cache_loc.element_size());
  a.pred = nullptr;
  a.pred_s0 = 0;
  a.pred_out = nullptr;
  a.pred_out_s0 = 0;
  a.pred_esize = 4;
  if (predicts.has_value()) {
    a.pred = static_cast<const char*>(predicts->data_ptr());
    a.pred_s0 = predicts->stride(0);
    a.pred_out = static_cast<char*>(predicts_out->data_ptr());
    a.pred_out_s0 = predicts_out->stride(0);
    a.pred_esize = static_cast<int>(predicts->element_size());
  }
  a.src_index = src_index.data_ptr<int64_t>();
  a.src_s0 = src_index.stride(0);
  a.ocl_out = static_cast<char*>(out_cache_loc_out.data_ptr());
  a.ocl_out_s0 = out_cache_loc_out.stride(0);
  a.tgt_loc = static_cast<char*>(tgt_loc.data_ptr());
  a.tgt_s0 = tgt_loc.stride(0);
  a.src_loc = static_cast<char*>(src_loc.data_ptr());
  a.srcl_s0 = src_loc.stride(0);
  a.N = N;
  a.S = S;
  a.D = static_cast<int>(D64);
  a.hs = nullptr;
  a.hs_out = nullptr;
  a.hs_row_stride = a.hs_out_row_stride = 0;
  a.row_vecs = 0;
  a.chunk_vecs = 1;
  a.rows_per_block = kCompactRowsNoHidden;

  // Hidden rows as raw bytes: inputs through a contiguous copy when their inner dims are not
  // dense, outputs through a contiguous temporary (copied back below) when theirs are not.
  at::Tensor hs_in, hs_out_direct, hs_tmp;
  int64_t vec = 1;
  int64_t row_bytes = 0;
  if (hidden_states.has_value()) {
    const at::Tensor& h = *hidden_states;
    const at::Tensor& ho = *hidden_states_out;
    row_bytes = h.element_size();
    for (int64_t d = 1; d < h.dim(); ++d) row_bytes *= h.size(d);
    if (row_bytes > 0) {
      hs_in = rows_dense(h) ? h : h.contiguous();
      const int64_t row_elems = row_bytes / h.element_size();
      const bool out_ok = rows_dense(ho) && (N <= 1 || ho.stride(0) >= row_elems);
      hs_tmp = out_ok ? at::Tensor() : at::empty(ho.sizes(), ho.options());
      hs_out_direct = out_ok ? ho : hs_tmp;
      a.hs = static_cast<const char*>(hs_in.data_ptr());
      a.hs_out = static_cast<char*>(hs_out_direct.data_ptr());
      a.hs_row_stride = hs_in.stride(0) * hs_in.element_size();
      a.hs_out_row_stride = hs_out_direct.stride(0) * hs_out_direct.element_size();
      vec = 16;
      while (vec > 1 && (row_bytes % vec != 0 || a.hs_row_stride % vec != 0 ||
                         a.hs_out_row_stride % vec != 0 ||
                         reinterpret_cast<uintptr_t>(a.hs) % vec != 0 ||
                         reinterpret_cast<uintptr_t>(a.hs_out) % vec != 0)) {
        vec /= 2;
      }
      a.row_vecs = row_bytes / vec;
      a.chunk_vecs = std::min<int64_t>(a.row_vecs, kCompactChunk);
      a.rows_per_block = static_cast<int>(std::max<int64_t>(1, kCompactChunk / a.chunk_vecs));
    }
  }
  const int64_t blocks_x = (N + a.rows_per_block - 1) / a.rows_per_block;
  const int64_t blocks_y = a.hs == nullptr ? 1 : (a.row_vecs + a.chunk_vecs - 1) / a.chunk_vecs;
  TORCH_CHECK(blocks_x <= std::numeric_limits<int32_t>::max() && blocks_y <= 65535, op,
              ": too many rows (", N, ") or hidden rows too long (", row_bytes, " bytes)");
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y));
  switch (vec) {
    case 16:
      compact_kernel<uint4><<<grid, kCompactThreads, 0, stream>>>(a);
      break;
    case 8:
      compact_kernel<uint2><<<grid, kCompactThreads, 0, stream>>>(a);
      break;
    case 4:
      compact_kernel<uint32_t><<<grid, kCompactThreads, 0, stream>>>(a);
      break;
    case 2:
      compact_kernel<uint16_t><<<grid, kCompactThreads, 0, stream>>>(a);
      break;
    default:
      compact_kernel<uint8_t><<<grid, kCompactThreads, 0, stream>>>(a);
      break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (hs_tmp.defined()) hidden_states_out->copy_(hs_tmp);
}

}  // namespace specattn
