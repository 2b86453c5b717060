"""configs/lss_paper.yaml holds the LSS paper recipe and trains."""
import json
from pathlib import Path

import pytest

from benchmarks.accuracy import BENCHMARK_SET, DEFAULT_RECIPES, ORIGINAL, QUICK_OVERRIDES
from lss.config import NUSCENES_CAMERAS, load_config
from lss.engine.train import train

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "lss_paper.yaml"


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


def test_the_nuscenes_configs_carry_the_default_recipe():
    default = load_config(str(ROOT / "configs/synthetic_segmentation.yaml"), [])
    assert default.loss.class_weights == (2.0, 3.0, 0.5, 0.5) and default.loss.type == "bce"
    assert default.loss.class_pos_weights == (4.0, 6.7, 1.5, 2.6)
    assert default.grid.dbound == (4.0, 45.0, 0.5)
    assert default.loss.soft_iou_weights == (1.0, 1.0, 1.0, 1.0)
    for name in ("nuscenes_mini.yaml", "nuscenes_trainval.yaml"):
        cfg = load_config(str(ROOT / "configs" / name), [])
        assert cfg.data.classes == default.data.classes, name
        assert cfg.loss == default.loss, name
        assert cfg.optim == default.optim, name
        assert cfg.data.final_dim == default.data.final_dim == (256, 704), name
        assert cfg.data.resize_lim == default.data.resize_lim, name
        assert cfg.model.frustum_pixels == default.model.frustum_pixels == "receptive_field", name
        assert cfg.model.bev_full_res_skip is default.model.bev_full_res_skip is True, name
        assert cfg.grid == default.grid, name


@pytest.mark.parametrize("name, dbound, pos_weights, class_weights, skip", [
    ("skip_pw6", (4.0, 45.0, 1.0), (4.0, 6.0, 1.5, 2.6), (2.0, 1.0, 0.5, 0.5), True),
    ("default_noskip", (4.0, 45.0, 1.0), (4.0, 10.0, 1.5, 2.6), (2.0, 1.0, 0.5, 0.5), False),
    ("default_128", (4.0, 45.0, 1.0), (4.0, 10.0, 1.5, 2.6), (2.0, 1.0, 0.5, 0.5), False),
])
def test_the_earlier_default_recipes_keep_what_they_were(name, dbound, pos_weights, class_weights, skip):
    # docs/accuracy.md compares the default recipe with these rows: they must stay the recipes that were measured
    config, overrides = DEFAULT_RECIPES[name]
    cfg = load_config(str(ROOT / config), list(overrides))
    assert cfg.grid.dbound == dbound
    assert cfg.loss.class_pos_weights == pos_weights and cfg.loss.class_weights == class_weights
    assert cfg.model.bev_full_res_skip is skip
    assert cfg.loss.soft_iou_weights is None  # measured before the soft-IoU term
    assert cfg.data.final_dim == ((128, 352) if name == "default_128" else (256, 704))


@pytest.mark.parametrize("name", sorted(n for n, (c, _) in DEFAULT_RECIPES.items() if c != ORIGINAL))
def test_every_named_recipe_resolves_to_a_valid_config(name):
    config, overrides = DEFAULT_RECIPES[name]
    cfg = load_config(str(ROOT / config), list(overrides))
    weights = cfg.loss.class_weights
    assert weights is None or len(weights) == len(cfg.data.classes)
    if name == "default_vehicle":
        assert cfg.data.classes == ("vehicle",) and weights is None
    if name == "balanced":
        assert weights is None and cfg.optim == load_config(str(ROOT / "configs/synthetic_segmentation.yaml"), []).optim
