#pragma once
// The slice of torch the kernels use: <torch/extension.h> (pybind11 and torch's whole C++ API)
// is most of each file's compile time, and only bindings.cpp needs it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

namespace torch {  // torch::Tensor, torch::empty, ... as torch/extension.h names them
using namespace at;
}  // namespace torch
