// GIoU loss CUDA kernels and their launchers (see giou_kernels.cuh for the contract).
//
// One forward kernel (loss only) and one backward kernel, each for both layouts. Warps take runs of up to
// 32 images (a grid-stride loop over b; lane l reads the count of the run's l-th image up front, one load
// latency for 32 images). Two ways to cover a run, each where it pays (`python -m detector bench kernels`):
//   - a lane per valid box (for_run_boxes): the run's valid boxes numbered image after image, lane l taking
//     boxes l, l + 32, ... and finding its image by a binary search over the run's prefix sums in the
//     lanes. The forwards that skip padded slots (cuda_conditional, packed) and the backward's valid boxes:
//     every lane works while there are boxes, and the run's loads are issued together, where a warp per
//     image left most lanes idle (a few boxes per image) and waited one load latency per image.
//   - a warp per image (for_warp_images), lane l taking the K consecutive slots j0 = l * K + 32 * K * i:
//     for 16-bit predictions two boxes, one 16-byte vector of pred (kLaneBoxes). The forward that reads
//     every slot (cuda_fused), and the backward's zeros (stores only, nothing read, 16 bytes at a time).
// Forward: per-box loss in the compute type (fp32, or fp64 for fp64 predictions: giou.h), accumulated in
// registers; block partials, then the last block to take a ticket adds them in block order and writes
// loss and 1 / max(n_valid, 1). Backward: zeros in every padded slot, then the gradient recomputed from
// pred and target for the valid slots, scaled by grad_output * inv_count; no slot is written twice.
// Packed layout: the same kernels, slot j of image b taking target row C[b] + j. In the forward C, the
// prefix sums of the clamped counts, comes from every block's own scan in shared memory (small batches: no
// second launch) or from block sums in giou_loss_packed_kernel (large batches), and is written out (`offsets`);
// the backward reads it from there and never scans.
#include "giou.h"
#include "giou_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <type_traits>

namespace detector {
namespace {

constexpr int kThreads = 256;      // threads per block
constexpr int kMaxBlocks = 16384;  // capacity of the workspace; grids are capped to it
constexpr size_t kScanSharedBytes = kBlockScanBatchLimit * sizeof(int64_t);

// A block's published sum of counts (packed forward): this bit set, the sum in the others; 0 until then.
constexpr unsigned long long kPublished = 1ull << 63;

struct Workspace {
  unsigned int ticket;                      // zeroed before each forward; the last block takes kBlocks - 1
  unsigned int pad[3];
  unsigned long long block_sums[kMaxBlocks];  // packed forward: kPublished | each block's count sum; zeroed
  double loss[kMaxBlocks];                  // per-block sums of the per-box losses
  unsigned int valid[kMaxBlocks];           // per-block numbers of valid boxes
};

// The bytes a forward zeroes before its kernel: the ticket, and the sums of `blocks` blocks (packed).
size_t zeroed_bytes(int blocks) { return offsetof(Workspace, block_sums) + size_t(blocks) * sizeof(unsigned long long); }

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

// N elements loaded or stored as whole 16-byte vectors (N * sizeof(T) is a multiple of 16).
template <typename T, int N>
struct alignas(16) Pack {
  static_assert(N * sizeof(T) % 16 == 0, "a Pack is whole 16-byte vectors");
  T v[N];
};

// One box's four coordinates as stored: one load of 4 B (uint8), 8 B (bf16) or 16 B (fp32); 16-byte
// aligned at most, so fp64 and int64 boxes are two 16-byte loads.
template <typename T>
struct alignas(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16) Vec4 {
  T v[4];
};

// How to find a box: element strides, and whether its 4 coordinates are one aligned Vec4.
// Packed target rows use stride_b as the row stride and stride_m = 0.
struct BoxAccess {
  int64_t stride_b, stride_m, stride_c;
  bool vec;
};

template <typename T>
__device__ __forceinline__ Vec4<T> load_box(const T* __restrict__ box, int64_t stride_c, bool vec) {
  if (vec) return *reinterpret_cast<const Vec4<T>*>(box);
  Vec4<T> v;
#pragma unroll
  for (int k = 0; k < 4; ++k) v.v[k] = box[k * stride_c];
  return v;
}

// A stored box in the compute type C. Boxes stay in their stored dtype until used: fewer registers.
template <typename C, typename T>
__device__ __forceinline__ void to_compute(const Vec4<T>& box, C out[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_compute<C>(box.v[k]);
}

// A count clamped to [0, slots]: the device never validates counts (that would synchronise).
__device__ __forceinline__ int64_t clamp_count(int64_t c, int64_t slots) { return c < 0 ? 0 : (c > slots ? slots : c); }

#define DETECTOR_TYPED_COUNTS(Name, AtName, Type, str) \
  case DType::k##Name:                                 \
    f(static_cast<const Type*>(counts.data));          \
    break;

// f(data): the counts as a pointer to their element type, for loops whose loads must not wait on a switch
// per count (DETECTOR_COUNTS_DTYPES; uniform across the grid).
template <typename F>
__device__ __forceinline__ void with_typed_counts(const CountsArg& counts, F&& f) {
  switch (counts.dtype) {
    DETECTOR_COUNTS_DTYPES(DETECTOR_TYPED_COUNTS)
    default: break;
  }
}

// counts[b] clamped to [0, slots].
__device__ __forceinline__ int64_t load_count(const CountsArg& counts, int64_t b, int64_t slots) {
  int64_t c = 0;
  with_typed_counts(counts, [&](const auto* data) { c = static_cast<int64_t>(data[b * counts.stride]); });
  return clamp_count(c, slots);
}

// ----------------------------------------------------------------------------- block reductions and scans

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Lane l gets x of lanes 0 .. l added up (an inclusive scan over the warp; every lane calls it).
__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
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

// incl[b] = clamped counts[0] + ... + counts[b] for b < batch <= kBlockScanBatchLimit, into shared memory,
// by every block on its own (no second launch). Warp w takes the w-th eighth of the batch: it adds up its
// counts, the warps' sums give each warp the counts before its part, then the warp scans its part 32
// counts at a time (a shuffle scan and a carry) and writes the sums. Lanes read consecutive counts, so
// each load is one coalesced access (L2 hits after the first block; the second pass hits L1). A thread
// per run of consecutive counts would have its lanes read 32 lines per load, and the blocks x B loads of
// a large batch would take the L1's time.
__device__ void block_inclusive_scan(const CountsArg& counts, int64_t batch, int64_t slots, int64_t* incl) {
  __shared__ int64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t per_warp = (batch + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t begin = warp * per_warp < batch ? warp * per_warp : batch;
  const int64_t end = begin + per_warp < batch ? begin + per_warp : batch;
  int64_t sum = 0;
  with_typed_counts(counts, [&](const auto* data) {
#pragma unroll 4
    for (int64_t b = begin + lane; b < end; b += 32) sum += clamp_count(int64_t(data[b * counts.stride]), slots);
  });
  sum = warp_sum(sum);
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  int64_t carry = 0;  // the counts before this warp's part
  for (int w = 0; w < warp; ++w) carry += warp_sums[w];
  with_typed_counts(counts, [&](const auto* data) {
    for (int64_t b0 = begin; b0 < end; b0 += 32) {
      const int64_t b = b0 + lane;
      const int64_t x = warp_inclusive_sum(b < end ? clamp_count(int64_t(data[b * counts.stride]), slots) : 0);
      if (b < end) incl[b] = carry + x;
      carry += __shfl_sync(0xffffffffu, x, 31);
    }
  });
  __syncthreads();
}

// ----------------------------------------------------------------------------- images and chunks

// Image b's valid slots: count, and (packed) the target row of its slot 0.
struct Image {
  int64_t count, first_row;
};

// Padded layout: the count read from counts[b], clamped.
struct PaddedImages {
  CountsArg counts;
  int64_t slots;
  __device__ Image operator()(int64_t b) const { return {load_count(counts, b, slots), 0}; }
};

// Packed layout: from the inclusive prefix sums of the clamped counts (shared or global memory); boxes that
// would lie at or past row `rows` are absent. The sums are clamped as they are read: an image's rows lie
// within [0, rows) and number at most `slots`, whatever the sums hold (the backward's are an argument).
struct PackedImages {
  const int64_t* incl;
  int64_t rows, slots;
  __device__ Image operator()(int64_t b) const { return clamped(b > 0 ? incl[b - 1] : 0, incl[b]); }
  // The image whose rows are [before, end) as the sums say, clamped.
  __device__ Image clamped(int64_t before, int64_t end) const {
    const int64_t first = before < 0 ? 0 : (before > rows ? rows : before);
    const int64_t room = rows - first < slots ? rows - first : slots;
    const int64_t present = end - first;
    return {present < 0 ? 0 : (present > room ? room : present), first};
  }
};

// ----------------------------------------------------------------------------- warps over images

// Every kernel below gives each warp runs of whole images (a grid-stride loop over b), so a count is read
// once per warp and image and never divided for. Where a warp covers an image slot by slot, lane l takes
// the kLaneBoxes consecutive slots j0 = l * K + 32 * K * i: for 16-bit predictions two boxes, one 16-byte
// vector.
template <typename P>
constexpr int kLaneBoxes = sizeof(P) == 2 ? 2 : 1;

// A lane's K slots j0 .. j0 + K - 1 of one image: which exist and which are valid.
template <int K>
struct Lane {
  bool in[K];     // j < M
  bool valid[K];  // j < the image's count (implies in)
  bool all_in;
};

template <int K>
__device__ __forceinline__ Lane<K> lane_at(int64_t j0, int64_t slots, int64_t count) {
  Lane<K> l;
  l.all_in = true;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    l.in[k] = j0 + k < slots;
    l.valid[k] = j0 + k < count;
    l.all_in = l.all_in && l.in[k];
  }
  return l;
}

// run_body(first, stride, n, mine) for each run of up to 32 images of this warp: images b = first + i * stride
// for i < n (a grid-stride loop over b, W warps in the grid: stride W). Lane l holds `mine`, the count (and
// packed: first row) of the run's l-th image, read up front: 32 images cost one load latency, not 32.
template <typename Images, typename RunBody>
__device__ __forceinline__ void for_warp_image_runs(int64_t batch, const Images& images, RunBody&& run_body) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t first = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; first < batch; first += 32 * warps) {
    const int64_t left = (batch - first + warps - 1) / warps;
    const int n = left < 32 ? int(left) : 32;
    run_body(first, warps, n, lane < n ? images(first + lane * warps) : Image{0, 0});
  }
}

// body(b, image) for the images of this warp, one after another, given to the whole warp. The same loop as
// for_warp_image_runs, written out: built on it (a run body shuffling each image out), cuda_fused's fp32
// forward takes more registers and runs measurably slower.
template <typename Images, typename Body>
__device__ __forceinline__ void for_warp_images(int64_t batch, const Images& images, Body&& body) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t first = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; first < batch; first += 32 * warps) {
    const int64_t mine = first + lane * warps;
    const Image my_image = mine < batch ? images(mine) : Image{0, 0};
    for (int i = 0; i < 32 && first + i * warps < batch; ++i) {
      const Image image{__shfl_sync(0xffffffffu, my_image.count, i), __shfl_sync(0xffffffffu, my_image.first_row, i)};
      body(first + i * warps, image);
    }
  }
}

// body(b, j, first_row) for every valid box of a run (slot j < count of image b; first_row: the image's
// packed row 0), one box per lane: the run's boxes are numbered image after image, lane l takes boxes l,
// l + 32, ..., and finds its box's image by a binary search over the run's prefix sums, one per lane. So
// every lane works while there are boxes, and a run's loads are issued together: most images hold a few
// boxes, and a warp per image would leave most lanes idle and wait one load latency per image.
template <typename Body>
__device__ __forceinline__ void for_run_boxes(int64_t first, int64_t stride, int n, const Image& mine, Body&& body) {
  const int lane = threadIdx.x & 31;
  const int64_t count = lane < n ? mine.count : 0;
  const int64_t incl = warp_inclusive_sum(count);  // the run's prefix sums, image `lane`'s in lane `lane`
  const int64_t excl = incl - count;
  const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
  for (int64_t g0 = 0; g0 < total; g0 += 32) {
    const int64_t g = g0 + lane;
    int i = 0;  // the number of images whose boxes all come before box g: its image
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) {
      if (__shfl_sync(0xffffffffu, incl, i + step - 1) <= g) i += step;
    }
    const int64_t j = g - __shfl_sync(0xffffffffu, excl, i);
    const int64_t first_row = __shfl_sync(0xffffffffu, mine.first_row, i);
    if (g < total) body(first + i * stride, j, first_row);
  }
}

// A box of pred and its target box, slot j of image b (packed: target row first_row + j), loaded.
template <bool kRows, typename P, typename T>
__device__ __forceinline__ void load_box_pair(const P* __restrict__ pred, const T* __restrict__ target, const BoxAccess& pa,
                                              const BoxAccess& ta, int64_t b, int64_t j, int64_t first_row, Vec4<P>& p,
                                              Vec4<T>& t) {
  p = load_box(pred + b * pa.stride_b + j * pa.stride_m, pa.stride_c, pa.vec);
  const int64_t t_offset = kRows ? (first_row + j) * ta.stride_b : b * ta.stride_b + j * ta.stride_m;
  t = load_box(target + t_offset, ta.stride_c, ta.vec);
}

// Packed images whose prefix sums are not given (incl == nullptr, B <= kBlockScanBatchLimit) get them
// from this block's own scan into `shared` (every thread calls this), and block 0 writes them to
// `offsets` for the backward; padded images pass through.
template <typename Images>
__device__ __forceinline__ Images scanned(Images images, const CountsArg& counts, int64_t batch, int64_t slots,
                                          int64_t* shared, int64_t* __restrict__ offsets) {
  if constexpr (std::is_same_v<Images, PackedImages>) {
    if (images.incl == nullptr) {
      block_inclusive_scan(counts, batch, slots, shared);
      images.incl = shared;
      if (blockIdx.x == 0) {
        for (int64_t b = threadIdx.x; b < batch; b += kThreads) offsets[b] = shared[b];
      }
    }
  }
  return images;
}

// Where a kernel finds image b's boxes: pred [B, M, 4] and the targets [B, M, 4] or (packed) [N, 4] rows.
// `vectors`: pred contiguous with 16-byte-aligned images, so a lane's K whole slots are one 16-byte load.
// `rows`: besides, M a multiple of K and below 2^29, and the target boxes of an image contiguous aligned
// Vec4s, so cuda_fused's forward walks an image with 32-bit offsets and no bounds but j < M (add_image_losses).
struct Boxes {
  BoxAccess pred, target;
  bool vectors, rows;
};

// The pred and target boxes of a lane's slots of image b that exist (padded layout); pred as one vector when
// `whole`.
template <int K, typename P, typename T>
__device__ __forceinline__ void load_lane(const P* __restrict__ pred, const T* __restrict__ target, const Boxes& at,
                                          int64_t b, int64_t j0, const Lane<K>& l, bool whole, Vec4<P> (&p)[K],
                                          Vec4<T> (&t)[K]) {
  const P* pred_image = pred + b * at.pred.stride_b;
  if (whole) {
    const Pack<P, 4 * K> v = *reinterpret_cast<const Pack<P, 4 * K>*>(pred_image + j0 * 4);
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) p[k].v[c] = v.v[4 * k + c];
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!l.in[k]) continue;
    if (!whole) p[k] = load_box(pred_image + (j0 + k) * at.pred.stride_m, at.pred.stride_c, at.pred.vec);
    t[k] = load_box(target + b * at.target.stride_b + (j0 + k) * at.target.stride_m, at.target.stride_c,
                    at.target.vec);
  }
}

// ----------------------------------------------------------------------------- forward kernel

// Adds the loss of slot j of image b (packed: target row first_row + j) to loss_acc and counts it.
template <bool kRows, typename C, typename P, typename T>
__device__ __forceinline__ void add_box_loss(const P* __restrict__ pred, const T* __restrict__ target, const Boxes& at,
                                             int64_t b, int64_t j, int64_t first_row, C& loss_acc,
                                             unsigned int& valid_acc) {
  Vec4<P> p;
  Vec4<T> t;
  load_box_pair<kRows>(pred, target, at.pred, at.target, b, j, first_row, p, t);
  C pk[4], tk[4];
  to_compute(p, pk);
  to_compute(t, tk);
  loss_acc += giou_loss(pk, tk);
  valid_acc += 1u;
}

// Adds the losses of a lane's loaded slots to loss_acc, selected by validity, and counts the valid ones.
template <int K, typename C, typename P, typename T>
__device__ __forceinline__ void add_lane_losses(const Vec4<P> (&p)[K], const Vec4<T> (&t)[K], const Lane<K>& l,
                                                C& loss_acc, unsigned int& valid_acc) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (!l.in[k]) continue;
    C pk[4], tk[4];
    to_compute(p[k], pk);
    to_compute(t[k], tk);
    const C loss = giou_loss(pk, tk);
    loss_acc += l.valid[k] ? loss : C(0);  // select, never multiply: NaN in a padded slot must not leak
    valid_acc += l.valid[k] ? 1u : 0u;
  }
}

// uint8 coordinates as floats: the byte under the exponent of 2^23 is 2^23 + byte exactly (one PRMT and one
// FADD each, where a conversion takes three instructions, one of them on the slower conversion pipe).
__device__ __forceinline__ void to_compute(const Vec4<uint8_t>& box, float out[4]) {
  const unsigned int word = *reinterpret_cast<const unsigned int*>(box.v);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | k)) - 8388608.0f;
}

// a / b for cuda_fused's forward: fp32 through the branch-free head of the division nvcc emits for '/' (the
// reciprocal, one Newton step, one correction), which rounds correctly whenever its range check (FCHK) lets
// it; that check instead branches to a slow path, and a branch around every quotient kept the compiler from
// interleaving a lane's boxes. Operands outside 2^-60 <= |b| <= 2^60 and 2^-60 <= |a| <= 2^60 or a = 0
// (so that no step under- or overflows) clear *ok, and the caller recomputes those losses with '/'. A zero
// a takes a * r, whose zero has the quotient's sign. It must equal '/' to the bit, or the forward's loss
// would differ from the backward's and the CPU kernel's arithmetic; test_cuda_fused_forward_division_fallback
// covers the fallback. fp64: '/'.
template <typename C>
struct ChunkDivide {
  bool* ok;
  __device__ __forceinline__ C operator()(C a, C b) const { return a / b; }
};

template <>
struct ChunkDivide<float> {
  bool* ok;
  __device__ __forceinline__ float operator()(float a, float b) const {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
    r = __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
    const float q = __fmul_rn(a, r);
    const float abs_a = fabsf(a), abs_b = fabsf(b);
    const bool zero = a == 0.0f;
    *ok = *ok && abs_b >= 0x1p-60f && abs_b <= 0x1p60f && abs_a <= 0x1p60f && (abs_a >= 0x1p-60f || zero);
    return zero ? q : __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
  }
};

// The losses of N steps of a lane's K boxes, loaded (add_image_losses), each quotient by `divide`.
template <int N, int K, typename C, typename P, typename T, typename Divide>
__device__ __forceinline__ void step_losses(const Pack<P, 4 * K> (&p)[N], const Vec4<T> (&t)[N][K], Divide divide,
                                            C (&loss)[N][K]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      C pk[4], tk[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) pk[c] = to_compute<C>(p[i].v[4 * k + c]);
      to_compute(t[i][k], tk);
      loss[i][k] = giou_loss(pk, tk, divide);
    }
  }
}

// Adds the losses of N steps from slot j0 on (add_image_losses): loads first, losses without a branch, one
// branch to '/' where an operand left ChunkDivide's range, then the valid ones added in slot order.
template <int N, int K, typename C, typename P, typename T>
__device__ __forceinline__ void add_steps(const P* __restrict__ pred_image, const T* __restrict__ target_image, int j0,
                                          int count, C& loss_acc) {
  constexpr int kStep = 32 * K;
  Pack<P, 4 * K> p[N];
  Vec4<T> t[N][K];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    p[i] = *reinterpret_cast<const Pack<P, 4 * K>*>(pred_image + 4 * (j0 + i * kStep));
#pragma unroll
    for (int k = 0; k < K; ++k) t[i][k] = *reinterpret_cast<const Vec4<T>*>(target_image + 4 * (j0 + i * kStep + k));
  }
  C loss[N][K];
  bool ok = true;
  step_losses(p, t, ChunkDivide<C>{&ok}, loss);
  if (!ok) step_losses(p, t, PlainDivide{}, loss);
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      loss_acc += j0 + i * kStep + k < count ? loss[i][k] : C(0);  // select, never multiply: NaN must not leak
    }
  }
}

// Adds the losses of image b's slots 0 .. M - 1 to loss_acc, padded ones selected away (cuda_fused's forward
// when at.rows): lane l takes slots j0 = l * K + 32 * K * i as add_lane_losses, with offsets inside the
// image in 32 bits, two steps' loads issued before their arithmetic, and their losses computed without a
// branch, so a lane spends its instructions on the loss, not on 64-bit indices and per-slot bounds, and its
// boxes' latencies overlap. Two steps, not more: each step in flight costs registers, and more steps made
// this forward and the backward beside it slower.
template <int K, typename C, typename P, typename T>
__device__ __forceinline__ void add_image_losses(const P* __restrict__ pred_image, const T* __restrict__ target_image,
                                                 int slots, int count, C& loss_acc) {
  constexpr int kSteps = 2, kStep = 32 * K;
  int j0 = (threadIdx.x & 31) * K;
  for (; j0 + (kSteps - 1) * kStep < slots; j0 += kSteps * kStep) {
    add_steps<kSteps, K>(pred_image, target_image, j0, count, loss_acc);
  }
  for (; j0 < slots; j0 += kStep) add_steps<1, K>(pred_image, target_image, j0, count, loss_acc);
}

// Loss only. kSkipInvalid = false (cuda_fused, padded layout): every slot is loaded and computed, padded
// ones selected away, a warp per image; true (cuda_conditional, and packed): only valid boxes are loaded
// and computed, one per lane (for_run_boxes). Packed (PackedImages): slot j of image b takes target row
// C[b] + j; incl == nullptr there makes every block scan the counts into shared memory first
// (B <= kBlockScanBatchLimit), and block 0 writes them to `offsets`.
template <typename P, typename T, bool kSkipInvalid, typename Images>
__global__ void __launch_bounds__(kThreads)
    giou_loss_kernel(const P* __restrict__ pred,    // [B, M, 4] xyxy, strided
                     const T* __restrict__ target,  // [B, M, 4] or [N, 4] xyxy, strided
                     Boxes at,                      //
                     Images images,                 // counts, clamped on load; packed: prefix sums
                     CountsArg counts,              // [B] (packed block scan only)
                     int64_t batch,                 // B
                     int64_t slots,                 // M
                     compute_t<P>* loss,            // 0-dim, out
                     compute_t<P>* inv_count,       // 0-dim, out
                     int64_t* offsets,              // [B], out (packed block scan only)
                     Workspace* ws) {
  using C = compute_t<P>;
  constexpr int K = kLaneBoxes<P>;
  constexpr bool kRows = std::is_same_v<Images, PackedImages>;
  static_assert(kSkipInvalid || !kRows, "the packed layout reads valid boxes only");
  extern __shared__ int64_t shared_incl[];
  images = scanned(images, counts, batch, slots, shared_incl, offsets);
  const int lane = threadIdx.x & 31;
  C loss_acc = 0;
  unsigned int valid_acc = 0;
  if constexpr (kSkipInvalid) {
    for_warp_image_runs(batch, images, [&](int64_t first, int64_t stride, int n, const Image& mine) {
      for_run_boxes(first, stride, n, mine, [&](int64_t b, int64_t j, int64_t first_row) {
        add_box_loss<kRows>(pred, target, at, b, j, first_row, loss_acc, valid_acc);
      });
    });
  } else if (at.rows) {
    for_warp_images(batch, images, [&](int64_t b, const Image& image) {
      add_image_losses<K>(pred + b * at.pred.stride_b, target + b * at.target.stride_b, int(slots), int(image.count),
                          loss_acc);
      valid_acc += lane == 0 ? unsigned(image.count) : 0u;
    });
  } else {
    for_warp_images(batch, images, [&](int64_t b, const Image& image) {
      for (int64_t j0 = lane * K; j0 < slots; j0 += 32 * K) {
        const Lane<K> l = lane_at<K>(j0, slots, image.count);
        Vec4<P> p[K];
        Vec4<T> t[K];
        load_lane(pred, target, at, b, j0, l, at.vectors && l.all_in, p, t);
        add_lane_losses(p, t, l, loss_acc, valid_acc);
      }
    });
  }
  finish_loss(loss_acc, valid_acc, ws, loss, inv_count);
}

// The packed forward for batches past the block scan: each block takes a contiguous range of images and
// finds where its target rows start without a scan of all B counts and without a second launch. Block k
// adds up its own clamped counts, publishes the sum (ws->block_sums[k], kPublished set), then adds up the
// sums of blocks 0 .. k - 1 (waiting for any not yet published). Every block reads at most one sum per
// block before it, all in one round of loads, not a chain of look-backs. Block k waits only on blocks with
// smaller indices, which publish before they wait on anything: the grid is at most one wave of resident
// blocks (packed_grid), and blocks are dispatched in index order, as CUB's single-pass scan also relies on.
// Within the block, warp w takes the w-th eighth of the range in runs of up to 32 images, one box per
// lane (for_run_boxes), and writes the run's prefix sums to `offsets` for the backward.
template <typename P, typename T>
__global__ void __launch_bounds__(kThreads)
    giou_loss_packed_kernel(const P* __restrict__ pred,    // [B, M, 4] xyxy, strided
                            const T* __restrict__ target,  // [N, 4] xyxy, strided
                            Boxes at,                      //
                            CountsArg counts,              // [B]
                            int64_t batch,                 // B
                            int64_t slots,                 // M
                            int64_t rows,                  // N
                            compute_t<P>* loss,            // 0-dim, out
                            compute_t<P>* inv_count,       // 0-dim, out
                            int64_t* __restrict__ offsets,  // [B], out: C[b + 1]
                            Workspace* ws) {
  using C = compute_t<P>;
  __shared__ int64_t s_warp_sums[kThreads / 32];
  __shared__ int64_t s_scratch[kThreads / 32];
  __shared__ int64_t s_before;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t per_block = (batch + gridDim.x - 1) / gridDim.x, per_warp = (per_block + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t block_begin = blockIdx.x * per_block < batch ? blockIdx.x * per_block : batch;
  const int64_t block_end = block_begin + per_block < batch ? block_begin + per_block : batch;
  const int64_t begin = block_begin + warp * per_warp < block_end ? block_begin + warp * per_warp : block_end;
  const int64_t end = begin + per_warp < block_end ? begin + per_warp : block_end;
  int64_t warp_total = 0;
  with_typed_counts(counts, [&](const auto* data) {
    for (int64_t b = begin + lane; b < end; b += 32) warp_total += clamp_count(int64_t(data[b * counts.stride]), slots);
  });
  warp_total = warp_sum(warp_total);
  if (lane == 0) s_warp_sums[warp] = warp_total;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t block_total = 0;
    for (int w = 0; w < kThreads / 32; ++w) block_total += s_warp_sums[w];
    atomicExch(&ws->block_sums[blockIdx.x], kPublished | static_cast<unsigned long long>(block_total));
  }
  int64_t before = 0;  // the counts of the blocks before this one
  for (int k = threadIdx.x; k < int(blockIdx.x); k += kThreads) {
    unsigned long long v;
    do {
      v = *reinterpret_cast<volatile unsigned long long*>(&ws->block_sums[k]);
    } while (!(v & kPublished));
    before += static_cast<int64_t>(v & ~kPublished);
  }
  before = block_sum(before, s_scratch);
  if (threadIdx.x == 0) s_before = before;
  __syncthreads();
  int64_t base = s_before;  // the row of this warp's first image's slot 0
  for (int w = 0; w < warp; ++w) base += s_warp_sums[w];
  C loss_acc = 0;
  unsigned int valid_acc = 0;
  with_typed_counts(counts, [&](const auto* data) {
    for (int64_t first = begin; first < end; first += 32) {
      const int n = end - first < 32 ? int(end - first) : 32;
      const int64_t count = lane < n ? clamp_count(int64_t(data[(first + lane) * counts.stride]), slots) : 0;
      const int64_t incl = warp_inclusive_sum(count);
      if (lane < n) offsets[first + lane] = base + incl;
      const Image mine = PackedImages{nullptr, rows, slots}.clamped(base + incl - count, base + incl);
      for_run_boxes(first, 1, n, mine, [&](int64_t b, int64_t j, int64_t first_row) {
        add_box_loss<true>(pred, target, at, b, j, first_row, loss_acc, valid_acc);
      });
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
  });
  finish_loss(static_cast<double>(loss_acc), valid_acc, ws, loss, inv_count);
}

// ----------------------------------------------------------------------------- backward kernel

// A Pack stored with the evict-first hint (st.global.cs): the zeros are written once and not read again by
// this kernel, so they need not displace the boxes still to be read from L2 (faster than plain stores).
template <typename T, int N>
__device__ __forceinline__ void store_streaming(T* __restrict__ address, const Pack<T, N>& value) {
  const int4* from = reinterpret_cast<const int4*>(&value);
  int4* to = reinterpret_cast<int4*>(address);
#pragma unroll
  for (int i = 0; i < int(sizeof(value) / 16); ++i) __stcs(to + i, from[i]);
}

// Zeros into slots count .. M - 1 of one image's gradient (the whole warp calls it): 16-byte vectors where
// whole ones lie past the count, single boxes in the vector the count ends in (16-bit pred: at most one box).
template <int K, typename P>
__device__ __forceinline__ void store_padded_zeros(P* __restrict__ grad_image, int64_t count, int64_t slots,
                                                   bool grad_vectors) {
  const int lane = threadIdx.x & 31;
  Vec4<P> zero_box;
#pragma unroll
  for (int c = 0; c < 4; ++c) zero_box.v[c] = from_compute<P>(compute_t<P>(0));
  const int64_t head_end = grad_vectors ? ((count + K - 1) / K * K < slots ? (count + K - 1) / K * K : slots) : slots;
  for (int64_t j = count + lane; j < head_end; j += 32) *reinterpret_cast<Vec4<P>*>(grad_image + j * 4) = zero_box;
  if (!grad_vectors) return;
  Pack<P, 4 * K> zeros;
#pragma unroll
  for (int i = 0; i < 4 * K; ++i) zeros.v[i] = zero_box.v[0];
  for (int64_t v = head_end / K + lane; v < slots / K; v += 32) store_streaming(grad_image + v * K * 4, zeros);
}

// Every slot of grad_pred: for each run of a warp's images, first the valid boxes one per lane
// (for_run_boxes): the gradient of (1 - GIoU) recomputed from pred and the target box, times scale =
// grad_output * inv_count; then zeros in every slot past each image's count (stores only, nothing read).
// Valid and padded slots are disjoint, so no slot is written twice. Loads first: issued behind the zeros'
// stores they wait longer. Images and targets as in the forward; packed images read the forward's prefix
// sums (global memory), never the counts.
template <typename P, typename T, typename Images>
__global__ void __launch_bounds__(kThreads)
    giou_grad_kernel(const compute_t<P>* grad_output,  // 0-dim
                     const compute_t<P>* inv_count,    // 0-dim, the forward's
                     const P* __restrict__ pred,       // [B, M, 4] xyxy, strided
                     const T* __restrict__ target,     // [B, M, 4] or [N, 4] xyxy, strided
                     Boxes at,                         //
                     Images images,                    // counts, clamped on load; packed: prefix sums
                     int64_t batch,                    // B
                     int64_t slots,                    // M
                     bool grad_vectors,                // M * 4 * sizeof(P) % 16 == 0: whole 16-byte vectors
                     P* __restrict__ grad_pred) {      // [B, M, 4] contiguous, out
  using C = compute_t<P>;
  constexpr int K = kLaneBoxes<P>;
  constexpr bool kRows = std::is_same_v<Images, PackedImages>;
  const C scale = grad_output[0] * inv_count[0];
  for_warp_image_runs(batch, images, [&](int64_t first, int64_t stride, int n, const Image& mine) {
    for_run_boxes(first, stride, n, mine, [&](int64_t b, int64_t j, int64_t first_row) {
      Vec4<P> p;
      Vec4<T> t;
      load_box_pair<kRows>(pred, target, at.pred, at.target, b, j, first_row, p, t);
      C pk[4], tk[4], gk[4];
      to_compute(p, pk);
      to_compute(t, tk);
      giou_loss_and_grad(pk, tk, gk);
      Vec4<P> g;
#pragma unroll
      for (int c = 0; c < 4; ++c) g.v[c] = from_compute<P>(gk[c] * scale);
      *reinterpret_cast<Vec4<P>*>(grad_pred + (b * slots + j) * 4) = g;
    });
    for (int i = 0; i < n; ++i) {
      const int64_t count = __shfl_sync(0xffffffffu, mine.count, i);
      store_padded_zeros<K>(grad_pred + (first + i * stride) * slots * 4, count, slots, grad_vectors);
    }
  });
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
const T* typed(const BoxesArg& boxes) {
  return static_cast<const T*>(boxes.data);
}

template <typename T>
BoxAccess box_access(const BoxesArg& boxes) {
  // One vector load per box needs the 4 coordinates contiguous and every box aligned as Vec4<T>.
  const bool vec = boxes.stride_c == 1 && boxes.stride_m % 4 == 0 && boxes.stride_b % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(boxes.data) % alignof(Vec4<T>) == 0;
  return {boxes.stride_b, boxes.stride_m, boxes.stride_c, vec};
}

// The kernels' view of pred and targets (kRows: packed [N, 4] target rows, no slot dimension).
template <typename P, typename T>
Boxes boxes_of(const GiouInputs& in) {
  const BoxesArg& p = in.pred;
  const bool vectors = p.stride_c == 1 && p.stride_m == 4 && (p.stride_b * sizeof(P)) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.data) % 16 == 0;
  const BoxAccess target = box_access<T>(in.target);
  const bool rows = vectors && in.slots % kLaneBoxes<P> == 0 && in.slots < (int64_t(1) << 29) && target.vec &&
                    target.stride_m == 4;
  return {box_access<P>(p), target, vectors, rows};
}

// Blocks of `Kernel` resident on one SM (registers and shared memory decide), queried once per kernel.
template <auto Kernel, size_t kSharedBytes>
int blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, Kernel, kThreads, kSharedBytes);
    return b > 0 ? b : 1;
  }();
  return blocks;
}

// One warp per image up to one full wave of blocks (grid-stride beyond), at least one block so the loss is
// always written. kSharedBytes: the dynamic shared memory of a block-scan launch, at its largest.
template <auto Kernel, size_t kSharedBytes = 0>
int grid_for(int64_t images) {
  const int64_t wanted = (images + kThreads / 32 - 1) / (kThreads / 32);
  int64_t cap = int64_t(multiprocessors()) * blocks_per_sm<Kernel, kSharedBytes>();
  if (cap > kMaxBlocks) cap = kMaxBlocks;
  return int(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// The block-sums forward's grid: 16 images a warp and at least a block per 1024 target rows (4 boxes a
// thread), at most one wave. N, known on the host, bounds the valid boxes, so the grid follows the work;
// the padded layout's kernels cannot know it and take a wave. Fewer blocks wait on fewer sums and leave
// fewer partials to add; far fewer leave the GPU idle (`python -m detector bench kernels` at batch 16384).
template <auto Kernel>
int packed_grid(int64_t batch, int64_t rows) {
  const int64_t by_images = (batch + 16 * (kThreads / 32) - 1) / (16 * (kThreads / 32));
  const int64_t by_rows = (rows + 4 * kThreads - 1) / (4 * kThreads);
  const int64_t wanted = by_images > by_rows ? by_images : by_rows;
  const int wave = grid_for<Kernel>(batch);
  return wanted < wave ? int(wanted < 1 ? 1 : wanted) : wave;
}

template <typename Body>
bool dispatch_target(DType dtype, Body&& body) {
  const auto f = [&](auto tag) { return body(tag), true; };
  switch (dtype) {
    DETECTOR_TARGET_DTYPES(DETECTOR_CASE_DTYPE)
    default: return false;
  }
}

// body(Tag<P>{}, Tag<T>{}) for the element types of a pred and a target dtype and true; false (and no
// call) for other dtypes.
template <typename Body>
bool dispatch_pred_target(DType pred, DType target, Body&& body) {
  const auto f = [&](auto p_tag) { return dispatch_target(target, [&](auto t_tag) { body(p_tag, t_tag); }); };
  switch (pred) {
    DETECTOR_PRED_DTYPES(DETECTOR_CASE_DTYPE)
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

// Whether a packed forward scans all the counts inside every block (giou_loss_kernel) rather than have each
// block add up the sums of the blocks before it (giou_loss_packed_kernel). The scan reads all B counts in
// every block (from L2 after the first block), so its cost grows as blocks x B. Default threshold:
// giou_op.cpp's schema, with the arithmetic.
bool block_scan(int64_t batch, int64_t block_scan_max_batch) {
  const int64_t limit = block_scan_max_batch < kBlockScanBatchLimit ? block_scan_max_batch : kBlockScanBatchLimit;
  return batch <= limit;
}

// Packed target rows: the row stride as stride_b and no slot dimension, so alignment depends on rows alone.
BoxesArg as_rows(BoxesArg target) {
  target.stride_m = 0;
  return target;
}

// The forward's shared memory for a block scan: B int64 when incl is null (packed, small batches), else none.
template <typename Images>
size_t scan_shared_bytes(const GiouInputs& in, const Images& images) {
  if constexpr (std::is_same_v<Images, PackedImages>) return images.incl == nullptr ? size_t(in.batch) * sizeof(int64_t) : 0;
  else return 0;
}

template <typename Images>
constexpr size_t kMaxSharedBytes = std::is_same_v<Images, PackedImages> ? kScanSharedBytes : 0;

template <typename P, typename T, bool kSkipInvalid, typename Images>
void launch_loss(const GiouInputs& in, const Images& images, const LossOutputs& out, cudaStream_t stream) {
  constexpr auto kernel = giou_loss_kernel<P, T, kSkipInvalid, Images>;
  kernel<<<grid_for<kernel, kMaxSharedBytes<Images>>(in.batch), kThreads, scan_shared_bytes(in, images), stream>>>(
      typed<P>(in.pred), typed<T>(in.target), boxes_of<P, T>(in), images, in.counts, in.batch, in.slots,
      static_cast<compute_t<P>*>(out.loss), static_cast<compute_t<P>*>(out.inv_count), out.offsets,
      static_cast<Workspace*>(out.workspace));
}

template <typename P, typename T, typename Images>
void launch_grad(const GiouInputs& in, const Images& images, const GradArgs& args, cudaStream_t stream) {
  using C = compute_t<P>;
  constexpr auto kernel = giou_grad_kernel<P, T, Images>;
  const bool grad_vectors = (in.slots * 4 * sizeof(P)) % 16 == 0;  // grad_pred is freshly allocated: aligned
  kernel<<<grid_for<kernel>(in.batch), kThreads, 0, stream>>>(
      static_cast<const C*>(args.grad_output), static_cast<const C*>(args.inv_count), typed<P>(in.pred),
      typed<T>(in.target), boxes_of<P, T>(in), images, in.batch, in.slots, grad_vectors,
      static_cast<P*>(args.grad_pred));
}

}  // namespace

size_t giou_workspace_bytes() { return sizeof(Workspace); }

cudaError_t giou_loss_padded_launch(const GiouInputs& in, bool skip_invalid, LossOutputs out, cudaStream_t stream) {
  if (!valid_counts(in.counts)) return cudaErrorInvalidValue;
  const cudaError_t err = cudaMemsetAsync(out.workspace, 0, zeroed_bytes(0), stream);
  if (err != cudaSuccess) return err;
  const bool ok = dispatch_pred_target(in.pred.dtype, in.target.dtype, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    const PaddedImages images{in.counts, in.slots};
    skip_invalid ? launch_loss<P, T, true>(in, images, out, stream) : launch_loss<P, T, false>(in, images, out, stream);
  });
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t giou_loss_packed_launch(const GiouInputs& in, int64_t block_scan_max_batch, LossOutputs out,
                                    cudaStream_t stream) {
  if (!valid_counts(in.counts)) return cudaErrorInvalidValue;
  GiouInputs rows = in;
  rows.target = as_rows(in.target);
  auto* ws = static_cast<Workspace*>(out.workspace);
  cudaError_t err = cudaSuccess;
  const bool ok = dispatch_pred_target(in.pred.dtype, in.target.dtype, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    if (block_scan(in.batch, block_scan_max_batch)) {
      err = cudaMemsetAsync(ws, 0, zeroed_bytes(0), stream);
      if (err == cudaSuccess) launch_loss<P, T, true>(rows, PackedImages{nullptr, in.rows, in.slots}, out, stream);
      return;
    }
    constexpr auto kernel = giou_loss_packed_kernel<P, T>;
    const int grid = packed_grid<kernel>(in.batch, in.rows);
    err = cudaMemsetAsync(ws, 0, zeroed_bytes(grid), stream);
    if (err != cudaSuccess) return;
    using C = compute_t<P>;
    kernel<<<grid, kThreads, 0, stream>>>(typed<P>(rows.pred), typed<T>(rows.target), boxes_of<P, T>(rows), in.counts,
                                          in.batch, in.slots, in.rows, static_cast<C*>(out.loss),
                                          static_cast<C*>(out.inv_count), out.offsets, ws);
  });
  if (err != cudaSuccess) return err;
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t giou_grad_padded_launch(const GiouInputs& in, GradArgs args, cudaStream_t stream) {
  if (!valid_counts(in.counts)) return cudaErrorInvalidValue;
  if (in.batch * in.slots == 0) return cudaSuccess;  // an empty gradient: nothing to write
  const bool ok = dispatch_pred_target(in.pred.dtype, in.target.dtype, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    launch_grad<P, T>(in, PaddedImages{in.counts, in.slots}, args, stream);
  });
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t giou_grad_packed_launch(const GiouInputs& in, const int64_t* offsets, GradArgs args, cudaStream_t stream) {
  if (in.batch * in.slots == 0) return cudaSuccess;  // an empty gradient: nothing to write
  GiouInputs rows = in;
  rows.target = as_rows(in.target);
  const bool ok = dispatch_pred_target(in.pred.dtype, in.target.dtype, [&](auto p_tag, auto t_tag) {
    using P = typename decltype(p_tag)::type;
    using T = typename decltype(t_tag)::type;
    launch_grad<P, T>(rows, PackedImages{offsets, in.rows, in.slots}, args, stream);
  });
  return ok ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace detector
