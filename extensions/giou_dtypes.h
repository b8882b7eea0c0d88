// The dtypes the detector::giou_loss ops accept, listed once. The input checks (giou_checks.cpp), the
// CPU kernel's dispatch (giou_op.cpp), the CUDA dtype map (giou_cuda.cpp) and the CUDA kernels' dispatch
// (giou_kernels.cu) all expand these lists; adding a dtype here adds it everywhere. No torch and no CUDA
// headers: a plain `nvcc -c` of giou_kernels.cu includes it too.
//
// Each entry is X(Name, AtName, Type, "name"): DType::k##Name (giou_kernels.cuh), at::ScalarType::AtName,
// the C++ element type and the name in error messages. The 16-bit floats' element types are the aliases
// half_t and bfloat16_t, which each side defines before it dispatches (at::Half / __half, ...).
#pragma once

// Floating dtypes: predictions (fp64 computes in fp64, the others in fp32) and targets.
#define DETECTOR_FLOAT_DTYPES(X)                \
  X(Float64, Double, double, "float64")         \
  X(Float32, Float, float, "float32")           \
  X(BFloat16, BFloat16, bfloat16_t, "bfloat16") \
  X(Float16, Half, half_t, "float16")

// Integer dtypes: counts and targets. Target coordinates are converted to the compute type on load, as
// detector.losses.geometry converts them (target.to(compute dtype)), so every strategy sees equal values.
#define DETECTOR_INT_DTYPES(X)    \
  X(UInt8, Byte, uint8_t, "uint8") \
  X(Int8, Char, int8_t, "int8")    \
  X(Int16, Short, int16_t, "int16") \
  X(Int32, Int, int32_t, "int32")   \
  X(Int64, Long, int64_t, "int64")

// Every (pred, target) pair is its own kernel instantiation, 4 x 9 per kernel: the kernels are small, and a
// conversion pass for rare target dtypes would cost an extra read and write of the targets. Counts are
// read through a switch on their dtype (uniform across the grid), not instantiated.
#define DETECTOR_PRED_DTYPES(X) DETECTOR_FLOAT_DTYPES(X)
#define DETECTOR_TARGET_DTYPES(X) DETECTOR_FLOAT_DTYPES(X) DETECTOR_INT_DTYPES(X)
#define DETECTOR_COUNTS_DTYPES(X) DETECTOR_INT_DTYPES(X)
#define DETECTOR_ALL_DTYPES(X) DETECTOR_TARGET_DTYPES(X)  // every dtype above once: the kernels' DType enum

// Expansions: a `case` calling f(Tag<Type>{}) in a switch over at::ScalarType (CPU) or DType (CUDA), an
// enumerator, a name for a message.
#define DETECTOR_CASE_SCALAR_TYPE(Name, AtName, Type, str) \
  case at::ScalarType::AtName:                             \
    return f(::detector::Tag<Type>{});
#define DETECTOR_CASE_DTYPE(Name, AtName, Type, str) \
  case ::detector::DType::k##Name:                   \
    return f(::detector::Tag<Type>{});
#define DETECTOR_ENUMERATOR(Name, AtName, Type, str) k##Name,
#define DETECTOR_DTYPE_NAME(Name, AtName, Type, str) str,

namespace detector {

// A type carried as a value, so that a generic lambda can receive it: f(Tag<float>{}).
template <typename T>
struct Tag {
  using type = T;
};

}  // namespace detector
