// Declarations of the host entry points of specattn's compiled ops.
//
// Each op's schema is defined once in ops.cpp (TORCH_LIBRARY(specattn, m)); the CUDA
// implementations live in the .cu files and are registered there under the CUDA key.
// Python callers go through specattn.ops (which validates inputs and picks an
// implementation); torch.ops.specattn.* is the raw entry point.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace specattn {

// torch.ops.specattn.move_kv_cache(Tensor(a!)[] buffers, Tensor tgt_loc, Tensor src_loc) -> ()
//
// For every buffer b and every i: afterwards b[tgt_loc[i]] holds what b[src_loc[i]] held
// before the call (rows are moved as raw bytes, any dtype), also when the target and
// source slot sets overlap.  Buffers: contiguous, one device, same num_slots, no two
// sharing memory; tgt_loc: distinct slots.  See kv_move.cu for the algorithm.
void move_kv_cache_cuda(at::TensorList buffers, const at::Tensor& tgt_loc,
                        const at::Tensor& src_loc);

}  // namespace specattn
