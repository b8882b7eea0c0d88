// GIoU loss of one box pair and its analytic gradient w.r.t. the prediction, in fp32.
//
// Shared by the CPU implementation (giou_op.cpp) and the CUDA kernels (giou_kernels.cu): no torch,
// no CUDA runtime, only arithmetic. The contract is detector/losses/reference.py (torchvision's
// formula, eps = 1e-7 on the union and enclosing denominators, strict overlap test).
#pragma once

#if defined(__CUDACC__)
#define GIOU_HD __host__ __device__ __forceinline__
#else
#define GIOU_HD inline
#endif

namespace detector {

constexpr float kGiouEps = 1e-7f;  // as detector.losses.reference.EPS and torchvision

// d max(a, b) / d a as PyTorch autograd gives it: 1 if a wins, 0 if b wins, half each on a tie.
GIOU_HD float max_weight(float a, float b) { return a > b ? 1.f : (a == b ? 0.5f : 0.f); }
// d min(a, b) / d a, likewise.
GIOU_HD float min_weight(float a, float b) { return a < b ? 1.f : (a == b ? 0.5f : 0.f); }

// Returns 1 - GIoU(p, t) for boxes xyxy and writes grad[k] = d(1 - GIoU) / d p[k].
//
//   inter = iw * ih if iw > 0 and ih > 0 else 0,  iw = min(x2, X2) - max(x1, X1), ih likewise
//   U = union + eps,  E = enclose + eps,  GIoU = inter / U - (enclose - union) / E
//   with union = area(p) + area(t) - inter, so d(1 - GIoU) =
//       c_inter * d inter + c_area * d area(p) + c_enclose * d enclose
//   c_inter = 1/E - 1/U - inter/U^2,  c_area = inter/U^2 - 1/E,  c_enclose = U/E^2
GIOU_HD float giou_loss_and_grad(const float p[4], const float t[4], float grad[4]) {
  const float x1 = p[0], y1 = p[1], x2 = p[2], y2 = p[3];
  const float X1 = t[0], Y1 = t[1], X2 = t[2], Y2 = t[3];

  const float xi1 = x1 > X1 ? x1 : X1, yi1 = y1 > Y1 ? y1 : Y1;
  const float xi2 = x2 < X2 ? x2 : X2, yi2 = y2 < Y2 ? y2 : Y2;
  const float iw = xi2 - xi1, ih = yi2 - yi1;
  const bool overlaps = (xi2 > xi1) && (yi2 > yi1);
  const float inter = overlaps ? iw * ih : 0.f;

  const float pw = x2 - x1, ph = y2 - y1;
  const float area_p = pw * ph;
  const float area_t = (X2 - X1) * (Y2 - Y1);
  const float union_ = area_p + area_t - inter;
  const float U = union_ + kGiouEps;
  const float iou = inter / U;

  const float xc1 = x1 < X1 ? x1 : X1, yc1 = y1 < Y1 ? y1 : Y1;
  const float xc2 = x2 > X2 ? x2 : X2, yc2 = y2 > Y2 ? y2 : Y2;
  const float cw = xc2 - xc1, ch = yc2 - yc1;
  const float enclose = cw * ch;
  const float E = enclose + kGiouEps;
  const float loss = 1.f - (iou - (enclose - union_) / E);

  const float inv_U = 1.f / U, inv_E = 1.f / E;
  const float iou_over_U = iou * inv_U;  // inter / U^2
  const float c_inter = inv_E - inv_U - iou_over_U;
  const float c_area = iou_over_U - inv_E;
  const float c_enclose = U * inv_E * inv_E;

  // Partial derivatives of inter (0 when the boxes do not overlap: torch.where selects the 0 branch),
  // of area(p) and of enclose w.r.t. x1, y1, x2, y2, ties split as autograd splits them.
  const float ih_o = overlaps ? ih : 0.f, iw_o = overlaps ? iw : 0.f;
  grad[0] = c_inter * (-ih_o * max_weight(x1, X1)) + c_area * (-ph) + c_enclose * (-ch * min_weight(x1, X1));
  grad[1] = c_inter * (-iw_o * max_weight(y1, Y1)) + c_area * (-pw) + c_enclose * (-cw * min_weight(y1, Y1));
  grad[2] = c_inter * (ih_o * min_weight(x2, X2)) + c_area * ph + c_enclose * (ch * max_weight(x2, X2));
  grad[3] = c_inter * (iw_o * min_weight(y2, Y2)) + c_area * pw + c_enclose * (cw * max_weight(y2, Y2));
  return loss;
}

}  // namespace detector
