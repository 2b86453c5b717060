// CUDA kernels of the focal loss ops (schemas in ../focal_loss.cpp, per-element math in ../focal_loss.h).
//
// One pass over logits and targets: each thread computes loss and, when asked, d loss / d logits of its elements
// (vectorized 4-wide loads where every pointer allows), each block writes one partial sum, and a one-block kernel
// adds the partials in a fixed order in double, so "mean"/"sum" are deterministic run to run on one GPU.
// Class-index targets are range-checked inside the kernel (bad rows get NaN, never an out-of-bounds read); the
// host reads the error flag after the kernel to raise a clear error, which waits for the kernel (skipped while a
// CUDA graph is being captured, where the NaN loss remains the signal).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>

#include "ops/focal_loss.h"

namespace lss {
namespace focal {
namespace {

constexpr int kVec = 4;
constexpr int kWarpsPerBlock = kThreads / 32;

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

template <typename acc_t>
struct SigmoidParams {
  const acc_t* weight;
  const bool* mask;
  int64_t numel;
  int64_t classes;
  int64_t inner;
  acc_t alpha;
  acc_t gamma;
};

// Loss and gradient of element i whose logit is x; dense target t (unused for class indices, read from targets).
// Returns false for masked-out elements (zero loss and gradient).
template <typename acc_t, typename target_t>
__device__ __forceinline__ bool sigmoid_element(const SigmoidParams<acc_t>& p, const target_t* targets, int64_t i,
                                                acc_t x, acc_t t, bool keep, acc_t& loss, acc_t& grad,
                                                int* bad_target) {
  int64_t cls;
  if constexpr (std::is_same<target_t, int64_t>::value) {
    // Labels are checked before the mask so that CPU and CUDA reject the same inputs.
    const int64_t row = i / p.classes;
    cls = i - row * p.classes;
    const int64_t label = targets[row];
    if (label < 0 || label > p.classes) {
      *bad_target = 1;
      loss = grad = std::numeric_limits<acc_t>::quiet_NaN();
      return true;
    }
    t = label == cls ? acc_t(1) : acc_t(0);
  } else {
    cls = p.weight != nullptr ? (i / p.inner) % p.classes : 0;
  }
  if (!keep) {
    loss = acc_t(0);
    grad = acc_t(0);
    return false;
  }
  sigmoid_focal<acc_t>(x, t, p.alpha, p.gamma, loss, grad);
  if (p.weight != nullptr) {
    loss *= p.weight[cls];
    grad *= p.weight[cls];
  }
  return true;
}

// VEC > 1 only for dense targets with every pointer aligned to VEC elements; the tail runs element by element.
template <typename scalar_t, typename target_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    sigmoid_focal_kernel(const scalar_t* __restrict__ logits, const target_t* __restrict__ targets,
                         SigmoidParams<at::opmath_type<scalar_t>> p, scalar_t* __restrict__ loss_out,
                         scalar_t* __restrict__ grad_out, double* __restrict__ block_loss,
                         long long* __restrict__ block_kept, int* __restrict__ bad_target) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kIndex = std::is_same<target_t, int64_t>::value;
  static_assert(!kIndex || VEC == 1, "class-index targets are read per row, not vectorized");
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  acc_t sum = acc_t(0);
  long long kept = 0;

  const int64_t nvec = p.numel / VEC;
  for (int64_t v = first; v < nvec; v += stride) {
    const int64_t base = v * VEC;
    const auto xs = *reinterpret_cast<const Pack<scalar_t, VEC>*>(logits + base);
    Pack<target_t, VEC> ts;
    if constexpr (!kIndex) ts = *reinterpret_cast<const Pack<target_t, VEC>*>(targets + base);
    Pack<bool, VEC> ms;
    if (p.mask != nullptr) {
      ms = *reinterpret_cast<const Pack<bool, VEC>*>(p.mask + base);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) ms.v[k] = true;
    }
    Pack<scalar_t, VEC> ls, gs;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_t l, g;
      const acc_t t = kIndex ? acc_t(0) : static_cast<acc_t>(ts.v[k]);
      kept += sigmoid_element<acc_t, target_t>(p, targets, base + k, static_cast<acc_t>(xs.v[k]), t, ms.v[k], l, g,
                                               bad_target);
      sum += l;
      ls.v[k] = static_cast<scalar_t>(l);
      gs.v[k] = static_cast<scalar_t>(g);
    }
    if (loss_out != nullptr) *reinterpret_cast<Pack<scalar_t, VEC>*>(loss_out + base) = ls;
    if (grad_out != nullptr) *reinterpret_cast<Pack<scalar_t, VEC>*>(grad_out + base) = gs;
  }
  for (int64_t i = nvec * VEC + first; i < p.numel; i += stride) {
    acc_t l, g;
    const acc_t t = kIndex ? acc_t(0) : static_cast<acc_t>(targets[i]);
    const bool keep = p.mask == nullptr || p.mask[i];
    kept += sigmoid_element<acc_t, target_t>(p, targets, i, static_cast<acc_t>(logits[i]), t, keep, l, g,
                                             bad_target);
    sum += l;
    if (loss_out != nullptr) loss_out[i] = static_cast<scalar_t>(l);
    if (grad_out != nullptr) grad_out[i] = static_cast<scalar_t>(g);
  }
  if (block_loss != nullptr) store_block_partial<acc_t>(sum, kept, block_loss, block_kept);
}

// One warp per sample row: max, sum of exponentials, then the gradient row, all reading the row from cache after
// the first touch.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    softmax_focal_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ targets,
                         const at::opmath_type<scalar_t>* __restrict__ weight, int64_t rows, int64_t classes,
                         at::opmath_type<scalar_t> alpha, at::opmath_type<scalar_t> gamma,
                         scalar_t* __restrict__ loss_out, scalar_t* __restrict__ grad_out,
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

// Adds the block partials in a fixed order; loss = total / denominator (denominator < 0: the kept count).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    finalize_kernel(const double* __restrict__ block_loss, const long long* __restrict__ block_kept, int nblocks,
                    double denominator, scalar_t* __restrict__ loss, at::opmath_type<scalar_t>* __restrict__ grad_scale) {
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
    *grad_scale = static_cast<at::opmath_type<scalar_t>>(scale);
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    scale_grad_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ grad_output,
                      const at::opmath_type<scalar_t>* __restrict__ grad_scale, scalar_t* __restrict__ out, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t f = static_cast<acc_t>(*grad_output) * *grad_scale;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += stride) {
    auto g = *reinterpret_cast<const Pack<scalar_t, VEC>*>(grad + v * VEC);
#pragma unroll
    for (int k = 0; k < VEC; ++k) g.v[k] = static_cast<scalar_t>(static_cast<acc_t>(g.v[k]) * f);
    *reinterpret_cast<Pack<scalar_t, VEC>*>(out + v * VEC) = g;
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride) out[i] = static_cast<scalar_t>(static_cast<acc_t>(grad[i]) * f);
}

// Blocks for a grid-stride loop of `kernel` over `work` items: one resident wave (the occupancy limit times the SM
// count), or fewer for small work, so no block waits for a second wave and the partials stay short.
template <typename Kernel>
int grid_size(Kernel kernel, int64_t work, int per_block) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  const int64_t fill =
      static_cast<int64_t>(std::max(per_sm, 1)) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
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
                                double alpha, double gamma, c10::string_view reduction_name, bool save_grad) {
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
  at::Tensor grad_scale = at::ones({}, logits.options().dtype(acc_dtype(logits)));
  if (s.numel == 0) {
    if (reduction != kNone) {
      loss.zero_();
      if (reduction == kMean) grad_scale.zero_();
    }
    return {loss, grad, grad_scale};
  }

  const bool reduce = reduction != kNone;
  at::Tensor bad_target = s.index_targets ? at::zeros({1}, logits.options().dtype(at::kInt)) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sigmoid_focal_loss_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    SigmoidParams<acc_t> p;
    p.weight = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
    p.mask = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    p.numel = s.numel;
    p.classes = s.classes;
    p.inner = s.inner;
    p.alpha = static_cast<acc_t>(alpha);
    p.gamma = static_cast<acc_t>(gamma);
    const scalar_t* x = logits.data_ptr<scalar_t>();
    scalar_t* loss_out = reduce ? nullptr : loss.data_ptr<scalar_t>();
    scalar_t* grad_out = save_grad ? grad.data_ptr<scalar_t>() : nullptr;
    int* bad = s.index_targets ? bad_target.data_ptr<int>() : nullptr;
    at::Tensor block_loss, block_kept;
    double* bl = nullptr;
    long long* bk = nullptr;
    int blocks = 1;

    auto launch = [&](auto kernel, auto* tg, int vec) {
      blocks = grid_size(kernel, ceil_div(s.numel, vec), kThreads);
      if (reduce) {
        block_loss = at::empty({blocks}, logits.options().dtype(at::kDouble));
        block_kept = at::empty({blocks}, logits.options().dtype(at::kLong));
        bl = block_loss.data_ptr<double>();
        bk = reinterpret_cast<long long*>(block_kept.data_ptr<int64_t>());
      }
      kernel<<<blocks, kThreads, 0, stream>>>(x, tg, p, loss_out, grad_out, bl, bk, bad);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto launch_dense = [&](auto* tg) {
      using target_t = std::remove_const_t<std::remove_pointer_t<decltype(tg)>>;
      const bool vec = aligned<kVec>(x, sizeof(scalar_t)) && aligned<kVec>(tg, sizeof(target_t)) &&
                       aligned<kVec>(p.mask, sizeof(bool)) && aligned<kVec>(loss_out, sizeof(scalar_t)) &&
                       aligned<kVec>(grad_out, sizeof(scalar_t));
      if (vec) {
        launch(sigmoid_focal_kernel<scalar_t, target_t, kVec>, tg, kVec);
      } else {
        launch(sigmoid_focal_kernel<scalar_t, target_t, 1>, tg, 1);
      }
    };
    if (s.index_targets) {
      launch(sigmoid_focal_kernel<scalar_t, int64_t, 1>, targets.data_ptr<int64_t>(), 1);
    } else if (targets.scalar_type() == logits.scalar_type()) {
      launch_dense(targets.data_ptr<scalar_t>());
    } else {
      launch_dense(targets.data_ptr<float>());
    }
    if (reduce) {
      double denominator = 1.0;
      if (reduction == kMean) {
        denominator = s.index_targets ? static_cast<double>(s.rows) : (mask.defined() ? -1.0 : double(s.numel));
      }
      finalize_kernel<scalar_t><<<1, kThreads, 0, stream>>>(bl, bk, blocks, denominator, loss.data_ptr<scalar_t>(),
                                                            grad_scale.data_ptr<acc_t>());
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
                                c10::string_view reduction_name, bool save_grad) {
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
  at::Tensor grad_scale = at::ones({}, logits.options().dtype(acc_dtype(logits)));
  if (rows == 0) {
    if (reduction != kNone) {
      loss.zero_();
      if (reduction == kMean) grad_scale.zero_();
    }
    return {loss, grad, grad_scale};
  }

  const bool reduce = reduction != kNone;
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
        reduce ? nullptr : loss.data_ptr<scalar_t>(), save_grad ? grad.data_ptr<scalar_t>() : nullptr, bl, bk,
        bad_target.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (reduce) {
      finalize_kernel<scalar_t><<<1, kThreads, 0, stream>>>(bl, bk, blocks,
                                                            reduction == kMean ? static_cast<double>(rows) : 1.0,
                                                            loss.data_ptr<scalar_t>(), grad_scale.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  raise_if_bad_targets(bad_target, targets, "softmax_focal_loss",
                       "[0, C) = [0, " + std::to_string(classes) + ") or < 0 (ignored)");
  return {loss, grad, grad_scale};
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
  const at::Tensor go = grad_output.to(grad.scalar_type()).contiguous();
  at::Tensor out = at::empty_like(grad);
  const int64_t n = grad.numel();
  if (n == 0) return out;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "focal_loss_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const acc_t* sc = grad_scale.data_ptr<acc_t>();
    if (aligned<kVec>(g, sizeof(scalar_t)) && aligned<kVec>(o, sizeof(scalar_t))) {
      const int blocks = grid_size(scale_grad_kernel<scalar_t, kVec>, ceil_div(n, kVec), kThreads);
      scale_grad_kernel<scalar_t, kVec><<<blocks, kThreads, 0, stream>>>(g, go.data_ptr<scalar_t>(), sc, o, n);
    } else {
      const int blocks = grid_size(scale_grad_kernel<scalar_t, 1>, n, kThreads);
      scale_grad_kernel<scalar_t, 1><<<blocks, kThreads, 0, stream>>>(g, go.data_ptr<scalar_t>(), sc, o, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace focal
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("sigmoid_focal_loss", &lss::focal::sigmoid_focal_loss_cuda);
  m.impl("softmax_focal_loss", &lss::focal::softmax_focal_loss_cuda);
  m.impl("_focal_loss_backward", &lss::focal::focal_loss_backward_cuda);
}
