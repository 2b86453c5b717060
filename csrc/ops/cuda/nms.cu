// CUDA NMS. Boxes sorted by decreasing score; a tile kernel writes, for every box i and every 64-box word at or
// after i's own word, the bits of the later boxes that i suppresses: only the upper triangle of the n x ceil(n/64)
// bitmask, packed row after row (about n^2 / 16 bytes: 0.63 GB at 100k boxes). One block then walks the words on
// the device in bands of 8: a warp resolves a band box by box from the band's diagonal block, held in shared
// memory, and the whole block ORs the band's kept rows into the later words while it loads the next band's block.
// Only the kept count crosses to the host.
// batched_nms orders the boxes by class (by score within a class) and treats each class as a segment of its own:
// the tile kernel covers only pairs inside a segment (its own packed triangle, about sum n_c^2 / 16 bytes), and the
// reduction runs one block per segment, all classes at once. Kept boxes are marked by score rank and read back in
// score order. The class counts cross to the host once, to size the launches. Below kSegmentedMinBoxes boxes, where
// that extra round trip would cost more than it saves, batched_nms is one segment whose tile kernel compares labels.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "ops/nms_common.h"

namespace lss {
namespace {

constexpr int kBoxesPerWord = 64;
constexpr int kStripWords = 8;  // column words per mask-kernel block: amortizes the block and its row boxes
constexpr int kBandWords = 8;   // words the reduce kernel resolves between two block barriers
constexpr int kBandRows = kBandWords * kBoxesPerWord;
constexpr int kReduceThreads = 1024;
constexpr int64_t kSegmentedMinBoxes = 2048;  // batched_nms: one segment per class from here on
constexpr int kBandLoads = kBandRows * kBandWords / kReduceThreads;  // band words each reduce thread loads
static_assert(kBandRows * kBandWords % kReduceThreads == 0, "every reduce thread loads the same number of words");
static_assert(kBandRows <= kReduceThreads, "one reduce thread writes each kept box of a band");

// The bitmask keeps only the upper triangle: row i holds its words i / 64 .. words - 1, rows back to back. Returns
// where row i's word 0 would be, so that its word c (c >= i / 64) is at the result + c. Row n's start is the size.
C10_HOST_DEVICE inline int64_t packed_row(int64_t i, int64_t words) {
  const int64_t r = i / kBoxesPerWord;
  return kBoxesPerWord * (r * words - r * (r - 1) / 2) + (i - r * kBoxesPerWord) * (words - r) - r;
}

C10_HOST_DEVICE inline int64_t packed_size(int64_t n, int64_t words) {
  return packed_row(n, words) + n / kBoxesPerWord;
}

// Boxes that suppress only each other (all boxes for nms, one class for batched_nms): contiguous in the sorted
// order, by decreasing score. Its words follow the previous segment's words in the tile kernel's grid; its packed
// triangle starts at mask_base.
struct Segment {
  int64_t first;       // first box in the sorted order
  int64_t count;       // boxes
  int64_t first_word;  // first word in the grid of all segments' words
  int64_t mask_base;   // offset of its packed triangle in the mask
};
static_assert(sizeof(Segment) == 4 * sizeof(int64_t), "segments travel as rows of an int64 tensor");

// The segment that owns grid word `word`: the table's last one starting at or before it (table null: `single`).
__device__ inline Segment segment_of_word(const Segment* __restrict__ table, int64_t count, const Segment& single,
                                          int64_t word) {
  if (table == nullptr) return single;
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].first_word <= word) lo = mid;
    else hi = mid - 1;
  }
  return table[lo];
}

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

// Block (grid word, strip of kStripWords column words of its segment), one thread per row box: for each column word
// of the strip at or after the row word, the bits of the segment's later boxes that the row box suppresses. With
// kClasses, only boxes of the same class (classes[], in the sorted order) suppress each other.
template <typename T, bool kClasses>
__global__ void __launch_bounds__(kBoxesPerWord)
    nms_mask_kernel(const Segment* __restrict__ segments, int64_t num_segments, Segment single,
                    const T* __restrict__ boxes, const int64_t* __restrict__ classes, T threshold,
                    uint64_t* __restrict__ mask) {
  const Segment seg = segment_of_word(segments, num_segments, single, blockIdx.x);
  const int64_t n = seg.count, words = ceil_div(n, kBoxesPerWord);
  const int64_t row_word = blockIdx.x - seg.first_word;
  const int64_t col_begin = upper<int64_t>(static_cast<int64_t>(blockIdx.y) * kStripWords, row_word);
  const int64_t col_end = lower<int64_t>(static_cast<int64_t>(blockIdx.y + 1) * kStripWords, words);
  if (col_begin >= col_end) return;
  boxes += 4 * seg.first;
  mask += seg.mask_base;
  __shared__ Box<T> col_boxes[kStripWords * kBoxesPerWord];
  __shared__ T col_areas[kStripWords * kBoxesPerWord];
  __shared__ int64_t col_classes[kClasses ? kStripWords * kBoxesPerWord : 1];
  const int64_t first_col = col_begin * kBoxesPerWord;
  const int slots = static_cast<int>(col_end - col_begin) * kBoxesPerWord;
  for (int s = threadIdx.x; s < slots; s += kBoxesPerWord) {
    // Slots past the segment's last box hold a zero box; their bits are cleared below.
    const bool real = first_col + s < n;
    const Box<T> b = real ? load_box(boxes, first_col + s) : Box<T>{T(0), T(0), T(0), T(0)};
    col_boxes[s] = b;
    col_areas[s] = box_area(b);
    if (kClasses) col_classes[s] = real ? classes[seg.first + first_col + s] : 0;
  }
  __syncthreads();
  const int64_t i = row_word * kBoxesPerWord + threadIdx.x;
  if (i >= n) return;
  const Box<T> box = load_box(boxes, i);
  const T area = box_area(box);
  const int64_t cls = kClasses ? classes[seg.first + i] : 0;
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
        const bool hit = (!kClasses || col_classes[s] == cls) &&
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

// One block of kReduceThreads per segment. removed (dynamic shared memory, one bit per box) collects the suppressed
// boxes. A kept box at sorted position p gives index[p]: kFlags false (one segment), the kept list keep[0 ..
// *num_kept - 1] in order; kFlags true, kept_flags[index[p]] = true.
template <bool kFlags>
__global__ void __launch_bounds__(kReduceThreads)
    nms_reduce_kernel(const Segment* __restrict__ segments, Segment single, const uint64_t* __restrict__ mask,
                      const int64_t* __restrict__ index, int64_t* __restrict__ keep, int64_t* __restrict__ num_kept,
                      bool* __restrict__ kept_flags) {
  extern __shared__ uint64_t removed[];
  const Segment seg = segments == nullptr ? single : segments[blockIdx.x];
  const int64_t n = seg.count, words = ceil_div(n, kBoxesPerWord);
  mask += seg.mask_base;
  index += seg.first;
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
    const int64_t kept_index = writes_keep ? index[w0 * kBoxesPerWord + kept_in_band[threadIdx.x]] : 0;
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
    if (writes_keep) {
      if (kFlags) kept_flags[kept_index] = true;
      else keep[kept_before_band + threadIdx.x] = kept_index;
    }
    __syncthreads();
  }
  if (!kFlags && threadIdx.x == 0) *num_kept = kept;
}

// Shared memory the reduction may take for its removed bits on the current device (queried once per device; the
// kernels' dynamic shared-memory limit is raised to it at the same time).
int64_t reduce_smem_limit() {
  static std::atomic<int64_t> limits[64];
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 64 && limits[device].load() > 0) return limits[device].load();
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, nms_reduce_kernel<true>));
  const int64_t limit = smem_optin - static_cast<int64_t>(attr.sharedSizeBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(nms_reduce_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(limit)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(nms_reduce_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(limit)));
  if (device < 64) limits[device].store(limit);
  return limit;
}

// Both kernels over `boxes` (sorted, accumulation type, contiguous) cut into segments: `table` on the device
// (num_segments rows) or, when undefined, the one segment `single`; `classes` (sorted, int64), when defined, keeps
// boxes of other classes from suppressing each other inside a segment. max_count: the largest segment's box count;
// total_words, mask_size: the grid's words and the mask's words over all segments. Returns the kept list (one
// segment) or fills kept_flags.
at::Tensor run_nms(const char* op, const at::Tensor& boxes, const at::Tensor& classes, const at::Tensor& table,
                   int64_t num_segments, const Segment& single, int64_t max_count, int64_t total_words,
                   int64_t mask_size, const at::Tensor& index, double iou_threshold, const at::Tensor* kept_flags) {
  const int64_t max_words = ceil_div(max_count, kBoxesPerWord);
  const int64_t smem = max_words * static_cast<int64_t>(sizeof(uint64_t));
  const int64_t smem_left = reduce_smem_limit();
  LSS_CHECK(smem <= smem_left,
            std::string(op) + ": " + std::to_string(max_count) + " boxes" + (kept_flags ? " of one class" : "") +
                " need " + std::to_string(smem) + " bytes of shared memory for the suppression bitmap, more than the " +
                std::to_string(smem_left) +
                " this GPU has left for it; split the boxes (e.g. by class or image) first");
  const auto* segments = table.defined() ? reinterpret_cast<const Segment*>(table.data_ptr<int64_t>()) : nullptr;
  auto mask = at::empty({mask_size}, boxes.options().dtype(at::kLong));
  auto* mask_ptr = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
  auto stream = c10::cuda::getCurrentCUDAStream();
  // total_words fits a grid's x dimension and ceil(max_words / kStripWords) its y dimension: the shared-memory
  // check above bounds max_words by about 30k.
  const dim3 mask_grid(static_cast<unsigned>(total_words), static_cast<unsigned>(ceil_div(max_words, kStripWords)));
  AT_DISPATCH_FLOATING_TYPES(boxes.scalar_type(), "nms_mask_cuda", [&] {
    auto* kernel = classes.defined() ? nms_mask_kernel<scalar_t, true> : nms_mask_kernel<scalar_t, false>;
    kernel<<<mask_grid, kBoxesPerWord, 0, stream>>>(segments, num_segments, single, boxes.data_ptr<scalar_t>(),
                                                    classes.defined() ? classes.data_ptr<int64_t>() : nullptr,
                                                    static_cast<scalar_t>(iou_threshold), mask_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (kept_flags != nullptr) {
    nms_reduce_kernel<true><<<static_cast<unsigned>(num_segments), kReduceThreads, smem, stream>>>(
        segments, single, mask_ptr, index.data_ptr<int64_t>(), nullptr, nullptr, kept_flags->data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return at::Tensor();
  }
  auto keep = at::empty({single.count}, boxes.options().dtype(at::kLong));
  auto num_kept = at::empty({1}, boxes.options().dtype(at::kLong));
  nms_reduce_kernel<false><<<1, kReduceThreads, smem, stream>>>(segments, single, mask_ptr, index.data_ptr<int64_t>(),
                                                                 keep.data_ptr<int64_t>(),
                                                                 num_kept.data_ptr<int64_t>(), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep.narrow(0, 0, num_kept.item<int64_t>()).clone();
}

at::Tensor nms_cuda(const at::Tensor& boxes_, const at::Tensor& scores, double iou_threshold) {
  nms_detail::check_nms_args("nms", boxes_, scores, nullptr);
  check_cuda_tensor(boxes_, "nms: boxes");
  c10::cuda::CUDAGuard guard(boxes_.device());
  const int64_t n = boxes_.size(0);
  if (n == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));
  const auto order = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  const auto boxes = boxes_.index_select(0, order).to(nms_detail::nms_acc_type(boxes_)).contiguous();
  const int64_t words = ceil_div(n, kBoxesPerWord);
  return run_nms("nms", boxes, at::Tensor(), at::Tensor(), 1, Segment{0, n, 0, 0}, n, words, packed_size(n, words),
                 order, iou_threshold, nullptr);
}

// Classes as segments: boxes ordered by class, by decreasing score within a class (stable both times, so equal
// scores keep index order as on the CPU); the reduction marks kept boxes by score rank, read back in score order.
at::Tensor batched_nms_cuda(const at::Tensor& boxes_, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold) {
  nms_detail::check_nms_args("batched_nms", boxes_, scores, &idxs);
  check_cuda_tensor(boxes_, "batched_nms: boxes");
  c10::cuda::CUDAGuard guard(boxes_.device());
  const int64_t n = boxes_.size(0);
  if (n == 0) return at::empty({0}, boxes_.options().dtype(at::kLong));
  const auto by_score = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true)).contiguous();
  if (n < kSegmentedMinBoxes) {
    const auto boxes = boxes_.index_select(0, by_score).to(nms_detail::nms_acc_type(boxes_)).contiguous();
    const auto classes = idxs.index_select(0, by_score).to(at::kLong).contiguous();
    const int64_t words = ceil_div(n, kBoxesPerWord);
    return run_nms("batched_nms", boxes, classes, at::Tensor(), 1, Segment{0, n, 0, 0}, n, words,
                   packed_size(n, words), by_score, iou_threshold, nullptr);
  }
  const auto [classes, rank] = idxs.index_select(0, by_score).to(at::kLong).sort(/*stable=*/true, /*dim=*/0,
                                                                                  /*descending=*/false);
  const auto sorted = by_score.index_select(0, rank);
  const auto boxes = boxes_.index_select(0, sorted).to(nms_detail::nms_acc_type(boxes_)).contiguous();
  const auto counts = std::get<2>(at::unique_consecutive(classes, /*return_inverse=*/false,
                                                         /*return_counts=*/true)).cpu();
  const int64_t num_segments = counts.size(0);
  auto table_host = at::empty({num_segments, 4}, counts.options().pinned_memory(true));
  auto* rows = reinterpret_cast<Segment*>(table_host.data_ptr<int64_t>());
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t first = 0, words = 0, mask_size = 0, max_count = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    rows[s] = Segment{first, count[s], words, mask_size};
    const int64_t w = ceil_div(count[s], kBoxesPerWord);
    first += count[s];
    words += w;
    mask_size += packed_size(count[s], w);
    max_count = std::max(max_count, count[s]);
  }
  const auto table = table_host.to(boxes_.options().dtype(at::kLong), /*non_blocking=*/true);
  auto kept_flags = at::zeros({n}, boxes_.options().dtype(at::kBool));
  run_nms("batched_nms", boxes, at::Tensor(), table, num_segments, Segment{0, 0, 0, 0}, max_count, words, mask_size,
          rank, iou_threshold, &kept_flags);
  return by_score.masked_select(kept_flags);
}

}  // namespace
}  // namespace lss

TORCH_LIBRARY_IMPL(lss, CUDA, m) {
  m.impl("nms", &lss::nms_cuda);
  m.impl("batched_nms", &lss::batched_nms_cuda);
}
