// The input checks of the detector::giou_loss ops, in one place for the CPU (giou_op.cpp) and CUDA
// (giou_cuda.cpp) implementations: TORCH_CHECK errors that name the argument. Count values are never
// checked (on CUDA that would synchronise): both kernels clamp them to [0, M].
// Messages carry numbers as strings made by std::to_string, never streamed: with torch 2.11 and the
// extension built against it, streaming an integer or sizes() into the message's ostringstream crashed
// the process (SIGSEGV in libstdc++'s number formatting), while streamed strings and dtype names were fine.
#include <ATen/ATen.h>

#include <initializer_list>
#include <string>

#include "giou_dtypes.h"
#include "giou_op.h"

namespace detector {

namespace {

std::string str(int64_t value) { return std::to_string(value); }

std::string str(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

// "a, b or c" from the names of a dtype list of giou_dtypes.h.
std::string join(std::initializer_list<const char*> names) {
  std::string out;
  size_t k = 0;
  for (const char* name : names) {
    out += (k == 0 ? "" : (k + 1 == names.size() ? " or " : ", ")) + std::string(name);
    ++k;
  }
  return out;
}

#define DETECTOR_CASE_TRUE(Name, AtName, Type, str) \
  case at::ScalarType::AtName:                       \
    return true;

bool is_pred_dtype(at::ScalarType t) {
  switch (t) {
    DETECTOR_PRED_DTYPES(DETECTOR_CASE_TRUE)
    default: return false;
  }
}

bool is_target_dtype(at::ScalarType t) {
  switch (t) {
    DETECTOR_TARGET_DTYPES(DETECTOR_CASE_TRUE)
    default: return false;
  }
}

bool is_counts_dtype(at::ScalarType t) {
  switch (t) {
    DETECTOR_COUNTS_DTYPES(DETECTOR_CASE_TRUE)
    default: return false;
  }
}

const std::string kPredDtypes = join({DETECTOR_PRED_DTYPES(DETECTOR_DTYPE_NAME)});
const std::string kTargetDtypes = join({DETECTOR_TARGET_DTYPES(DETECTOR_DTYPE_NAME)});
const std::string kCountsDtypes = join({DETECTOR_COUNTS_DTYPES(DETECTOR_DTYPE_NAME)});

}  // namespace

at::ScalarType compute_dtype(at::ScalarType pred) { return pred == at::kDouble ? at::kDouble : at::kFloat; }

GiouSizes check_giou_inputs(const at::Tensor& pred, const at::Tensor& target, const at::Tensor& counts,
                            bool packed, const char* counts_name) {
  TORCH_CHECK(pred.dim() == 3 && pred.size(2) == 4, "pred must have shape [B, M, 4], got ", str(pred.sizes()));
  TORCH_CHECK_TYPE(is_pred_dtype(pred.scalar_type()), "pred must be ", kPredDtypes, ", got ",
                   pred.scalar_type());
  const int64_t batch = pred.size(0), slots = pred.size(1);
  if (packed) {
    TORCH_CHECK(target.dim() == 2 && target.size(1) == 4, "target must have shape [N, 4] (packed boxes), got ",
                      str(target.sizes()));
  } else {
    TORCH_CHECK(target.sizes() == pred.sizes(), "target must have shape [B, M, 4] = ", str(pred.sizes()),
                      " like pred, got ", str(target.sizes()));
  }
  TORCH_CHECK_TYPE(is_target_dtype(target.scalar_type()),
                   "target must be ", kTargetDtypes, ", got ", target.scalar_type());
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == batch, counts_name, " must have shape [B] = [", str(batch),
              "] (the batch of pred), got ", str(counts.sizes()));
  TORCH_CHECK_TYPE(is_counts_dtype(counts.scalar_type()), counts_name, " must be ", kCountsDtypes, ", got ",
                   counts.scalar_type());
  TORCH_CHECK(pred.device() == target.device() && pred.device() == counts.device(), "pred, target and ",
              counts_name, " must be on one device, got ", pred.device(), ", ", target.device(), ", ",
              counts.device());
  return {batch, slots, packed ? target.size(0) : batch * slots};
}

void check_giou_backward_inputs(const at::Tensor& grad_output, const at::Tensor& pred, const at::Tensor& inv_count) {
  const at::ScalarType scalar = compute_dtype(pred.scalar_type());
  TORCH_CHECK(grad_output.dim() == 0, "grad_output must be a 0-dim tensor, got ", str(grad_output.sizes()));
  TORCH_CHECK_TYPE(grad_output.scalar_type() == scalar, "grad_output must be ", scalar, " (the loss's dtype for ",
                   pred.scalar_type(), " pred), got ", grad_output.scalar_type());
  TORCH_CHECK(inv_count.dim() == 0, "inv_count must be a 0-dim tensor, got ", str(inv_count.sizes()));
  TORCH_CHECK_TYPE(inv_count.scalar_type() == scalar, "inv_count must be ", scalar, ", got ",
                   inv_count.scalar_type());
  TORCH_CHECK(grad_output.device() == pred.device() && inv_count.device() == pred.device(),
              "grad_output and inv_count must be on pred's device ", pred.device(), ", got ", grad_output.device(),
              ", ", inv_count.device());
}

void check_packed_offsets(const at::Tensor& offsets) {
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kLong, "offsets must be int64 (the third output of "
                   "giou_loss_packed: the inclusive prefix sums of the clamped counts), got ", offsets.scalar_type());
}

void check_block_scan_max_batch(int64_t block_scan_max_batch) {
  TORCH_CHECK(block_scan_max_batch >= 0, "block_scan_max_batch must be >= 0, got ", str(block_scan_max_batch));
}

}  // namespace detector
