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

constexpr int64_t kChunk = 4096;  // slots per parallel task (whole images); fixed, so sums never depend on threads

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

// Which slots are valid and where their target boxes are, for either layout: slot j of image b is valid
// iff j < present[b]; its target box is at element b * stride_b + j * stride_m + first_row[b] * stride_r.
struct Slots {
  GiouSizes n;
  std::vector<int64_t> present;    // the clamped count; packed: only the boxes whose row is below N
  std::vector<int64_t> first_row;  // packed: the target row of the image's slot 0 (C[b]); padded: 0
  int64_t stride_b, stride_m, stride_r, stride_c;  // target strides in elements
};

Slots padded_slots(const at::Tensor& target, const at::Tensor& counts, const GiouSizes& n) {
  const auto ts = target.strides();
  return {n, clamped_counts(counts, n.slots), std::vector<int64_t>(n.batch, 0), ts[0], ts[1], 0, ts[2]};
}

// The packed forward's third output: C[b + 1], the inclusive prefix sums of the clamped counts, int64 [B].
at::Tensor packed_offsets(const at::Tensor& counts, int64_t slots) {
  const std::vector<int64_t> clamped = clamped_counts(counts, slots);
  at::Tensor offsets = at::empty({static_cast<int64_t>(clamped.size())}, counts.options().dtype(at::kLong));
  int64_t* out = offsets.mutable_data_ptr<int64_t>();
  int64_t sum = 0;
  for (size_t b = 0; b < clamped.size(); ++b) out[b] = sum += clamped[b];
  return offsets;
}

// Packed: image b's boxes are rows C[b] .. C[b + 1] - 1, C[b + 1] = offsets[b]; rows at or past C[B] are
// ignored, and boxes whose row would be N or more are absent. Clamped as the CUDA kernels clamp them (each
// image's rows within [0, N), at most M), so offsets handed to the backward can never index out of bounds.
Slots packed_slots(const at::Tensor& target, const at::Tensor& offsets, const GiouSizes& n) {
  const auto ts = target.strides();
  Slots s{n, std::vector<int64_t>(n.batch, 0), std::vector<int64_t>(n.batch, 0), 0, ts[0], ts[0], ts[1]};
  const int64_t* incl = offsets.const_data_ptr<int64_t>();
  const int64_t stride = offsets.stride(0);
  for (int64_t b = 0; b < n.batch; ++b) {
    s.first_row[b] = std::clamp<int64_t>(b > 0 ? incl[(b - 1) * stride] : 0, 0, n.boxes);
    const int64_t room = std::min(n.boxes - s.first_row[b], n.slots);
    s.present[b] = std::clamp<int64_t>(incl[b * stride] - s.first_row[b], 0, room);
  }
  return s;
}

template <typename F>
void dispatch_pred_target(const at::Tensor& pred, const at::Tensor& target, F&& f) {
  dispatch_pred(pred.scalar_type(), [&](auto p_tag) {
    dispatch_target(target.scalar_type(), [&](auto t_tag) { f(p_tag, t_tag); });
  });
}

// The pred and target boxes of slot (b, j) as C.
template <typename P, typename T>
struct BoxReader {
  const P* pred;
  at::IntArrayRef ps;
  const T* target;
  const Slots& s;

  BoxReader(const at::Tensor& p, const at::Tensor& t, const Slots& slots)
      : pred(p.const_data_ptr<P>()), ps(p.strides()), target(t.const_data_ptr<T>()), s(slots) {}

  template <typename C>
  void operator()(int64_t b, int64_t j, C p[4], C t[4]) const {
    const P* p_box = pred + b * ps[0] + j * ps[1];
    const T* t_box = target + b * s.stride_b + j * s.stride_m + s.first_row[b] * s.stride_r;
    for (int k = 0; k < 4; ++k) {
      p[k] = static_cast<C>(p_box[k * ps[2]]);
      t[k] = static_cast<C>(t_box[k * s.stride_c]);
    }
  }
};

// Images [first, last) of a parallel task: a fixed number of slots per task, so the sum order never
// depends on the number of threads.
struct Task {
  int64_t first, last;
};

int64_t images_per_task(const GiouSizes& n) { return std::max<int64_t>(1, kChunk / std::max<int64_t>(n.slots, 1)); }

int64_t task_count(const GiouSizes& n) {
  const int64_t per_task = images_per_task(n);
  return (n.batch + per_task - 1) / per_task;
}

Task task(const GiouSizes& n, int64_t k) {
  const int64_t per_task = images_per_task(n);
  return {k * per_task, std::min(n.batch, (k + 1) * per_task)};
}

// Per-task sums of the losses (in the compute type, then widened) and of the valid boxes.
struct Partials {
  std::vector<double> loss;
  std::vector<int64_t> valid;
  explicit Partials(int64_t tasks) : loss(tasks, 0.0), valid(tasks, 0) {}
};

// loss = sum / max(n, 1) and inv_count = 1 / max(n, 1) (0-dim, compute dtype), adding the partials in task
// order (fixed whatever the threads) in double, as the CUDA kernels add their block partials.
std::tuple<at::Tensor, at::Tensor> finish_loss(const at::Tensor& pred, const Partials& partials) {
  double total = 0.0;
  int64_t n_valid = 0;
  for (size_t k = 0; k < partials.loss.size(); ++k) {
    total += partials.loss[k];
    n_valid += partials.valid[k];
  }
  const double denominator = n_valid > 0 ? static_cast<double>(n_valid) : 1.0;
  const auto scalar = pred.options().dtype(compute_dtype(pred.scalar_type()));
  at::Tensor loss = at::empty({}, scalar), inv_count = at::empty({}, scalar);
  // rounded once to the compute dtype; written in place (fill_ would be two more dispatcher calls)
  AT_DISPATCH_FLOATING_TYPES(loss.scalar_type(), "giou_finish_loss", [&] {
    *loss.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(total / denominator);
    *inv_count.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(1.0 / denominator);
  });
  return {loss, inv_count};
}

// Forward, either layout: the loss of the valid slots only (padded slots are never read).
std::tuple<at::Tensor, at::Tensor> loss_cpu(const at::Tensor& pred, const at::Tensor& target, const Slots& s) {
  Partials partials(task_count(s.n));
  dispatch_pred_target(pred, target, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    using C = compute_t<P>;
    const BoxReader<P, T> read(pred, target, s);
    at::parallel_for(0, task_count(s.n), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const Task images = task(s.n, k);
        C loss_acc = 0;
        for (int64_t b = images.first; b < images.last; ++b) {
          for (int64_t j = 0; j < s.present[b]; ++j) {
            C p[4], t[4];
            read(b, j, p, t);
            loss_acc += giou_loss(p, t);
          }
          partials.valid[k] += s.present[b];
        }
        partials.loss[k] = loss_acc;
      }
    });
  });
  return finish_loss(pred, partials);
}

// Backward, either layout: every slot of a contiguous grad_pred, 0 where not valid (nothing read), else the
// gradient recomputed from pred and target times grad_output * inv_count, rounded once to pred's dtype.
at::Tensor grad_cpu(const at::Tensor& grad_output, const at::Tensor& pred, const at::Tensor& target,
                    const at::Tensor& inv_count, const Slots& s) {
  check_giou_backward_inputs(grad_output, pred, inv_count);
  at::Tensor grad_pred = at::empty(pred.sizes(), pred.options());
  dispatch_pred_target(pred, target, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    using C = compute_t<P>;
    const C scale = *grad_output.const_data_ptr<C>() * *inv_count.const_data_ptr<C>();  // CPU: read in place
    const BoxReader<P, T> read(pred, target, s);
    P* grad = grad_pred.mutable_data_ptr<P>();
    at::parallel_for(0, task_count(s.n), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const Task images = task(s.n, k);
        for (int64_t b = images.first; b < images.last; ++b) {
          for (int64_t j = 0; j < s.n.slots; ++j) {
            C g[4] = {0, 0, 0, 0};
            if (j < s.present[b]) {
              C p[4], t[4];
              read(b, j, p, t);
              giou_loss_and_grad(p, t, g);
              for (int c = 0; c < 4; ++c) g[c] *= scale;
            }
            for (int c = 0; c < 4; ++c) grad[(b * s.n.slots + j) * 4 + c] = static_cast<P>(g[c]);
          }
        }
      }
    });
  });
  return grad_pred;
}

std::tuple<at::Tensor, at::Tensor> giou_loss_cpu(const at::Tensor& pred, const at::Tensor& target,
                                                 const at::Tensor& counts, bool skip_invalid) {
  (void)skip_invalid;  // changes nothing here: the CPU kernel never reads a padded slot
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  return loss_cpu(pred, target, padded_slots(target, counts, n));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> giou_loss_packed_cpu(const at::Tensor& pred, const at::Tensor& target,
                                                                    const at::Tensor& counts,
                                                                    int64_t block_scan_max_batch) {
  check_block_scan_max_batch(block_scan_max_batch);  // a CUDA choice only: the CPU sums the counts on the host
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/true);
  at::Tensor offsets = packed_offsets(counts, n.slots);
  auto [loss, inv_count] = loss_cpu(pred, target, packed_slots(target, offsets, n));
  return {loss, inv_count, offsets};
}

at::Tensor giou_loss_backward_cpu(const at::Tensor& grad_output, const at::Tensor& pred, const at::Tensor& target,
                                  const at::Tensor& counts, const at::Tensor& inv_count) {
  const GiouSizes n = check_giou_inputs(pred, target, counts, /*packed=*/false);
  return grad_cpu(grad_output, pred, target, inv_count, padded_slots(target, counts, n));
}

at::Tensor giou_loss_packed_backward_cpu(const at::Tensor& grad_output, const at::Tensor& pred,
                                         const at::Tensor& target, const at::Tensor& offsets,
                                         const at::Tensor& inv_count) {
  const GiouSizes n = check_giou_inputs(pred, target, offsets, /*packed=*/true, "offsets");
  check_packed_offsets(offsets);
  return grad_cpu(grad_output, pred, target, inv_count, packed_slots(target, offsets, n));
}

}  // namespace

// Forward: loss (0-dim, mean over valid boxes) and inv_count (0-dim, 1 / max(n_valid, 1)), both in the
// compute dtype (compute_dtype: fp64 for fp64 pred, else fp32); the packed forward also returns offsets
// (int64 [B], the inclusive prefix sums of the clamped counts). No gradient buffer: backward recomputes the
// gradient from the same pred, target and counts (saved by reference; packed: the offsets in place of the
// counts, so the backward never scans them again) and writes grad_pred, [B, M, 4] contiguous in pred's
// dtype, 0 on padded slots.
//
// block_scan_max_batch (packed forward, CUDA): batches of up to this many images (at most kBlockScanBatchLimit =
// 4096, the shared memory of B int64) get the prefix sums of their counts from every block's own scan of
// all B counts; larger ones from block sums: each block adds up the clamped counts of its own contiguous
// range of images, publishes that sum, and adds up the sums its earlier blocks published (one kernel, no
// scan launch; the backward reads the forward's offsets and never scans). The own-scan forward runs B / 8
// blocks up to one wave, whose scans read blocks x B x 8 B in all (L2 hits after the first block), growing
// as B^2 until the grid is a full wave: 1 MB at B = 1024, 4 MB at 2048, ~16 MB at 4096 with a wave of ~500
// blocks; the block sums read B x 8 B once but wait one L2 round trip for the earlier blocks' sums. The
// default, 2048, is about where the two cost the same: `python -m detector bench kernels` times both paths
// at 1024, 2048 and 4096 images. Tests pass 0 (block sums always) to run both paths at small B.
TORCH_LIBRARY(detector, m) {
  m.set_python_module("detector.kernels.cuda_op");  // where register_fake lives
  m.def("giou_loss(Tensor pred, Tensor target, Tensor counts, bool skip_invalid=False) "
        "-> (Tensor loss, Tensor inv_count)");
  m.def("giou_loss_packed(Tensor pred, Tensor target, Tensor counts, int block_scan_max_batch=2048) "
        "-> (Tensor loss, Tensor inv_count, Tensor offsets)");
  m.def("giou_loss_backward(Tensor grad_output, Tensor pred, Tensor target, Tensor counts, Tensor inv_count) "
        "-> Tensor");
  m.def("giou_loss_packed_backward(Tensor grad_output, Tensor pred, Tensor target, Tensor offsets, "
        "Tensor inv_count) -> Tensor");
}

TORCH_LIBRARY_IMPL(detector, CPU, m) {
  m.impl("giou_loss", &giou_loss_cpu);
  m.impl("giou_loss_packed", &giou_loss_packed_cpu);
  m.impl("giou_loss_backward", &giou_loss_backward_cpu);
  m.impl("giou_loss_packed_backward", &giou_loss_packed_backward_cpu);
}

}  // namespace detector
