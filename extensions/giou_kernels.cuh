// Launchers of the GIoU loss CUDA kernels: raw pointers, sizes, strides and a stream; no torch headers,
// so giou_kernels.cu compiles with a plain `nvcc -c` on a machine without a GPU or torch.
//
// Forward (one loss kernel, after a cudaMemsetAsync of the head of its workspace) writes only
//   - loss      scalar in the compute type (double for fp64 pred, else float): sum of the per-box losses
//               / max(n_valid, 1);
//   - inv_count scalar in the compute type: 1 / max(n_valid, 1);
//   - offsets   (packed only) int64 [B]: C[b + 1], the inclusive prefix sums of the clamped counts, which
//               the packed backward takes in place of the counts, so it never scans them again.
// Blocks reduce their losses and valid counts; the last block to finish (atomic ticket) adds the block
// partials in a fixed order, so the result is deterministic. No gradient buffer: the forward moves only
// the bytes it reads.
//
// Backward (one kernel over all B * M slots) recomputes the gradient from pred, target and counts (packed:
// the forward's offsets) and writes every slot of grad_pred [B, M, 4] (contiguous, pred's dtype): exactly
// 0 in padded slots, which it never reads, and d(1 - GIoU) / d pred * grad_output * inv_count in valid
// slots. Nothing ever synchronises with the host.
//
// Counts are read on the device and never validated (that would need a host synchronisation): a count
// below 0 counts as 0, above M as M, as on the CPU. Packed layout: row i of the N target rows is box
// i - C[b] of the image b with C[b] <= i < C[b + 1] (C: prefix sums of the clamped counts); rows at or past
// C[B] are ignored, and when N < C[B] the boxes that would lie past row N are absent (the loss averages
// over the min(N, C[B]) boxes present). The backward clamps the offsets it is given the same way (each
// image's rows within [0, N) and at most M of them), so no offsets make it read or write out of bounds.
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

// The inputs of every launcher.
struct GiouInputs {
  BoxesArg pred;     // [B, M, 4] xyxy
  BoxesArg target;   // [B, M, 4] (padded) or [N, 4] (packed, image 0's boxes first) xyxy
  CountsArg counts;  // [B]
  int64_t batch;     // B
  int64_t slots;     // M
  int64_t rows;      // N (packed); B * M (padded)
};

struct LossOutputs {
  void* loss;        // 0-dim, compute type (double for fp64 pred, else float)
  void* inv_count;   // 0-dim, compute type
  void* workspace;   // giou_workspace_bytes(...) bytes
  int64_t* offsets;  // packed: [B] contiguous, out; padded: unused (null)
};

struct GradArgs {
  const void* grad_output;  // 0-dim, compute type
  const void* inv_count;    // 0-dim, compute type: the forward's
  void* grad_pred;          // [B, M, 4] contiguous, pred's dtype, out
};

// Packed batches of up to this many images scan their counts inside every block (a shared-memory array of
// B int64, 32 KiB at most, inside the 48 KiB a block gets without opting in); in larger ones each block
// adds up the count sums of the blocks before it, whatever block_scan_max_batch asks.
constexpr int64_t kBlockScanBatchLimit = 4096;

// Scratch bytes a forward needs: its block partials and ticket, and the packed forward's per-block sums.
size_t giou_workspace_bytes();

// Padded layout: pred and target [B, M, 4]; slot j of image b is valid iff j < counts[b].
// skip_invalid = false (cuda_fused): every thread loads and computes all its slots, then selects 0 for the
// padded ones; skip_invalid = true (cuda_conditional): only slots that are valid are loaded and computed.
cudaError_t giou_loss_padded_launch(const GiouInputs& in, bool skip_invalid, LossOutputs out, cudaStream_t stream);

// Packed layout: slot j of image b takes target row C[b] + j, C the prefix sums of the clamped counts;
// only valid slots are loaded and computed. With B <= block_scan_max_batch (and <= kBlockScanBatchLimit) every block computes
// those sums itself in shared memory (block 0 writes them to out.offsets); otherwise each block takes a
// contiguous range of images, sums its counts, publishes the sum and adds up those of the blocks before it
// (no second launch either), and writes its images' sums to out.offsets.
cudaError_t giou_loss_packed_launch(const GiouInputs& in, int64_t block_scan_max_batch, LossOutputs out,
                                    cudaStream_t stream);

// Backward, padded layout: grad_pred as described above, one kernel.
cudaError_t giou_grad_padded_launch(const GiouInputs& in, GradArgs args, cudaStream_t stream);

// Backward, packed layout: slot j of image b takes target row C[b] + j, C from `offsets` (int64 [B],
// contiguous: the forward's, C[b + 1] = offsets[b]); in.counts is not read.
cudaError_t giou_grad_packed_launch(const GiouInputs& in, const int64_t* offsets, GradArgs args, cudaStream_t stream);

}  // namespace detector
