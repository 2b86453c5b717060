// Geometry shared by the CPU and CUDA kernels of roi_align and roi_pool, so both backends sample the same points,
// and the host-side argument checks of both ops.
// Roi coordinates are in the accumulation type T (float for fp16/bf16/fp32 features, double for fp64).
#pragma once

#include <c10/macros/Macros.h>
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cmath>
#include <cstdint>

#include "ops/common.h"

namespace lss {
namespace roi {
namespace {

// Written without isfinite so the same code compiles for host and device: inf - inf and NaN fail both tests.
template <typename T>
C10_HOST_DEVICE inline bool is_finite(T v) {
  return v == v && v - v == T(0);
}

// Whether a roi can be pooled at all: finite coordinates and an integer batch index in [0, batch_size). The
// forward ops report failures in their bad-roi record; every kernel pools such a roi to zeros.
template <typename T>
C10_HOST_DEVICE inline bool roi_ok(const T* roi, int64_t batch_size) {
  for (int i = 0; i < 5; ++i) {
    if (!is_finite(roi[i])) return false;
  }
  return roi[0] >= T(0) && roi[0] < static_cast<T>(batch_size) && roi[0] == ::floor(roi[0]);
}

// The slot of the bad-roi record (find_bad_rois) a roi belongs in: 0 for non-finite coordinates, 1 for a bad batch
// index, -1 when it can be pooled.
template <typename T>
C10_HOST_DEVICE inline int bad_roi_slot(const T* roi, int64_t batch_size) {
  for (int i = 0; i < 5; ++i) {
    if (!is_finite(roi[i])) return 0;
  }
  return roi_ok(roi, batch_size) ? -1 : 1;
}

// One RoIAlign roi: image index (-1 when the roi is unusable), bin origin and size, samples per bin.
template <typename T>
struct AlignRoi {
  int64_t batch;
  T start_h, start_w, bin_h, bin_w;
  int grid_h, grid_w;
  T count;  // samples averaged per bin, at least 1

  C10_HOST_DEVICE T sample_y(int ph, int iy) const {
    return start_h + ph * bin_h + static_cast<T>(iy + 0.5) * bin_h / static_cast<T>(grid_h);
  }
  C10_HOST_DEVICE T sample_x(int pw, int ix) const {
    return start_w + pw * bin_w + static_cast<T>(ix + 0.5) * bin_w / static_cast<T>(grid_w);
  }
};

// torchvision's RoIAlign geometry; rois that fail roi_ok or have absurdly large coordinates get batch -1 and
// produce zeros instead of reading out of bounds or looping forever.
template <typename T>
C10_HOST_DEVICE inline AlignRoi<T> align_roi(const T* roi, int64_t batch_size, T spatial_scale, int pooled_h,
                                             int pooled_w, int sampling_ratio, bool aligned) {
  AlignRoi<T> r;
  r.batch = -1;
  r.start_h = r.start_w = r.bin_h = r.bin_w = T(0);
  r.grid_h = r.grid_w = 0;
  r.count = T(1);
  if (!roi_ok(roi, batch_size)) return r;
  const T offset = aligned ? T(0.5) : T(0);
  r.start_w = roi[1] * spatial_scale - offset;
  r.start_h = roi[2] * spatial_scale - offset;
  T roi_w = roi[3] * spatial_scale - offset - r.start_w;
  T roi_h = roi[4] * spatial_scale - offset - r.start_h;
  if (!aligned) {
    roi_w = roi_w > T(1) ? roi_w : T(1);
    roi_h = roi_h > T(1) ? roi_h : T(1);
  }
  r.bin_h = roi_h / static_cast<T>(pooled_h);
  r.bin_w = roi_w / static_cast<T>(pooled_w);
  if (sampling_ratio > 0) {
    r.grid_h = r.grid_w = sampling_ratio;
  } else {
    const T gh = ::ceil(roi_h / static_cast<T>(pooled_h));
    const T gw = ::ceil(roi_w / static_cast<T>(pooled_w));
    // More than 2^20 samples per bin side means coordinates far outside any feature map.
    if (!(gh < T(1 << 20) && gw < T(1 << 20))) return r;
    r.grid_h = gh > T(0) ? static_cast<int>(gh) : 0;
    r.grid_w = gw > T(0) ? static_cast<int>(gw) : 0;
  }
  const int64_t n = static_cast<int64_t>(r.grid_h) * r.grid_w;
  r.count = n > 0 ? static_cast<T>(n) : T(1);
  r.batch = static_cast<int64_t>(roi[0]);
  return r;
}

// Bilinear corners (offsets into one H x W plane) and weights of a sample point; valid == false: the point is
// more than one pixel outside the map and contributes zero (torchvision's rule).
template <typename T>
struct Bilinear {
  int64_t o1, o2, o3, o4;
  T w1, w2, w3, w4;
  bool valid;
};

template <typename T>
C10_HOST_DEVICE inline Bilinear<T> bilinear(int64_t height, int64_t width, T y, T x) {
  Bilinear<T> b;
  b.valid = !(y < T(-1) || y > static_cast<T>(height) || x < T(-1) || x > static_cast<T>(width));
  if (!b.valid) {
    b.o1 = b.o2 = b.o3 = b.o4 = 0;
    b.w1 = b.w2 = b.w3 = b.w4 = T(0);
    return b;
  }
  if (y <= T(0)) y = T(0);
  if (x <= T(0)) x = T(0);
  int64_t y_low = static_cast<int64_t>(y);
  int64_t x_low = static_cast<int64_t>(x);
  int64_t y_high, x_high;
  if (y_low >= height - 1) {
    y_high = y_low = height - 1;
    y = static_cast<T>(y_low);
  } else {
    y_high = y_low + 1;
  }
  if (x_low >= width - 1) {
    x_high = x_low = width - 1;
    x = static_cast<T>(x_low);
  } else {
    x_high = x_low + 1;
  }
  const T ly = y - static_cast<T>(y_low);
  const T lx = x - static_cast<T>(x_low);
  const T hy = T(1) - ly;
  const T hx = T(1) - lx;
  b.w1 = hy * hx;
  b.w2 = hy * lx;
  b.w3 = ly * hx;
  b.w4 = ly * lx;
  b.o1 = y_low * width + x_low;
  b.o2 = y_low * width + x_high;
  b.o3 = y_high * width + x_low;
  b.o4 = y_high * width + x_high;
  return b;
}

// One RoIPool bin: the half-open pixel window [h0, h1) x [w0, w1) (empty when h1 <= h0 or w1 <= w0).
struct PoolBin {
  int64_t batch;  // -1 when the roi is unusable
  int64_t h0, h1, w0, w1;
};

template <typename T>
C10_HOST_DEVICE inline int64_t clamp_i64(T v, int64_t lo, int64_t hi) {
  return v < static_cast<T>(lo) ? lo : (v > static_cast<T>(hi) ? hi : static_cast<int64_t>(v));
}

// torchvision's RoIPool geometry (coordinates rounded half away from zero, inclusive end pixel).
template <typename T>
C10_HOST_DEVICE inline PoolBin pool_bin(const T* roi, int64_t batch_size, T spatial_scale, int pooled_h,
                                        int pooled_w, int64_t height, int64_t width, int ph, int pw) {
  PoolBin p{-1, 0, 0, 0, 0};
  if (!roi_ok(roi, batch_size)) return p;
  // Clamping to +-2^30 keeps the integer arithmetic below from overflowing for absurd coordinates.
  const int64_t start_w = clamp_i64(::round(roi[1] * spatial_scale), -(1 << 30), 1 << 30);
  const int64_t start_h = clamp_i64(::round(roi[2] * spatial_scale), -(1 << 30), 1 << 30);
  const int64_t end_w = clamp_i64(::round(roi[3] * spatial_scale), -(1 << 30), 1 << 30);
  const int64_t end_h = clamp_i64(::round(roi[4] * spatial_scale), -(1 << 30), 1 << 30);
  const int64_t roi_w = end_w - start_w + 1 > 1 ? end_w - start_w + 1 : 1;
  const int64_t roi_h = end_h - start_h + 1 > 1 ? end_h - start_h + 1 : 1;
  const T bin_h = static_cast<T>(roi_h) / static_cast<T>(pooled_h);
  const T bin_w = static_cast<T>(roi_w) / static_cast<T>(pooled_w);
  p.h0 = clamp_i64(static_cast<T>(::floor(static_cast<T>(ph) * bin_h)) + static_cast<T>(start_h), 0, height);
  p.h1 = clamp_i64(static_cast<T>(::ceil(static_cast<T>(ph + 1) * bin_h)) + static_cast<T>(start_h), 0, height);
  p.w0 = clamp_i64(static_cast<T>(::floor(static_cast<T>(pw) * bin_w)) + static_cast<T>(start_w), 0, width);
  p.w1 = clamp_i64(static_cast<T>(::ceil(static_cast<T>(pw + 1) * bin_w)) + static_cast<T>(start_w), 0, width);
  p.batch = static_cast<int64_t>(roi[0]);
  return p;
}

}  // namespace

// Host-side checks, defined in roi_common.cpp (see common.h for why they are not inline here).

// Shape checks shared by the CPU and CUDA entry points.
void check_roi_args(const char* op, const at::Tensor& input, const at::Tensor& rois, int64_t pooled_h,
                    int64_t pooled_w);

// Shape checks of a backward op's grad (K x C x PH x PW) and, when it routes the gradient, argmax.
void check_roi_grad(const char* op, const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
                    bool uses_argmax, int64_t channels, int64_t pooled_h, int64_t pooled_w);

// Rois in the accumulation type of the features (float, or double for double features), contiguous.
at::Tensor rois_in_acc_type(const at::Tensor& rois, const at::Tensor& input);

// The forward ops' bad-roi record, their third output: two int64, the first roi with non-finite coordinates and the
// first roi with a bad batch index (slots of bad_roi_slot), -1 for none. The Python wrappers read it and raise the
// errors; nothing is thrown from here, whatever the roi values. CPU version: a loop over the (acc-type, contiguous)
// rois on the host. record_bad_rois == false (the caller will not read it): no_bad_roi_record, no loop.
at::Tensor find_bad_rois(const at::Tensor& rois, int64_t batch_size, bool record_bad_rois);

// The third output of a forward call with record_bad_rois=false: an empty int64 tensor on like's device.
at::Tensor no_bad_roi_record(const at::Tensor& like);

}  // namespace roi
}  // namespace lss
