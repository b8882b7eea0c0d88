// The input checks of the detector::giou_loss ops, shared by the CPU (giou_op.cpp) and CUDA
// (giou_cuda.cpp) implementations: one helper, errors that name the argument.
#pragma once

#include <ATen/core/Tensor.h>

namespace detector {

struct GiouSizes {
  int64_t batch;  // B
  int64_t slots;  // M
  int64_t boxes;  // N: packed target rows, or B * M for the padded layout
};

// Shapes, ranks, dtypes and devices of pred [B, M, 4], target ([B, M, 4] padded or [N, 4] packed) and
// counts [B]. Reads no tensor values, so it never synchronises with a device.
GiouSizes check_giou_inputs(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts, bool packed);

// grad_output: fp32 0-dim; grad_sum: pred-dtype [B, M, 4]; inv_count: fp32 0-dim; all on one device.
void check_giou_backward_inputs(const at::Tensor& grad_output, const at::Tensor& grad_sum,
                                const at::Tensor& inv_count);

}  // namespace detector
