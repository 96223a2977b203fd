// KV move for all layers in one or few launches: torch.ops.specattn.move_kv_cache.
//
// Semantics (same as specattn.ops.move_kv_cache_reference): for every buffer b and every
// i, afterwards b[tgt_loc[i]] holds what b[src_loc[i]] held before the call, also when the
// target and source slot sets overlap (after verify, the accepted path moves toward the
// front of its own block, so they do).  Rows are moved as raw bytes: any dtype works.
// Buffers must not share memory with each other (each layer's cache passed once): with
// more than one chunk (below), a buffer listed twice would be moved twice.
//
// Two algorithms, picked by the op's `group_size` argument:
//
// Staged (group_size == 0, the default; always safe): gather-to-staging, then scatter.
//   1. gather:  stage[b][i] = b[src_loc[i]]   for all buffers b (one launch)
//   2. scatter: b[tgt_loc[i]] = stage[b][i]   for all buffers b (one launch)
// Every read of step 1 happens before any write of step 2 (stream order), so overlapping
// slot sets are safe without any constraint on their order.  It moves every row twice
// (4 x the row bytes of traffic), so it cannot get near the copy bandwidth.
//
// Direct (group_size = G >= 1; ONE launch for up to kMaxBuffersPerLaunch buffers): the
// caller promises that pairs come in consecutive groups of G (pairs [g*G, (g+1)*G), the
// last group may be shorter) and that a slot read by one pair is written by another pair
// only within the same group (G == 1: no slot is both read and written by different
// pairs).  After compact_accepted_path that holds with G = num_draft_tokens (request b's
// pairs are block b, its slots are its own).  The Python wrapper checks the promise
// eagerly (one host sync, skipped during CUDA-graph capture); the kernel trusts it.  Each
// block owns whole groups for one column tile of one buffer: it loads every (row, vector)
// of its tile into registers, __syncthreads(), then stores them.  Every read of a group's
// bytes precedes every write of them, and no other block touches them (other column
// tiles are other bytes, other groups are other slots by the promise), so the move is
// exact with 2 x the row bytes of traffic (a read and a write per moved row).  G == 1
// skips the second barrier (a thread's store only depends on its own load).
//   Tiling (direct_tiling, host-side, per buffer, in the parameter table): a block holds
//   at most kItems = kThreads * kUnroll = 1024 vectors, i.e. groups_per_block * G rows of
//   `cols` vectors; the row is split into col_tiles column tiles when whole groups of
//   whole rows do not fit (or fit badly: e.g. G = 8 MLA rows of 72 vectors -> 4 tiles of
//   18 vectors, 7 groups a block).  G > kItems is not supported by the direct kernel: the
//   host falls back to the staged algorithm (still exact).
//
// Layers: the buffers' base pointers, row lengths and staging offsets / tiling travel in a
// kernel-parameter struct (BufferTable / DirectTable, < 4 KiB, __grid_constant__), one
// buffer per blockIdx.y; nothing is copied host-to-device and nothing depends on the batch
// size or on G at compile time (n, num_slots, G and the tiling are runtime arguments; the
// only instantiations are the vector width x index dtype), so the launches are CUDA-graph
// capturable.  More than kMaxBuffersPerLaunch (128) buffers are handled in chunks of
// buffers, one launch (direct) or two (staged) per chunk: a buffer's rows only depend on
// that buffer.  Staged also chunks so that staging stays under kMaxStagingBytes (the next
// chunk reuses the staging area; it comes from PyTorch's caching allocator, on the current
// stream).  Pools: MLA 61 layers = 61 buffers, MHA 32 layers = 64 buffers (K and V): one
// chunk.
//
// Grid: x over tiles (of rows, and for direct also of columns), y over the buffers of the
// chunk (direct: x is the largest tile count of the chunk's buffers; blocks past a
// narrower buffer's count exit at once).  Inside a block the (row, vector) pairs of the
// tile are flattened, so short rows (MLA 576 x bf16 = 72 x 16 B) still keep all threads
// busy and each warp reads and writes contiguous 16-byte vectors of a row; each thread
// issues kUnroll independent loads before its stores.  Accesses are 16-byte vectors when
// every row length and base pointer is a multiple of 16 bytes, else the widest of
// 8/4/2/1 that divides all of them.
//
// Rows with tgt == src are skipped (the row is already in place and no other row may
// target it, since targets are unique).  A row whose tgt or src lies outside
// [0, num_slots) is skipped rather than touched: the Python wrapper rejects such indices
// before the call (outside CUDA-graph capture); the kernel never reads or writes out of
// bounds.  n == 0 launches nothing.
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h): they need no cuBLAS/cuSPARSE
// headers, so this file also compiles against a CPU-only torch with a bare nvcc (CI).
// c10::cuda::getCurrentCUDAStream is what at::cuda::getCurrentCUDAStream names.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "specattn_ops.h"

namespace specattn {
namespace {

constexpr int kMaxBuffersPerLaunch = 128;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kItemsPerBlockPass = kThreads * kUnroll;       // vectors per block per pass
constexpr int64_t kMaxStagingBytes = int64_t(64) << 20;      // per chunk of buffers
constexpr int64_t kStagingAlign = 256;

struct BufferTable {
  char* base[kMaxBuffersPerLaunch];         // buffer base pointer
  int64_t stage_off[kMaxBuffersPerLaunch];  // byte offset of this buffer's n staged rows
  int32_t row_vecs[kMaxBuffersPerLaunch];   // row length in units of the access vector
};
static_assert(sizeof(BufferTable) + 64 <= 4096, "kernel parameters must stay under 4 KiB");

template <typename Vec, typename Idx, bool kGather>
__global__ void __launch_bounds__(kThreads)
    move_rows_kernel(const __grid_constant__ BufferTable tab, char* __restrict__ stage,
                     const Idx* __restrict__ tgt, const Idx* __restrict__ src, int64_t n,
                     int64_t num_slots, int rows_per_block) {
  // s_from[r]: row to read (buffer row when gathering, staging row when scattering), or -1
  // to skip; s_to[r]: row to write.
  extern __shared__ int64_t s_rows[];
  int64_t* s_from = s_rows;
  int64_t* s_to = s_rows + rows_per_block;

  const int b = blockIdx.y;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(rows_per_block), n - r0));
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int64_t i = r0 + r;
    const int64_t t = static_cast<int64_t>(tgt[i]);
    const int64_t s = static_cast<int64_t>(src[i]);
    const bool live = t != s && t >= 0 && t < num_slots && s >= 0 && s < num_slots;
    s_from[r] = live ? (kGather ? s : i) : -1;
    s_to[r] = kGather ? i : t;
  }
  __syncthreads();

  const uint32_t vecs = static_cast<uint32_t>(tab.row_vecs[b]);
  char* const buf = tab.base[b];
  char* const stg = stage + tab.stage_off[b];
  const Vec* __restrict__ from = reinterpret_cast<const Vec*>(kGather ? buf : stg);
  Vec* __restrict__ to = reinterpret_cast<Vec*>(kGather ? stg : buf);

  // rows * vecs <= max(kItemsPerBlockPass, vecs) (host picks rows_per_block), fits 32 bits.
  const uint32_t total = static_cast<uint32_t>(rows) * vecs;
  for (uint32_t pass = 0; pass < total; pass += kItemsPerBlockPass) {
    Vec tmp[kUnroll];
    int64_t dst[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t w = pass + u * kThreads + threadIdx.x;
      dst[u] = -1;
      if (w < total) {
        const uint32_t r = w / vecs;
        const uint32_t v = w - r * vecs;
        const int64_t f = s_from[r];
        if (f >= 0) {
          tmp[u] = from[f * vecs + v];
          dst[u] = s_to[r] * vecs + v;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dst[u] >= 0) to[dst[u]] = tmp[u];
    }
  }
}

// ----------------------------------------------------------------------------- direct
constexpr int kItems = kItemsPerBlockPass;  // direct: (row, vector) items one block holds

struct DirectTable {
  char* base[kMaxBuffersPerLaunch];              // buffer base pointer
  int32_t row_vecs[kMaxBuffersPerLaunch];        // row length in access vectors
  int32_t cols[kMaxBuffersPerLaunch];            // vectors per column tile
  int32_t col_tiles[kMaxBuffersPerLaunch];       // column tiles per row
  int32_t groups_per_block[kMaxBuffersPerLaunch];
};
static_assert(sizeof(DirectTable) + 64 <= 4096, "kernel parameters must stay under 4 KiB");

struct DirectTiling {
  int groups_per_block;
  int cols;
  int col_tiles;
};

// Tiling of one buffer's rows for the direct kernel: groups_per_block * group_size rows of
// `cols` vectors per block, at most kItems items.  Among the few smallest column-tile
// counts that fit, the one with the most useful items per block on average
// (groups_per_block / col_tiles); more tiles only for > 1/16 more (longer contiguous row
// segments otherwise: MLA rows stay whole at group_size 1).  1 <= group_size <= kItems.
DirectTiling direct_tiling(int64_t row_vecs, int group_size) {
  const int64_t max_cols = kItems / group_size;  // >= 1
  const int64_t t0 = (row_vecs + max_cols - 1) / max_cols;
  DirectTiling best{0, 0, 0};
  for (int64_t t = t0; t < t0 + 8 && t <= row_vecs; ++t) {
    const int64_t cols = (row_vecs + t - 1) / t;  // <= max_cols
    const int64_t tiles = (row_vecs + cols - 1) / cols;
    const int64_t groups = kItems / (group_size * cols);  // >= 1
    if (best.groups_per_block == 0 ||
        16 * groups * best.col_tiles > 17 * static_cast<int64_t>(best.groups_per_block) * tiles) {
      best = {static_cast<int>(groups), static_cast<int>(cols), static_cast<int>(tiles)};
    }
  }
  return best;
}

template <typename Vec, typename Idx>
__global__ void __launch_bounds__(kThreads)
    move_rows_direct_kernel(const __grid_constant__ DirectTable tab, const Idx* __restrict__ tgt,
                            const Idx* __restrict__ src, int64_t n, int64_t num_slots,
                            int group_size) {
  // s_src[r]: slot to read for row r of the tile, or -1 to skip; s_tgt[r]: slot to write.
  extern __shared__ int64_t s_rows[];
  const int b = blockIdx.y;
  const uint32_t col_tiles = static_cast<uint32_t>(tab.col_tiles[b]);
  const uint32_t tile_row = blockIdx.x / col_tiles;
  const uint32_t ct = blockIdx.x - tile_row * col_tiles;
  const int rows_per_block = tab.groups_per_block[b] * group_size;  // <= kItems
  const int64_t r0 = static_cast<int64_t>(tile_row) * rows_per_block;
  if (r0 >= n) return;  // this buffer needs fewer blocks than the grid has (whole block)
  const int rows = static_cast<int>(min(static_cast<int64_t>(rows_per_block), n - r0));
  int64_t* s_src = s_rows;
  int64_t* s_tgt = s_rows + rows_per_block;
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int64_t t = static_cast<int64_t>(tgt[r0 + r]);
    const int64_t s = static_cast<int64_t>(src[r0 + r]);
    const bool live = t != s && t >= 0 && t < num_slots && s >= 0 && s < num_slots;
    s_src[r] = live ? s : -1;
    s_tgt[r] = t;
  }
  __syncthreads();

  const uint32_t vecs = static_cast<uint32_t>(tab.row_vecs[b]);
  const uint32_t c0 = ct * static_cast<uint32_t>(tab.cols[b]);
  const uint32_t cols = min(static_cast<uint32_t>(tab.cols[b]), vecs - c0);
  Vec* const buf = reinterpret_cast<Vec*>(tab.base[b]);  // read and written: not restrict
  const uint32_t total = static_cast<uint32_t>(rows) * cols;  // <= kItems

  Vec tmp[kUnroll];
  int64_t dst[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint32_t w = u * kThreads + threadIdx.x;
    dst[u] = -1;
    if (w < total) {
      const uint32_t r = w / cols;
      const uint32_t v = c0 + (w - r * cols);
      const int64_t f = s_src[r];
      if (f >= 0) {
        tmp[u] = buf[f * vecs + v];
        dst[u] = s_tgt[r] * vecs + v;
      }
    }
  }
  // Every load of the tile before any store of it: a row of this block may read a slot
  // that another row of the same group writes.  group_size == 1 promises no such pair
  // (a thread's store depends only on its own load), so the barrier is skipped there.
  if (group_size > 1) __syncthreads();
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (dst[u] >= 0) buf[dst[u]] = tmp[u];
  }
}

// ----------------------------------------------------------------------------- launches
template <typename Vec, typename Idx>
void launch_gather_scatter(const BufferTable& tab, int num_buffers, int max_row_vecs,
                           char* stage, const at::Tensor& tgt, const at::Tensor& src,
                           int64_t n, int64_t num_slots, cudaStream_t stream) {
  const int rows_per_block = max_row_vecs >= kItemsPerBlockPass
                                 ? 1
                                 : kItemsPerBlockPass / max_row_vecs;
  const int64_t blocks_x = (n + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks_x <= std::numeric_limits<int32_t>::max(),
              "specattn::move_kv_cache: too many rows (", n, ")");
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(num_buffers));
  const size_t smem = 2 * static_cast<size_t>(rows_per_block) * sizeof(int64_t);
  const Idx* t = tgt.data_ptr<Idx>();
  const Idx* s = src.data_ptr<Idx>();
  move_rows_kernel<Vec, Idx, true>
      <<<grid, kThreads, smem, stream>>>(tab, stage, t, s, n, num_slots, rows_per_block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  move_rows_kernel<Vec, Idx, false>
      <<<grid, kThreads, smem, stream>>>(tab, stage, t, s, n, num_slots, rows_per_block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Vec, typename Idx>
void launch_direct(const DirectTable& tab, int num_buffers, int64_t blocks_x, int max_rows,
                   const at::Tensor& tgt, const at::Tensor& src, int64_t n, int64_t num_slots,
                   int group_size, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(num_buffers));
  const size_t smem = 2 * static_cast<size_t>(max_rows) * sizeof(int64_t);  // <= 16 KiB
  move_rows_direct_kernel<Vec, Idx><<<grid, kThreads, smem, stream>>>(
      tab, tgt.data_ptr<Idx>(), src.data_ptr<Idx>(), n, num_slots, group_size);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(Vec{}, Idx{}) with the access vector type of `vec` bytes and the index type.
template <typename F>
void dispatch_vec_idx(int64_t vec, at::ScalarType idx, F&& f) {
  auto with_vec = [&](auto vec_tag) {
    if (idx == at::kInt) {
      f(vec_tag, int32_t{});
    } else {
      f(vec_tag, int64_t{});
    }
  };
  switch (vec) {
    case 16: with_vec(uint4{}); break;
    case 8: with_vec(uint2{}); break;
    case 4: with_vec(uint32_t{}); break;
    case 2: with_vec(uint16_t{}); break;
    default: with_vec(uint8_t{}); break;
  }
}

struct Row {
  char* ptr;
  int64_t row_bytes;
};

}  // namespace

void move_kv_cache_cuda(at::TensorList buffers, const at::Tensor& tgt_loc,
                        const at::Tensor& src_loc, int64_t group_size) {
  TORCH_CHECK(!buffers.empty(), "specattn::move_kv_cache: buffers must hold at least one tensor");
  TORCH_CHECK(group_size >= 0, "specattn::move_kv_cache: group_size must be >= 0 (0: staged), got ",
              group_size);
  const at::Tensor& b0 = buffers[0];
  TORCH_CHECK(b0.is_cuda(), "specattn::move_kv_cache: buffers must be CUDA tensors, got ",
              b0.device());
  TORCH_CHECK(b0.dim() >= 1, "specattn::move_kv_cache: buffers[0] must have a slot dimension");
  const int64_t num_slots = b0.size(0);
  for (size_t k = 0; k < buffers.size(); ++k) {
    const at::Tensor& b = buffers[k];
    TORCH_CHECK(b.device() == b0.device(), "specattn::move_kv_cache: buffers[", k, "] is on ",
                b.device(), ", buffers[0] on ", b0.device());
    TORCH_CHECK(b.dim() >= 1 && b.size(0) == num_slots, "specattn::move_kv_cache: buffers[", k,
                "] has shape ", b.sizes(), ", expected ", num_slots, " slots");
    TORCH_CHECK(b.is_contiguous(), "specattn::move_kv_cache: buffers[", k,
                "] must be contiguous");
  }
  for (const at::Tensor* idx : {&tgt_loc, &src_loc}) {
    const char* name = idx == &tgt_loc ? "tgt_loc" : "src_loc";
    TORCH_CHECK(idx->dim() == 1, "specattn::move_kv_cache: ", name, " must be 1-D, got ",
                idx->sizes());
    TORCH_CHECK(idx->scalar_type() == at::kInt || idx->scalar_type() == at::kLong,
                "specattn::move_kv_cache: ", name, " must be int32 or int64, got ",
                idx->scalar_type());
    TORCH_CHECK(idx->device() == b0.device(), "specattn::move_kv_cache: ", name, " is on ",
                idx->device(), ", buffers on ", b0.device());
  }
  TORCH_CHECK(tgt_loc.numel() == src_loc.numel(), "specattn::move_kv_cache: tgt_loc has ",
              tgt_loc.numel(), " entries, src_loc ", src_loc.numel());
  const int64_t n = tgt_loc.numel();
  if (n == 0 || num_slots == 0) return;  // nothing to move (no slot can be valid)

  const c10::cuda::CUDAGuard guard(b0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor tgt = tgt_loc.contiguous();
  at::Tensor src = src_loc.contiguous();
  if (tgt.scalar_type() != src.scalar_type()) {
    tgt = tgt.to(at::kLong);
    src = src.to(at::kLong);
  }

  // Row sizes and the widest access every buffer allows.
  std::vector<Row> rows;
  rows.reserve(buffers.size());
  int64_t vec = 16;
  for (const at::Tensor& b : buffers) {
    int64_t row_bytes = b.element_size();
    for (int64_t d = 1; d < b.dim(); ++d) row_bytes *= b.size(d);
    if (row_bytes == 0) continue;
    char* ptr = static_cast<char*>(b.data_ptr());
    while (vec > 1 && (row_bytes % vec != 0 || reinterpret_cast<uintptr_t>(ptr) % vec != 0)) {
      vec /= 2;
    }
    rows.push_back({ptr, row_bytes});
  }
  if (rows.empty()) return;
  for (const Row& r : rows) {
    TORCH_CHECK(r.row_bytes / vec <= std::numeric_limits<int32_t>::max(),
                "specattn::move_kv_cache: rows of ", r.row_bytes, " bytes are too long");
  }

  if (group_size >= 1 && group_size <= kItems) {
    // Direct: one launch per chunk of kMaxBuffersPerLaunch buffers (one for real pools).
    const int g = static_cast<int>(group_size);
    const int64_t num_groups = (n + g - 1) / g;
    for (size_t c0 = 0; c0 < rows.size(); c0 += kMaxBuffersPerLaunch) {
      const int num_buffers =
          static_cast<int>(std::min<size_t>(kMaxBuffersPerLaunch, rows.size() - c0));
      DirectTable tab;
      int64_t blocks_x = 1;
      int max_rows = 1;
      for (int j = 0; j < num_buffers; ++j) {
        const Row& r = rows[c0 + j];
        const int64_t row_vecs = r.row_bytes / vec;
        const DirectTiling tiling = direct_tiling(row_vecs, g);
        tab.base[j] = r.ptr;
        tab.row_vecs[j] = static_cast<int32_t>(row_vecs);
        tab.cols[j] = tiling.cols;
        tab.col_tiles[j] = tiling.col_tiles;
        tab.groups_per_block[j] = tiling.groups_per_block;
        blocks_x = std::max(blocks_x, (num_groups + tiling.groups_per_block - 1) /
                                          tiling.groups_per_block * tiling.col_tiles);
        max_rows = std::max(max_rows, tiling.groups_per_block * g);
      }
      TORCH_CHECK(blocks_x <= std::numeric_limits<int32_t>::max(),
                  "specattn::move_kv_cache: too many rows (", n, ")");
      dispatch_vec_idx(vec, tgt.scalar_type(), [&](auto vec_tag, auto idx_tag) {
        launch_direct<decltype(vec_tag), decltype(idx_tag)>(tab, num_buffers, blocks_x, max_rows,
                                                            tgt, src, n, num_slots, g, stream);
      });
    }
    return;
  }

  // Staged (group_size == 0, or groups larger than the direct kernel holds).
  // Chunks of buffers: at most kMaxBuffersPerLaunch and (unless one buffer alone needs
  // more) kMaxStagingBytes of staging each.
  auto staged = [&](const Row& r) {
    return (n * r.row_bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
  };
  std::vector<size_t> chunk_begin{0};
  int64_t chunk_bytes = 0, max_chunk_bytes = 0;
  for (size_t k = 0; k < rows.size(); ++k) {
    const int64_t bytes = staged(rows[k]);
    const size_t in_chunk = k - chunk_begin.back();
    if (in_chunk > 0 &&
        (in_chunk == kMaxBuffersPerLaunch || chunk_bytes + bytes > kMaxStagingBytes)) {
      chunk_begin.push_back(k);
      chunk_bytes = 0;
    }
    chunk_bytes += bytes;
    max_chunk_bytes = std::max(max_chunk_bytes, chunk_bytes);
  }
  chunk_begin.push_back(rows.size());

  at::Tensor staging = at::empty({max_chunk_bytes}, b0.options().dtype(at::kByte));
  char* stage = static_cast<char*>(staging.data_ptr());

  for (size_t c = 0; c + 1 < chunk_begin.size(); ++c) {
    BufferTable tab;
    int64_t off = 0;
    int max_row_vecs = 1;
    const int num_buffers = static_cast<int>(chunk_begin[c + 1] - chunk_begin[c]);
    for (int j = 0; j < num_buffers; ++j) {
      const Row& r = rows[chunk_begin[c] + j];
      const int64_t row_vecs = r.row_bytes / vec;
      tab.base[j] = r.ptr;
      tab.stage_off[j] = off;
      tab.row_vecs[j] = static_cast<int32_t>(row_vecs);
      max_row_vecs = std::max(max_row_vecs, static_cast<int>(row_vecs));
      off += staged(r);
    }
    dispatch_vec_idx(vec, tgt.scalar_type(), [&](auto vec_tag, auto idx_tag) {
      launch_gather_scatter<decltype(vec_tag), decltype(idx_tag)>(
          tab, num_buffers, max_row_vecs, stage, tgt, src, n, num_slots, stream);
    });
  }
}

}  // namespace specattn
