// Autograd of detector::giou_loss and detector::giou_loss_packed, in C++: no Python runs in forward or
// backward (a Python register_autograd cost ~0.25 ms of host time per step on the GPU machine).
//
// Forward calls the op below autograd (its CPU or CUDA kernel), which returns the loss and
// 1 / max(n_valid, 1). Saved for backward: pred, target and counts (references to the inputs, no copies)
// and inv_count. Backward is one detector::giou_loss[_packed]_backward call, one kernel on CUDA that
// recomputes the gradient and writes grad_pred. Both calls go through the dispatcher, so torch.compile
// traces them (with the fake kernels of detector/kernels/cuda_op.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

namespace detector {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor>;  // loss, inv_count

using PaddedSignature = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using PackedSignature = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using BackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&);
using PackedBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor&, int64_t);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Saves the inputs and inv_count for backward; the loss is the only differentiable output.
variable_list save_inputs(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                          const at::Tensor& counts, const Forward& out) {
  const auto& [loss, inv_count] = out;
  ctx->save_for_backward({pred, target, counts, inv_count});
  ctx->mark_non_differentiable({inv_count});
  ctx->set_materialize_grads(false);  // no zero-filled gradient for the non-differentiable output
  return {loss, inv_count};
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
    return save_inputs(ctx, pred, target, counts, op.call(pred, target, counts, skip_invalid));
  }

  // d loss / d pred; undefined if the loss got no gradient. Returns pred, target, counts, skip_invalid.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("detector::giou_loss (strategies cuda_fused, cuda_conditional)");
    if (!grads[0].defined()) return {{}, {}, {}, {}};
    static const auto op = find_op<BackwardSignature>("detector::giou_loss_backward");
    const variable_list saved = ctx->get_saved_variables();  // pred, target, counts, inv_count
    return {op.call(grads[0], saved[0], saved[1], saved[2], saved[3]), {}, {}, {}};
  }
};

struct GiouLossPackedFunction : torch::autograd::Function<GiouLossPackedFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& pred, const at::Tensor& target,
                               const at::Tensor& counts, int64_t block_scan_max_batch) {
    static const auto op = find_op<PackedSignature>("detector::giou_loss_packed");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["block_scan_max_batch"] = block_scan_max_batch;
    return save_inputs(ctx, pred, target, counts, op.call(pred, target, counts, block_scan_max_batch));
  }

  // Returns pred, target, counts, block_scan_max_batch.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("detector::giou_loss_packed (strategy packed)");
    if (!grads[0].defined()) return {{}, {}, {}, {}};
    static const auto op = find_op<PackedBackwardSignature>("detector::giou_loss_packed_backward");
    const variable_list saved = ctx->get_saved_variables();
    const int64_t block_scan_max_batch = ctx->saved_data["block_scan_max_batch"].toInt();
    return {op.call(grads[0], saved[0], saved[1], saved[2], saved[3], block_scan_max_batch), {}, {}, {}};
  }
};

Forward as_tuple(const variable_list& out) { return {out[0], out[1]}; }

Forward giou_loss_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                           bool skip_invalid) {
  return as_tuple(GiouLossFunction::apply(pred, target, counts, skip_invalid));
}

Forward giou_loss_packed_autograd(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                                  int64_t block_scan_max_batch) {
  return as_tuple(GiouLossPackedFunction::apply(pred, target, counts, block_scan_max_batch));
}

}  // namespace

TORCH_LIBRARY_IMPL(detector, Autograd, m) {
  m.impl("giou_loss", &giou_loss_autograd);
  m.impl("giou_loss_packed", &giou_loss_packed_autograd);
}

}  // namespace detector
