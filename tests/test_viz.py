"""Pictures: BEV orientation (forward up, left on the left), the nuScenes camera layout, the BEV panel, evaluation
and pictures of a checkpoint through load_for_inference, and the demo end to end (train -> eval -> viz) on the tiny
synthetic set."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from lss.viz import FRONT_ROW, BACK_ROW, bev_grid_image, bev_panel, bev_to_image, camera_mosaic

CAMERAS = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")


def test_bev_image_has_forward_up_and_left_on_the_left():
    bev = np.zeros((4, 6))
    bev[3, 5] = 1  # largest x (front), largest y (left)
    img = bev_to_image(bev)
    assert img[0, 0] == 1 and img.sum() == 1


def test_camera_mosaic_follows_the_nuscenes_layout():
    order = ("CAM_BACK", "CAM_FRONT", "CAM_BACK_LEFT", "CAM_FRONT_LEFT", "CAM_BACK_RIGHT", "CAM_FRONT_RIGHT")
    images = np.stack([np.full((10, 20, 3), 40 * k, np.uint8) for k in range(6)])
    mosaic = camera_mosaic(images, order, tile_width=20)
    assert mosaic.shape == (20, 60, 3)
    for row, names in enumerate((FRONT_ROW, BACK_ROW)):
        for col, name in enumerate(names):
            assert mosaic[row * 10 + 9, col * 20 + 19, 0] == 40 * order.index(name), name


def test_bev_panel_draws_heat_outline_map_and_ego():
    classes = ("vehicle", "drivable_area")
    probs = np.zeros((2, 20, 20), np.float32)
    targets = np.zeros((2, 20, 20), np.float32)
    targets[1, :, 8:12] = 1  # a road along x
    targets[0, 15:18, 9:11] = 1  # a car ahead
    probs[0, 15:18, 9:11] = 1.0
    panel = bev_panel(probs, targets, classes, lower=(-10.0, -10.0), cell_size=(1.0, 1.0), size=200)
    assert panel.shape == (200, 200, 3) and panel.dtype == np.uint8
    assert tuple(panel[110, 104]) == (20, 170, 20)  # the ego car at the grid origin, the image centre
    car = panel[30:50, 90:110].reshape(-1, 3)  # rows 15-17 -> image rows 20-50 (forward up)
    assert (car[:, 2] > 200).sum() > 100  # the blue vehicle heat map
    assert tuple(panel[150, 5]) == (255, 255, 255) and tuple(panel[150, 100]) == (200, 200, 200)  # road behind


def test_bev_grid_image_tiles_prediction_and_truth():
    img = bev_grid_image(torch.rand(3, 2, 8, 8), torch.zeros(3, 2, 8, 8), ("a", "b"), max_samples=2, cell=2)
    assert img.shape == (2 * 8 * 2, 2 * (8 + 2 + 8 + 4) * 2, 3) and img.dtype == np.uint8


TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.batch_size=2", "train.max_steps=2",
        "train.eval_every=2", "train.viz_every=2", "train.ckpt_every=2", "train.log_every=1", "train.device=cpu",
        "eval.batch_size=2", "viz.num=2", "viz.gif=true"]


def test_eval_and_viz_of_a_checkpoint_go_through_load_for_inference(synthetic_root, tmp_path, monkeypatch):
    import lss.engine.eval as eval_module
    import lss.viz as viz
    from lss.config import load_config
    from lss.engine import build
    from lss.engine.checkpoint import save_checkpoint

    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}"])
    torch.manual_seed(7)
    saved = build.build_model(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "best.pt"
    save_checkpoint(ckpt, saved, step=5, config=cfg)
    loaded = []

    def spy(*args, **kwargs):
        model, state = build.load_for_inference(*args, **kwargs)
        loaded.append(model)
        return model, state

    monkeypatch.setattr(eval_module, "load_for_inference", spy)  # viz loads through eval's load_checkpoint_model
    result = eval_module.evaluate_checkpoint(cfg, str(ckpt))
    assert len(loaded) == 1 and not loaded[0].training
    weights = saved.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in loaded[0].state_dict().items())
    cpu = torch.device("cpu")
    loader = build.build_eval_loader(cfg, build.build_dataset(cfg, cfg.data.val_split, False), cpu)
    reference = eval_module.evaluate(saved, loader, cfg, cpu, show_progress=False)
    assert result["iou"] == pytest.approx(reference["iou"], abs=1e-6)
    assert result["step"] == 5 and result["samples"] == 3
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["iou"] == result["iou"]

    pictures = viz.render_checkpoint(cfg, str(ckpt), str(tmp_path / "viz"))
    assert len(loaded) == 2 and not loaded[1].training
    assert [p.suffix for p in pictures] == [".png", ".png", ".gif"] and all(p.is_file() for p in pictures)


@pytest.mark.slow
def test_demo_trains_evaluates_and_renders_on_synthetic_data(synthetic_root, tmp_path):
    from lss.engine.demo import demo

    run = tmp_path / "demo"
    result = demo(overrides=TINY + [f"data.dataroot={synthetic_root}"], out_dir=str(run))
    assert (run / "checkpoints" / "best.pt").is_file() and (run / "metrics.jsonl").is_file()
    report = json.loads((run / "eval.json").read_text())
    assert set(report["iou"]) == {"vehicle", "drivable_area"} and report["samples"] == 3
    assert report["iou"] == result["eval"]["iou"]
    pngs = sorted((run / "viz").glob("*.png"))
    assert len(pngs) == 2 and len(list((run / "viz").glob("*.gif"))) == 1
    with Image.open(pngs[0]) as im:
        w, h = im.size
    assert w > 3 * 352 and h > 100  # three camera tiles plus the BEV panel side by side
