// Torch-side helpers shared by the core's bindings (binding.cpp, request_ops.cpp): the core's
// bad-input errors as Python ValueError, and int64 vectors as tensors. The policy (kv_core.h)
// does not include this file.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <stdexcept>
#include <vector>

namespace gr_kv_core {

// Runs `fn`, turning the core's bad-input errors (std::invalid_argument) into ValueError.
template <typename Fn>
auto guarded(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
    throw;  // unreachable: the check above throws
  }
}

// int64 CPU [n] with the values of `v`.
inline at::Tensor to_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

}  // namespace gr_kv_core
