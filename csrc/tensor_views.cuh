// Kernel-argument views of small tensors, shared by the spec-op kernels (tree_ops.cu,
// tree_sampling.cu): a pointer plus element strides, built once on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace specattn {

// Read-only view of an int32 / int64 tensor of rank <= 2 (strides in elements): index inputs
// may come in either dtype, in any mix.
struct IdxView {
  const void* ptr;
  int64_t s0;
  int64_t s1;
  bool i64;
  __device__ __forceinline__ int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t off = i * s0 + j * s1;
    return i64 ? static_cast<const int64_t*>(ptr)[off]
               : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[off]);
  }
};

inline bool is_index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

// IdxView of ``t`` (``op: name`` in the error when ``t`` is not int32/int64 of rank <= 2).
inline IdxView index_view(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(is_index_dtype(t), op, ": ", name, " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() <= 2, op, ": ", name, " must have rank <= 2, got ", t.sizes());
  return IdxView{t.data_ptr(), t.dim() >= 1 ? t.stride(0) : 0, t.dim() >= 2 ? t.stride(1) : 0,
                 t.scalar_type() == at::kLong};
}

// Writable view of a rank <= 2 tensor of T (the caller has checked dtype and shape).
template <typename T>
struct OutView {
  T* ptr;
  int64_t s0;
  int64_t s1;
  __device__ __forceinline__ T& operator()(int64_t i, int64_t j = 0) const {
    return ptr[i * s0 + j * s1];
  }
};

template <typename T>
OutView<T> out_view(const at::Tensor& t) {
  return OutView<T>{t.data_ptr<T>(), t.dim() >= 1 ? t.stride(0) : 0, t.dim() >= 2 ? t.stride(1) : 0};
}

}  // namespace specattn
