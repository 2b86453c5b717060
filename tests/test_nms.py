import pytest
import torch
import torchvision

from conftest import devices
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
@pytest.mark.parametrize("offset", [0.0, -60.0, -1e3])
def test_batched_matches_per_class_nms(device, offset):
    boxes, scores = random_boxes(400, seed=9, device=device, offset=offset)
    idxs = torch.randint(0, 5, (400,), generator=torch.Generator().manual_seed(0)).to(device)
    keep = batched_nms(boxes, scores, idxs, 0.5)
    per_class = torch.cat([torch.nonzero(idxs == c).flatten()[nms(boxes[idxs == c], scores[idxs == c], 0.5)]
                           for c in range(5)])
    expected = per_class[torch.sort(scores[per_class], descending=True, stable=True).indices]
    assert torch.equal(keep, expected)
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
