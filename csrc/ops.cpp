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
void move_kv_cache_meta(at::TensorList, const at::Tensor&, const at::Tensor&) {}

}  // namespace
}  // namespace specattn

TORCH_LIBRARY(specattn, m) {
  m.def("move_kv_cache(Tensor(a!)[] buffers, Tensor tgt_loc, Tensor src_loc) -> ()");
}

TORCH_LIBRARY_IMPL(specattn, CUDA, m) {
  m.impl("move_kv_cache", &specattn::move_kv_cache_cuda);
}

TORCH_LIBRARY_IMPL(specattn, Meta, m) {
  m.impl("move_kv_cache", &specattn::move_kv_cache_meta);
}
