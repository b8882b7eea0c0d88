// Autograd of detector::giou_loss and detector::giou_loss_packed, in C++: no Python runs in forward or
// backward (a Python register_autograd cost ~0.25 ms of host time per step on the GPU machine).
//
// Forward calls the op below autograd (its CPU or CUDA kernel), which also returns the gradient of the
// summed loss and 1 / max(n, 1); both are saved. Backward is one detector::giou_loss_backward call,
// grad_sum * (grad_output * inv_count): one elementwise kernel on CUDA. Both calls go through the
// dispatcher, so torch.compile traces them (with the fake kernels of detector/kernels/cuda_op.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

namespace detector {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // loss, grad_sum, inv_count

using PaddedSignature = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using PackedSignature = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Saves grad_sum and inv_count for backward; the loss is the only differentiable output.
variable_list save_outputs(AutogradContext* ctx, const Forward& out) {
  const auto& [loss, grad_sum, inv_count] = out;
  ctx->save_for_backward({grad_sum, inv_count});
  ctx->mark_non_differentiable({grad_sum, inv_count});
  ctx->set_materialize_grads(false);  // no zero-filled gradients for the two non-differentiable outputs
  return {loss, grad_sum, inv_count};
}

// d loss / d pred = grad_sum * (grad_output * inv_count); undefined if the loss got no gradient.
at::Tensor grad_pred(AutogradContext* ctx, const variable_list& grads, const char* strategies) {
  // create_graph=True runs backward with grad mode on: grad_sum has no graph, so a second derivative
  // would silently be 0. Refuse at once.
  TORCH_CHECK(!at::GradMode::is_enabled(), "double backward through ", strategies,
              " is not supported: its gradient is computed inside the forward kernel and only scaled in "
              "backward, so it has no graph to differentiate again; use the 'padded' strategy for "
              "higher-order gradients");
  if (!grads[0].defined()) return {};
  static const auto backward = find_op<BackwardSignature>("detector::giou_loss_backward");
  const variable_list saved = ctx->get_saved_variables();
  return backward.call(grads[0], saved[0], saved[1]);
}

struct GiouLossFunction : torch::autograd::Function<GiouLossFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                               const at::Tensor& counts, bool skip_invalid) {
    static const auto op = find_op<PaddedSignature>("detector::giou_loss");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return save_outputs(ctx, op.call(pred, target, counts, skip_invalid));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* strategies = "detector::giou_loss (strategies cuda_fused, cuda_conditional)";
    return {grad_pred(ctx, grads, strategies), {}, {}, {}};  // pred, target, counts, skip_invalid
  }
};

struct GiouLossPackedFunction : torch::autograd::Function<GiouLossPackedFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                               const at::Tensor& counts) {
    static const auto op = find_op<PackedSignature>("detector::giou_loss_packed");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return save_outputs(ctx, op.call(pred, target, counts));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grad_pred(ctx, grads, "detector::giou_loss_packed (strategy packed)"), {}, {}};
  }
};

Forward as_tuple(const variable_list& out) { return {out[0], out[1], out[2]}; }

Forward giou_loss_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                           bool skip_invalid) {
  return as_tuple(GiouLossFunction::apply(pred, target, counts, skip_invalid));
}

Forward giou_loss_packed_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts) {
  return as_tuple(GiouLossPackedFunction::apply(pred, target, counts));
}

}  // namespace

TORCH_LIBRARY_IMPL(detector, Autograd, m) {
  m.impl("giou_loss", &giou_loss_autograd);
  m.impl("giou_loss_packed", &giou_loss_packed_autograd);
}

}  // namespace detector
