"""model.temporal.correlation: the local correlation volume between the two frames' grids. Values against a direct
loop over the offsets; a moving object's volume peaks at its displacement and a static one's at the centre; the
fusion conv reads [current, previous, volume]; gradients reach the correlation's embedding from both frames; the
config refuses it without two frames and an odd grid; a two-frame model with it trains a step and starts as the
two-frame model without it does elsewhere."""
import pytest
import torch

from lss.config import ConfigError, config_from_dict
from lss.models.build import build_model
from lss.models.losses import TotalLoss
from lss.models.temporal import MotionCorrelation, TemporalFusion, local_correlation
from test_temporal_model import SMALL, previous_of, rig_batch, small_config


def direct_correlation(current, previous, radius):
    b, c, h, w = current.shape
    window = 2 * radius + 1
    out = torch.zeros(b, window * window, h, w, dtype=current.dtype)
    for i in range(window):
        for j in range(window):
            for y in range(h):
                for x in range(w):
                    py, px = y + i - radius, x + j - radius
                    if 0 <= py < h and 0 <= px < w:
                        out[:, i * window + j, y, x] = (current[:, :, y, x] * previous[:, :, py, px]).mean(1)
    return out


def test_local_correlation_is_the_mean_product_at_every_offset():
    g = torch.Generator().manual_seed(0)
    current, previous = (torch.randn(2, 5, 7, 9, generator=g, dtype=torch.float64) for _ in range(2))
    for radius in (1, 3):
        torch.testing.assert_close(local_correlation(current, previous, radius),
                                   direct_correlation(current, previous, radius))


def test_local_correlation_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(1)
    current, previous = (torch.randn(1, 3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
                         for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b: local_correlation(a, b, 2), (current, previous))


def test_local_correlation_refuses_mismatched_maps_and_no_window():
    with pytest.raises(ValueError, match=r"two B x C x H x W maps of one shape, got \(1, 2, 4, 4\) and \(1, 2, 4, 6\)"):
        local_correlation(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 6), 1)
    with pytest.raises(ValueError, match="radius=0, expected >= 1"):
        local_correlation(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), 0)


def blob_grid(channels, size, corner, seed=3):
    """An empty BEV grid with one 4 x 4-cell object of random features at `corner`."""
    grid = torch.zeros(1, channels, size, size)
    features = torch.randn(channels, 4, 4, generator=torch.Generator().manual_seed(seed)).abs()
    grid[0, :, corner[0]:corner[0] + 4, corner[1]:corner[1] + 4] = features
    return grid


@pytest.mark.parametrize("move", [(0, 0), (6, -4), (-2, 8)])
def test_the_volume_peaks_where_the_object_was_one_frame_before(move):
    torch.manual_seed(0)
    corr = MotionCorrelation(8, radius=5).eval()  # coarse cells of 2 grid cells: +-10 grid cells
    before = (14, 14)
    now = (before[0] + move[0], before[1] + move[1])
    with torch.no_grad():
        volume = corr(blob_grid(8, 40, now), blob_grid(8, 40, before))
    assert volume.shape == (1, 121, 40, 40)
    # at the object's cells now: the strongest offset is the way back to where it was, in coarse cells
    peak = int(volume[0, :, now[0] + 1, now[1] + 1].argmax())
    assert divmod(peak, 11) == (5 - move[0] // 2, 5 - move[1] // 2)
    torch.testing.assert_close(volume[0, peak, now[0] + 1, now[1] + 1], torch.tensor(1.0))  # cosine of a copy
    assert float(volume[0, :, 0, 0].abs().max()) == 0.0  # empty cells correlate to nothing


def test_the_fusion_reads_both_grids_and_the_volume():
    torch.manual_seed(0)
    fusion = TemporalFusion(16, correlation=3).eval()
    assert fusion.conv[0].weight.shape == (16, 2 * 16 + 49, 3, 3)
    g = torch.Generator().manual_seed(4)
    current, previous = (torch.randn(2, 16, 12, 12, generator=g) for _ in range(2))
    with torch.no_grad():
        want = fusion.conv(torch.cat([current, previous, fusion.correlation(current, previous)], 1))
        torch.testing.assert_close(fusion(current, previous), want)
    with pytest.raises(ValueError, match=r"13 x 13 cells do not divide into 2 x 2 blocks.*even number of cells"):
        fusion(torch.zeros(1, 16, 13, 13), torch.zeros(1, 16, 13, 13))


def test_a_two_frame_model_with_the_volume_trains_its_embedding_from_both_frames():
    torch.manual_seed(0)
    plain = build_model(small_config(frames=2)).state_dict()
    torch.manual_seed(0)
    model = build_model(small_config(frames=2, correlation=4)).train()
    added = set(model.state_dict()) - set(plain)
    assert added and all(k.startswith("temporal.correlation.embed.") for k in added)
    same = [k for k in plain if not k.startswith("temporal.")]
    assert all(torch.equal(plain[k], model.state_dict()[k]) for k in same)
    batch = previous_of(rig_batch(batch_size=2))
    batch["targets"] = torch.rand(2, 2, 64, 64, generator=torch.Generator().manual_seed(5)).round()
    TotalLoss(small_config(frames=2, correlation=4))(model(batch), batch)["loss"].backward()
    grads = [p.grad for p in model.temporal.correlation.parameters()]
    assert all(gr is not None and float(gr.abs().sum()) > 0 for gr in grads)


def test_the_config_refuses_a_volume_without_two_frames_or_out_of_range():
    with pytest.raises(ConfigError, match=r"model.temporal.correlation=4 needs model.temporal.frames: 2"):
        config_from_dict({**SMALL, "model": {**SMALL["model"], "temporal": {"correlation": 4}}})
    with pytest.raises(ConfigError, match=r"model.temporal.correlation=20: expected a window radius of 0"):
        config_from_dict({**SMALL, "model": {**SMALL["model"], "temporal": {"frames": 2, "correlation": 20}}})
