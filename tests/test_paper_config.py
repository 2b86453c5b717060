"""configs/lss_paper.yaml holds the LSS paper recipe and trains."""
import json
from pathlib import Path

import pytest

from lss.benchmarks.accuracy import BENCHMARK_SET, QUICK_OVERRIDES
from lss.config import NUSCENES_CAMERAS, load_config
from lss.engine.train import train

PAPER = Path(__file__).resolve().parents[1] / "configs" / "lss_paper.yaml"


def test_paper_recipe_values():
    cfg = load_config(PAPER)
    d, g, m, loss, o, t = cfg.data, cfg.grid, cfg.model, cfg.loss, cfg.optim, cfg.train
    assert d.classes == ("vehicle",) and d.cameras == NUSCENES_CAMERAS and d.num_train_cameras == 5
    assert (d.resize_lim, d.bot_pct_lim, d.rot_lim, d.rand_flip, d.final_dim) == (
        (0.193, 0.225), (0.0, 0.22), (-5.4, 5.4), True, (128, 352))
    assert not d.depth_targets and loss.depth_weight == 0.0
    assert (d.bev_rot_lim, d.bev_scale_lim, d.bev_flip) == ((0.0, 0.0), (1.0, 1.0), False)
    assert (g.xbound, g.ybound, g.zbound, g.dbound) == ((-50.0, 50.0, 0.5), (-50.0, 50.0, 0.5), (-10.0, 10.0, 20.0),
                                                        (4.0, 45.0, 1.0))
    assert (m.backbone, m.downsample, m.context_channels, m.heads) == ("efficientnet-b0", 16, 64, ("segmentation",))
    assert (loss.type, loss.pos_weight) == ("bce", 2.13)
    assert (o.name, o.lr, o.weight_decay, o.grad_clip, o.schedule, o.warmup_steps) == (
        "adam", 1e-3, 1e-7, 5.0, "constant", 0)
    assert (t.batch_size, t.grad_accum) == (4, 1)
    syn = d.synthetic
    assert (d.version, syn.scenes, syn.samples_per_scene, tuple(syn.image_size), syn.seed) == (
        BENCHMARK_SET.version, BENCHMARK_SET.scenes, BENCHMARK_SET.samples_per_scene, BENCHMARK_SET.image_size,
        BENCHMARK_SET.seed)


@pytest.mark.slow
def test_paper_recipe_trains_on_the_tiny_set(synthetic_root, tmp_path):
    overrides = list(QUICK_OVERRIDES) + [f"data.dataroot={synthetic_root}", "data.version=v1.0-mini",
                                         "data.make_synthetic_if_missing=false", "data.workers=0",
                                         "train.max_steps=2", "train.log_every=1", "train.eval_every=2"]
    cfg = load_config(PAPER, overrides)
    final = train(cfg, str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    assert all(r["loss"] > 0 for r in rows if r["kind"] == "train")
    assert list(final["val"]["iou"]) == ["vehicle"] and set(final["val"]["sweep"]) >= {"0.5"}
