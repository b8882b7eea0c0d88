// CUDA implementation of the detector::giou_loss ops: the shared checks, outputs allocated by the
// caching allocator, the launchers of giou_kernels.cu on the current stream. Nothing synchronises.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "giou_kernels.cuh"
#include "giou_op.h"

namespace detector {
namespace {

#define DETECTOR_CASE_KERNEL_DTYPE(Name, AtName, Type, str) \
  case at::ScalarType::AtName:                              \
    return DType::k##Name;

DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    DETECTOR_ALL_DTYPES(DETECTOR_CASE_KERNEL_DTYPE)
    default: TORCH_CHECK_TYPE(false, "no GIoU kernel for dtype ", t);  // check_giou_inputs rejects it first
  }
}

// [B, M, 4] or [N, 4] (then stride_m is unused).
BoxesArg boxes_arg(const at::Tensor& t) {
  if (t.dim() == 3) return {t.const_data_ptr(), kernel_dtype(t.scalar_type()), t.stride(0), t.stride(1), t.stride(2)};
  return {t.const_data_ptr(), kernel_dtype(t.scalar_type()), t.stride(0), 0, t.stride(1)};
}

CountsArg counts_arg(const at::Tensor& c) { return {c.const_data_ptr(), kernel_dtype(c.scalar_type()), c.stride(0)}; }

struct Outputs {
  at::Tensor loss, grad_sum, inv_count, workspace;
  GiouOutputs pointers() {
    return {grad_sum.mutable_data_ptr(), loss.mutable_data_ptr(), inv_count.mutable_data_ptr(),
            workspace.mutable_data_ptr()};
  }
};

// workspace_batch: B for the packed layout (its prefix sums live there), 0 for the padded one.
Outputs empty_outputs(const at::Tensor& pred, int64_t workspace_batch) {
  const auto scalar = pred.options().dtype(compute_dtype(pred.scalar_type()));
  return {at::empty({}, scalar), at::empty(pred.sizes(), pred.options()), at::empty({}, scalar),
          at::empty({static_cast<int64_t>(giou_workspace_bytes(workspace_batch))}, pred.options().dtype(at::kByte))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_cuda(const at::Tensor& pred, const at::Tensor& target,
                                                              const at::Tensor& counts, bool skip_invalid) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  const c10::cuda::CUDAGuard guard(pred.device());
  Outputs out = empty_outputs(pred, 0);
  C10_CUDA_CHECK(giou_loss_padded_launch(boxes_arg(pred), boxes_arg(target), counts_arg(counts), n.batch, n.slots,
                                         skip_invalid, out.pointers(), c10::cuda::getCurrentCUDAStream()));
  return {out.loss, out.grad_sum, out.inv_count};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_packed_cuda(const at::Tensor& pred, const at::Tensor& target,
                                                                     const at::Tensor& counts) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/true);
  const c10::cuda::CUDAGuard guard(pred.device());
  Outputs out = empty_outputs(pred, n.batch);
  C10_CUDA_CHECK(giou_loss_packed_launch(boxes_arg(pred), boxes_arg(target), n.boxes, counts_arg(counts), n.batch,
                                         n.slots, out.pointers(), c10::cuda::getCurrentCUDAStream()));
  return {out.loss, out.grad_sum, out.inv_count};
}

at::Tensor giou_loss_backward_cuda(const at::Tensor& grad_output, const at::Tensor& grad_sum,
                                   const at::Tensor& inv_count) {
  check_giou_backward_inputs(grad_output, grad_sum, inv_count);
  const c10::cuda::CUDAGuard guard(grad_sum.device());
  const at::Tensor saved = grad_sum.contiguous();  // a no-op for the forward's own output
  at::Tensor grad_pred = at::empty(saved.sizes(), saved.options());
  C10_CUDA_CHECK(giou_loss_backward_launch(grad_output.const_data_ptr(), saved.const_data_ptr(),
                                           inv_count.const_data_ptr(), kernel_dtype(saved.scalar_type()),
                                           saved.numel(), grad_pred.mutable_data_ptr(),
                                           c10::cuda::getCurrentCUDAStream()));
  return grad_pred;
}

}  // namespace

TORCH_LIBRARY_IMPL(detector, CUDA, m) {
  m.impl("giou_loss", &giou_loss_cuda);
  m.impl("giou_loss_packed", &giou_loss_packed_cuda);
  m.impl("giou_loss_backward", &giou_loss_backward_cuda);
}

}  // namespace detector
