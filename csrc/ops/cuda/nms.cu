// CUDA NMS. Boxes sorted by decreasing score; a tile kernel writes, for every box i and every 64-box word at or
// after i's own word, the bits of the later boxes that i suppresses: only the upper triangle of the n x ceil(n/64)
// bitmask, packed row after row (about n^2 / 16 bytes: 0.63 GB at 100k boxes). One block then walks the words on
// the device in bands of 8: a warp resolves a band box by box from the band's diagonal block, held in shared
// memory, and the whole block ORs the band's kept rows into the later words while it loads the next band's block.
// Only the kept count crosses to the host.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "ops/nms_common.h"

namespace lss {
namespace {

constexpr int kBoxesPerWord = 64;
constexpr int kStripWords = 8;  // column words per mask-kernel block: amortizes the block and its row boxes
constexpr int kBandWords = 8;   // words the reduce kernel resolves between two block barriers
constexpr int kBandRows = kBandWords * kBoxesPerWord;
constexpr int kReduceThreads = 1024;
constexpr int kBandLoads = kBandRows * kBandWords / kReduceThreads;  // band words each reduce thread loads
static_assert(kBandRows * kBandWords % kReduceThreads == 0, "every reduce thread loads the same number of words");
static_assert(kBandRows <= kReduceThreads, "one reduce thread writes each kept box of a band");

// The bitmask keeps only the upper triangle: row i holds its words i / 64 .. words - 1, rows back to back. Returns
// where row i's word 0 would be, so that its word c (c >= i / 64) is at the result + c. Row n's start is the size.
C10_HOST_DEVICE inline int64_t packed_row(int64_t i, int64_t words) {
  const int64_t r = i / kBoxesPerWord;
  return kBoxesPerWord * (r * words - r * (r - 1) / 2) + (i - r * kBoxesPerWord) * (words - r) - r;
}

int64_t packed_size(int64_t n, int64_t words) { return packed_row(n, words) + n / kBoxesPerWord; }

// IoU rounded step by step (no fused multiply-add), so the GPU matches the CPU kernel bit for bit.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline float min_of(float a, float b) { return fminf(a, b); }
__device__ inline float max_of(float a, float b) { return fmaxf(a, b); }
__device__ inline double min_of(double a, double b) { return fmin(a, b); }
__device__ inline double max_of(double a, double b) { return fmax(a, b); }

template <typename T>
C10_HOST_DEVICE inline T lower(T a, T b) { return b < a ? b : a; }
template <typename T>
C10_HOST_DEVICE inline T upper(T a, T b) { return a < b ? b : a; }

template <typename T>
struct alignas(4 * sizeof(T)) Box {
  T x1, y1, x2, y2;
};

template <typename T>
__device__ inline Box<T> load_box(const T* boxes, int64_t i) {
  return {boxes[4 * i], boxes[4 * i + 1], boxes[4 * i + 2], boxes[4 * i + 3]};
}

template <typename T>
__device__ inline T box_area(const Box<T>& b) { return mul_rn(sub_rn(b.x2, b.x1), sub_rn(b.y2, b.y1)); }

// IoU(a, b) > threshold, as the CPU kernel decides it. fmin / fmax differ from its std::min / std::max only on a
// NaN operand (whose box has a NaN area, so its IoU is NaN anyway) and on the sign of a zero (which no comparison
// below sees). Most pairs do not overlap: a width or height that is not positive (or NaN) makes the intersection 0
// or NaN, whose IoU is never above a threshold >= 0, so the division is skipped.
template <typename T>
__device__ inline bool suppresses(const Box<T>& a, T area_a, const Box<T>& b, T area_b, T threshold,
                                  bool nonneg_threshold) {
  const T w = sub_rn(min_of(a.x2, b.x2), max_of(a.x1, b.x1));
  const T h = sub_rn(min_of(a.y2, b.y2), max_of(a.y1, b.y1));
  if (nonneg_threshold && !(w > T(0) && h > T(0))) return false;
  const T inter = mul_rn(upper(w, T(0)), upper(h, T(0)));
  return div_rn(inter, sub_rn(add_rn(area_a, area_b), inter)) > threshold;
}

// Block (row word, strip of kStripWords column words), one thread per row box: for each column word of the strip
// at or after the row word, the bits of the column boxes after the row box that it suppresses.
template <typename T, bool kBatched>
__global__ void __launch_bounds__(kBoxesPerWord)
    nms_mask_kernel(int64_t n, int64_t words, const T* __restrict__ boxes, const int64_t* __restrict__ classes,
                    T threshold, uint64_t* __restrict__ mask) {
  const int64_t row_word = blockIdx.x;
  const int64_t col_begin = upper<int64_t>(static_cast<int64_t>(blockIdx.y) * kStripWords, row_word);
  const int64_t col_end = lower<int64_t>(static_cast<int64_t>(blockIdx.y + 1) * kStripWords, words);
  if (col_begin >= col_end) return;
  __shared__ Box<T> col_boxes[kStripWords * kBoxesPerWord];
  __shared__ T col_areas[kStripWords * kBoxesPerWord];
  __shared__ int64_t col_classes[kBatched ? kStripWords * kBoxesPerWord : 1];
  const int64_t first_col = col_begin * kBoxesPerWord;
  const int slots = static_cast<int>(col_end - col_begin) * kBoxesPerWord;
  for (int s = threadIdx.x; s < slots; s += kBoxesPerWord) {
    // Slots past the last box hold a zero box; their bits are cleared below.
    const bool real = first_col + s < n;
    const Box<T> b = real ? load_box(boxes, first_col + s) : Box<T>{T(0), T(0), T(0), T(0)};
    col_boxes[s] = b;
    col_areas[s] = box_area(b);
    if (kBatched) col_classes[s] = real ? classes[first_col + s] : 0;
  }
  __syncthreads();
  const int64_t i = row_word * kBoxesPerWord + threadIdx.x;
  if (i >= n) return;
  const Box<T> box = load_box(boxes, i);
  const T area = box_area(box);
  const int64_t cls = kBatched ? classes[i] : 0;
  const bool nonneg_threshold = threshold >= T(0);
  uint64_t* row = mask + packed_row(i, words);
  for (int64_t c = col_begin; c < col_end; ++c) {
    const int base = static_cast<int>(c - col_begin) * kBoxesPerWord;
    uint64_t bits = 0;
    for (int g = 0; g < kBoxesPerWord; g += 8) {
      unsigned hits = 0;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int s = base + g + u;
        const bool hit = (!kBatched || col_classes[s] == cls) &&
                         suppresses(box, area, col_boxes[s], col_areas[s], threshold, nonneg_threshold);
        hits |= static_cast<unsigned>(hit) << u;
      }
      bits |= static_cast<uint64_t>(hits) << g;
    }
    // Keep only later boxes (above the diagonal) that exist (the last word may be partial).
    if (c == row_word) bits &= ~((uint64_t(2) << threadIdx.x) - 1);
    if (c == words - 1 && n % kBoxesPerWord != 0) bits &= (uint64_t(1) << (n % kBoxesPerWord)) - 1;
    row[c] = bits;
  }
}

// This thread's share of the diagonal block of the band starting at word w0 (its kBandRows rows' words w0 ..
// w0 + kBandWords - 1), zero outside the stored upper triangle and past the last box or word.
__device__ inline void load_band(uint64_t (&out)[kBandLoads], int64_t w0, int64_t n, int64_t words,
                                 const uint64_t* __restrict__ mask) {
#pragma unroll
  for (int u = 0; u < kBandLoads; ++u) {
    const int e = threadIdx.x + u * kReduceThreads;
    const int q = e / kBandWords, k = e % kBandWords;
    const int64_t i = w0 * kBoxesPerWord + q;
    const bool stored = i < n && w0 + k < words && k >= q / kBoxesPerWord;
    out[u] = stored ? mask[packed_row(i, words) + w0 + k] : 0;
  }
}

// One block of kReduceThreads. removed (dynamic shared memory, one bit per box) collects the suppressed boxes.
__global__ void __launch_bounds__(kReduceThreads)
    nms_reduce_kernel(int64_t n, int64_t words, const uint64_t* __restrict__ mask,
                      const int64_t* __restrict__ order, int64_t* __restrict__ keep,
                      int64_t* __restrict__ num_kept) {
  extern __shared__ uint64_t removed[];
  __shared__ uint64_t band[kBandRows][kBandWords];  // [q][k]: row w0 * 64 + q, word w0 + k
  __shared__ int64_t kept_rows[kBandRows];           // packed_row of the band's kept boxes, in order
  __shared__ int kept_in_band[kBandRows];            // their positions in the band (0 .. kBandRows - 1)
  __shared__ int band_kept;
  __shared__ int64_t kept_before_band;
  for (int64_t j = threadIdx.x; j < words; j += kReduceThreads) removed[j] = 0;
  uint64_t next[kBandLoads];
  load_band(next, 0, n, words, mask);
  int64_t kept = 0;  // meaningful in warp 0, where every lane holds the same value
  for (int64_t w0 = 0; w0 < words; w0 += kBandWords) {
#pragma unroll
    for (int u = 0; u < kBandLoads; ++u) {
      const int e = threadIdx.x + u * kReduceThreads;
      band[e / kBandWords][e % kBandWords] = next[u];
    }
    __syncthreads();
    const int band_words = static_cast<int>(lower<int64_t>(words - w0, kBandWords));
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      // Lane k < band_words: the removed bits of word w0 + k, growing as the band's kept boxes are found.
      uint64_t rem = lane < band_words ? removed[w0 + lane] : 0;
      int nk = 0;
      for (int k = 0; k < band_words; ++k) {
        const int64_t first = (w0 + k) * kBoxesPerWord;
        const int rows = static_cast<int>(lower<int64_t>(n - first, kBoxesPerWord));
        const uint64_t real = rows == kBoxesPerWord ? ~uint64_t(0) : (uint64_t(1) << rows) - 1;
        const int64_t word_row0 = packed_row(first, words), row_stride = words - (w0 + k);
        // Boxes of word w0 + k still to visit that nothing has suppressed, visited in order: only kept ones.
        uint64_t open = ~__shfl_sync(0xffffffffu, rem, k) & real;
        while (open != 0) {
          const int t = __ffsll(static_cast<long long>(open)) - 1;
          const int q = k * kBoxesPerWord + t;
          if (lane == 0) {
            kept_rows[nk] = word_row0 + t * row_stride;
            kept_in_band[nk] = q;
          }
          ++nk;
          open &= ~(band[q][k] | (uint64_t(1) << t));
          if (lane > k && lane < band_words) rem |= band[q][lane];
        }
      }
      if (lane == 0) {
        band_kept = nk;
        kept_before_band = kept;
      }
      kept += nk;
    }
    __syncthreads();
    // The next band's loads and the kept boxes' indices go out first, so that their latency overlaps the OR pass.
    if (w0 + kBandWords < words) load_band(next, w0 + kBandWords, n, words, mask);
    const int nk = band_kept;
    const bool writes_keep = threadIdx.x < nk;
    const int64_t kept_index = writes_keep ? order[w0 * kBoxesPerWord + kept_in_band[threadIdx.x]] : 0;
    // Each later word gets `slices` threads (when there are fewer later words than threads), each ORing every
    // slices-th kept row, so that all threads keep loads in flight until the last bands.
    const int64_t later = words - (w0 + band_words);
    const int slices = static_cast<int>(lower<int64_t>(upper<int64_t>(kReduceThreads / upper<int64_t>(later, 1), 1),
                                                       upper(nk, 1)));
    for (int64_t item = threadIdx.x; item < later * slices; item += kReduceThreads) {
      const int64_t j = w0 + band_words + item % later;
      int q = static_cast<int>(item / later);
      uint64_t r = 0;
      // Eight independent loads in flight per thread keep the single block from stalling on memory latency.
      for (; q + 7 * slices < nk; q += 8 * slices) {
        uint64_t v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = mask[kept_rows[q + u * slices] + j];
#pragma unroll
        for (int u = 0; u < 8; ++u) r |= v[u];
      }
      for (; q < nk; q += slices) r |= mask[kept_rows[q] + j];
      if (r != 0) atomicOr(reinterpret_cast<unsigned long long*>(removed + j), static_cast<unsigned long long>(r));
    }
    if (writes_keep) keep[kept_before_band + threadIdx.x] = kept_index;
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
  const int64_t smem = words * static_cast<int64_t>(sizeof(uint64_t));
  int device = 0, smem_optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes reduce_attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&reduce_attr, nms_reduce_kernel));
  const int64_t smem_left = smem_optin - static_cast<int64_t>(reduce_attr.sharedSizeBytes);
  LSS_CHECK(smem <= smem_left,
            std::string(op) + ": " + std::to_string(n) + " boxes need " + std::to_string(smem) +
                " bytes of shared memory for the suppression bitmap, more than the " + std::to_string(smem_left) +
                " this GPU has left for it; split the boxes (e.g. by class or image) first");
  const auto order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  const auto boxes = boxes_.index_select(0, order).to(nms_detail::nms_acc_type(boxes_)).contiguous();
  at::Tensor classes;
  if (idxs != nullptr) classes = idxs->index_select(0, order).to(at::kLong).contiguous();
  auto mask = at::empty({packed_size(n, words)}, boxes_.options().dtype(at::kLong));
  auto keep = at::empty({n}, boxes_.options().dtype(at::kLong));
  auto num_kept = at::empty({1}, boxes_.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  // words fits a grid's x dimension and ceil(words / kStripWords) its y dimension: the shared-memory check above
  // bounds words by about 30k.
  const dim3 mask_grid(static_cast<unsigned>(words), static_cast<unsigned>(ceil_div(words, kStripWords)));
  AT_DISPATCH_FLOATING_TYPES(boxes.scalar_type(), "nms_mask_cuda", [&] {
    auto* kernel = idxs != nullptr ? nms_mask_kernel<scalar_t, true> : nms_mask_kernel<scalar_t, false>;
    kernel<<<mask_grid, kBoxesPerWord, 0, stream>>>(
        n, words, boxes.data_ptr<scalar_t>(), idxs != nullptr ? classes.data_ptr<int64_t>() : nullptr,
        static_cast<scalar_t>(iou_threshold), reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  C10_CUDA_CHECK(cudaFuncSetAttribute(nms_reduce_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
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
