// The detector::giou_loss ops: schema (defined once, here) and the CPU implementation. The input checks
// are giou_checks.cpp, the CUDA implementation giou_cuda.cpp, the autograd giou_autograd.cpp; the Python
// wrappers and fake kernels are detector/kernels/cuda_op.py, whose docstrings hold the contract.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "giou.h"
#include "giou_dtypes.h"
#include "giou_op.h"

#ifdef WITH_CUDA
#define DETECTOR_WITH_CUDA 1
#else
#define DETECTOR_WITH_CUDA 0
#endif

// `import detector._C` loads this library, which registers the ops (TORCH_LIBRARY below) as a side
// effect; WITH_CUDA says whether the CUDA kernels were built in.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "detector::giou_loss ops (C++/CUDA)", -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddIntConstant(module, "WITH_CUDA", DETECTOR_WITH_CUDA) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

namespace detector {

// ----------------------------------------------------------------------------- CPU implementation

namespace {

constexpr int64_t kChunk = 4096;  // boxes per parallel task; fixed, so the sum order never depends on threads

using half_t = at::Half;  // the 16-bit element types of giou_dtypes.h's lists, on the CPU
using bfloat16_t = at::BFloat16;

// f(Tag<P>{}) for pred's element type P; check_giou_inputs has rejected any other dtype.
template <typename F>
void dispatch_pred(at::ScalarType t, F&& f) {
  switch (t) {
    DETECTOR_PRED_DTYPES(DETECTOR_CASE_SCALAR_TYPE)
    default: TORCH_CHECK_TYPE(false, "no GIoU CPU kernel for pred dtype ", t);
  }
}

template <typename F>
void dispatch_target(at::ScalarType t, F&& f) {
  switch (t) {
    DETECTOR_TARGET_DTYPES(DETECTOR_CASE_SCALAR_TYPE)
    default: TORCH_CHECK_TYPE(false, "no GIoU CPU kernel for target dtype ", t);
  }
}

template <typename F>
void dispatch_counts(at::ScalarType t, F&& f) {
  switch (t) {
    DETECTOR_COUNTS_DTYPES(DETECTOR_CASE_SCALAR_TYPE)
    default: TORCH_CHECK_TYPE(false, "no GIoU CPU kernel for counts dtype ", t);
  }
}

// counts[b] clamped to [0, slots], as the CUDA kernels clamp them: out-of-range counts are never an error.
// Read in place (no tensor op: this runs every step, and its host time is the CPU kernel's overhead).
std::vector<int64_t> clamped_counts(const at::Tensor& counts, int64_t slots) {
  std::vector<int64_t> values(counts.size(0));
  dispatch_counts(counts.scalar_type(), [&](auto c_tag) {
    using I = typename decltype(c_tag)::type;
    const I* data = counts.const_data_ptr<I>();
    for (size_t b = 0; b < values.size(); ++b) {
      const int64_t c = static_cast<int64_t>(data[b * counts.stride(0)]);
      values[b] = c < 0 ? 0 : (c > slots ? slots : c);
    }
  });
  return values;
}

template <typename F>
void dispatch_pred_target(const at::Tensor& pred, const at::Tensor& target, F&& f) {
  dispatch_pred(pred.scalar_type(), [&](auto p_tag) {
    dispatch_target(target.scalar_type(), [&](auto t_tag) { f(p_tag, t_tag); });
  });
}

template <typename C, typename T>
void load_box(const T* row, int64_t stride_c, C out[4]) {
  for (int k = 0; k < 4; ++k) out[k] = static_cast<C>(row[k * stride_c]);
}

struct Outputs {
  at::Tensor loss, grad_sum, inv_count;
};

Outputs empty_outputs(const at::Tensor& pred) {
  const auto scalar = pred.options().dtype(compute_dtype(pred.scalar_type()));
  return {at::empty({}, scalar), at::empty(pred.sizes(), pred.options()), at::empty({}, scalar)};
}

// Per-chunk sums of the losses (in the compute type, then widened) and of the valid boxes.
struct Partials {
  std::vector<double> loss;
  std::vector<int64_t> valid;
  explicit Partials(int64_t chunks) : loss(chunks, 0.0), valid(chunks, 0) {}
};

// Writes loss = sum / max(n, 1) and inv_count = 1 / max(n, 1), adding the partials in chunk order
// (fixed whatever the threads) in double, as the CUDA kernels add their block partials.
void finish_loss(const Partials& partials, Outputs& out) {
  double total = 0.0;
  int64_t n_valid = 0;
  for (size_t k = 0; k < partials.loss.size(); ++k) {
    total += partials.loss[k];
    n_valid += partials.valid[k];
  }
  const double denominator = n_valid > 0 ? static_cast<double>(n_valid) : 1.0;
  // rounded once to the compute dtype; written in place (fill_ would be two more dispatcher calls)
  AT_DISPATCH_FLOATING_TYPES(out.loss.scalar_type(), "giou_finish_loss", [&] {
    *out.loss.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(total / denominator);
    *out.inv_count.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(1.0 / denominator);
  });
}

// Padded layout: slot s = b * M + j of chunk `chunk`; grad_sum is written on every slot (0 if padded).
template <typename P, typename T>
void padded_chunk(const at::Tensor& pred, const at::Tensor& target, const std::vector<int64_t>& count,
                  const GiouSizes& n, int64_t chunk, P* grad, Partials& partials) {
  using C = compute_t<P>;
  const P* p_data = pred.const_data_ptr<P>();
  const T* t_data = target.const_data_ptr<T>();
  const auto ps = pred.strides(), ts = target.strides();
  C loss_acc = 0;
  int64_t valid_acc = 0;
  const int64_t last = std::min(n.batch * n.slots, (chunk + 1) * kChunk);
  for (int64_t s = chunk * kChunk; s < last; ++s) {
    const int64_t b = s / n.slots, j = s % n.slots;
    C g[4] = {0, 0, 0, 0};
    if (j < count[b]) {
      C p[4], t[4];
      load_box(p_data + b * ps[0] + j * ps[1], ps[2], p);
      load_box(t_data + b * ts[0] + j * ts[1], ts[2], t);
      loss_acc += giou_loss_and_grad(p, t, g);
      ++valid_acc;
    }
    for (int k = 0; k < 4; ++k) grad[s * 4 + k] = static_cast<P>(g[k]);
  }
  partials.loss[chunk] = loss_acc;
  partials.valid[chunk] = valid_acc;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_cpu(const at::Tensor& pred, const at::Tensor& target,
                                                             const at::Tensor& counts, bool skip_invalid) {
  // skip_invalid changes nothing here: the CPU kernel never reads a padded slot.
  (void)skip_invalid;
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  const std::vector<int64_t> count = clamped_counts(counts, n.slots);
  Outputs out = empty_outputs(pred);
  const int64_t chunks = (n.batch * n.slots + kChunk - 1) / kChunk;
  Partials partials(chunks);
  dispatch_pred_target(pred, target, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    P* grad = out.grad_sum.mutable_data_ptr<P>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        padded_chunk<P, T>(pred, target, count, n, chunk, grad, partials);
      }
    });
  });
  finish_loss(partials, out);
  return {out.loss, out.grad_sum, out.inv_count};
}

// Packed layout: boxes [first, last) of chunk `chunk`, below `rows`; box i belongs to the image b with
// offset[b] <= i < offset[b + 1], slot j = i - offset[b]. grad_sum is zeroed beforehand.
template <typename P, typename T>
void packed_chunk(const at::Tensor& pred, const at::Tensor& target, const std::vector<int64_t>& offset,
                  const GiouSizes& n, int64_t rows, int64_t chunk, P* grad, Partials& partials) {
  using C = compute_t<P>;
  const P* p_data = pred.const_data_ptr<P>();
  const T* t_data = target.const_data_ptr<T>();
  const auto ps = pred.strides(), ts = target.strides();
  C loss_acc = 0;
  const int64_t first = chunk * kChunk, last = std::min(rows, first + kChunk);
  // image of the chunk's first box: the last b with offset[b] <= first (skips empty images)
  int64_t b = std::upper_bound(offset.begin(), offset.end(), first) - offset.begin() - 1;
  for (int64_t i = first; i < last; ++i) {
    while (i >= offset[b + 1]) ++b;
    const int64_t j = i - offset[b];
    C p[4], t[4], g[4];
    load_box(p_data + b * ps[0] + j * ps[1], ps[2], p);
    load_box(t_data + i * ts[0], ts[1], t);
    loss_acc += giou_loss_and_grad(p, t, g);
    for (int k = 0; k < 4; ++k) grad[(b * n.slots + j) * 4 + k] = static_cast<P>(g[k]);
  }
  partials.loss[chunk] = loss_acc;
  partials.valid[chunk] = last - first;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_packed_cpu(const at::Tensor& pred, const at::Tensor& target,
                                                                    const at::Tensor& counts) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/true);
  const std::vector<int64_t> count = clamped_counts(counts, n.slots);
  std::vector<int64_t> offset(n.batch + 1, 0);  // box index of each image's first box
  for (int64_t b = 0; b < n.batch; ++b) offset[b + 1] = offset[b] + count[b];
  // Rows past the counts' sum are ignored; with fewer rows than the sum, the boxes past row N are absent.
  const int64_t rows = std::min(n.boxes, offset[n.batch]);
  Outputs out = empty_outputs(pred);
  out.grad_sum.zero_();
  const int64_t chunks = (rows + kChunk - 1) / kChunk;
  Partials partials(chunks);
  dispatch_pred_target(pred, target, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    P* grad = out.grad_sum.mutable_data_ptr<P>();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        packed_chunk<P, T>(pred, target, offset, n, rows, chunk, grad, partials);
      }
    });
  });
  finish_loss(partials, out);
  return {out.loss, out.grad_sum, out.inv_count};
}

at::Tensor giou_loss_backward_cpu(const at::Tensor& grad_output, const at::Tensor& grad_sum,
                                  const at::Tensor& inv_count) {
  check_giou_backward_inputs(grad_output, grad_sum, inv_count);
  const at::Tensor saved = grad_sum.contiguous();
  at::Tensor grad_pred = at::empty(saved.sizes(), saved.options());
  dispatch_pred(saved.scalar_type(), [&](auto p_tag) {
    using P = typename decltype(p_tag)::type;
    using C = compute_t<P>;
    const C scale = *grad_output.const_data_ptr<C>() * *inv_count.const_data_ptr<C>();  // CPU: read in place
    const P* in = saved.const_data_ptr<P>();
    P* result = grad_pred.mutable_data_ptr<P>();
    at::parallel_for(0, saved.numel(), kChunk, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) result[k] = static_cast<P>(static_cast<C>(in[k]) * scale);
    });
  });
  return grad_pred;
}

}  // namespace

// Outputs of the forward ops: loss (0-dim, mean over valid boxes), grad_sum (pred's dtype, [B, M, 4]
// contiguous, d(sum of per-box losses) / d pred, 0 on padded slots), inv_count (0-dim, 1 / max(n, 1)); loss
// and inv_count in the compute dtype (compute_dtype: fp64 for fp64 pred, else fp32).
TORCH_LIBRARY(detector, m) {
  m.set_python_module("detector.kernels.cuda_op");  // where register_fake lives
  m.def("giou_loss(Tensor pred, Tensor target, Tensor counts, bool skip_invalid=False) "
        "-> (Tensor loss, Tensor grad_sum, Tensor inv_count)");
  m.def("giou_loss_packed(Tensor pred, Tensor target, Tensor counts) "
        "-> (Tensor loss, Tensor grad_sum, Tensor inv_count)");
  m.def("giou_loss_backward(Tensor grad_output, Tensor grad_sum, Tensor inv_count) -> Tensor");
}

TORCH_LIBRARY_IMPL(detector, CPU, m) {
  m.impl("giou_loss", &giou_loss_cpu);
  m.impl("giou_loss_packed", &giou_loss_packed_cpu);
  m.impl("giou_loss_backward", &giou_loss_backward_cpu);
}

}  // namespace detector
