// GIoU loss of one box pair and its analytic gradient w.r.t. the prediction, in the compute type: fp32,
// or fp64 for fp64 predictions (compute_t).
//
// Shared by the CPU implementation (giou_op.cpp) and the CUDA kernels (giou_kernels.cu): no torch,
// no CUDA runtime, only arithmetic. The contract is detector/losses/contract.py (torchvision's
// formula, eps = 1e-7 on the union and enclosing denominators, strict overlap test).
#pragma once

#include <type_traits>

#if defined(__CUDACC__)
#define GIOU_HD __host__ __device__ __forceinline__
#else
#define GIOU_HD inline
#endif

namespace detector {

constexpr double kGiouEps = 1e-7;  // as detector.losses.geometry.EPS and torchvision

// The arithmetic type for predictions of element type P: double for double, float for the rest (fp16
// areas overflow; bf16 loses the overlap), as detector.losses.geometry.compute_dtype.
template <typename P>
using compute_t = std::conditional_t<std::is_same_v<P, double>, double, float>;

// d max(a, b) / d a as PyTorch autograd gives it: 1 if a wins, 0 if b wins, half each on a tie.
template <typename S>
GIOU_HD S max_weight(S a, S b) { return a > b ? S(1) : (a == b ? S(0.5) : S(0)); }
// d min(a, b) / d a, likewise.
template <typename S>
GIOU_HD S min_weight(S a, S b) { return a < b ? S(1) : (a == b ? S(0.5) : S(0)); }

// a / b as written: the CPU kernel, the backward kernels, and the forwards but where a kernel brings its own.
struct PlainDivide {
  template <typename S>
  GIOU_HD S operator()(S a, S b) const { return a / b; }
};

// Returns 1 - GIoU(p, t) for boxes xyxy and writes grad[k] = d(1 - GIoU) / d p[k] (the backward kernels).
//
//   inter = iw * ih if iw > 0 and ih > 0 else 0,  iw = min(x2, X2) - max(x1, X1), ih likewise
//   U = union + eps,  E = enclose + eps,  GIoU = inter / U - (enclose - union) / E
//   with union = area(p) + area(t) - inter, so d(1 - GIoU) =
//       c_inter * d inter + c_area * d area(p) + c_enclose * d enclose
//   c_inter = 1/E - 1/U - inter/U^2,  c_area = inter/U^2 - 1/E,  c_enclose = U/E^2
// The loss's two quotients go through `divide`, which must return a / b to the bit (the gradient's
// reciprocals do not: they are the backward's alone).
template <typename S, typename Divide = PlainDivide>
GIOU_HD S giou_loss_and_grad(const S p[4], const S t[4], S grad[4], Divide divide = {}) {
  const S eps = S(kGiouEps);
  const S x1 = p[0], y1 = p[1], x2 = p[2], y2 = p[3];
  const S X1 = t[0], Y1 = t[1], X2 = t[2], Y2 = t[3];

  const S xi1 = x1 > X1 ? x1 : X1, yi1 = y1 > Y1 ? y1 : Y1;
  const S xi2 = x2 < X2 ? x2 : X2, yi2 = y2 < Y2 ? y2 : Y2;
  const S iw = xi2 - xi1, ih = yi2 - yi1;
  const bool overlaps = (xi2 > xi1) && (yi2 > yi1);
  const S inter = overlaps ? iw * ih : S(0);

  const S pw = x2 - x1, ph = y2 - y1;
  const S area_p = pw * ph;
  const S area_t = (X2 - X1) * (Y2 - Y1);
  const S union_ = area_p + area_t - inter;
  const S U = union_ + eps;
  const S iou = divide(inter, U);

  const S xc1 = x1 < X1 ? x1 : X1, yc1 = y1 < Y1 ? y1 : Y1;
  const S xc2 = x2 > X2 ? x2 : X2, yc2 = y2 > Y2 ? y2 : Y2;
  const S cw = xc2 - xc1, ch = yc2 - yc1;
  const S enclose = cw * ch;
  const S E = enclose + eps;
  const S loss = S(1) - (iou - divide(enclose - union_, E));

  const S inv_U = S(1) / U, inv_E = S(1) / E;
  const S iou_over_U = iou * inv_U;  // inter / U^2
  const S c_inter = inv_E - inv_U - iou_over_U;
  const S c_area = iou_over_U - inv_E;
  const S c_enclose = U * inv_E * inv_E;

  // Partial derivatives of inter (0 when the boxes do not overlap: torch.where selects the 0 branch),
  // of area(p) and of enclose w.r.t. x1, y1, x2, y2, ties split as autograd splits them.
  const S ih_o = overlaps ? ih : S(0), iw_o = overlaps ? iw : S(0);
  grad[0] = c_inter * (-ih_o * max_weight(x1, X1)) + c_area * (-ph) + c_enclose * (-ch * min_weight(x1, X1));
  grad[1] = c_inter * (-iw_o * max_weight(y1, Y1)) + c_area * (-pw) + c_enclose * (-cw * min_weight(y1, Y1));
  grad[2] = c_inter * (ih_o * min_weight(x2, X2)) + c_area * ph + c_enclose * (ch * max_weight(x2, X2));
  grad[3] = c_inter * (iw_o * min_weight(y2, Y2)) + c_area * pw + c_enclose * (cw * max_weight(y2, Y2));
  return loss;
}

// 1 - GIoU(p, t) alone (the forward kernels): the same arithmetic, so the same value to the bit; inlined,
// the unused gradient is dead code that the compiler drops.
template <typename S, typename Divide = PlainDivide>
GIOU_HD S giou_loss(const S p[4], const S t[4], Divide divide = {}) {
  S unused[4];
  return giou_loss_and_grad(p, t, unused, divide);
}

}  // namespace detector
