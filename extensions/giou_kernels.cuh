// Launchers of the GIoU loss CUDA kernels: raw pointers, sizes, strides and a stream; no torch headers,
// so giou_kernels.cu compiles with a plain `nvcc -c` on a machine without a GPU or torch.
//
// Every forward launcher runs ONE loss kernel (after a small cudaMemsetAsync of its workspace counter,
// plus, for the packed layout, one of the gradient buffer and a prefix-sum scan of the counts) that writes
//   - grad_sum  [B, M, 4] in pred's dtype: d(sum of the per-box losses) / d pred, exactly 0 on padded slots;
//   - loss      scalar in the compute type (double for fp64 pred, else float): sum of the per-box losses
//               / max(n_valid, 1);
//   - inv_count scalar in the compute type: 1 / max(n_valid, 1), so that backward is one elementwise scale
//     grad_pred = grad_sum * (grad_output * inv_count) and nothing ever synchronises with the host.
// Blocks reduce their losses and valid counts; the last block to finish (atomic ticket) adds the
// block partials in a fixed order, so the result is deterministic.
//
// Counts are read on the device and never validated (that would need a host synchronisation): a count
// below 0 counts as 0, above M as M, as on the CPU. Packed layout: row i of the N target rows is box
// i - C[b] of the image b with C[b] <= i < C[b + 1] (C: prefix sums of the clamped counts); rows at or past
// C[B] are ignored, and when N < C[B] the boxes that would lie past row N are absent (the loss averages
// over the min(N, C[B]) boxes present). Nothing is ever read or written out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "giou_dtypes.h"

namespace detector {

// The element types of the kernels' inputs and outputs (giou_dtypes.h lists which each argument takes).
enum class DType : int { DETECTOR_ALL_DTYPES(DETECTOR_ENUMERATOR) };

// A strided [rows, 4] or [B, M, 4] tensor of boxes; strides in elements.
struct BoxesArg {
  const void* data;
  DType dtype;
  int64_t stride_b;  // image (padded) or box (packed) stride
  int64_t stride_m;  // slot stride (padded only)
  int64_t stride_c;  // coordinate stride
};

struct CountsArg {
  const void* data;  // [B], an integer dtype of DETECTOR_COUNTS_DTYPES
  DType dtype;
  int64_t stride;
};

struct GiouOutputs {
  void* grad_sum;   // [B, M, 4] contiguous, pred's dtype
  void* loss;       // 0-dim, compute type (double for fp64 pred, else float)
  void* inv_count;  // 0-dim, compute type
  void* workspace;  // giou_workspace_bytes(batch) bytes (padded layout: batch = 0)
};

// Bytes of scratch memory a forward launcher needs: block partials and the ticket counter, plus, for the
// packed layout (batch > 0), the prefix sums of the counts and the device scan's state. Padded: batch = 0.
size_t giou_workspace_bytes(int64_t batch);

// Padded layout: pred and target [B, M, 4]; slot j of image b is valid iff j < counts[b].
// skip_invalid = false: every thread loads and computes its slot, then selects 0 for padded slots;
// skip_invalid = true: threads of padded slots skip all loads and arithmetic (they only store zeros).
cudaError_t giou_loss_padded_launch(BoxesArg pred, BoxesArg target, CountsArg counts, int64_t batch,
                                    int64_t slots, bool skip_invalid, GiouOutputs out, cudaStream_t stream);

// Packed layout: pred [B, M, 4], target [N, 4] (image 0's boxes first), counts [B] (B < 2^31). A device
// scan writes the prefix sums of the clamped counts once; then a grid over the N boxes, each finding its
// image by a binary search over them (O(log B) per box, where each block used to walk all B counts).
cudaError_t giou_loss_packed_launch(BoxesArg pred, BoxesArg target, int64_t num_boxes, CountsArg counts,
                                    int64_t batch, int64_t slots, GiouOutputs out, cudaStream_t stream);

// Backward: grad_pred = grad_sum * (grad_output[0] * inv_count[0]), elementwise over `numel` values
// (a multiple of 4) of dtype `dtype`; grad_output and inv_count (compute type) stay on the device.
cudaError_t giou_loss_backward_launch(const void* grad_output, const void* grad_sum, const void* inv_count,
                                      DType dtype, int64_t numel, void* grad_pred, cudaStream_t stream);

}  // namespace detector
