// CUDA kernels of the focal loss ops (schemas in ../focal_loss.cpp, per-element math in ../focal_loss.h).
//
// One pass over logits and targets: each thread computes loss and, when asked, d loss / d logits of its elements
// (16-byte vector loads where every pointer allows, several vectors in flight per thread), each block writes one
// partial sum, and a one-block kernel adds the partials in a fixed order in double, so "mean"/"sum" are
// deterministic run to run on one GPU. Where the host knows the reduction's denominator the saved gradient already
// carries 1 / denominator, and the in-place backward reads grad_output on the device and returns at once when it
// leaves nothing to scale (no host sync, graph-capturable). The dense kernel is meant to run at memory bandwidth,
// so float32 math uses short approximate forms of exp, log1p and the reciprocals (sigmoid_focal_fast, a few ulp);
// float64 keeps the exact header functions.
// Class-index targets are range-checked inside the kernel (bad rows get NaN, never an out-of-bounds read); the
// host reads the error flag after the kernel to raise a clear error, which waits for the kernel (skipped while a
// CUDA graph is being captured, where the NaN loss remains the signal).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>

#include <cfloat>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "ops/focal_loss.h"

namespace lss {
namespace focal {
namespace {

constexpr int kWarpsPerBlock = kThreads / 32;
// Vectors per thread and loop step of the backward scaling.
constexpr int kScaleUnroll = 4;

// Elements per 16-byte vector of scalar_t.
template <typename scalar_t>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(scalar_t));
}

// Vectors per thread and loop step of the dense forward: two for 4- and 8-byte logits; one 8-wide vector for
// 16-bit logits (its float targets already fill two loads, and a second vector would cost occupancy in registers).
template <typename scalar_t>
constexpr int dense_unroll() {
  return sizeof(scalar_t) == 2 ? 1 : 2;
}

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N>
bool aligned(const void* ptr, size_t elem_size) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % (elem_size * N) == 0;
}

// Sums v over the block and, from thread 0, stores it as this block's partial. Every thread must call it.
template <typename acc_t>
__device__ void store_block_partial(acc_t v, long long kept, double* block_loss, long long* block_kept) {
  using LossReduce = cub::BlockReduce<acc_t, kThreads>;
  using CountReduce = cub::BlockReduce<long long, kThreads>;
  __shared__ typename LossReduce::TempStorage loss_tmp;
  __shared__ typename CountReduce::TempStorage count_tmp;
  const acc_t total = LossReduce(loss_tmp).Sum(v);
  const long long count = CountReduce(count_tmp).Sum(kept);
  if (threadIdx.x == 0) {
    block_loss[blockIdx.x] = static_cast<double>(total);
    block_kept[blockIdx.x] = count;
  }
}

// Fast float32 forms of the per-element math (acc_t == float only; float64 keeps the exact header functions).
// Each is about as accurate as the libdevice function it replaces (a few ulp), at a fraction of the instructions.

__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ float rcp_approx(float v) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// exp(-a) for a >= 0. The rounding error of a * log2(e) (and log2(e)'s own tail) is carried as a first-order
// correction, so the relative error does not grow with a; a is clamped where exp(-a) is below float's range anyway.
__device__ __forceinline__ float exp_neg(float a) {
  constexpr float kLog2e = 1.44269502162933349609f;      // float(log2(e))
  constexpr float kLog2eTail = 1.92596299112661746888e-8f;  // log2(e) - kLog2e
  constexpr float kLn2 = 0.69314718055994530942f;
  a = fminf(a, 104.0f);
  const float h = -a * kLog2e;
  const float lo = fmaf(-a, kLog2eTail, fmaf(-a, kLog2e, -h));
  const float e = ex2_approx(h);
  return fmaf(e, lo * kLn2, e);
}

// log1p(e) for e in [0, 1]: e P(e), P a degree-9 least-relative-error fit of log1p(e) / e (about 2 ulp).
__device__ __forceinline__ float log1p_unit(float e) {
  float r = -3.2440258655697107e-3f;
  r = fmaf(r, e, 1.985146477818489e-2f);
  r = fmaf(r, e, -5.695953965187073e-2f);
  r = fmaf(r, e, 1.0603655129671097e-1f);
  r = fmaf(r, e, -1.5305593609809875e-1f);
  r = fmaf(r, e, 1.967593878507614e-1f);
  r = fmaf(r, e, -2.4954134225845337e-1f);
  r = fmaf(r, e, 3.332996368408203e-1f);
  r = fmaf(r, e, -4.999990165233612e-1f);
  r = fmaf(r, e, 1.0f);
  return r * e;
}

// sigmoid_focal (focal_loss.h) in float32 with alpha_t = at0 + at1 t (at0 = 1, at1 = 0 without class balancing)
// and, for kGamma2, q^gamma = q * q known at compile time.
template <bool kGamma2>
__device__ __forceinline__ void sigmoid_focal_fast(float x, float t, float at0, float at1, float gamma, float& loss,
                                                   float& dloss) {
  const float e = exp_neg(fabsf(x));
  const float inv = rcp_approx(1.0f + e);
  const float einv = e * inv;
  const bool pos = x >= 0.0f;
  const float p = pos ? inv : einv;
  const float pc = pos ? einv : inv;
  const float ce = fmaf(-x, t, fmaxf(x, 0.0f)) + log1p_unit(e);
  // p (1 - t) + pc t, not p + t (pc - p): that would cancel to 0 for t = 1 and a saturated logit.
  const float q = fmaf(pc, t, p * (1.0f - t));
  const float qg = kGamma2 ? q * q : modulating_factor(q, gamma);
  const float at = fmaf(at1, t, at0);
  // The approximate reciprocal flushes q below FLT_MIN to 0; clamped there, the ratio stays in [0, 1] (and is 0
  // at q = 0, where p pc = 0) without a branch.
  const float ratio = p * rcp_approx(fmaxf(q, FLT_MIN)) * pc;
  const float g = kGamma2 ? 2.0f : gamma;
  loss = at * ce * qg;
  dloss = at * qg * fmaf(g * fmaf(-2.0f, t, 1.0f), ce * ratio, p - t);
}

template <typename acc_t>
struct SigmoidParams {
  const acc_t* weight;
  bool weight_by_label;  // class-index targets: weight[label] scales the row (C + 1 entries), else weight[column]
  const bool* mask;
  int64_t numel;
  int64_t classes;
  int64_t inner;
  acc_t alpha;
  acc_t gamma;
  acc_t at0;  // alpha_t = at0 + at1 t
  acc_t at1;
  acc_t grad_prescale;  // 1 / denominator folded into the saved gradient, or 1
};

template <typename acc_t, bool kGamma2>
__device__ __forceinline__ void focal_element(const SigmoidParams<acc_t>& p, acc_t x, acc_t t, acc_t& loss,
                                              acc_t& grad) {
  if constexpr (std::is_same<acc_t, float>::value) {
    sigmoid_focal_fast<kGamma2>(x, t, p.at0, p.at1, p.gamma, loss, grad);
  } else {
    sigmoid_focal<acc_t>(x, t, p.alpha, p.gamma, loss, grad);
  }
}

// Dense targets. Each thread takes kUnroll vectors of VEC elements per loop step and issues all their loads before
// the math, so that enough bytes are in flight to keep the memory system busy; the last numel % VEC elements run
// element by element. VEC > 1 only where every pointer is aligned to VEC elements.
template <typename scalar_t, typename target_t, int VEC, bool kGamma2>
__global__ void __launch_bounds__(kThreads)
    sigmoid_dense_kernel(const scalar_t* __restrict__ logits, const target_t* __restrict__ targets,
                         SigmoidParams<at::opmath_type<scalar_t>> p, scalar_t* __restrict__ loss_out,
                         scalar_t* __restrict__ grad_out, double* __restrict__ block_loss,
                         long long* __restrict__ block_kept, at::opmath_type<scalar_t>* __restrict__ unit_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kUnroll = dense_unroll<scalar_t>();
  using XPack = Pack<scalar_t, VEC>;
  using TPack = Pack<target_t, VEC>;
  using MPack = Pack<bool, VEC>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // grad_scale of reduction "none" (the reductions' finalize_kernel writes it otherwise).
  if (unit_scale != nullptr && first == 0) *unit_scale = acc_t(1);
  acc_t sum = acc_t(0);
  long long kept = 0;

  const int64_t nvec = p.numel / VEC;
  for (int64_t v0 = first; v0 < nvec; v0 += stride * kUnroll) {
    XPack xs[kUnroll];
    TPack ts[kUnroll];
    MPack ms[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * stride;
      if (v < nvec) {
        xs[u] = reinterpret_cast<const XPack*>(logits)[v];
        ts[u] = reinterpret_cast<const TPack*>(targets)[v];
        if (p.mask != nullptr) ms[u] = reinterpret_cast<const MPack*>(p.mask)[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * stride;
      if (v >= nvec) continue;
      // Class column of the vector's first element, then stepped along (one division per vector, not per element).
      int64_t pos = 0, cls = 0;
      if (p.weight != nullptr) {
        const int64_t outer = (v * VEC) / p.inner;
        pos = v * VEC - outer * p.inner;
        cls = outer % p.classes;
      }
      XPack ls, gs;
      int vec_kept = 0;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc_t l, g;
        focal_element<acc_t, kGamma2>(p, static_cast<acc_t>(xs[u].v[k]), static_cast<acc_t>(ts[u].v[k]), l, g);
        g *= p.grad_prescale;
        if (p.weight != nullptr) {
          const acc_t w = p.weight[cls];
          l *= w;
          g *= w;
          if (++pos == p.inner) {
            pos = 0;
            cls = cls + 1 == p.classes ? 0 : cls + 1;
          }
        }
        if (p.mask != nullptr) {
          // A select, not a multiply: masked-out cells may hold any logit (even inf / NaN) and give exact zeros.
          const bool keep = ms[u].v[k];
          l = keep ? l : acc_t(0);
          g = keep ? g : acc_t(0);
          vec_kept += keep;
        }
        sum += l;
        ls.v[k] = static_cast<scalar_t>(l);
        gs.v[k] = static_cast<scalar_t>(g);
      }
      kept += vec_kept;
      if (loss_out != nullptr) reinterpret_cast<XPack*>(loss_out)[v] = ls;
      if (grad_out != nullptr) reinterpret_cast<XPack*>(grad_out)[v] = gs;
    }
  }
  for (int64_t i = nvec * VEC + first; i < p.numel; i += stride) {
    acc_t l, g;
    focal_element<acc_t, kGamma2>(p, static_cast<acc_t>(logits[i]), static_cast<acc_t>(targets[i]), l, g);
    g *= p.grad_prescale;
    if (p.weight != nullptr) {
      const acc_t w = p.weight[(i / p.inner) % p.classes];
      l *= w;
      g *= w;
    }
    if (p.mask != nullptr) {
      const bool keep = p.mask[i];
      l = keep ? l : acc_t(0);
      g = keep ? g : acc_t(0);
      kept += keep;
    }
    sum += l;
    if (loss_out != nullptr) loss_out[i] = static_cast<scalar_t>(l);
    if (grad_out != nullptr) grad_out[i] = static_cast<scalar_t>(g);
  }
  if (block_loss != nullptr) store_block_partial<acc_t>(sum, kept, block_loss, block_kept);
}

// Class-index targets (logits N x C): element i is in row i / C, column i % C; labels are range-checked here, and
// before the mask so that CPU and CUDA reject the same inputs (bad rows get NaN, never an out-of-bounds read).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    sigmoid_index_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                         SigmoidParams<at::opmath_type<scalar_t>> p, scalar_t* __restrict__ loss_out,
                         scalar_t* __restrict__ grad_out, double* __restrict__ block_loss,
                         long long* __restrict__ block_kept, at::opmath_type<scalar_t>* __restrict__ unit_scale,
                         int* __restrict__ bad_target) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (unit_scale != nullptr && first == 0) *unit_scale = acc_t(1);
  acc_t sum = acc_t(0);
  for (int64_t i = first; i < p.numel; i += stride) {
    const int64_t row = i / p.classes;
    const int64_t cls = i - row * p.classes;
    const int64_t label = targets[row];
    acc_t l, g;
    if (label < 0 || label > p.classes) {
      *bad_target = 1;
      l = g = std::numeric_limits<acc_t>::quiet_NaN();
    } else {
      focal_element<acc_t, false>(p, static_cast<acc_t>(logits[i]), label == cls ? acc_t(1) : acc_t(0), l, g);
      g *= p.grad_prescale;
      if (p.weight != nullptr) {
        const acc_t w = p.weight[p.weight_by_label ? label : cls];
        l *= w;
        g *= w;
      }
      if (p.mask != nullptr && !p.mask[i]) l = g = acc_t(0);
    }
    sum += l;
    if (loss_out != nullptr) loss_out[i] = static_cast<scalar_t>(l);
    if (grad_out != nullptr) grad_out[i] = static_cast<scalar_t>(g);
  }
  if (block_loss != nullptr) store_block_partial<acc_t>(sum, 0, block_loss, block_kept);
}

// One warp per sample row: max, sum of exponentials, then the gradient row, all reading the row from cache after
// the first touch.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    softmax_focal_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                         const at::opmath_type<scalar_t>* __restrict__ weight, int64_t rows, int64_t classes,
                         at::opmath_type<scalar_t> alpha, at::opmath_type<scalar_t> gamma,
                         at::opmath_type<scalar_t> grad_prescale, scalar_t* __restrict__ loss_out,
                         scalar_t* __restrict__ grad_out,
                         double* __restrict__ block_loss, long long* __restrict__ block_kept,
                         int* __restrict__ bad_target) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  acc_t sum = acc_t(0);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < rows;
       r += warp_stride) {
    const scalar_t* xr = logits + r * classes;
    const int64_t label = targets[r];
    const bool bad = label >= classes;
    const bool ignored = label < 0;
    acc_t loss = acc_t(0), coef = acc_t(0), mx = acc_t(0), lse = acc_t(0);
    if (bad) {
      if (lane == 0) *bad_target = 1;
      loss = coef = std::numeric_limits<acc_t>::quiet_NaN();
    } else if (!ignored) {
      mx = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = lane; j < classes; j += 32) mx = max(mx, static_cast<acc_t>(xr[j]));
#pragma unroll
      for (int off = 16; off > 0; off /= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      acc_t se = acc_t(0);
      for (int64_t j = lane; j < classes; j += 32) se += exp_(static_cast<acc_t>(xr[j]) - mx);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) se += __shfl_xor_sync(0xffffffffu, se, off);
      lse = log_(se);
      softmax_focal<acc_t>((static_cast<acc_t>(xr[label]) - mx) - lse, alpha, gamma, loss, coef);
      coef *= grad_prescale;
      if (weight != nullptr) {
        loss *= weight[label];
        coef *= weight[label];
      }
    }
    if (grad_out != nullptr) {
      scalar_t* gr = grad_out + r * classes;
      for (int64_t j = lane; j < classes; j += 32) {
        acc_t g = coef;
        if (!bad && !ignored) {
          g = coef * (exp_(static_cast<acc_t>(xr[j]) - mx - lse) - (j == label ? acc_t(1) : acc_t(0)));
        }
        gr[j] = static_cast<scalar_t>(g);
      }
    }
    if (lane == 0) {
      if (loss_out != nullptr) loss_out[r] = static_cast<scalar_t>(loss);
      sum += loss;
    }
  }
  if (block_loss != nullptr) store_block_partial<acc_t>(sum, 0, block_loss, block_kept);
}

// Adds the block partials in a fixed order; loss = total / denominator (denominator < 0: the kept count), and
// grad_scale = 1 / denominator unless the forward folded it into the gradient.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    finalize_kernel(const double* __restrict__ block_loss, const long long* __restrict__ block_kept, int nblocks,
                    double denominator, bool folded, scalar_t* __restrict__ loss,
                    at::opmath_type<scalar_t>* __restrict__ grad_scale) {
  using LossReduce = cub::BlockReduce<double, kThreads>;
  using CountReduce = cub::BlockReduce<long long, kThreads>;
  __shared__ typename LossReduce::TempStorage loss_tmp;
  __shared__ typename CountReduce::TempStorage count_tmp;
  double s = 0.0;
  long long k = 0;
  for (int b = threadIdx.x; b < nblocks; b += kThreads) {
    s += block_loss[b];
    k += block_kept[b];
  }
  const double total = LossReduce(loss_tmp).Sum(s);
  const long long kept = CountReduce(count_tmp).Sum(k);
  if (threadIdx.x == 0) {
    const double d = denominator >= 0 ? denominator : static_cast<double>(kept);
    const double scale = d > 0 ? 1.0 / d : 0.0;
    *loss = static_cast<scalar_t>(total * scale);
    *grad_scale = static_cast<at::opmath_type<scalar_t>>(folded ? 1.0 : scale);
  }
}

// out = grad * grad_output * grad_scale, kScaleUnroll vectors per thread and loop step with the loads issued first.
// With out == grad (the in-place backward) a factor of exactly 1 leaves nothing to do, and every thread returns
// after reading the two scalars.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    scale_grad_kernel(const scalar_t* grad, const scalar_t* __restrict__ grad_output,
                      const at::opmath_type<scalar_t>* __restrict__ grad_scale, scalar_t* out, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  using GPack = Pack<scalar_t, VEC>;
  const acc_t f = static_cast<acc_t>(*grad_output) * *grad_scale;
  if (f == acc_t(1) && out == grad) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v0 = first; v0 < nvec; v0 += stride * kScaleUnroll) {
    GPack g[kScaleUnroll];
#pragma unroll
    for (int u = 0; u < kScaleUnroll; ++u) {
      if (v0 + u * stride < nvec) g[u] = reinterpret_cast<const GPack*>(grad)[v0 + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kScaleUnroll; ++u) {
      if (v0 + u * stride >= nvec) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[u].v[k] = static_cast<scalar_t>(static_cast<acc_t>(g[u].v[k]) * f);
      reinterpret_cast<GPack*>(out)[v0 + u * stride] = g[u];
    }
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride) out[i] = static_cast<scalar_t>(static_cast<acc_t>(grad[i]) * f);
}

// Resident blocks per SM of `kernel` at kThreads threads, queried once per kernel and device (the query costs host
// time on every call otherwise).
int blocks_per_sm(const void* kernel) {
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, int> cache;
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find({kernel, device});
  if (it == cache.end()) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    it = cache.emplace(std::make_pair(kernel, device), std::max(per_sm, 1)).first;
  }
  return it->second;
}

// Blocks for a grid-stride loop of `kernel` over `work` items: one resident wave (the occupancy limit times the SM
// count), or fewer for small work, so no block waits for a second wave and the partials stay short.
template <typename Kernel>
int grid_size(Kernel kernel, int64_t work, int per_block) {
  const int64_t fill = static_cast<int64_t>(blocks_per_sm(reinterpret_cast<const void*>(kernel))) *
                       at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, per_block), fill)));
}

// Reads the kernel's error flag (waits for the kernel) unless a CUDA graph is being captured.
void raise_if_bad_targets(const at::Tensor& bad_target, const at::Tensor& targets, const char* op,
                          const std::string& expected) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  if (bad_target.item<int>() == 0) return;
  raise_bad_targets(op, expected, targets.min().item<int64_t>(), targets.max().item<int64_t>());
}

Outputs sigmoid_focal_loss_cuda(const at::Tensor& logits_in, const at::Tensor& targets_in,
                                const c10::optional<at::Tensor>& weight_in, const c10::optional<at::Tensor>& mask_in,
                                double alpha, double gamma, c10::string_view reduction_name, bool save_grad,
                                bool /*reuse_grad*/) {
  const SigmoidLayout s = check_sigmoid_args(logits_in, targets_in, weight_in, mask_in);
  check_cuda_tensor(logits_in, "sigmoid_focal_loss: logits");
  const Reduction reduction = parse_reduction(std::string(reduction_name), "sigmoid_focal_loss");
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor targets = targets_in.contiguous();
  const at::Tensor weight = weight_in.has_value() ? weight_in->to(acc_dtype(logits)).contiguous() : at::Tensor();
  const at::Tensor mask = mask_in.has_value() ? mask_in->contiguous() : at::Tensor();

  at::Tensor grad = save_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  at::Tensor loss = reduction == kNone ? at::empty_like(logits) : at::empty({}, logits.options());
  // Written by the kernels: 1 for "none", 1 / denominator (or 1 for "sum") by finalize_kernel.
  at::Tensor grad_scale = at::empty({}, logits.options().dtype(acc_dtype(logits)));
  if (s.numel == 0) {
    grad_scale.fill_(reduction == kMean ? 0.0 : 1.0);
    if (reduction != kNone) loss.zero_();
    return {loss, grad, grad_scale};
  }

  const bool reduce = reduction != kNone;
  const double denominator = host_denominator(reduction, s, mask.defined());
  const bool folded = folds_reduction_into_grad(logits.scalar_type(), denominator);
  at::Tensor bad_target = s.index_targets ? at::zeros({1}, logits.options().dtype(at::kInt)) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sigmoid_focal_loss_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    SigmoidParams<acc_t> p;
    p.weight = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
    p.weight_by_label = s.weight_by_label;
    p.mask = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    p.numel = s.numel;
    p.classes = s.classes;
    p.inner = s.inner;
    p.alpha = static_cast<acc_t>(alpha);
    p.gamma = static_cast<acc_t>(gamma);
    p.at0 = alpha >= 0 ? static_cast<acc_t>(1.0 - alpha) : acc_t(1);
    p.at1 = alpha >= 0 ? static_cast<acc_t>(2.0 * alpha - 1.0) : acc_t(0);
    p.grad_prescale = folded ? static_cast<acc_t>(1.0 / denominator) : acc_t(1);
    const scalar_t* x = logits.data_ptr<scalar_t>();
    scalar_t* loss_out = reduce ? nullptr : loss.data_ptr<scalar_t>();
    scalar_t* grad_out = save_grad ? grad.data_ptr<scalar_t>() : nullptr;
    acc_t* unit_scale = reduce ? nullptr : grad_scale.data_ptr<acc_t>();
    at::Tensor partials;
    double* bl = nullptr;
    long long* bk = nullptr;
    int blocks = 1;

    // Per-block loss sums (double) and kept counts (int64) share one allocation.
    auto alloc_partials = [&]() {
      if (!reduce) return;
      partials = at::empty({2 * static_cast<int64_t>(blocks)}, logits.options().dtype(at::kDouble));
      bl = partials.data_ptr<double>();
      bk = reinterpret_cast<long long*>(bl + blocks);
    };
    auto launch_dense = [&](auto* tg) {
      using target_t = std::remove_const_t<std::remove_pointer_t<decltype(tg)>>;
      constexpr int V = vec_width<scalar_t>();
      auto run = [&](auto kernel, int vec) {
        blocks = grid_size(kernel, ceil_div(s.numel, static_cast<int64_t>(vec) * dense_unroll<scalar_t>()), kThreads);
        alloc_partials();
        kernel<<<blocks, kThreads, 0, stream>>>(x, tg, p, loss_out, grad_out, bl, bk, unit_scale);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      const bool vec = aligned<V>(x, sizeof(scalar_t)) && aligned<V>(tg, sizeof(target_t)) &&
                       aligned<V>(p.mask, sizeof(bool)) && aligned<V>(loss_out, sizeof(scalar_t)) &&
                       aligned<V>(grad_out, sizeof(scalar_t));
      if (!vec) {
        run(sigmoid_dense_kernel<scalar_t, target_t, 1, false>, 1);
        return;
      }
      if constexpr (std::is_same<acc_t, float>::value) {
        if (gamma == 2.0) {
          run(sigmoid_dense_kernel<scalar_t, target_t, V, true>, V);
          return;
        }
      }
      run(sigmoid_dense_kernel<scalar_t, target_t, V, false>, V);
    };
    if (s.index_targets) {
      blocks = grid_size(sigmoid_index_kernel<scalar_t>, s.numel, kThreads);
      alloc_partials();
      sigmoid_index_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          x, targets.data_ptr<int64_t>(), p, loss_out, grad_out, bl, bk, unit_scale, bad_target.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (targets.scalar_type() == logits.scalar_type()) {
      launch_dense(targets.data_ptr<scalar_t>());
    } else {
      launch_dense(targets.data_ptr<float>());
    }
    if (reduce) {
      finalize_kernel<scalar_t><<<1, kThreads, 0, stream>>>(bl, bk, blocks, denominator, folded,
                                                            loss.data_ptr<scalar_t>(), grad_scale.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (s.index_targets) {
    raise_if_bad_targets(bad_target, targets, "sigmoid_focal_loss",
                         "[0, C] = [0, " + std::to_string(s.classes) + "] (C = background)");
  }
  return {loss, grad, grad_scale};
}

Outputs softmax_focal_loss_cuda(const at::Tensor& logits_in, const at::Tensor& targets_in,
                                const c10::optional<at::Tensor>& weight_in, double alpha, double gamma,
                                c10::string_view reduction_name, bool save_grad, bool /*reuse_grad*/) {
  check_softmax_args(logits_in, targets_in, weight_in);
  check_cuda_tensor(logits_in, "softmax_focal_loss: logits");
  const Reduction reduction = parse_reduction(std::string(reduction_name), "softmax_focal_loss");
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor targets = targets_in.contiguous();
  const at::Tensor weight = weight_in.has_value() ? weight_in->to(acc_dtype(logits)).contiguous() : at::Tensor();
  const int64_t rows = logits.size(0), classes = logits.size(1);

  at::Tensor grad = save_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  at::Tensor loss = reduction == kNone ? at::empty({rows}, logits.options()) : at::empty({}, logits.options());
  // finalize_kernel writes grad_scale of the reductions.
  const auto scale_options = logits.options().dtype(acc_dtype(logits));
  at::Tensor grad_scale = reduction == kNone ? at::ones({}, scale_options) : at::empty({}, scale_options);
  if (rows == 0) {
    if (reduction != kNone) {
      loss.zero_();
      grad_scale.fill_(reduction == kMean ? 0.0 : 1.0);
    }
    return {loss, grad, grad_scale};
  }

  const bool reduce = reduction != kNone;
  const double denominator = reduction == kMean ? static_cast<double>(rows) : reduction == kSum ? 1.0 : 0.0;
  const bool folded = folds_reduction_into_grad(logits.scalar_type(), denominator);
  at::Tensor bad_target = at::zeros({1}, logits.options().dtype(at::kInt));
  const auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "softmax_focal_loss_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int blocks = grid_size(softmax_focal_kernel<scalar_t>, rows, kWarpsPerBlock);
    at::Tensor block_loss = reduce ? at::empty({blocks}, logits.options().dtype(at::kDouble)) : at::Tensor();
    at::Tensor block_kept = reduce ? at::empty({blocks}, logits.options().dtype(at::kLong)) : at::Tensor();
    double* bl = reduce ? block_loss.data_ptr<double>() : nullptr;
    long long* bk = reduce ? reinterpret_cast<long long*>(block_kept.data_ptr<int64_t>()) : nullptr;
    softmax_focal_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        logits.data_ptr<scalar_t>(), targets.data_ptr<int64_t>(), weight.defined() ? weight.data_ptr<acc_t>() : nullptr,
        rows, classes, static_cast<acc_t>(alpha), static_cast<acc_t>(gamma),
        folded ? static_cast<acc_t>(1.0 / denominator) : acc_t(1), reduce ? nullptr : loss.data_ptr<scalar_t>(),
        save_grad ? grad.data_ptr<scalar_t>() : nullptr, bl, bk, bad_target.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (reduce) {
      finalize_kernel<scalar_t><<<1, kThreads, 0, stream>>>(bl, bk, blocks, denominator, folded,
                                                            loss.data_ptr<scalar_t>(), grad_scale.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  raise_if_bad_targets(bad_target, targets, "softmax_focal_loss",
                       "[0, C) = [0, " + std::to_string(classes) + ") or < 0 (ignored)");
  return {loss, grad, grad_scale};
}

// out = grad * grad_output * grad_scale on the current stream (out may be grad); grad and out contiguous, grad_output
// one element of grad's dtype.
void launch_scale_grad(const at::Tensor& grad, const at::Tensor& grad_output, const at::Tensor& grad_scale,
                       at::Tensor& out) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "focal_loss_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* go = grad_output.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const acc_t* sc = grad_scale.data_ptr<acc_t>();
    constexpr int V = vec_width<scalar_t>();
    if (aligned<V>(g, sizeof(scalar_t)) && aligned<V>(o, sizeof(scalar_t))) {
      const int blocks =
          grid_size(scale_grad_kernel<scalar_t, V>, ceil_div(n, static_cast<int64_t>(V) * kScaleUnroll), kThreads);
      scale_grad_kernel<scalar_t, V><<<blocks, kThreads, 0, stream>>>(g, go, sc, o, n);
    } else {
      const int blocks = grid_size(scale_grad_kernel<scalar_t, 1>, ceil_div(n, kScaleUnroll), kThreads);
      scale_grad_kernel<scalar_t, 1><<<blocks, kThreads, 0, stream>>>(g, go, sc, o, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor focal_loss_backward_cuda(const at::Tensor& grad_output, const at::Tensor& grad_in,
                                    const at::Tensor& grad_scale) {
  check_backward_args(grad_output, grad_in, grad_scale);
  check_cuda_tensor(grad_in, "focal loss backward: grad");
  if (grad_output.numel() != 1 || grad_output.dim() > grad_in.dim() ||
      grad_scale.scalar_type() != acc_dtype(grad_in)) {
    return scale_grad_broadcast(grad_output, grad_in, grad_scale);
  }
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  at::Tensor out = at::empty_like(grad);
  launch_scale_grad(grad, grad_output.to(grad.scalar_type()).contiguous(), grad_scale, out);
  return out;
}

// The saved gradient scaled in place; a kernel that returns at once when grad_output * grad_scale is 1.
void focal_loss_backward_inplace_cuda(at::Tensor& grad, const at::Tensor& grad_output, const at::Tensor& grad_scale) {
  check_backward_inplace_args(grad_output, grad, grad_scale);
  check_cuda_tensor(grad, "focal loss backward (in place): grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  launch_scale_grad(grad, grad_output, grad_scale, grad);
}

}  // namespace
}  // namespace focal
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("sigmoid_focal_loss", &lss::focal::sigmoid_focal_loss_cuda);
  m.impl("softmax_focal_loss", &lss::focal::softmax_focal_loss_cuda);
  m.impl("_focal_loss_backward", &lss::focal::focal_loss_backward_cuda);
  m.impl("_focal_loss_backward_", &lss::focal::focal_loss_backward_inplace_cuda);
}
