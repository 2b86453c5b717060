// CUDA NMS. Boxes sorted by decreasing score; a 64 x 64 tile kernel writes, for every box i and 64-box word j,
// the bits of the later boxes it suppresses (n x ceil(n/64) uint64: 1.25 GB at 100k boxes). One block then walks
// the words in order on the device: a warp resolves the 64 boxes of word w serially from the diagonal word, and
// the whole block ORs the rows of the kept ones into the later words. Only the kept count crosses to the host.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "ops/nms_common.h"

namespace lss {
namespace {

constexpr int kBoxesPerWord = 64;
constexpr int kReduceThreads = 1024;

// IoU rounded step by step (no fused multiply-add), so the GPU matches the CPU kernel bit for bit.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// std::min / std::max semantics (not fmin / fmax), as in the CPU kernel, so NaN coordinates agree too.
template <typename T>
__device__ inline T lower(T a, T b) { return b < a ? b : a; }
template <typename T>
__device__ inline T upper(T a, T b) { return a < b ? b : a; }

template <typename T>
__device__ inline bool iou_above(const T* a, const T* b, T threshold) {
  const T w = upper(sub_rn(lower(a[2], b[2]), upper(a[0], b[0])), T(0));
  const T h = upper(sub_rn(lower(a[3], b[3]), upper(a[1], b[1])), T(0));
  const T inter = mul_rn(w, h);
  const T area_a = mul_rn(sub_rn(a[2], a[0]), sub_rn(a[3], a[1]));
  const T area_b = mul_rn(sub_rn(b[2], b[0]), sub_rn(b[3], b[1]));
  return div_rn(inter, sub_rn(add_rn(area_a, area_b), inter)) > threshold;
}

// Block (col word, row word), 64 threads: row box i gets the bits of the col-word boxes j > i it suppresses.
template <typename T>
__global__ void nms_mask_kernel(int64_t n, int64_t words, const T* __restrict__ boxes,
                                const int64_t* __restrict__ classes, T threshold, uint64_t* __restrict__ mask) {
  const int64_t row_word = blockIdx.y, col_word = blockIdx.x;
  if (col_word < row_word) return;
  const int rows = static_cast<int>(lower<int64_t>(n - row_word * kBoxesPerWord, kBoxesPerWord));
  const int cols = static_cast<int>(lower<int64_t>(n - col_word * kBoxesPerWord, kBoxesPerWord));
  __shared__ T col_boxes[kBoxesPerWord * 4];
  __shared__ int64_t col_classes[kBoxesPerWord];
  if (threadIdx.x < cols) {
    const int64_t j = col_word * kBoxesPerWord + threadIdx.x;
    for (int q = 0; q < 4; ++q) col_boxes[threadIdx.x * 4 + q] = boxes[j * 4 + q];
    col_classes[threadIdx.x] = classes != nullptr ? classes[j] : 0;
  }
  __syncthreads();
  if (threadIdx.x >= rows) return;
  const int64_t i = row_word * kBoxesPerWord + threadIdx.x;
  T box[4];
  for (int q = 0; q < 4; ++q) box[q] = boxes[i * 4 + q];
  const int64_t cls = classes != nullptr ? classes[i] : 0;
  uint64_t bits = 0;
  for (int j = row_word == col_word ? threadIdx.x + 1 : 0; j < cols; ++j) {
    if (col_classes[j] == cls && iou_above(box, col_boxes + j * 4, threshold)) bits |= uint64_t(1) << j;
  }
  mask[i * words + col_word] = bits;
}

// One block. removed (dynamic shared memory, one bit per box) collects the suppressed boxes word by word.
__global__ void nms_reduce_kernel(int64_t n, int64_t words, const uint64_t* __restrict__ mask,
                                  const int64_t* __restrict__ order, int64_t* __restrict__ keep,
                                  int64_t* __restrict__ num_kept) {
  extern __shared__ uint64_t removed[];
  __shared__ int kept_rows[kBoxesPerWord];  // rows of word w that were kept, ascending
  __shared__ int num_kept_rows;
  for (int64_t j = threadIdx.x; j < words; j += blockDim.x) removed[j] = 0;
  __syncthreads();
  int64_t kept = 0;  // meaningful in warp 0, where every lane holds the same value
  for (int64_t w = 0; w < words; ++w) {
    const int64_t first = w * kBoxesPerWord;
    const int rows = static_cast<int>(lower<int64_t>(n - first, kBoxesPerWord));
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const uint64_t d0 = lane < rows ? mask[(first + lane) * words + w] : 0;
      const uint64_t d1 = lane + 32 < rows ? mask[(first + lane + 32) * words + w] : 0;
      uint64_t rem = removed[w], bits = 0;
      for (int t = 0; t < rows; ++t) {
        const uint64_t d = __shfl_sync(0xffffffffu, t < 32 ? d0 : d1, t & 31);
        if (!((rem >> t) & 1)) {
          bits |= uint64_t(1) << t;
          rem |= d;
        }
      }
      for (int t = lane; t < rows; t += 32) {
        if ((bits >> t) & 1) {
          const int rank = __popcll(bits & ((uint64_t(1) << t) - 1));
          keep[kept + rank] = order[first + t];
          kept_rows[rank] = t;
        }
      }
      kept += __popcll(bits);
      if (lane == 0) num_kept_rows = __popcll(bits);
    }
    __syncthreads();
    const int nk = num_kept_rows;
    for (int64_t j = w + 1 + threadIdx.x; j < words; j += blockDim.x) {
      uint64_t r = removed[j];
      int q = 0;
      // Eight independent loads in flight per thread keep the single block from stalling on memory latency.
      for (; q + 8 <= nk; q += 8) {
        uint64_t v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = mask[(first + kept_rows[q + u]) * words + j];
#pragma unroll
        for (int u = 0; u < 8; ++u) r |= v[u];
      }
      for (; q < nk; ++q) r |= mask[(first + kept_rows[q]) * words + j];
      removed[j] = r;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *num_kept = kept;
}

at::Tensor nms_cuda_common(const char* op, const at::Tensor& boxes_, const at::Tensor& scores,
                           const at::Tensor* idxs, double iou_threshold) {
  nms_detail::check_nms_args(op, boxes_, scores, idxs);
  check_cuda_tensor(boxes_, "nms: boxes");
  c10::cuda::CUDAGuard guard(boxes_.device());
  const int64_t n = boxes_.size(0);
  if (n == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));
  const int64_t words = ceil_div(n, kBoxesPerWord);
  LSS_CHECK(words <= 65535, std::string(op) + ": at most " + std::to_string(65535 * kBoxesPerWord) +
                                 " boxes are supported, got " + std::to_string(n));
  const int64_t smem = words * static_cast<int64_t>(sizeof(uint64_t));
  int device = 0, smem_optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // 1 KiB of margin for the kernel's static shared memory.
  LSS_CHECK(smem + 1024 <= static_cast<int64_t>(smem_optin),
            std::string(op) + ": " + std::to_string(n) + " boxes need " + std::to_string(smem) +
                " bytes of shared memory for the suppression bitmap, more than this GPU's " +
                std::to_string(smem_optin) + "; split the boxes (e.g. by class or image) first");
  const auto order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  const auto boxes = boxes_.index_select(0, order).to(nms_detail::nms_acc_type(boxes_)).contiguous();
  at::Tensor classes;
  if (idxs != nullptr) classes = idxs->index_select(0, order).to(at::kLong).contiguous();
  auto mask = at::empty({n, words}, boxes_.options().dtype(at::kLong));
  auto keep = at::empty({n}, boxes_.options().dtype(at::kLong));
  auto num_kept = at::empty({1}, boxes_.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 mask_grid(static_cast<unsigned>(words), static_cast<unsigned>(words));
  AT_DISPATCH_FLOATING_TYPES(boxes.scalar_type(), "nms_mask_cuda", [&] {
    nms_mask_kernel<scalar_t><<<mask_grid, kBoxesPerWord, 0, stream>>>(
        n, words, boxes.data_ptr<scalar_t>(), idxs != nullptr ? classes.data_ptr<int64_t>() : nullptr,
        static_cast<scalar_t>(iou_threshold), reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(nms_reduce_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  nms_reduce_kernel<<<1, kReduceThreads, smem, stream>>>(n, words,
                                                         reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>()),
                                                         order.data_ptr<int64_t>(), keep.data_ptr<int64_t>(),
                                                         num_kept.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep.narrow(0, 0, num_kept.item<int64_t>()).clone();
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  return nms_cuda_common("nms", boxes, scores, nullptr, iou_threshold);
}

at::Tensor batched_nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold) {
  return nms_cuda_common("batched_nms", boxes, scores, &idxs, iou_threshold);
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("nms", &lss::nms_cuda);
  m.impl("batched_nms", &lss::batched_nms_cuda);
}
