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

GiouInputs inputs(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts, const GiouSizes& n) {
  const CountsArg counts_arg{counts.const_data_ptr(), kernel_dtype(counts.scalar_type()), counts.stride(0)};
  return {boxes_arg(pred), boxes_arg(target), counts_arg, n.batch, n.slots, n.boxes};
}

// Scratch memory of a forward launcher (giou_workspace_bytes).
at::Tensor workspace(const at::Tensor& pred, size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, pred.options().dtype(at::kByte));
}

void* pointer(at::Tensor& t) { return t.numel() > 0 ? t.mutable_data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor> loss_outputs(const at::Tensor& pred) {
  const auto scalar = pred.options().dtype(compute_dtype(pred.scalar_type()));
  return {at::empty({}, scalar), at::empty({}, scalar)};
}

std::tuple<at::Tensor, at::Tensor> giou_loss_cuda(const at::Tensor& pred, const at::Tensor& target,
                                                  const at::Tensor& counts, bool skip_invalid) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  const c10::cuda::CUDAGuard guard(pred.device());
  auto [loss, inv_count] = loss_outputs(pred);
  at::Tensor scratch = workspace(pred, giou_workspace_bytes());
  C10_CUDA_CHECK(giou_loss_padded_launch(
      inputs(pred, target, counts, n), skip_invalid,
      {loss.mutable_data_ptr(), inv_count.mutable_data_ptr(), pointer(scratch), nullptr},
      c10::cuda::getCurrentCUDAStream()));
  return {loss, inv_count};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_packed_cuda(const at::Tensor& pred, const at::Tensor& target,
                                                                     const at::Tensor& counts,
                                                                     int64_t block_scan_max_batch) {
  check_block_scan_max_batch(block_scan_max_batch);
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/true);
  const c10::cuda::CUDAGuard guard(pred.device());
  auto [loss, inv_count] = loss_outputs(pred);
  at::Tensor offsets = at::empty({n.batch}, counts.options().dtype(at::kLong));
  at::Tensor scratch = workspace(pred, giou_workspace_bytes());
  C10_CUDA_CHECK(giou_loss_packed_launch(
      inputs(pred, target, counts, n), block_scan_max_batch,
      {loss.mutable_data_ptr(), inv_count.mutable_data_ptr(), pointer(scratch), offsets.mutable_data_ptr<int64_t>()},
      c10::cuda::getCurrentCUDAStream()));
  return {loss, inv_count, offsets};
}

at::Tensor giou_loss_backward_cuda(const at::Tensor& grad_output, const at::Tensor& pred, const at::Tensor& target,
                                   const at::Tensor& counts, const at::Tensor& inv_count) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  check_giou_backward_inputs(grad_output, pred, inv_count);
  const c10::cuda::CUDAGuard guard(pred.device());
  at::Tensor grad_pred = at::empty(pred.sizes(), pred.options());  // contiguous, as the kernel writes it
  const GradArgs args{grad_output.const_data_ptr(), inv_count.const_data_ptr(), grad_pred.mutable_data_ptr()};
  C10_CUDA_CHECK(giou_grad_padded_launch(inputs(pred, target, counts, n), args, c10::cuda::getCurrentCUDAStream()));
  return grad_pred;
}

at::Tensor giou_loss_packed_backward_cuda(const at::Tensor& grad_output, const at::Tensor& pred,
                                          const at::Tensor& target, const at::Tensor& offsets,
                                          const at::Tensor& inv_count) {
  const GiouSizes n = check_giou_inputs(pred, target, offsets, /*packed=*/true, "offsets");
  check_giou_backward_inputs(grad_output, pred, inv_count);
  check_packed_offsets(offsets);
  const c10::cuda::CUDAGuard guard(pred.device());
  at::Tensor grad_pred = at::empty(pred.sizes(), pred.options());
  const at::Tensor sums = offsets.contiguous();  // the forward's are contiguous already: no copy
  const GradArgs args{grad_output.const_data_ptr(), inv_count.const_data_ptr(), grad_pred.mutable_data_ptr()};
  C10_CUDA_CHECK(giou_grad_packed_launch(inputs(pred, target, sums, n), sums.const_data_ptr<int64_t>(), args,
                                         c10::cuda::getCurrentCUDAStream()));
  return grad_pred;
}

}  // namespace

TORCH_LIBRARY_IMPL(detector, CUDA, m) {
  m.impl("giou_loss", &giou_loss_cuda);
  m.impl("giou_loss_packed", &giou_loss_packed_cuda);
  m.impl("giou_loss_backward", &giou_loss_backward_cuda);
  m.impl("giou_loss_packed_backward", &giou_loss_packed_backward_cuda);
}

}  // namespace detector
