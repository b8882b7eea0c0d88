// GIoU loss CUDA kernels and their launchers (see giou_kernels.cuh for the contract).
//
// Forward, one kernel per call: each thread takes one box pair per grid-stride step, loads pred and
// target in their own dtypes (one vector load per box when the layout allows), computes the loss and
// its gradient in the compute type (fp32, or fp64 for fp64 predictions: giou.h), stores the gradient in pred's dtype and accumulates its loss and
// valid count in registers. Blocks then reduce, write one partial each, and the last block to take a
// ticket adds the partials in block order and writes loss and 1 / max(n_valid, 1).
#include "giou.h"
#include "giou_kernels.cuh"

#include <cub/device/device_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <atomic>
#include <type_traits>

namespace detector {
namespace {

constexpr int kThreads = 256;      // threads per block
constexpr int kMaxBlocks = 16384;  // capacity of the workspace; grids are capped to it

struct Workspace {
  unsigned int ticket;                // zeroed before each launch; the last block takes kBlocks - 1
  unsigned int pad[3];
  double loss[kMaxBlocks];            // per-block sums of the per-box losses
  unsigned int valid[kMaxBlocks];     // per-block numbers of valid boxes
};

// ----------------------------------------------------------------------------- loads and stores

using half_t = __half;  // the 16-bit element types of giou_dtypes.h's lists, on the device
using bfloat16_t = __nv_bfloat16;

// An element of dtype T as the compute type C (float or double).
template <typename C, typename T>
__device__ __forceinline__ C to_compute(T v) {
  if constexpr (std::is_same_v<T, __half>) return static_cast<C>(__half2float(v));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return static_cast<C>(__bfloat162float(v));
  else return static_cast<C>(v);
}

// A compute-type value stored as P, rounded to nearest (16-bit P always comes with C = float).
template <typename P, typename C>
__device__ __forceinline__ P from_compute(C v) {
  if constexpr (std::is_same_v<P, __half>) return __float2half_rn(v);
  else if constexpr (std::is_same_v<P, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return static_cast<P>(v);
}

// Four coordinates of one box in one load (16 B for fp32, 8 B for bf16, 4 B for uint8; 32 B, two loads,
// for fp64 and int64).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T v[4];
};

// Coordinates of the box at `row` in the compute type C; `vec`: contiguous and aligned, so one vector load.
template <typename C, typename T>
__device__ __forceinline__ void load_box(const T* __restrict__ row, int64_t stride_c, bool vec, C out[4]) {
  if (vec) {
    const Vec4<T> v = *reinterpret_cast<const Vec4<T>*>(row);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_compute<C>(v.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_compute<C>(row[k * stride_c]);
  }
}

template <typename P, typename C>
__device__ __forceinline__ void store_box(P* __restrict__ row, const C g[4]) {
  Vec4<P> v;
#pragma unroll
  for (int k = 0; k < 4; ++k) v.v[k] = from_compute<P>(g[k]);
  *reinterpret_cast<Vec4<P>*>(row) = v;
}

#define DETECTOR_LOAD_COUNT(Name, AtName, Type, str)                                \
  case DType::k##Name:                                                              \
    c = static_cast<int64_t>(static_cast<const Type*>(counts.data)[b * counts.stride]); \
    break;

// counts[b] clamped to [0, slots]: the device never validates counts (that would synchronise).
// The launchers accept only DETECTOR_COUNTS_DTYPES, so the switch is uniform across the grid.
__device__ __forceinline__ int64_t load_count(const CountsArg& counts, int64_t b, int64_t slots) {
  int64_t c = 0;
  switch (counts.dtype) {
    DETECTOR_COUNTS_DTYPES(DETECTOR_LOAD_COUNT)
    default: break;
  }
  return c < 0 ? 0 : (c > slots ? slots : c);
}

// counts[b] clamped, as the input of the prefix-sum scan (thrust::transform_iterator over b = 0, 1, ...).
struct ClampedCount {
  CountsArg counts;
  int64_t slots;
  __device__ int64_t operator()(int64_t b) const { return load_count(counts, b, slots); }
};

// ----------------------------------------------------------------------------- block reductions

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, valid in thread 0. `scratch` holds kThreads / 32 values.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // a previous use of scratch is finished
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? scratch[threadIdx.x] : T(0);
  if (warp == 0) v = warp_sum(v);
  return v;
}

// Block partials, then the last block (by atomic ticket) adds them in block order: deterministic. Partials
// and the total are double (as the CPU kernel's chunk partials); loss and 1 / max(n, 1) are rounded once to C.
template <typename C>
__device__ void finish_loss(double loss_acc, unsigned int valid_acc, Workspace* ws, C* loss, C* inv_count) {
  __shared__ double s_loss[kThreads / 32];
  __shared__ unsigned int s_valid[kThreads / 32];
  __shared__ unsigned long long s_total[kThreads / 32];
  __shared__ bool s_last;
  const double block_loss = block_sum(loss_acc, s_loss);
  const unsigned int block_valid = block_sum(valid_acc, s_valid);
  if (threadIdx.x == 0) {
    ws->loss[blockIdx.x] = block_loss;
    ws->valid[blockIdx.x] = block_valid;
    __threadfence();  // the partials are visible to every block before the ticket is
    s_last = atomicAdd(&ws->ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  double total = 0.0;
  unsigned long long n_valid = 0;
  for (int k = threadIdx.x; k < gridDim.x; k += kThreads) {
    total += __ldcg(&ws->loss[k]);  // L2, not a possibly stale L1 line
    n_valid += __ldcg(&ws->valid[k]);
  }
  total = block_sum(total, s_loss);
  n_valid = block_sum(n_valid, s_total);
  if (threadIdx.x == 0) {
    const double denominator = n_valid > 0 ? static_cast<double>(n_valid) : 1.0;
    *loss = static_cast<C>(total / denominator);
    *inv_count = static_cast<C>(1.0 / denominator);
  }
}

// ----------------------------------------------------------------------------- kernels

struct BoxAccess {
  int64_t stride_b, stride_m, stride_c;
  bool vec;
};

// Padded layout: one thread per slot (b, j) of the [B, M] grid, grid-stride, kItems slots per step
// (all their loads issued before any arithmetic, so more bytes are in flight). kContig: pred and target
// are contiguous [B, M, 4] and aligned, so slot s is at s * 4 (fewer registers than general strides).
template <typename P, typename T, bool kSkipInvalid, bool kContig>
__global__ void __launch_bounds__(kThreads)
    giou_padded_kernel(const P* __restrict__ pred,      // [B, M, 4] xyxy, strided
                       BoxAccess pred_at,               //
                       const T* __restrict__ target,    // [B, M, 4] xyxy, strided
                       BoxAccess target_at,             //
                       CountsArg counts,                // [B] integer
                       int64_t batch,                   // B
                       int64_t slots,                   // M
                       P* __restrict__ grad_sum,        // [B, M, 4] contiguous, out
                       compute_t<P>* loss,              // 0-dim, out
                       compute_t<P>* inv_count,         // 0-dim, out
                       Workspace* ws) {
  using C = compute_t<P>;
  // 16-bit pred moves half the bytes per box for the same instructions (bf16 reached 34% of copy
  // bandwidth against fp32's 61%): twice the boxes per step keep as many bytes in flight.
  constexpr int kItems = sizeof(P) == 2 ? 4 : 2;
  const int64_t total = batch * slots;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const bool narrow = total <= 0xffffffffLL;  // 32-bit division is several times cheaper than 64-bit
  C loss_acc = 0;
  unsigned int valid_acc = 0;
  for (int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x; first < total; first += kItems * stride) {
    C p[kItems][4], t[kItems][4];
    bool valid[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t s = first + k * stride;
      valid[k] = false;
      if (s >= total) continue;
      int64_t b, j;
      if (narrow) {
        const uint32_t su = uint32_t(s), m = uint32_t(slots), bu = su / m;
        b = bu;
        j = su - bu * m;
      } else {
        b = s / slots;
        j = s - b * slots;
      }
      valid[k] = j < load_count(counts, b, slots);
      if (kSkipInvalid && !valid[k]) continue;
      if (kContig) {
        load_box(pred + s * 4, 1, true, p[k]);
        load_box(target + s * 4, 1, true, t[k]);
      } else {
        load_box(pred + b * pred_at.stride_b + j * pred_at.stride_m, pred_at.stride_c, pred_at.vec, p[k]);
        load_box(target + b * target_at.stride_b + j * target_at.stride_m, target_at.stride_c, target_at.vec, t[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t s = first + k * stride;
      if (s >= total) continue;
      C g[4] = {0, 0, 0, 0};
      if (!kSkipInvalid || valid[k]) {
        C gv[4];
        const C l = giou_loss_and_grad(p[k], t[k], gv);
        // Select, never multiply: a NaN in a padded slot must not reach the loss or the gradient.
        loss_acc += valid[k] ? l : C(0);
#pragma unroll
        for (int c = 0; c < 4; ++c) g[c] = valid[k] ? gv[c] : C(0);
      }
      valid_acc += valid[k] ? 1u : 0u;
      store_box(grad_sum + s * 4, g);
    }
  }
  finish_loss(loss_acc, valid_acc, ws, loss, inv_count);
}

// The image of packed box i: the first b with incl[b] > i, incl the inclusive prefix sums of the clamped
// counts (i < incl[B - 1], so b < B). Consecutive threads search for consecutive boxes: the same cache lines.
__device__ __forceinline__ int64_t image_of(const int64_t* __restrict__ incl, int64_t batch, int64_t i) {
  int64_t lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (__ldg(incl + mid) > i) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Packed layout: a grid-stride loop over the rows = min(N, incl[B - 1]) target boxes present (rows past
// the counts' sum are ignored, none past N is read); box i finds its image b by a binary search over the
// prefix sums (computed once, by the scan before this kernel) and its slot j = i - incl[b - 1].
template <typename P, typename T>
__global__ void __launch_bounds__(kThreads)
    giou_packed_kernel(const P* __restrict__ pred,        // [B, M, 4] xyxy, strided
                       BoxAccess pred_at,                 //
                       const T* __restrict__ target,      // [N, 4] xyxy, strided (stride_m unused)
                       BoxAccess target_at,               //
                       int64_t num_boxes,                 // N
                       const int64_t* __restrict__ incl,  // [B] inclusive prefix sums of the clamped counts
                       int64_t batch,                     // B
                       int64_t slots,                     // M
                       P* __restrict__ grad_sum,          // [B, M, 4] contiguous, zeroed, out
                       compute_t<P>* loss,                // 0-dim, out
                       compute_t<P>* inv_count,           // 0-dim, out
                       Workspace* ws) {
  using C = compute_t<P>;
  const int64_t total = batch > 0 ? incl[batch - 1] : 0;
  const int64_t rows = num_boxes < total ? num_boxes : total;
  C loss_acc = 0;
  unsigned int valid_acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < rows; i += int64_t(gridDim.x) * kThreads) {
    const int64_t b = image_of(incl, batch, i);
    const int64_t j = i - (b > 0 ? __ldg(incl + b - 1) : 0);
    C p[4], t[4], g[4];
    load_box(pred + b * pred_at.stride_b + j * pred_at.stride_m, pred_at.stride_c, pred_at.vec, p);
    load_box(target + i * target_at.stride_b, target_at.stride_c, target_at.vec, t);
    loss_acc += giou_loss_and_grad(p, t, g);
    valid_acc += 1u;
    store_box(grad_sum + (b * slots + j) * 4, g);
  }
  finish_loss(loss_acc, valid_acc, ws, loss, inv_count);
}

// grad_pred = grad_sum * (grad_output * inv_count), one box (4 values) per thread and step.
template <typename P>
__global__ void __launch_bounds__(kThreads)
    giou_backward_kernel(const compute_t<P>* grad_output,  // 0-dim
                         const P* __restrict__ grad_sum,   // [rows, 4] contiguous
                         const compute_t<P>* inv_count,    // 0-dim
                         int64_t rows,                     //
                         bool vec,                         // both buffers 4-element aligned
                         P* __restrict__ grad_pred) {      // [rows, 4] contiguous, out
  using C = compute_t<P>;
  const C scale = grad_output[0] * inv_count[0];
  for (int64_t r = int64_t(blockIdx.x) * kThreads + threadIdx.x; r < rows; r += int64_t(gridDim.x) * kThreads) {
    C g[4];
    load_box(grad_sum + r * 4, 1, vec, g);
#pragma unroll
    for (int k = 0; k < 4; ++k) g[k] *= scale;
    if (vec) {
      store_box(grad_pred + r * 4, g);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) grad_pred[r * 4 + k] = from_compute<P>(g[k]);
    }
  }
}

// ----------------------------------------------------------------------------- host side

int multiprocessors() {
  static std::atomic<int> cache[64];  // per device; static storage starts zeroed
  int device = 0;
  cudaGetDevice(&device);
  int count = device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (count == 0) {
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    if (count <= 0) count = 1;
    if (device < 64) cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

template <typename T>
BoxAccess box_access(const BoxesArg& boxes) {
  // One vector load per box needs the 4 coordinates contiguous and the box aligned to 4 elements.
  const bool vec = boxes.stride_c == 1 && boxes.stride_m % 4 == 0 && boxes.stride_b % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(boxes.data) % (4 * sizeof(T)) == 0;
  return {boxes.stride_b, boxes.stride_m, boxes.stride_c, vec};
}

// Blocks of `Kernel` resident on one SM (registers decide), queried once per kernel.
template <auto Kernel>
int blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, 0);
    return b > 0 ? b : 1;
  }();
  return blocks;
}

// Enough blocks to fill the GPU once (grid-stride beyond), at least one so the loss is always written.
template <auto Kernel>
int grid_for(int64_t items) {
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  int64_t cap = int64_t(multiprocessors()) * blocks_per_sm<Kernel>();
  if (cap > kMaxBlocks) cap = kMaxBlocks;
  return int(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

template <typename P, typename T, bool kSkipInvalid, bool kContig>
void launch_padded(const BoxesArg& pred, const BoxesArg& target, const CountsArg& counts, int64_t batch,
                   int64_t slots, const GiouOutputs& out, cudaStream_t stream) {
  constexpr auto kernel = giou_padded_kernel<P, T, kSkipInvalid, kContig>;
  kernel<<<grid_for<kernel>(batch * slots), kThreads, 0, stream>>>(
      static_cast<const P*>(pred.data), box_access<P>(pred), static_cast<const T*>(target.data),
      box_access<T>(target), counts, batch, slots, static_cast<P*>(out.grad_sum),
      static_cast<compute_t<P>*>(out.loss), static_cast<compute_t<P>*>(out.inv_count),
      static_cast<Workspace*>(out.workspace));
}

// Contiguous [B, M, 4] and aligned for one vector load per box.
template <typename T>
bool contiguous_boxes(const BoxesArg& boxes, int64_t slots) {
  return box_access<T>(boxes).vec && boxes.stride_m == 4 && boxes.stride_b == 4 * slots;
}

// body(Tag<P>{}) for the element type P of a pred dtype and true; false (and no call) for other dtypes.
template <typename Body>
bool dispatch_pred(DType dtype, Body&& body) {
  const auto f = [&](auto tag) { return body(tag), true; };
  switch (dtype) {
    DETECTOR_PRED_DTYPES(DETECTOR_CASE_DTYPE)
    default: return false;
  }
}

template <typename Body>
bool dispatch_target(DType dtype, Body&& body) {
  const auto f = [&](auto tag) { return body(tag), true; };
  switch (dtype) {
    DETECTOR_TARGET_DTYPES(DETECTOR_CASE_DTYPE)
    default: return false;
  }
}

#define DETECTOR_CASE_TRUE(Name, AtName, Type, str) \
  case DType::k##Name:                              \
    return true;

bool valid_counts(const CountsArg& counts) {
  switch (counts.dtype) {
    DETECTOR_COUNTS_DTYPES(DETECTOR_CASE_TRUE)
    default: return false;
  }
}

thrust::transform_iterator<ClampedCount, thrust::counting_iterator<int64_t>> clamped_counts(const CountsArg& counts,
                                                                                           int64_t slots) {
  return thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), ClampedCount{counts, slots});
}

constexpr size_t kAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The packed launcher's part of the workspace, after the Workspace struct: the prefix sums [B], then
// CUB's scan state (its size is a host-side query: no launch, no synchronisation).
struct PackedLayout {
  size_t incl_offset, scan_offset, scan_bytes;
};

// CUB's scan state for `batch` counts on the current device; the last answer is kept (one query per
// new batch size, not two per step).
size_t scan_bytes(int64_t batch) {
  thread_local int last_device = -1;
  thread_local int64_t last_batch = -1;
  thread_local size_t last_bytes = 0;
  int device = 0;
  cudaGetDevice(&device);
  if (device != last_device || batch != last_batch) {
    last_bytes = 0;
    cub::DeviceScan::InclusiveSum(nullptr, last_bytes, clamped_counts({}, 0), static_cast<int64_t*>(nullptr),
                                  int(batch));
    last_device = device;
    last_batch = batch;
  }
  return last_bytes;
}

PackedLayout packed_layout(int64_t batch) {
  const size_t scan_bytes_ = batch > 0 ? scan_bytes(batch) : 0;
  const size_t incl_offset = align_up(sizeof(Workspace));
  return {incl_offset, incl_offset + align_up(size_t(batch) * sizeof(int64_t)), scan_bytes_};
}

}  // namespace

size_t giou_workspace_bytes(int64_t batch) {
  if (batch <= 0) return sizeof(Workspace);
  const PackedLayout layout = packed_layout(batch);
  return layout.scan_offset + layout.scan_bytes;
}

cudaError_t giou_loss_padded_launch(BoxesArg pred, BoxesArg target, CountsArg counts, int64_t batch,
                                    int64_t slots, bool skip_invalid, GiouOutputs out, cudaStream_t stream) {
  if (!valid_counts(counts)) return cudaErrorInvalidValue;
  auto* ws = static_cast<Workspace*>(out.workspace);
  cudaError_t err = cudaMemsetAsync(&ws->ticket, 0, sizeof(ws->ticket), stream);
  if (err != cudaSuccess) return err;
  bool dtypes_ok = false;
  dispatch_pred(pred.dtype, [&](auto p_tag) {
    using P = typename decltype(p_tag)::type;
    dtypes_ok = dispatch_target(target.dtype, [&](auto t_tag) {
      using T = typename decltype(t_tag)::type;
      const bool contig = contiguous_boxes<P>(pred, slots) && contiguous_boxes<T>(target, slots);
      if (skip_invalid) {
        contig ? launch_padded<P, T, true, true>(pred, target, counts, batch, slots, out, stream)
               : launch_padded<P, T, true, false>(pred, target, counts, batch, slots, out, stream);
      } else {
        contig ? launch_padded<P, T, false, true>(pred, target, counts, batch, slots, out, stream)
               : launch_padded<P, T, false, false>(pred, target, counts, batch, slots, out, stream);
      }
    });
  });
  return dtypes_ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t giou_loss_packed_launch(BoxesArg pred, BoxesArg target, int64_t num_boxes, CountsArg counts,
                                    int64_t batch, int64_t slots, GiouOutputs out, cudaStream_t stream) {
  if (!valid_counts(counts)) return cudaErrorInvalidValue;
  auto* ws = static_cast<Workspace*>(out.workspace);
  cudaError_t err = cudaMemsetAsync(&ws->ticket, 0, sizeof(ws->ticket), stream);
  const PackedLayout layout = packed_layout(batch);
  auto* incl = reinterpret_cast<int64_t*>(static_cast<char*>(out.workspace) + layout.incl_offset);
  if (err == cudaSuccess && batch > 0) {  // the prefix sums, once: a single-pass device scan, no host sync
    size_t scan_bytes = layout.scan_bytes;
    err = cub::DeviceScan::InclusiveSum(static_cast<char*>(out.workspace) + layout.scan_offset, scan_bytes,
                                        clamped_counts(counts, slots), incl, int(batch), stream);
  }
  if (err != cudaSuccess) return err;
  bool dtypes_ok = false;
  dispatch_pred(pred.dtype, [&](auto p_tag) {
    using P = typename decltype(p_tag)::type;
    const size_t grad_bytes = size_t(batch) * size_t(slots) * 4 * sizeof(P);
    if (grad_bytes > 0) err = cudaMemsetAsync(out.grad_sum, 0, grad_bytes, stream);  // padded slots stay 0
    if (err != cudaSuccess) return;
    dtypes_ok = dispatch_target(target.dtype, [&](auto t_tag) {
      using T = typename decltype(t_tag)::type;
      constexpr auto kernel = giou_packed_kernel<P, T>;
      BoxesArg rows = target;
      rows.stride_m = 4;  // [N, 4] has no slot dimension: the row stride alone decides alignment
      kernel<<<grid_for<kernel>(num_boxes), kThreads, 0, stream>>>(
          static_cast<const P*>(pred.data), box_access<P>(pred), static_cast<const T*>(target.data),
          box_access<T>(rows), num_boxes, incl, batch, slots, static_cast<P*>(out.grad_sum),
          static_cast<compute_t<P>*>(out.loss), static_cast<compute_t<P>*>(out.inv_count), ws);
    });
  });
  if (err != cudaSuccess) return err;
  return dtypes_ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t giou_loss_backward_launch(const void* grad_output, const void* grad_sum, const void* inv_count,
                                      DType dtype, int64_t numel, void* grad_pred, cudaStream_t stream) {
  const int64_t rows = numel / 4;
  const bool dtypes_ok = dispatch_pred(dtype, [&](auto p_tag) {
    using P = typename decltype(p_tag)::type;
    constexpr auto kernel = giou_backward_kernel<P>;
    const bool vec = reinterpret_cast<uintptr_t>(grad_sum) % (4 * sizeof(P)) == 0 &&
                     reinterpret_cast<uintptr_t>(grad_pred) % (4 * sizeof(P)) == 0;
    using C = compute_t<P>;
    kernel<<<grid_for<kernel>(rows), kThreads, 0, stream>>>(static_cast<const C*>(grad_output),
                                                            static_cast<const P*>(grad_sum),
                                                            static_cast<const C*>(inv_count), rows, vec,
                                                            static_cast<P*>(grad_pred));
  });
  return dtypes_ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace detector
