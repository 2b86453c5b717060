"""Pictures: the BEV view (forward up, left on the left, square metres), the nuScenes camera layout, class
colours and layer opacity, the figure's layout (cameras on top, prediction then ground truth below, legend), the ego
car and known boxes found at their pixels, the thresholded view, the training picture, and `lss viz` of a
checkpoint and the demo end to end on the tiny synthetic set."""
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from lss.config import ConfigError, load_config
from lss.viz.detection import GROUND_TRUTH_COLOR, PREDICTION_COLOR
from lss.geometry.boxes import box_corners
from lss.geometry import BevGrid, ego_to_pixels, load_nuscenes_rig
from lss.viz import BACK_ROW, FRONT_ROW, BevView, camera_mosaic, class_colors, layer_opacity, render_batch
from lss.viz import render_sample
from lss.viz.bev import BACKGROUND, CLASS_COLORS, EGO_COLOR, compose_layers, drawing_order
from lss.viz.figure import LEGEND_ROW_HEIGHT

CAMERAS = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
CLASSES = ("vehicle", "pedestrian", "drivable_area", "lane_divider")
# A 32 m x 32 m grid of 1 m cells; the network input 32 x 96 pixels.
SMALL = ["grid.xbound=[-16.0, 16.0, 1.0]", "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]",
         "data.final_dim=[32, 96]", f"data.classes={list(CLASSES)}"]
DETECTION = ["model.heads=[segmentation, detection]", "data.detection_targets=true"]


def small_config(*extra):
    return load_config(None, SMALL + list(extra))


def near(image, color, tol=40):
    """Pixels within `tol` of `color` in every channel."""
    return (np.abs(image.astype(int) - np.asarray(color)) <= tol).all(-1)


def known_scene(grid):
    """Targets K x nx x ny (CLASSES order) with known contents: a road |y| < 4 m along x, a lane divider at
    4 <= y < 5 m, a vehicle at x 8..12 m, y 2..4 m (centre (10, 3)), a pedestrian at x -6..-5 m, y -8..-7 m."""
    x = grid.cell_centers_x().numpy()[:, None]
    y = grid.cell_centers_y().numpy()[None, :]
    targets = np.zeros((len(CLASSES), grid.nx, grid.ny), np.float32)
    targets[0] = (x > 8) & (x < 12) & (y > 2) & (y < 4)
    targets[1] = (x > -6) & (x < -5) & (y > -8) & (y < -7)
    targets[2] = np.broadcast_to(np.abs(y) < 4, targets[2].shape)
    targets[3] = np.broadcast_to((y >= 4) & (y < 5), targets[3].shape)
    return targets


def known_item(grid, boxes=None):
    n = len(CAMERAS)
    intrinsics, rot, trans = load_nuscenes_rig(CAMERAS)
    scale = 96 / 1600  # the 1600 x 900 nuScenes image resized to the 96 pixel wide network input
    item = {
        "images": torch.zeros(n, 3, 32, 96),
        "targets": torch.from_numpy(known_scene(grid)),
        "sample_token": "known",
        "intrinsics": intrinsics,
        "sensor2ego_rot": rot,
        "sensor2ego_trans": trans,
        "post_rot": torch.diag(torch.tensor([scale, scale, 1.0])).expand(n, 3, 3).clone(),
        "post_trans": torch.tensor([0.0, -900 * scale + 32, 0.0]).expand(n, 3).clone(),
    }
    if boxes is not None:
        item["det_boxes"] = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 9)
    return item


def panel_view(figure, name, cfg):
    rect = figure.regions[name]
    return rect.of(figure.image), BevView(BevGrid.from_config(cfg.grid), rect.height, rect.width)


def pixel(panel, view, x, y):
    col, row = np.floor(view.to_pixels(np.array([x, y], np.float64))).astype(int)
    return tuple(int(v) for v in panel[row, col])


# ------------------------------------------------------------------------------------------------ BEV view


def test_bev_view_puts_forward_up_and_left_on_the_left():
    grid = BevGrid.planar((-10.0, 10.0, 1.0), (-10.0, 10.0, 1.0))
    view = BevView.fit(grid, 200)
    assert (view.height, view.width) == (200, 200) and view.pixels_per_metre == 10
    np.testing.assert_allclose(view.to_pixels(np.array([[0.0, 0.0], [10.0, 10.0], [-10.0, -10.0]])),
                               [[100, 100], [0, 0], [200, 200]])
    cells = np.zeros((20, 20), np.uint8)
    cells[19, 19] = 1  # the front-left corner cell: largest x (forward), largest y (left)
    image = view.raster(cells)
    assert image[:10, :10].all() and image.sum() == 100
    # A point inside a cell lands on a pixel of that cell.
    image = view.raster(np.arange(400, dtype=np.float32).reshape(20, 20))
    col, row = np.floor(view.to_pixels(np.array([3.4, -7.2]))).astype(int)
    assert image[row, col] == 13 * 20 + 2  # cell (floor(3.4 + 10), floor(-7.2 + 10))


def test_bev_view_keeps_metres_square_and_the_minimum_height():
    grid = BevGrid.planar((-30.0, 30.0, 0.5), (-20.0, 20.0, 0.5))  # 60 m along x, 40 m along y
    view = BevView.fit(grid, 200)
    assert (view.height, view.width) == (300, 200)
    view = BevView.fit(grid, 200, min_height=400)
    assert (view.height, view.width) == (400, 267)
    with pytest.raises(ValueError, match=r"a 10 x 10 map for a 120 x 80 grid"):
        view.raster(np.zeros((10, 10), np.uint8))


def test_camera_mosaic_follows_the_nuscenes_layout():
    order = ("CAM_BACK", "CAM_FRONT", "CAM_BACK_LEFT", "CAM_FRONT_LEFT", "CAM_BACK_RIGHT", "CAM_FRONT_RIGHT")
    images = np.stack([np.full((10, 20, 3), 40 * k, np.uint8) for k in range(6)])
    mosaic = camera_mosaic(images, order, tile_width=20)
    assert mosaic.shape == (20, 60, 3)
    for row, names in enumerate((FRONT_ROW, BACK_ROW)):
        for col, name in enumerate(names):
            assert mosaic[row * 10 + 9, col * 20 + 19, 0] == 40 * order.index(name), name
    with pytest.raises(ValueError, match="6 images but 2 camera names"):
        camera_mosaic(images, order[:2])


# ------------------------------------------------------------------------------------- colours and layers


def test_every_class_has_its_own_colour_apart_from_ego_boxes_and_ground():
    colors = list(CLASS_COLORS.values())
    assert len(set(colors)) == len(colors)
    assert not {EGO_COLOR, PREDICTION_COLOR, GROUND_TRUTH_COLOR, BACKGROUND} & set(colors)
    # Classes without a colour of their own get spare ones, still distinct.
    mixed = class_colors(["vehicle", "my_class", "other_class"])
    assert mixed[0] == CLASS_COLORS["vehicle"] and len(set(mixed)) == 3
    assert not set(mixed[1:]) & set(colors)


def test_layers_draw_map_areas_then_lines_then_objects():
    assert [CLASSES[k] for k in drawing_order(CLASSES)] == ["drivable_area", "lane_divider", "vehicle",
                                                             "pedestrian"]
    colors = class_colors(CLASSES)
    opacity = np.zeros((4, 2, 2), np.float32)
    opacity[2] = 1.0  # drivable area everywhere
    opacity[0, 0, 0] = 1.0  # a vehicle on the road
    opacity[0, 1, 1] = 0.5  # a half-sure vehicle
    canvas = compose_layers(opacity, colors, drawing_order(CLASSES))
    assert tuple(canvas[0, 0]) == colors[0] and tuple(canvas[0, 1]) == colors[2]
    half = 0.5 * np.asarray(colors[0]) + 0.5 * np.asarray(colors[2])
    assert np.abs(canvas[1, 1] - half).max() <= 1


def test_layer_opacity_is_the_probability_or_the_evaluation_threshold():
    probs = np.array([[[0.2, 0.5], [0.51, 1.2]]], np.float32)
    np.testing.assert_allclose(layer_opacity(probs, "probability", 0.5), [[[0.2, 0.5], [0.51, 1.0]]])
    # As the IoU counts a cell: predicted where the probability exceeds the threshold.
    np.testing.assert_array_equal(layer_opacity(probs, "threshold", 0.5), [[[0, 0], [1, 1]]])
    with pytest.raises(ValueError, match="mode 'heat'"):
        layer_opacity(probs, "heat", 0.5)


def test_viz_mode_is_checked_when_the_config_loads():
    assert small_config().viz.mode == "probability"
    assert small_config("viz.mode=threshold").viz.mode == "threshold"
    with pytest.raises(ConfigError, match=r"viz.mode='heat'.*'probability', 'threshold'"):
        small_config("viz.mode=heat")


# ------------------------------------------------------------------------------------------------ figure


def test_figure_layout_cameras_on_top_prediction_left_truth_right_legend_below():
    cfg = small_config()
    grid = BevGrid.from_config(cfg.grid)
    item = known_item(grid)
    figure = render_sample(item, item["targets"].numpy(), cfg, title="known sample")
    r = figure.regions
    cameras, pred, truth, legend = r["cameras"], r["prediction"], r["truth"], r["legend"]
    assert figure.image.dtype == np.uint8 and figure.image.shape[2] == 3
    assert (cameras.width, cameras.height) == (3 * 352, 2 * round(32 * 352 / 96))
    assert (pred.height, pred.width) == (truth.height, truth.width)  # panels of one size
    assert pred.height >= cameras.height and pred.height == pred.width  # a square grid, square panels
    assert pred.top == truth.top and pred.left + pred.width < truth.left  # prediction left of the truth
    assert r["title"].top < cameras.top < cameras.top + cameras.height <= r["prediction_title"].top
    assert r["prediction_title"].top + r["prediction_title"].height <= pred.top
    assert pred.top + pred.height <= legend.top and legend.top + legend.height <= figure.image.shape[0]
    assert truth.left + truth.width <= figure.image.shape[1]
    # The legend: a swatch of each class colour and of the ego car, and dark text.
    swatches = legend.of(figure.image)
    for color in class_colors(CLASSES) + [EGO_COLOR]:
        assert near(swatches, color, tol=0).sum() >= 100, color
    assert near(swatches, (30, 30, 30), tol=30).sum() > 200 and legend.height == LEGEND_ROW_HEIGHT
    # Titles above the panels and the picture.
    for name in ("title", "prediction_title", "truth_title"):
        assert (r[name].of(figure.image) < 100).all(-1).sum() > 50, name


def test_known_targets_appear_at_their_pixels_with_the_ego_car_forward_up():
    cfg = small_config()
    grid = BevGrid.from_config(cfg.grid)
    item = known_item(grid)
    probs = item["targets"].numpy() * np.array([1.0, 1.0, 0.5, 1.0], np.float32)[:, None, None]
    figure = render_sample(item, probs, cfg)
    vehicle, pedestrian, road, divider = class_colors(CLASSES)
    for name in ("truth", "prediction"):
        panel, view = panel_view(figure, name, cfg)
        assert pixel(panel, view, 10.0, 3.0) == vehicle, name  # the vehicle's centre
        assert pixel(panel, view, -5.5, -7.5) == pedestrian, name
        assert pixel(panel, view, -8.0, 4.5) == divider, name
        assert pixel(panel, view, 8.0, -10.0) == BACKGROUND, name  # off the road
        # The ego car at the grid origin, the panel's centre; its nose towards +x: the front corners of its
        # footprint are road, the rear ones car.
        ego_col, ego_row = view.to_pixels(np.zeros(2))
        assert (ego_col, ego_row) == (view.width / 2, view.height / 2)
        assert pixel(panel, view, 0.0, 0.0) == EGO_COLOR and pixel(panel, view, -1.7, 0.6) == EGO_COLOR
        assert pixel(panel, view, 1.9, 0.8) != EGO_COLOR and pixel(panel, view, 1.9, -0.8) != EGO_COLOR
        # Forward is up, ego left on the left: the vehicle (10 m ahead, 3 m left) above and left of the ego car.
        col, row = view.to_pixels(np.array([10.0, 3.0]))
        assert row < ego_row and col < ego_col
    truth, view = panel_view(figure, "truth", cfg)
    prediction, _ = panel_view(figure, "prediction", cfg)
    assert pixel(truth, view, -12.0, -2.0) == road
    half = 0.5 * np.asarray(road) + 0.5 * np.asarray(BACKGROUND)  # probability 0.5 as half the opacity
    assert np.abs(np.asarray(pixel(prediction, view, -12.0, -2.0)) - half).max() <= 1


def test_the_scale_bar_is_ten_metres_long():
    cfg = small_config()
    grid = BevGrid.from_config(cfg.grid)
    item = known_item(grid)
    figure = render_sample(item, np.zeros((4, grid.nx, grid.ny), np.float32), cfg)
    panel, view = panel_view(figure, "prediction", cfg)
    bar = near(panel[-30:, : panel.shape[1] // 2], (30, 30, 30), tol=0)  # the bar: dark rows at the bottom left
    longest = max(int(row.sum()) for row in bar)
    assert abs(longest - 10 * view.pixels_per_metre) <= 1


def test_threshold_mode_shows_the_cells_the_iou_counts():
    cfg = small_config("viz.mode=threshold", "eval.threshold=0.5")
    grid = BevGrid.from_config(cfg.grid)
    item = known_item(grid)
    probs = np.zeros((4, grid.nx, grid.ny), np.float32)
    probs[0] = 0.6 * known_scene(grid)[0]  # the vehicle above the threshold
    probs[1] = 0.4 * known_scene(grid)[1]  # the pedestrian below it
    figure = render_sample(item, probs, cfg)
    panel, view = panel_view(figure, "prediction", cfg)
    assert pixel(panel, view, 10.0, 3.0) == class_colors(CLASSES)[0]
    assert pixel(panel, view, -5.5, -7.5) == BACKGROUND


def test_boxes_predicted_left_true_right_and_both_in_the_cameras():
    cfg = small_config(*DETECTION)
    grid = BevGrid.from_config(cfg.grid)
    true_box = [10.0, -6.0, 0.0, 2.0, 4.0, 1.5, 0.0, 0.0, 0.0]  # 10 m ahead, 6 m right: in CAM_FRONT
    item = known_item(grid, [true_box])
    detections = {
        "boxes": torch.tensor([[-8.0, 8.0, 0.0, 2.0, 4.0, 1.5, math.pi / 2, 0, 0],
                               [8.0, 10.0, 0.0, 2.0, 4.0, 1.5, 0.0, 0, 0]]),
        "scores": torch.tensor([0.9, 0.1]),  # the second below the drawing threshold (0.3)
        "labels": torch.tensor([0, 0]),
    }
    figure = render_sample(item, np.zeros((4, grid.nx, grid.ny), np.float32), cfg, detections=detections)
    prediction, view = panel_view(figure, "prediction", cfg)
    truth, _ = panel_view(figure, "truth", cfg)

    def drawn_around(panel, color, x, y, half_m):
        rows, cols = np.nonzero(near(panel, color))
        assert len(rows) > 20, color
        col, row = view.to_pixels(np.array([x, y]))
        reach = half_m * view.pixels_per_metre + 3
        assert np.abs(rows - row).max() <= reach and np.abs(cols - col).max() <= reach

    drawn_around(prediction, PREDICTION_COLOR, -8.0, 8.0, 2.0)  # the confident prediction only
    drawn_around(truth, GROUND_TRUTH_COLOR, 10.0, -6.0, 2.0)
    assert not near(prediction, GROUND_TRUTH_COLOR).any() and not near(truth, PREDICTION_COLOR).any()
    # In CAM_FRONT the wireframe lies where the rig projects the box, scaled from 96 x 32 to the 352 pixel tile.
    front = figure.regions["cameras"].of(figure.image)[:, 352:704]
    corners = box_corners(np.array([true_box]))[0]
    rig = [item[k][1].numpy() for k in ("intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot",
                                         "post_trans")]
    uv = ego_to_pixels(corners, *rig)[0] * (352 / 96)
    rows, cols = np.nonzero(near(front, GROUND_TRUTH_COLOR))
    assert len(rows) > 10
    assert cols.min() >= max(0, uv[:, 0].min() - 3) and cols.max() <= min(351, uv[:, 0].max() + 3)
    assert rows.min() >= max(0, uv[:, 1].min() - 3) and rows.max() <= min(116, uv[:, 1].max() + 3)
    assert cols.max() - cols.min() > 0.5 * (min(351, uv[:, 0].max()) - max(0, uv[:, 0].min()))
    legend = figure.regions["legend"].of(figure.image)
    assert near(legend, PREDICTION_COLOR, tol=0).any() and near(legend, GROUND_TRUTH_COLOR, tol=0).any()


def test_the_training_picture_is_the_first_sample_of_the_batch():
    cfg = small_config()
    grid = BevGrid.from_config(cfg.grid)
    first, second = known_item(grid), known_item(grid)
    second["targets"] = torch.flip(second["targets"], dims=(1,))  # the vehicle behind the ego car
    batch = {k: torch.stack([first[k], second[k]]) if torch.is_tensor(first[k]) else [first[k], second[k]]
             for k in first}
    logits = torch.full((2, 4, grid.nx, grid.ny), -20.0)
    image = render_batch(batch, {"segmentation": logits}, cfg)
    figure = render_sample(first, np.zeros((4, grid.nx, grid.ny), np.float32), cfg)
    assert image.shape == figure.image.shape
    rect = figure.regions["truth"]
    truth = rect.of(image)
    view = BevView(grid, rect.height, rect.width)
    assert pixel(truth, view, 10.0, 3.0) == class_colors(CLASSES)[0]
    assert pixel(truth, view, -10.0, 3.0) != class_colors(CLASSES)[0]


# ------------------------------------------------------------------------------------ checkpoints and demo

TINY = ["data.final_dim=[32, 96]", "data.resize_lim=[0.24, 0.26]", "grid.xbound=[-16.0, 16.0, 1.0]",
        "grid.ybound=[-16.0, 16.0, 1.0]", "grid.dbound=[4.0, 20.0, 2.0]", "model.context_channels=8",
        "data.classes=[vehicle, drivable_area]", "data.workers=0", "train.batch_size=2", "train.max_steps=2",
        "train.eval_every=2", "train.viz_every=2", "train.ckpt_every=2", "train.log_every=1", "train.device=cpu",
        "eval.batch_size=2", "viz.num=2", "viz.gif=true"]


def test_eval_and_viz_of_a_checkpoint_go_through_load_for_inference(synthetic_root, tmp_path, monkeypatch):
    import lss.engine.checkpoint as checkpoint
    import lss.engine.eval as eval_module
    import lss.viz as viz
    from lss.data.loader import build_dataset, build_eval_loader
    from lss.engine.checkpoint import save_checkpoint
    from lss.models import build_model

    cfg = load_config(None, TINY + [f"data.dataroot={synthetic_root}"])
    torch.manual_seed(7)
    saved = build_model(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "best.pt"
    save_checkpoint(ckpt, saved, step=5, config=cfg)
    loaded, real_load = [], checkpoint.load_for_inference

    def spy(*args, **kwargs):
        model, state = real_load(*args, **kwargs)
        loaded.append(model)
        return model, state

    monkeypatch.setattr(checkpoint, "load_for_inference", spy)  # eval and viz: load_checkpoint_model
    result = eval_module.evaluate_checkpoint(cfg, str(ckpt))
    assert len(loaded) == 1 and not loaded[0].training
    weights = saved.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in loaded[0].state_dict().items())
    cpu = torch.device("cpu")
    loader = build_eval_loader(cfg, build_dataset(cfg, cfg.data.val_split, False), cpu)
    reference = eval_module.evaluate(saved, loader, cfg, cpu, show_progress=False)
    assert result["iou"] == pytest.approx(reference["iou"], abs=1e-6)
    assert result["step"] == 5 and result["samples"] == 3
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["iou"] == result["iou"]

    pictures = viz.render_checkpoint(cfg, str(ckpt))  # by default into viz/ of the run directory
    assert len(loaded) == 2 and not loaded[1].training
    assert [p.suffix for p in pictures] == [".png", ".png", ".gif"] and all(p.is_file() for p in pictures)
    assert all(p.parent == tmp_path / "run" / "viz" for p in pictures)
    assert pictures[2].name.startswith("scene-")  # the GIF is named after the samples' scene
    with Image.open(pictures[0]) as png, Image.open(pictures[2]) as gif:
        assert gif.n_frames == 2 and gif.size == png.size


def test_eval_and_viz_write_into_the_run_directory_of_a_checkpoint(tmp_path):
    from lss.engine.checkpoint import run_directory

    assert run_directory(tmp_path / "run" / "checkpoints" / "last.pt") == tmp_path / "run"
    assert run_directory(str(tmp_path / "exported" / "model.pt")) == tmp_path / "exported"


@pytest.mark.slow
def test_demo_generates_its_set_trains_evaluates_and_renders(tmp_path, capsys):
    """The CPU recipe end to end at a tiny size: the demo generates its synthetic set (the recipe's v1.0-trainval
    scene names: 1 train and 1 val scene of 2 scenes), trains its ResNet-18 trunk, evaluates and renders."""
    from lss.engine.demo import demo

    run, data = tmp_path / "demo", tmp_path / "data"
    tiny_set = ["data.synthetic.scenes=2", "data.synthetic.samples_per_scene=3", "data.synthetic.image_size=[128, 72]",
                "data.resize_lim=[0.75, 0.8]", f"data.dataroot={data}"]
    result = demo(overrides=TINY + tiny_set, out_dir=str(run), device="cpu")
    printed = capsys.readouterr().out
    assert ("lss demo: the CPU demo recipe (configs/synthetic_demo.yaml): 6 cameras at 32x96 (5 per training "
            "sample), 32 x 32 grid of 1 m cells, resnet18 camera trunk, 2 steps of batch 2 on cpu; data in "
            f"{data} (where missing: 2 synthetic scenes x 3 samples at 128x72)\n") in printed
    assert result["recipe"] == "the CPU demo recipe (configs/synthetic_demo.yaml)"
    assert (data / "v1.0-trainval").is_dir() and len(list((data / "samples" / "CAM_FRONT").iterdir())) == 6
    assert (run / "checkpoints" / "best.pt").is_file() and (run / "metrics.jsonl").is_file()
    report = json.loads((run / "eval.json").read_text())
    assert set(report["iou"]) == {"vehicle", "drivable_area"} and report["samples"] == 3
    assert report["iou"] == result["eval"]["iou"]
    pngs = sorted((run / "viz").glob("*.png"))
    assert len(pngs) == 2 and len(list((run / "viz").glob("*.gif"))) == 1
    with Image.open(pngs[0]) as im:
        w, h = im.size
    assert w == 3 * 352 and h > 2 * 352  # the cameras above two panels half the cameras' width each
    # The training loop's tensorboard picture is the same figure.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (tag,) = events.Tags()["images"]
    shown = events.Images(tag)[-1]
    assert (shown.width, shown.height) == (w, h)
