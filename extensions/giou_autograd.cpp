// Autograd of detector::giou_loss and detector::giou_loss_packed, in C++: no Python runs in forward or
// backward (a Python register_autograd adds host time to every step; `python -m detector bench kernels`
// measures the autograd round trip among its host floors).
//
// Forward calls the op below autograd (its CPU or CUDA kernel), which returns the loss and
// 1 / max(n_valid, 1) (packed: and the offsets, the prefix sums of the clamped counts). Saved for
// backward: pred, target and counts (references to the inputs, no copies; packed: the offsets in place of
// the counts, so the backward never scans them again) and inv_count. Backward is one
// detector::giou_loss[_packed]_backward call, one kernel on CUDA that recomputes the gradient and writes
// grad_pred. Both calls go through the dispatcher, so torch.compile traces them (with the fake kernels of
// detector/kernels/cuda_op.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

namespace detector {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor>;                    // loss, inv_count
using PackedForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // loss, inv_count, offsets

using PaddedSignature = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using PackedSignature = PackedForward(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
// grad_output, pred, target, counts (packed: the forward's offsets), inv_count
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Saves pred, target, `counts` (packed: the forward's offsets) and inv_count (outputs[1]) for backward and
// returns the outputs; the loss (outputs[0]) is the only differentiable one.
variable_list save_for_backward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                                const at::Tensor& counts, const variable_list& outputs) {
  ctx->save_for_backward({pred, target, counts, outputs[1]});
  ctx->mark_non_differentiable(variable_list(outputs.begin() + 1, outputs.end()));
  ctx->set_materialize_grads(false);  // no zero-filled gradients for the non-differentiable outputs
  return outputs;
}

// d loss / d pred by the backward op from the saved tensors; undefined if the loss got no gradient.
at::Tensor grad_pred(AutogradContext* ctx, const variable_list& grads,
                     const c10::TypedOperatorHandle<BackwardSignature>& op) {
  if (!grads[0].defined()) return {};
  const variable_list saved = ctx->get_saved_variables();  // pred, target, counts or offsets, inv_count
  return op.call(grads[0], saved[0], saved[1], saved[2], saved[3]);
}

// create_graph=True runs backward with grad mode on: the backward kernel's gradient has no graph, so a
// second derivative would silently be 0. Refuse at once.
void refuse_double_backward(const char* strategies) {
  TORCH_CHECK(!at::GradMode::is_enabled(), "double backward through ", strategies,
              " is not supported: its backward is one kernel that computes the analytic gradient, with no "
              "graph to differentiate again; use the 'padded' strategy for higher-order gradients");
}

struct GiouLossFunction : torch::autograd::Function<GiouLossFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                               const at::Tensor& counts, bool skip_invalid) {
    static const auto op = find_op<PaddedSignature>("detector::giou_loss");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto [loss, inv_count] = op.call(pred, target, counts, skip_invalid);
    return save_for_backward(ctx, pred, target, counts, {loss, inv_count});
  }

  // Returns the gradients of pred, target, counts, skip_invalid.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("detector::giou_loss (strategies cuda_fused, cuda_conditional)");
    static const auto op = find_op<BackwardSignature>("detector::giou_loss_backward");
    return {grad_pred(ctx, grads, op), {}, {}, {}};
  }
};

struct GiouLossPackedFunction : torch::autograd::Function<GiouLossPackedFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                               const at::Tensor& counts, int64_t block_scan_max_batch) {
    static const auto op = find_op<PackedSignature>("detector::giou_loss_packed");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto [loss, inv_count, offsets] = op.call(pred, target, counts, block_scan_max_batch);
    return save_for_backward(ctx, pred, target, offsets, {loss, inv_count, offsets});
  }

  // Returns the gradients of pred, target, counts, block_scan_max_batch.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("detector::giou_loss_packed (strategy packed)");
    static const auto op = find_op<BackwardSignature>("detector::giou_loss_packed_backward");
    return {grad_pred(ctx, grads, op), {}, {}, {}};
  }
};

Forward giou_loss_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                           bool skip_invalid) {
  const variable_list out = GiouLossFunction::apply(pred, target, counts, skip_invalid);
  return {out[0], out[1]};
}

PackedForward giou_loss_packed_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                                        int64_t block_scan_max_batch) {
  const variable_list out = GiouLossPackedFunction::apply(pred, target, counts, block_scan_max_batch);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(detector, Autograd, m) {
  m.impl("giou_loss", &giou_loss_autograd);
  m.impl("giou_loss_packed", &giou_loss_packed_autograd);
}

}  // namespace detector
