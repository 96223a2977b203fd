// specattn._C: op schemas (TORCH_LIBRARY), their CUDA / Meta registrations, and the
// Python module stub.
//
// The extension exposes no Python functions: `import specattn._C` only loads the shared
// library, whose static initializers (TORCH_LIBRARY / TORCH_LIBRARY_IMPL below) register
// the ops as torch.ops.specattn.*.  This is the layout of PyTorch's extension-cpp example
// for torch.library-only extensions: a plain CPython module init (no pybind11), so the
// module builds quickly and carries no pybind11 ABI.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "specattn_ops.h"

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define SPECATTN_CONCAT_(a, b) a##b
#define SPECATTN_CONCAT(a, b) SPECATTN_CONCAT_(a, b)
#define SPECATTN_STR_(x) #x
#define SPECATTN_STR(x) SPECATTN_STR_(x)

extern "C" {
// Creates the empty module `specattn._C`; importing it runs the registrations below.
PyMODINIT_FUNC SPECATTN_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      SPECATTN_STR(TORCH_EXTENSION_NAME),  // m_name
      "specattn compiled ops; they register as torch.ops.specattn.*",  // m_doc
      -1,       // m_size: no per-interpreter state
      nullptr,  // m_methods
  };
  return PyModule_Create(&module_def);
}
}

namespace specattn {
namespace {

// Shape-only (fake / meta) implementation: the op mutates its buffers and returns nothing,
// so tracing (torch.compile, FakeTensor) needs no work.
void move_kv_cache_meta(at::TensorList, const at::Tensor&, const at::Tensor&, int64_t) {}
void build_tree_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     int64_t, int64_t, int64_t, const std::optional<at::Tensor>&,
                     const std::optional<at::Tensor>&) {}
void verify_tree_greedy_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&) {}
void compact_accepted_path_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&) {}
void tree_speculative_sampling_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, double, double,
                                    const std::optional<at::Tensor>&) {}

void materialize_kv_epilogue_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, at::TensorList,
                                  at::TensorList, double, const std::optional<at::Tensor>&,
                                  double, double) {}

}  // namespace
}  // namespace specattn

TORCH_LIBRARY(specattn, m) {
  // DFlash KV materialization epilogue (after the caller's GEMM kv = hidden @ w_kv^T).
  m.def("materialize_kv_epilogue(Tensor kv, Tensor k_norm_weight, Tensor positions, "
        "Tensor cos_sin_cache, Tensor out_cache_loc, Tensor(a!)[] k_buffers, "
        "Tensor(b!)[] v_buffers, float eps, Tensor? kv_bias, float k_scale, "
        "float v_scale) -> ()");
  // group_size: 0 = staged (always safe), G >= 1 = direct one-launch move (see kv_move.cu).
  m.def("move_kv_cache(Tensor(a!)[] buffers, Tensor tgt_loc, Tensor src_loc, "
        "int group_size=0) -> ()");
  // EAGLE tree ops: argument order of the reference functions in specattn/ops/.
  m.def("build_tree(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
        "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, "
        "Tensor(d!) retrive_next_token, Tensor(e!) retrive_next_sibling, int topk, "
        "int num_steps, int num_draft_tokens, Tensor(f!)? flashinfer_packed_mask=None, "
        "Tensor? flashinfer_mask_indptr=None) -> ()");
  m.def("verify_tree_greedy(Tensor(a!) predicts, Tensor(b!) accept_index, "
        "Tensor(c!) accept_length, Tensor candidates, Tensor retrive_index, "
        "Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()");
  m.def("tree_speculative_sampling(Tensor(a!) predicts, Tensor(b!) accept_index, "
        "Tensor(c!) accept_length, Tensor candidates, Tensor retrive_index, "
        "Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor uniform_samples, "
        "Tensor uniform_samples_for_final_sampling, Tensor target_probs, "
        "float threshold_single, float threshold_acc, Tensor? draft_probs=None) -> ()");
  m.def("compact_accepted_path(Tensor accept_index, Tensor accept_length, "
        "Tensor out_cache_loc, Tensor? predicts, Tensor? hidden_states, Tensor(a!) src_index, "
        "Tensor(b!)? predicts_out, Tensor(c!)? hidden_states_out, Tensor(d!) out_cache_loc_out, "
        "Tensor(e!) tgt_loc, Tensor(f!) src_loc) -> ()");
}

TORCH_LIBRARY_IMPL(specattn, CUDA, m) {
  m.impl("materialize_kv_epilogue", &specattn::materialize_kv_epilogue_cuda);
  m.impl("move_kv_cache", &specattn::move_kv_cache_cuda);
  m.impl("build_tree", &specattn::build_tree_cuda);
  m.impl("verify_tree_greedy", &specattn::verify_tree_greedy_cuda);
  m.impl("tree_speculative_sampling", &specattn::tree_speculative_sampling_cuda);
  m.impl("compact_accepted_path", &specattn::compact_accepted_path_cuda);
}

TORCH_LIBRARY_IMPL(specattn, Meta, m) {
  m.impl("materialize_kv_epilogue", &specattn::materialize_kv_epilogue_meta);
  m.impl("move_kv_cache", &specattn::move_kv_cache_meta);
  m.impl("build_tree", &specattn::build_tree_meta);
  m.impl("verify_tree_greedy", &specattn::verify_tree_greedy_meta);
  m.impl("tree_speculative_sampling", &specattn::tree_speculative_sampling_meta);
  m.impl("compact_accepted_path", &specattn::compact_accepted_path_meta);
}
