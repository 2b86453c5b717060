"""ModelEMA: the average follows its formula, `applied` swaps the weights in and back, its state round-trips."""
import pytest
import torch
from torch import nn

from lss.engine.ema import ModelEMA


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))


def test_average_follows_the_formula_with_its_warm_up():
    model = small_model()
    ema = ModelEMA(model, decay=0.9)
    weight = model[0].weight
    expected = weight.detach().clone().double()
    for n in range(5):
        with torch.no_grad():
            weight.add_(torch.randn_like(weight))
        d = min(0.9, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * weight.detach().double()
        ema.update()
    index = [name for name in model.state_dict()].index("0.weight")
    torch.testing.assert_close(ema.shadow[index].double(), expected, rtol=1e-6, atol=1e-6)
    # integer buffers (BatchNorm's num_batches_tracked) are not averaged
    assert len(ema.shadow) == sum(t.is_floating_point() for t in model.state_dict().values())


def test_applied_swaps_in_the_average_and_restores_the_weights_exactly():
    model = small_model()
    ema = ModelEMA(model, decay=0.5)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    moved = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied():
        for k, v in model.state_dict().items():
            if v.is_floating_point():  # first update: d = 1/10, so the average is 0.9 * moved + 0.1 * own
                torch.testing.assert_close(v, 0.1 * own[k] + 0.9 * moved[k])
    assert all(torch.equal(v, moved[k]) for k, v in model.state_dict().items())
    averaged = ema.averaged_state_dict(model)
    assert set(averaged) == set(moved) and averaged["1.num_batches_tracked"].dtype == torch.int64


def test_state_round_trip_and_mismatch_error():
    model = small_model()
    ema = ModelEMA(model, decay=0.99)
    for _ in range(3):
        ema.update()
    other = ModelEMA(small_model(), decay=0.99)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 3 and all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow))
    wrong = ModelEMA(nn.Linear(2, 2), decay=0.99)
    with pytest.raises(ValueError, match="different architecture"):
        wrong.load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="decay must be in"):
        ModelEMA(model, decay=1.0)
