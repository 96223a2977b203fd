// Declarations of the host entry points of specattn's compiled ops.
//
// Each op's schema is defined once in ops.cpp (TORCH_LIBRARY(specattn, m)); the CUDA
// implementations live in the .cu files and are registered there under the CUDA key.
// Python callers go through specattn.ops (which validates inputs and picks an
// implementation); torch.ops.specattn.* is the raw entry point.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace specattn {

// torch.ops.specattn.move_kv_cache(Tensor(a!)[] buffers, Tensor tgt_loc, Tensor src_loc,
//                                  int group_size=0) -> ()
//
// For every buffer b and every i: afterwards b[tgt_loc[i]] holds what b[src_loc[i]] held
// before the call (rows are moved as raw bytes, any dtype), also when the target and
// source slot sets overlap.  Buffers: contiguous, one device, same num_slots, no two
// sharing memory; tgt_loc: distinct slots.  group_size 0: staged (two launches, any
// overlap); G >= 1: one direct launch, the caller promising that a slot read by one pair
// is written by another pair only within the same consecutive group of G pairs (not
// checked here; specattn.ops.move_kv_cache checks it eagerly).  See kv_move.cu.
void move_kv_cache_cuda(at::TensorList buffers, const at::Tensor& tgt_loc,
                        const at::Tensor& src_loc, int64_t group_size);

// EAGLE tree ops (csrc/tree_ops.cu).  Semantics, argument order and shapes: the reference
// functions in specattn/ops/tree.py, verify.py and compaction.py (outputs written in place,
// every element; inputs validated by the Python wrappers; the kernels still never index out
// of bounds).  One launch each for the whole batch, no host sync, CUDA-graph capturable.
void build_tree_cuda(const at::Tensor& parent_list, const at::Tensor& selected_index,
                     const at::Tensor& verified_seq_len, const at::Tensor& tree_mask,
                     const at::Tensor& positions, const at::Tensor& retrive_index,
                     const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
                     int64_t topk, int64_t num_steps, int64_t num_draft_tokens,
                     const std::optional<at::Tensor>& flashinfer_packed_mask,
                     const std::optional<at::Tensor>& flashinfer_mask_indptr);

void verify_tree_greedy_cuda(const at::Tensor& predicts, const at::Tensor& accept_index,
                             const at::Tensor& accept_length, const at::Tensor& candidates,
                             const at::Tensor& retrive_index, const at::Tensor& retrive_next_token,
                             const at::Tensor& retrive_next_sibling,
                             const at::Tensor& target_predict);

void compact_accepted_path_cuda(const at::Tensor& accept_index, const at::Tensor& accept_length,
                                const at::Tensor& out_cache_loc,
                                const std::optional<at::Tensor>& predicts,
                                const std::optional<at::Tensor>& hidden_states,
                                const at::Tensor& src_index,
                                const std::optional<at::Tensor>& predicts_out,
                                const std::optional<at::Tensor>& hidden_states_out,
                                const at::Tensor& out_cache_loc_out, const at::Tensor& tgt_loc,
                                const at::Tensor& src_loc);

// Stochastic tree verify (csrc/tree_sampling.cu); reference:
// specattn/ops/verify.py tree_speculative_sampling_reference.
void tree_speculative_sampling_cuda(
    const at::Tensor& predicts, const at::Tensor& accept_index, const at::Tensor& accept_length,
    const at::Tensor& candidates, const at::Tensor& retrive_index,
    const at::Tensor& retrive_next_token, const at::Tensor& retrive_next_sibling,
    const at::Tensor& uniform_samples, const at::Tensor& uniform_samples_for_final_sampling,
    const at::Tensor& target_probs, double threshold_single, double threshold_acc,
    const std::optional<at::Tensor>& draft_probs);

// torch.ops.specattn.materialize_kv_epilogue(Tensor kv, Tensor k_norm_weight, Tensor positions,
//     Tensor cos_sin_cache, Tensor out_cache_loc, Tensor(a!)[] k_buffers, Tensor(b!)[] v_buffers,
//     float eps, Tensor? kv_bias, float k_scale, float v_scale) -> ()
//
// DFlash fused KV materialization after the caller's GEMM kv = hidden @ w_kv^T
// ([T, L*2*Hkv*D], unit column stride): per token, layer and head, K RMSNorm + neox RoPE,
// cast (fp8: saturating, / scale) and store at out_cache_loc into every layer's K and V
// cache, in one launch (csrc/kv_materialize.cu).  Semantics: materialize_kv_reference in
// specattn/ops/kv_materialize.py; inputs validated by its Python wrapper.  D <= 256.
void materialize_kv_epilogue_cuda(const at::Tensor& kv, const at::Tensor& k_norm_weight,
                                  const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                  const at::Tensor& out_cache_loc, at::TensorList k_buffers,
                                  at::TensorList v_buffers, double eps,
                                  const std::optional<at::Tensor>& kv_bias, double k_scale,
                                  double v_scale);

}  // namespace specattn
