import pytest
import torch
import torchvision

from conftest import devices
from benchmarks.roi import _boxes
from lss.ops import batched_nms, nms, nms_reference
from lss.ops._ext import has_ext


def random_boxes(n, seed=0, device="cpu", dtype=torch.float32, offset=0.0, extent=100.0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * extent + offset
    wh = torch.rand(n, 2, generator=g) * extent * 0.3 + 1.0
    scores = torch.rand(n, generator=g)
    return torch.cat([xy, xy + wh], 1).to(device=device, dtype=dtype), scores.to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7])
def test_matches_torchvision(device, n, threshold):
    boxes, scores = random_boxes(n, seed=n, device=device)
    keep = nms(boxes, scores, threshold)
    assert keep.dtype == torch.long
    assert torch.equal(keep, torchvision.ops.nms(boxes, scores, threshold))
    if n <= 65:
        assert torch.equal(keep.cpu(), nms_reference(boxes.cpu(), scores.cpu(), threshold))


@pytest.mark.parametrize("device", devices())
def test_threshold_is_strict(device):
    # 10 x 10 boxes shifted by dx have IoU (10 - dx) / (10 + dx): 0.50037 at 3.33, 0.49925 at 3.34
    boxes = torch.tensor([[0, 0, 10, 10], [3.33, 0, 13.33, 10], [20, 0, 30, 10], [23.34, 0, 33.34, 10],
                          [40, 0, 43, 1], [41, 0, 44, 1]], device=device)  # last pair: IoU exactly 2 / 4
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4], device=device)
    assert nms(boxes, scores, 0.5).tolist() == [0, 2, 3, 4, 5]
    assert nms(boxes, scores, 0.499).tolist() == [0, 2, 4]
    assert torch.equal(nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores, 0.5))


@pytest.mark.parametrize("device", devices())
def test_equal_scores_keep_index_order(device):
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [0.5, 0.5, 10.5, 10.5], [50, 50, 60, 60]],
                         device=device)
    scores = torch.tensor([0.5, 0.5, 0.5, 0.5], device=device)
    assert nms(boxes, scores, 0.5).tolist() == [0, 3]
    boxes, scores = random_boxes(200, seed=3, device=device)
    scores = (scores * 4).floor()  # many ties
    assert torch.equal(nms(boxes, scores, 0.4), torchvision.ops.nms(boxes, scores, 0.4))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_boxes_match_float32(device, dtype):
    boxes, scores = random_boxes(300, seed=4, device=device, dtype=dtype)
    assert torch.equal(nms(boxes, scores, 0.5), nms(boxes.float(), scores, 0.5))
    assert torch.equal(nms(boxes, scores.to(dtype), 0.5), nms(boxes.float(), scores.to(dtype), 0.5))


@pytest.mark.parametrize("device", devices())
def test_float64(device):
    boxes, scores = random_boxes(300, seed=6, device=device, dtype=torch.float64)
    assert torch.equal(nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores.double(), 0.5))


@pytest.mark.parametrize("device", devices())
def test_nan_scores_are_visited_first(device):
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [30, 30, 40, 40], [31, 31, 41, 41]], device=device)
    scores = torch.tensor([0.9, float("nan"), 0.2, 0.8], device=device)
    keep = nms(boxes, scores, 0.5)
    assert keep.tolist() == [1, 3]
    assert torch.equal(keep, torchvision.ops.nms(boxes, scores, 0.5))
    boxes, scores = random_boxes(200, seed=8, device=device)
    scores[::7] = float("nan")
    assert torch.equal(nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores, 0.5))


@pytest.mark.parametrize("device", devices())
def test_empty(device):
    empty = torch.zeros(0, 4, device=device)
    assert nms(empty, torch.zeros(0, device=device), 0.5).shape == (0,)
    out = batched_nms(empty, torch.zeros(0, device=device), torch.zeros(0, dtype=torch.long, device=device), 0.5)
    assert out.shape == (0,) and out.dtype == torch.long



@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("boxes_shape,scores_shape", [((0,), (0,)), ((0, 0), (0,)), ((0, 5), (0,)), ((0, 4), (0, 1)),
                                                      ((3, 0), (3,))])
def test_batched_nms_accepts_torchvision_degenerate_empty_inputs(device, boxes_shape, scores_shape):
    boxes, scores = torch.zeros(boxes_shape, device=device), torch.zeros(scores_shape, device=device)
    for idxs in (torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device)):
        want = torchvision.ops.batched_nms(boxes.cpu(), scores.cpu(), idxs.cpu(), 0.5)
        out = batched_nms(boxes, scores, idxs, 0.5)
        assert out.shape == want.shape == (0,) and out.dtype == want.dtype == torch.int64
        assert out.device == boxes.device
    # nms accepts only N x 4 boxes, as torchvision's
    with pytest.raises(ValueError, match="N x 4"):
        nms(torch.zeros(0, device=device), torch.zeros(0, device=device), 0.5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("offset", [0.0, -60.0, -1e3])
def test_batched_matches_per_class_nms(device, offset):
    boxes, scores = random_boxes(400, seed=9, device=device, offset=offset)
    idxs = torch.randint(0, 5, (400,), generator=torch.Generator().manual_seed(0)).to(device)
    keep = batched_nms(boxes, scores, idxs, 0.5)
    assert torch.equal(keep.cpu(), per_class_nms(boxes, scores, idxs, 0.5))
    assert set(keep.tolist()) == set(torchvision.ops.boxes._batched_nms_vanilla(boxes, scores, idxs, 0.5).tolist())


@pytest.mark.parametrize("device", devices())
def test_batched_negative_coordinates_keep_classes_apart(device):
    # Two identical boxes of different classes left of the origin: a max-coordinate offset (idx * (max + 1),
    # max < 0 here) would stack them on top of each other and suppress one.
    boxes = torch.tensor([[-5.0, -5.0, -3.0, -3.0], [-5.0, -5.0, -3.0, -3.0], [-4.9, -5.0, -3.0, -3.0]],
                         device=device)
    scores = torch.tensor([0.9, 0.8, 0.7], device=device)
    idxs = torch.tensor([0, 1, 0], device=device)
    assert batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 1]
    assert nms_reference(boxes.cpu(), scores.cpu(), 0.5, idxs.cpu()).tolist() == [0, 1]


@pytest.mark.parametrize("device", devices())
def test_batched_large_labels_lose_no_precision(device):
    # Boxes 0 and 1 share class 10**5 and overlap with IoU 100 / 199 > 0.5, so 1 goes. Shifting them by
    # label * (max coordinate + 1) = 10**7 + 10**5 in float32 (ulp 1 there) would round 19.9 to 20 and make the IoU
    # exactly 0.5 (kept): classes are compared, not offset, so the IoU is that of the boxes as given.
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 19.9], [0.0, 0.0, 99.0, 99.0]], device=device)
    scores = torch.tensor([0.9, 0.8, 0.7], device=device)
    idxs = torch.tensor([10**5, 10**5, 3], device=device)
    assert batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 2]
    assert nms_reference(boxes.cpu(), scores.cpu(), 0.5, idxs.cpu()).tolist() == [0, 2]
    shifted = boxes + (idxs * (boxes.max() + 1)).to(boxes)[:, None]
    assert torchvision.ops.nms(shifted, scores, 0.5).tolist() == [0, 1, 2]  # what the offset would have given


def special_boxes(n, seed, device="cpu"):
    """Random boxes where every third one has a NaN, infinite, signed-zero, inverted or zero-width coordinate."""
    boxes, scores = random_boxes(n, seed=seed, extent=50.0)
    special = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]
    for k, i in enumerate(range(0, n, 3)):
        kind = k % 7
        if kind < len(special):
            boxes[i, k % 4] = special[kind]
        elif kind == 5:
            boxes[i] = boxes[i, [2, 3, 0, 1]]  # x2 < x1, y2 < y1: negative width and height, positive area
        else:
            boxes[i, 2] = boxes[i, 0]
    return boxes.to(device), scores.to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("threshold", [-0.5, 0.0, 0.5, float("nan")])
def test_special_coordinates_and_thresholds_match_reference(device, threshold):
    # A negative threshold suppresses disjoint boxes too (IoU 0 > threshold) unless the IoU is NaN; a NaN threshold
    # suppresses nothing. NaN coordinates give NaN IoUs, which never suppress.
    boxes, scores = special_boxes(300, seed=11, device=device)
    expected = nms_reference(boxes.cpu(), scores.cpu(), threshold)
    assert torch.equal(nms(boxes, scores, threshold).cpu(), expected)
    idxs = torch.randint(0, 3, (300,), generator=torch.Generator().manual_seed(2))
    expected = nms_reference(boxes.cpu(), scores.cpu(), threshold, idxs)
    assert torch.equal(batched_nms(boxes, scores, idxs.to(device), threshold).cpu(), expected)


def test_threshold_extremes():
    boxes, scores = random_boxes(50, seed=12)
    order = torch.sort(scores, descending=True, stable=True).indices
    assert nms(boxes, scores, -0.1).tolist() == order[:1].tolist()
    assert torch.equal(nms(boxes, scores, float("nan")), order)
    assert torch.equal(nms(boxes, scores, 1.0), order)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 511, 512, 513, 577, 1024, 1089, 4160, 5000])
@pytest.mark.parametrize("extent", [30.0, 400.0])
def test_cuda_matches_cpu_across_word_and_band_boundaries(n, extent):
    # Bitmask words hold 64 boxes; a mask-kernel block covers 8 column words and the reduction resolves 8 words per
    # band, so 512 boxes is a strip and band boundary. Dense boxes (extent 30) suppress across words and bands.
    boxes, scores = random_boxes(n, seed=n, extent=extent)
    idxs = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(n))
    for threshold in (0.5, 0.0, -0.1):
        assert torch.equal(nms(boxes.cuda(), scores.cuda(), threshold).cpu(), nms(boxes, scores, threshold))
        assert torch.equal(batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), threshold).cpu(),
                           batched_nms(boxes, scores, idxs, threshold))
    for dtype in (torch.float16, torch.float64):
        assert torch.equal(nms(boxes.to("cuda", dtype), scores.cuda(), 0.5).cpu(), nms(boxes.to(dtype), scores, 0.5))


def per_class_nms(boxes, scores, idxs, threshold):
    """torchvision's NMS run class by class on the CPU (exact, no coordinate offsets), merged by decreasing score."""
    boxes, scores, idxs = boxes.cpu(), scores.cpu(), idxs.cpu()
    kept = torch.cat([torch.nonzero(idxs == c).flatten()[torchvision.ops.nms(boxes[idxs == c], scores[idxs == c],
                                                                              threshold)] for c in idxs.unique()])
    return kept[torch.sort(scores[kept], descending=True, stable=True).indices]


@pytest.mark.cuda
@pytest.mark.parametrize("n,classes", [(700, 1), (700, 2), (3000, 7), (5000, 40), (20000, 10), (20000, 900),
                                       (100000, 10)])
@pytest.mark.parametrize("extent", [30.0, 1000.0])
def test_cuda_batched_nms_class_grouping_matches_cpu(n, classes, extent):
    # Many classes against torchvision's per-class NMS: classes of every size (one segment each), classes of a
    # single box, labels that are not 0..C-1. Not against torchvision.ops.batched_nms on CUDA: below 25k boxes it
    # shifts boxes by label * (max coordinate + 1) in float32, which moves IoUs near the threshold (with these labels
    # it keeps one box more at 20000 / 900 / 30 m and one fewer at 20000 / 10 / 1000 m than its own per-class NMS).
    boxes, scores = random_boxes(n, seed=n + classes, extent=extent)
    gen = torch.Generator().manual_seed(classes)
    idxs = torch.randint(0, classes, (n,), generator=gen) * 3 - 5
    idxs[torch.randperm(n, generator=gen)[:3]] = 10**6 + torch.arange(3)  # three classes of one box each
    # torch.rand repeats values among 20000 draws, and torchvision orders equal scores arbitrarily: distinct scores.
    scores = (torch.randperm(n, generator=gen) + 1).float() / n
    got = batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), per_class_nms(boxes, scores, idxs, 0.5))
    if n > 20000:
        return  # the CPU kernel's O(N x kept) loop takes too long here
    assert torch.equal(got.cpu(), batched_nms(boxes, scores, idxs, 0.5))
    # Ties in score: equal scores keep index order across classes too.
    tied = torch.full_like(scores, 0.5)
    assert torch.equal(batched_nms(boxes.cuda(), tied.cuda(), idxs.cuda(), 0.5).cpu(),
                       batched_nms(boxes, tied, idxs, 0.5))


@pytest.mark.cuda
def test_cuda_special_coordinates_match_cpu():
    for n in (65, 700):
        boxes, scores = special_boxes(n, seed=n)
        for threshold in (-0.5, 0.0, 0.3, 0.7, float("nan")):
            assert torch.equal(nms(boxes.cuda(), scores.cuda(), threshold).cpu(), nms(boxes, scores, threshold))
        assert torch.equal(nms(boxes.cuda().double(), scores.cuda(), 0.3).cpu(), nms(boxes.double(), scores, 0.3))


@pytest.mark.cuda
def test_cuda_matches_cpu_on_benchmark_boxes():
    # The roi benchmark's 100k boxes: 1563 words, about 196 bands.
    boxes, scores = _boxes(100000, "cpu")
    keep = nms(boxes, scores, 0.5)
    assert torch.equal(nms(boxes.cuda(), scores.cuda(), 0.5).cpu(), keep)
    assert torch.equal(torchvision.ops.nms(boxes.cuda(), scores.cuda(), 0.5).cpu(), keep)


@pytest.mark.cuda
def test_cuda_too_many_boxes_names_the_limit():
    boxes = torch.zeros(2_000_000, 4, device="cuda")
    with pytest.raises(RuntimeError, match="shared memory for the suppression bitmap.*split the boxes"):
        nms(boxes, torch.zeros(2_000_000, device="cuda"), 0.5)
    with pytest.raises(RuntimeError, match="boxes of one class need .* shared memory"):
        batched_nms(boxes, torch.zeros(2_000_000, device="cuda"), torch.zeros(2_000_000, device="cuda").long(), 0.5)


@pytest.mark.cuda
def test_cuda_batched_nms_beyond_one_nms_limit():
    # 2M boxes are too many for one nms call (above), but in 2,000 classes each class is a segment of its own.
    n, classes = 2_000_000, 2000
    boxes, _ = random_boxes(n, seed=5, extent=3000.0)
    gen = torch.Generator().manual_seed(5)
    idxs = torch.randint(0, classes, (n,), generator=gen)
    scores = (torch.randperm(n, generator=gen) + 1).float() / n  # distinct: torchvision orders ties arbitrarily
    got = batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5).cpu()
    few = torch.nonzero(idxs < 20).flatten()  # check 20 classes against torchvision's per-class NMS
    want = few[per_class_nms(boxes[few], scores[few], idxs[few], 0.5)]
    assert torch.equal(got[idxs[got] < 20], want)
    assert 0 < len(got) < n


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4096, 20000])
def test_cuda_matches_cpu_many_boxes(n):
    boxes, scores = random_boxes(n, seed=n, extent=1000.0)
    keep = nms(boxes, scores, 0.5)
    assert torch.equal(nms(boxes.cuda(), scores.cuda(), 0.5).cpu(), keep)
    assert torch.equal(torchvision.ops.nms(boxes.cuda(), scores.cuda(), 0.5).cpu(), keep)
    idxs = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5).cpu(),
                       batched_nms(boxes, scores, idxs, 0.5))


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    boxes, scores = random_boxes(50, device=device)
    idxs = torch.randint(0, 3, (50,), generator=torch.Generator().manual_seed(0)).to(device)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.lss.nms.default, (boxes, scores, 0.5), test_utils=tests)
    torch.library.opcheck(torch.ops.lss.batched_nms.default, (boxes, scores, idxs, 0.5), test_utils=tests)


def test_errors():
    boxes, scores = random_boxes(5)
    with pytest.raises(ValueError, match="same length, got 5 boxes and 4 scores"):
        nms(boxes, scores[:4], 0.5)
    with pytest.raises(ValueError, match="N x 4"):
        nms(boxes[:, :3], scores, 0.5)
    with pytest.raises(ValueError, match="1-D"):
        nms(boxes, scores[:, None], 0.5)
    with pytest.raises(ValueError, match="one class per box"):
        batched_nms(boxes, scores, torch.zeros(4, dtype=torch.long), 0.5)
    with pytest.raises(TypeError, match="integer"):
        batched_nms(boxes, scores, torch.zeros(5), 0.5)


@pytest.mark.skipif(not has_ext(), reason="lss._C not built")
def test_raw_op_checks_lengths():
    boxes, scores = random_boxes(5)
    with pytest.raises(RuntimeError, match="same length"):
        torch.ops.lss.nms(boxes, scores[:3], 0.5)
