// The input checks of the detector::giou_loss ops (giou_checks.cpp), shared by the CPU (giou_op.cpp)
// and CUDA (giou_cuda.cpp) implementations: one place, errors that name the argument.
#pragma once

#include <ATen/core/Tensor.h>

namespace detector {

struct GiouSizes {
  int64_t batch;  // B
  int64_t slots;  // M
  int64_t boxes;  // N: packed target rows, or B * M for the padded layout
};

// Shapes, ranks, dtypes and devices of pred [B, M, 4], target ([B, M, 4] padded or [N, 4] packed) and
// counts [B] (named `counts_name` in errors: the packed backward's is "offsets"). Reads no tensor values, so
// it never synchronises with a device.
GiouSizes check_giou_inputs(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts, bool packed,
                            const char* counts_name = "counts");

// The dtype of the loss, inv_count and grad_output: fp64 for fp64 predictions, fp32 for the others.
at::ScalarType compute_dtype(at::ScalarType pred);

// grad_output and inv_count: 0-dim in pred's compute dtype, on pred's device (the forward's inputs are
// checked again by check_giou_inputs).
void check_giou_backward_inputs(const at::Tensor& grad_output, const at::Tensor& pred, const at::Tensor& inv_count);

// The packed backward's offsets are int64 (the packed forward's third output; their shape and device are
// checked as counts).
void check_packed_offsets(const at::Tensor& offsets);

// The packed forward's block_scan_max_batch: >= 0 (0: always the block sums on CUDA, never the blocks' own scans).
void check_block_scan_max_batch(int64_t block_scan_max_batch);

}  // namespace detector
