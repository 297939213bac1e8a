// The host emulation's stand-in for CUDA's <cuda_fp16.h>: the conversions cuda_kernels use.
// g++'s _Float16 converts exactly, as the device's cvt does (f16 -> f32 is always exact).
#pragma once
typedef _Float16 __half;
inline float __half2float(__half h) { return float(h); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __ushort_as_half(unsigned short v) { __half h; __builtin_memcpy(&h, &v, 2); return h; }
inline unsigned short __half_as_ushort(__half h) { unsigned short v; __builtin_memcpy(&v, &h, 2); return v; }
