"""Engine: metrics, losses, checkpoints, schedules, sampler, and the trainer loop on a tiny fake model and dataset
(resume continues the same loss curve, NaN stops with the step, DDP code path with gloo, user hooks); the import
graph of lss has no cycle and the engine does not import lss.viz."""
import ast
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lss
from lss.config import ConfigError, load_config
from lss.data import collate
from lss.engine import checkpoint as ck
from lss.engine.optim import lr_factor
from lss.data.samplers import EpochSampler
from lss.engine.hooks import EvalHook, Hook, is_due
from lss.engine.step import compile_encoders
from lss.models.depth_loss import depth_loss
from lss.models.heads.segmentation import SegmentationLoss
from lss.models.losses import TotalLoss
from lss.engine.metrics import IoUMeter, format_iou_table
from lss.engine.train import train

CLASSES = ("vehicle", "drivable_area")
GRID = 8


def fake_picture(batch, outputs, cfg):
    """A render function with lss.viz.render_batch's signature: the first sample's first class."""
    probs = outputs["segmentation"][0, 0].float().sigmoid().cpu().numpy()
    return np.repeat((255 * probs).astype(np.uint8)[..., None], 3, axis=2)


# --------------------------------------------------------------------------------------------- fakes
class FakeBEVDataset(torch.utils.data.Dataset):
    """Items shaped like NuScenesBEV's (2 cameras of 8 x 8 pixels); the targets follow from the images so that a
    model can learn them. Uses the global torch RNG per item (like the real augmentation) for a noise term."""

    def __init__(self, length: int, offset: int = 0):
        self.length, self.offset = length, offset

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + self.offset + i)
        images = torch.randn(2, 3, GRID, GRID, generator=g)
        images = images + 0.01 * torch.randn(images.shape)  # augmentation-like global-RNG draw
        signal = images[0, :2]
        return {"images": images, "targets": (signal > 0.3).float(), "sample_token": f"tok{self.offset + i}"}


class FakeModel(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        self.conv = nn.Conv2d(3, len(CLASSES), 3, padding=1)
        self.drop = nn.Dropout(0.1)  # consumes the RNG in training, as drop-connect does in the real model

    def forward(self, batch):
        return {"segmentation": self.conv(self.drop(batch["images"][:, 0]))}


def fake_cfg(tmp_path, *extra):
    return load_config(None, [
        f"data.classes={list(CLASSES)}", "data.workers=0", "train.batch_size=2", "train.max_steps=6",
        "train.log_every=1", "train.eval_every=3", "train.ckpt_every=3", "train.viz_every=3", "train.device=cpu",
        "train.deterministic=true", "optim.lr=0.05", "eval.batch_size=3", f"train.out_dir={tmp_path / 'run'}",
        "loss.type=bce", *extra])


def fake_train(cfg, out_dir, resume=False, length=10):
    return train(cfg, str(out_dir), resume, model_fn=FakeModel,
                 dataset_fn=lambda c, split, is_train: FakeBEVDataset(length if is_train else 5,
                                                                      0 if is_train else 100),
                 collate_fn=collate, render_fn=fake_picture)


def train_records(run_dir):
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def losses_of(run_dir):
    return [(r["step"], r["loss"]) for r in train_records(run_dir)]


class SlowBEVDataset(FakeBEVDataset):
    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)


def test_train_records_split_the_loops_host_time(tmp_path):
    cfg = fake_cfg(tmp_path, "train.log_every=2", "train.eval_every=0", "train.ckpt_every=0", "train.viz_every=0")
    train(cfg, str(tmp_path / "run"), model_fn=FakeModel, collate_fn=collate, render_fn=fake_picture,
          dataset_fn=lambda c, split, is_train: SlowBEVDataset(10 if is_train else 5, 0 if is_train else 100))
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 4, 6]
    for before, record in zip(records, records[1:]):  # the first record's split starts after the first step
        host = record["host"]
        assert host["fetch_ms"] >= 2 * 20  # two items of 20 ms each per batch, loaded in this process (workers=0)
        assert host["wait_ms"] == 0  # the loss check waits only for a captured step
        assert host["other_ms"] > 0
        per_step = 1e3 * (record["elapsed"] - before["elapsed"]) / (record["step"] - before["step"])
        assert sum(host.values()) == pytest.approx(per_step, rel=0.2)


def test_host_split_rows_weigh_the_steady_records_by_steps():
    from benchmarks.train_loop import host_split_rows

    records = [{"kind": "train", "step": s, "host": {"fetch_ms": f, "wait_ms": 1.0, "other_ms": 2.0}}
               for s, f in ((5, 99.0), (10, 99.0), (20, 4.0), (40, 1.0), (50, 1.0))]
    rows = host_split_rows("c", records)
    assert [r["impl"] for r in rows] == ["loop host: fetch", "loop host: wait", "loop host: other"]
    # the steady window starts at the 2nd record (WARMUP_FRACTION of 5 records skips 1): steps 10-20 at 4 ms,
    # 20-50 at 1 ms
    assert rows[0]["ms"] == pytest.approx((10 * 4.0 + 30 * 1.0) / 40) and rows[1]["ms"] == pytest.approx(1.0)
    assert host_split_rows("c", [{"kind": "train", "step": 1}]) == []


# ------------------------------------------------------------------------------------------- metrics
def test_iou_is_dataset_level_not_mean_of_batches():
    meter = IoUMeter(["a"], threshold=0.5, sweep=[0.25, 0.75])
    probs = [np.array([0.9, 0.9, 0.1, 0.6]), np.array([0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])]
    truth = [np.array([1, 0, 0, 1]), np.array([0, 0, 0, 0, 0, 0, 0, 1])]
    for p, t in zip(probs, truth):
        logits = torch.logit(torch.tensor(p, dtype=torch.float64)).view(1, 1, 1, -1)
        meter.update(logits, torch.tensor(t, dtype=torch.float32).view(1, 1, 1, -1))
    result = meter.compute()
    for thr in (0.25, 0.5, 0.75):
        inter = sum(((p > thr) & (t > 0)).sum() for p, t in zip(probs, truth))
        union = sum(((p > thr) | (t > 0)).sum() for p, t in zip(probs, truth))
        assert result["sweep"][f"{thr:g}"]["a"] == pytest.approx(inter / union)
    assert result["iou"]["a"] == pytest.approx(2 / 5)  # batch means would give (2/3 + 0/2) / 2
    assert result["mean_iou"] == result["iou"]["a"]
    assert "a" in format_iou_table(result) and "@  0.5" in format_iou_table(result)


def test_iou_empty_union_is_zero_and_shapes_are_checked():
    meter = IoUMeter(CLASSES)
    meter.update(torch.full((2, 2, 4, 4), -10.0), torch.zeros(2, 2, 4, 4))
    assert meter.compute()["iou"] == {"vehicle": 0.0, "drivable_area": 0.0}
    with pytest.raises(ValueError, match="B x 2 x nx x ny"):
        meter.update(torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        IoUMeter(CLASSES, sweep=[1.0])


# -------------------------------------------------------------------------------------------- losses
def test_bce_loss_matches_pytorch_with_pos_weight_and_mask(tmp_path):
    cfg = fake_cfg(tmp_path, "loss.pos_weight=2.13")
    loss_fn = SegmentationLoss(cfg)
    logits = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    targets = (torch.rand(2, 2, 5, 5) > 0.7).float()
    got = loss_fn({"segmentation": logits}, {"targets": targets})
    ref = F.binary_cross_entropy_with_logits(logits.float(), targets, pos_weight=torch.tensor(2.13))
    assert torch.allclose(got["loss"], ref, atol=1e-6)
    mask = torch.rand(2, 5, 5) > 0.5
    got = loss_fn({"segmentation": logits}, {"targets": targets, "visibility_mask": mask})
    elem = F.binary_cross_entropy_with_logits(logits.float(), targets, pos_weight=torch.tensor(2.13),
                                              reduction="none")
    m = mask.unsqueeze(1).float()
    per_class = (elem * m).sum((0, 2, 3)) / m.expand_as(elem).sum((0, 2, 3))
    assert torch.allclose(got["loss"], per_class.mean(), atol=1e-6)
    assert torch.allclose(got["loss/vehicle"], per_class[0], atol=1e-6)
    got["loss"].backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_focal_loss_uses_the_op_and_class_weights(tmp_path):
    from lss.ops import sigmoid_focal_loss

    cfg = fake_cfg(tmp_path, "loss.type=focal", "loss.class_weights=[3.0, 1.0]", "loss.focal_alpha=0.5")
    logits, targets = torch.randn(2, 2, 4, 4), (torch.rand(2, 2, 4, 4) > 0.5).float()
    got = SegmentationLoss(cfg)({"segmentation": logits}, {"targets": targets})["loss"]
    per_class = sigmoid_focal_loss(logits, targets, alpha=0.5, gamma=2.0, reduction="none").mean((0, 2, 3))
    assert torch.allclose(got, (3 * per_class[0] + per_class[1]) / 4, atol=1e-6)
    with pytest.raises(ValueError, match="class_weights has 1 values"):
        SegmentationLoss(fake_cfg(tmp_path, "loss.class_weights=[1.0]"))
    with pytest.raises(ValueError, match="loss.type='l2'"):
        SegmentationLoss(fake_cfg(tmp_path, "loss.type=l2"))


def test_soft_iou_term_against_hand_values_mask_and_gradient(tmp_path):
    from lss.models.heads.segmentation import soft_iou

    cfg = fake_cfg(tmp_path, "loss.pos_weight=2.0", "loss.soft_iou_weights=[0.0, 2.0]")
    loss_fn = SegmentationLoss(cfg)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = (torch.rand(2, 2, 5, 5, generator=g) > 0.7).float()
    mask = torch.rand(2, 5, 5, generator=g) > 0.4
    got = loss_fn({"segmentation": logits}, {"targets": targets, "visibility_mask": mask})
    # by hand, the second class only, visible cells only, +1 on both sides of the fraction
    p = torch.sigmoid(logits[:, 1].detach())[mask]
    t = targets[:, 1][mask]
    iou = ((p * t).sum() + 1) / ((p + t - p * t).sum() + 1)
    elem = F.binary_cross_entropy_with_logits(logits.detach().float(), targets,
                                              pos_weight=torch.tensor(2.0), reduction="none")
    m = mask.unsqueeze(1).float().expand_as(elem)
    bce = ((elem * m).sum((0, 2, 3)) / m.sum((0, 2, 3))).mean()
    assert torch.allclose(got["loss/soft_iou"].double(), 2 * (1 - iou), atol=1e-6)
    assert torch.allclose(got["loss"].double(), bce.double() + 2 * (1 - iou), atol=1e-6)
    got["loss"].backward()
    # the term pulls the second class's positives up and its negatives down: its gradient on the
    # logits differs from the BCE's alone
    ref = logits.detach().clone().requires_grad_(True)
    SegmentationLoss(fake_cfg(tmp_path, "loss.pos_weight=2.0"))(
        {"segmentation": ref}, {"targets": targets, "visibility_mask": mask})["loss"].backward()
    assert torch.allclose(logits.grad[:, 0], ref.grad[:, 0])
    diff = (logits.grad[:, 1] - ref.grad[:, 1])[mask]
    assert (diff[t > 0] < 0).all() and (diff[t == 0] > 0).all()
    # a perfect prediction scores (almost) 1; weights of zero leave the loss unchanged
    perfect = (targets * 2 - 1) * 30
    assert torch.allclose(soft_iou(perfect, targets), torch.ones(2), atol=1e-6)
    plain = SegmentationLoss(fake_cfg(tmp_path, "loss.soft_iou_weights=[0.0, 0.0]"))
    assert "loss/soft_iou" not in plain({"segmentation": logits}, {"targets": targets})
    with pytest.raises(ValueError, match="soft_iou_weights has 1 values"):
        SegmentationLoss(fake_cfg(tmp_path, "loss.soft_iou_weights=[1.0]"))
    with pytest.raises(ValueError, match="expected finite values >= 0"):
        SegmentationLoss(fake_cfg(tmp_path, "loss.soft_iou_weights=[1.0, -1.0]"))


# ---------------------------------------------------------------------------------------- checkpoints
def depth_case(seed=0, bins=5):
    """Float64 depth logits B x N x D x fH x fW and int64 targets with about 30% cells ignored (-1)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, bins, 4, 6, generator=g, dtype=torch.float64)
    targets = torch.randint(0, bins, (2, 3, 4, 6), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -1
    return logits, targets


def depth_reference(logits, targets):
    """Mean over valid cells of -log softmax(logits)[target], in float64."""
    log_prob = torch.log_softmax(logits.double(), dim=2)
    picked = log_prob.gather(2, targets.clamp(min=0).unsqueeze(2)).squeeze(2)
    return -picked[targets >= 0].mean()


def test_depth_loss_matches_a_float64_reference_and_ignores_cells_without_lidar():
    logits, targets = depth_case()
    logits.requires_grad_(True)
    got = depth_loss({"depth_logits": logits}, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), depth_reference(logits.detach(), targets), rtol=1e-6, atol=1e-7)
    got.backward()
    ignored = (targets < 0).unsqueeze(2).expand_as(logits)
    assert logits.grad[~ignored].abs().sum() > 0 and torch.all(logits.grad[ignored] == 0)
    moved = logits.detach().clone()
    moved[ignored] += 10 * torch.rand(int(ignored.sum()), dtype=torch.float64)
    assert depth_loss({"depth_logits": moved}, targets) == got.detach()
    none = depth_loss({"depth_logits": logits}, torch.full_like(targets, -1))
    assert none == 0
    none.backward()  # an empty target set keeps the graph: no NaN, no error


def test_depth_loss_is_zero_for_one_hot_distributions_on_the_targets_and_positive_otherwise():
    logits, targets = depth_case()
    one_hot = F.one_hot(targets.clamp(min=0), 5).permute(0, 1, 4, 2, 3).double()
    assert depth_loss({"depth": one_hot}, targets) == 0  # log(1)
    assert depth_loss({"depth_logits": 60.0 * one_hot}, targets) < 1e-6
    uniform = depth_loss({"depth_logits": torch.zeros_like(one_hot)}, targets)
    assert math.isclose(float(uniform), math.log(5), rel_tol=1e-6)
    assert depth_loss({"depth": one_hot.roll(1, dims=2)}, targets) > 20  # all mass one bin off: log(1e-12) floor
    probabilities = logits.softmax(dim=2)
    torch.testing.assert_close(depth_loss({"depth": probabilities}, targets).double(),
                               depth_reference(logits, targets), rtol=1e-5, atol=1e-6)


def test_depth_loss_runs_in_float32_under_bf16_autocast():
    logits, targets = depth_case()
    low = logits.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = depth_loss({"depth_logits": low}, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), depth_reference(low, targets), rtol=1e-6, atol=1e-6)


def test_depth_loss_rejects_mismatched_inputs():
    logits, targets = depth_case()
    with pytest.raises(ValueError, match="do not match"):
        depth_loss({"depth_logits": logits}, targets[..., :5])
    with pytest.raises(ValueError, match=r"outside \[-1, 5\)"):
        depth_loss({"depth_logits": logits}, targets.clamp(max=4) + 1)
    with pytest.raises(ValueError, match="int64"):
        depth_loss({"depth_logits": logits}, targets.int())
    with pytest.raises(ValueError, match="'depth_logits'"):
        depth_loss({"segmentation": logits}, targets)


def test_depth_weight_needs_depth_targets(tmp_path):
    with pytest.raises(ConfigError, match="loss.depth_weight=1.0 needs lidar depth targets: set "
                                          "data.depth_targets: true"):
        fake_train(fake_cfg(tmp_path, "loss.depth_weight=1.0"), tmp_path / "run")
    with pytest.raises(ConfigError, match="expected >= 0"):
        TotalLoss(fake_cfg(tmp_path, "loss.depth_weight=-1.0", "data.depth_targets=true"))


def test_total_loss_adds_the_weighted_depth_loss_and_logs_it(tmp_path):
    logits, targets = depth_case()
    outputs = {"segmentation": torch.randn(2, 2, 4, 4), "depth_logits": logits.float()}
    batch = {"targets": (torch.rand(2, 2, 4, 4) > 0.5).float(), "depth_targets": targets}
    logged = TotalLoss(fake_cfg(tmp_path, "data.depth_targets=true"))(outputs, batch)
    weighted = TotalLoss(fake_cfg(tmp_path, "data.depth_targets=true", "loss.depth_weight=2.5"))(outputs, batch)
    depth = depth_loss(outputs, targets)
    assert logged["depth_loss"] == weighted["depth_loss"] == depth
    assert logged["loss"] == logged["loss/segmentation"] == weighted["loss/segmentation"]
    torch.testing.assert_close(weighted["loss"], logged["loss"] + 2.5 * depth)
    assert "depth_loss" not in TotalLoss(fake_cfg(tmp_path))(outputs, batch)
    with pytest.raises(ValueError, match="no 'depth_targets'"):
        TotalLoss(fake_cfg(tmp_path, "data.depth_targets=true"))(outputs, {"targets": batch["targets"]})


class FakeDepthDataset(FakeBEVDataset):
    """Adds depth targets (2 bins) that follow from the second image channel; a quarter of the cells ignored."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        depth = (item["images"][:, 1] > 0).long()
        depth[:, ::2, ::2] = -1
        item["depth_targets"] = depth
        return item


class FakeDepthModel(FakeModel):
    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.depth = nn.Conv2d(3, 2, 1)

    def forward(self, batch):
        out = super().forward(batch)
        images = batch["images"]
        out["depth_logits"] = self.depth(images.flatten(0, 1)).unflatten(0, images.shape[:2])
        return out


def test_training_logs_the_depth_loss_and_learns_it_only_with_a_weight(tmp_path):
    curves = {}
    for weight in (1.0, 0.0):
        cfg = fake_cfg(tmp_path, "data.depth_targets=true", f"loss.depth_weight={weight}", "train.max_steps=12")
        run = tmp_path / f"run{weight}"
        train(cfg, str(run), model_fn=FakeDepthModel, collate_fn=collate,
              dataset_fn=lambda c, split, is_train: FakeDepthDataset(10 if is_train else 5, 0 if is_train else 100))
        records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        records = [r for r in records if r["kind"] == "train"]
        assert all("loss/segmentation" in r for r in records)
        curves[weight] = [r["depth_loss"] for r in records]
    assert len(curves[1.0]) == 12 and curves[1.0][-1] < 0.6 * curves[1.0][0]
    assert curves[0.0][-1] > 0.9 * curves[0.0][0]  # logged only: no gradient reaches the depth logits


def test_checkpoint_round_trip_and_atomic_write(tmp_path):
    cfg = fake_cfg(tmp_path)
    model = FakeModel()
    opt = torch.optim.Adam(model.parameters())
    model(dict(images=torch.randn(2, 2, 3, 8, 8)))["segmentation"].sum().backward()
    opt.step()
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, model, 17, cfg, opt)
    state = ck.load_checkpoint(path)
    assert state["step"] == 17 and state["version"] and state["config"]["train"]["max_steps"] == 6
    other = FakeModel()
    ck.load_model_state(other, state, path)
    assert torch.equal(other.conv.weight, model.conv.weight)
    assert ck.checkpoint_config(state).data.classes == CLASSES
    before = path.read_bytes()
    with pytest.raises(Exception):
        ck.save_checkpoint(path, model, 18, cfg, extra={"unpicklable": lambda: 0})
    assert path.read_bytes() == before  # the failed write left the old file intact
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # and no temp file behind


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "none.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ck.CheckpointError, match="corrupt"):
        ck.load_checkpoint(bad)
    torch.save({"weights": 1}, bad)
    with pytest.raises(ck.CheckpointError, match="not an lss checkpoint"):
        ck.load_checkpoint(bad)
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, FakeModel(), 1, fake_cfg(tmp_path))
    wide = FakeModel()
    wide.conv = nn.Conv2d(3, 5, 3, padding=1)
    with pytest.raises(ck.CheckpointError, match=r"shape mismatch.*conv.weight"):
        ck.load_model_state(wide, ck.load_checkpoint(path), path)
    state = ck.load_checkpoint(path)
    state["format"] = 99
    torch.save(state, path)
    with pytest.raises(ck.CheckpointError, match="format 99"):
        ck.load_checkpoint(path)


def test_unwrap_strips_ddp_like_wrappers():
    inner = FakeModel()
    holder = nn.Module()
    holder.module = inner
    assert ck.unwrap(holder) is inner


# ------------------------------------------------------------------------------------- schedule, sampler
def test_lr_schedules(tmp_path):
    cfg = fake_cfg(tmp_path, "train.max_steps=100", "optim.warmup_steps=10", "optim.schedule=cosine")
    f = [lr_factor(cfg, s) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[99] < 0.01 and all(a >= b for a, b in zip(f[10:], f[11:]))
    cfg = fake_cfg(tmp_path, "train.max_steps=100", "optim.schedule=onecycle")
    f = [lr_factor(cfg, s) for s in range(101)]
    assert f[0] < 0.1 and max(f) == pytest.approx(1.0) and f[100] < 1e-3
    assert lr_factor(fake_cfg(tmp_path), 5) == 1.0
    with pytest.raises(ValueError, match="optim.schedule='step'"):
        lr_factor(fake_cfg(tmp_path, "optim.schedule=step"), 0)


def test_epoch_sampler_shards_and_resumes():
    full = EpochSampler(10, seed=3)
    full.set_epoch(2)
    order = list(full)
    assert sorted(order) == list(range(10)) and order != list(range(10))
    full.set_epoch(2, start=4)
    assert list(full) == order[4:] and len(full) == 6
    ranks = [EpochSampler(10, seed=3, rank=r, world_size=3) for r in range(3)]
    for s in ranks:
        s.set_epoch(2)
    shards = [list(s) for s in ranks]
    assert all(len(s) == 4 for s in shards) and set(sum(shards, [])) == set(range(10))
    evals = [list(EpochSampler(10, shuffle=False, rank=r, world_size=3, pad=False)) for r in range(3)]
    assert sorted(sum(evals, [])) == list(range(10))


# ------------------------------------------------------------------------------------------- trainer
def test_train_writes_run_directory_and_learns(tmp_path):
    cfg = fake_cfg(tmp_path, "train.max_steps=12", "train.eval_every=6", "train.ckpt_every=6")
    run = tmp_path / "run"
    final = fake_train(cfg, run)
    assert (run / "config.yaml").is_file() and (run / "final.json").is_file()
    assert (run / "checkpoints" / "last.pt").is_file() and (run / "checkpoints" / "best.pt").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert load_config(run / "config.yaml").train.max_steps == 12
    losses = losses_of(run)
    assert [s for s, _ in losses] == list(range(1, 13))
    assert losses[-1][1] < losses[0][1]
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in val] == [6, 12] and set(val[-1]["iou"]) == set(CLASSES)
    train_rec = [r for r in records if r["kind"] == "train"][0]
    assert {"lr", "step_time", "samples_per_s", "grad_norm", "loss/vehicle"} <= set(train_rec)
    assert final["step"] == 12 and final["val"]["iou"]["vehicle"] > 0
    assert ck.load_checkpoint(run / "checkpoints" / "last.pt")["step"] == 12


def test_resume_continues_the_same_loss_curve(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    fake_train(fake_cfg(tmp_path, "train.max_steps=8", "train.ckpt_every=4"), straight, length=6)
    fake_train(fake_cfg(tmp_path, "train.max_steps=4"), split, length=6)
    fake_train(fake_cfg(tmp_path, "train.max_steps=8", "train.ckpt_every=4"), split, resume=True, length=6)
    a, b = losses_of(straight), losses_of(split)
    assert [s for s, _ in b] == list(range(1, 9))
    assert a == b  # bit-identical on CPU, across an epoch boundary (6 samples, batch 2: 3 steps per epoch)
    wa = ck.load_checkpoint(straight / "checkpoints" / "last.pt")["model"]
    wb = ck.load_checkpoint(split / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="last.pt does not exist"):
        fake_train(fake_cfg(tmp_path), tmp_path / "fresh", resume=True)


def test_nan_loss_stops_with_step_number(tmp_path):
    class Exploding(FakeModel):
        def forward(self, batch):
            out = super().forward(batch)["segmentation"]
            return {"segmentation": out * float("nan") if self.training and self.calls_nan() else out}

        def calls_nan(self):
            self.n = getattr(self, "n", 0) + 1
            return self.n == 3

    cfg = fake_cfg(tmp_path)
    with pytest.raises(FloatingPointError, match="at step 3"):
        train(cfg, str(tmp_path / "nan"), model_fn=Exploding,
              dataset_fn=lambda c, s, t: FakeBEVDataset(10), collate_fn=collate)


def test_gradient_accumulation_matches_a_larger_batch(tmp_path):
    one = fake_cfg(tmp_path, "train.max_steps=1", "train.batch_size=4", "optim.grad_clip=0")
    two = fake_cfg(tmp_path, "train.max_steps=1", "train.batch_size=2", "train.grad_accum=2", "optim.grad_clip=0")
    results = []
    for cfg, name in ((one, "one"), (two, "two")):
        torch.manual_seed(0)
        train(cfg, str(tmp_path / name), model_fn=lambda c: FakeModel().eval().requires_grad_(True),
              dataset_fn=lambda c, s, t: FakeBEVDataset(4), collate_fn=collate)
        results.append(ck.load_checkpoint(tmp_path / name / "checkpoints" / "last.pt"))
    # both see the same 4 samples in one optimizer step (dropout differs, so compare the first-step loss loosely)
    la, lb = losses_of(tmp_path / "one")[0][1], losses_of(tmp_path / "two")[0][1]
    assert math.isclose(la, lb, rel_tol=0.1)
    assert results[0]["step"] == results[1]["step"] == 1


def _ddp_worker(rank, world_size, port, cfg_path, run_dir, out):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = load_config(cfg_path)
    final = train(cfg, run_dir, model_fn=FakeModel, dataset_fn=lambda c, s, t: FakeBEVDataset(8), collate_fn=collate)
    weights = FakeModel().state_dict()
    state = ck.load_checkpoint(f"{run_dir}/checkpoints/last.pt")["model"] if rank == 0 else weights
    torch.save({"final": final, "state": state}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_ddp_code_path_with_gloo_two_processes(tmp_path):
    import socket

    import torch.multiprocessing as mp
    from lss.config import save_config

    cfg = fake_cfg(tmp_path, "train.max_steps=3", "train.eval_every=3")
    cfg_path = tmp_path / "cfg.yaml"
    save_config(cfg, cfg_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(cfg_path), str(tmp_path / "ddp"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt", weights_only=False), torch.load(tmp_path / "rank1.pt",
                                                                                weights_only=False)
    assert r0["final"]["step"] == r1["final"]["step"] == 3
    # the val IoU is summed over both ranks' shards, so every rank reports the same numbers
    assert r0["final"]["val"]["iou"] == r1["final"]["val"]["iou"]
    assert len(losses_of(tmp_path / "ddp")) == 3  # only rank 0 wrote


@pytest.fixture
def inductor_settings(monkeypatch):
    """The fast-start settings as they are now, restored after the test; the compile workers' start recorded."""
    import torch._inductor.config as inductor_config
    from torch._inductor import async_compile

    started = []
    monkeypatch.setattr(async_compile.AsyncCompile, "warm_pool", classmethod(lambda cls: started.append(cls)))
    # the config module's own patch (pytest's monkeypatch would delete a sub-config setting when it undoes)
    with inductor_config.patch({"triton.autotune_pointwise": True, "pattern_matcher": True}):
        yield inductor_config, started


def test_compile_encoders_wraps_trainable_children_and_rejects_unknown_modes(inductor_settings):
    model = nn.Module()
    model.encoder = nn.Linear(2, 2)
    model.frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="train.compile_mode='fast'.*reduce-overhead"):
        compile_encoders(model, "fast")
    with pytest.raises(ConfigError, match=r"train.compile_memory_budget=1.5: expected a fraction in \(0, 1\]"):
        compile_encoders(model, "default", 1.5)
    import torch._functorch.config as functorch_config

    compile_encoders(model, "reduce-overhead", 0.5)
    assert model.encoder._compiled_call_impl is not None and model.frozen._compiled_call_impl is None
    assert functorch_config.activation_memory_budget == 0.5
    compile_encoders(nn.Module(), "default")
    assert functorch_config.activation_memory_budget == 1.0


def test_compile_encoders_sets_up_the_compiler_for_a_short_first_step(inductor_settings):
    inductor_config, started = inductor_settings
    model = nn.Module()
    model.encoder = nn.Linear(2, 2)
    compile_encoders(model, "default")
    assert inductor_config.triton.autotune_pointwise is False and inductor_config.pattern_matcher is False
    assert started == []  # a CPU model: no Triton workers to start


def test_fast_start_compiler_skips_settings_this_torch_lacks_and_starts_the_workers(inductor_settings, monkeypatch):
    import lss.engine.step.compiled as compiled

    inductor_config, started = inductor_settings
    monkeypatch.setattr(compiled, "FAST_START_INDUCTOR", (("triton.no_such_setting", 1), ("no_such_group.setting", 1),
                                                       ("pattern_matcher", False)))
    assert compiled.fast_start_compiler(start_workers=True) == ["pattern_matcher"]
    assert inductor_config.pattern_matcher is False and inductor_config.triton.autotune_pointwise is True
    assert len(started) == 1


# ----------------------------------------------------------------------------------- hooks and timing
def test_user_hooks_receive_callables_and_run_at_their_period(tmp_path):
    class EveryN(Hook):
        def __init__(self, period, callback):
            self.period, self.callback = period, callback

        def after_step(self, trainer, logs):
            if is_due(trainer, self.period):
                self.callback(trainer.step, logs["loss"])

    seen, evaluated = [], []
    scores = iter([0.2, 0.5, 0.4])

    def eval_function():
        evaluated.append(True)
        score = next(scores)
        return {"iou": {"vehicle": score}, "mean_iou": score}

    run = tmp_path / "hooks"
    cfg = fake_cfg(tmp_path, "train.max_steps=7", "train.eval_every=0", "train.viz_every=0")
    # no validation samples: the only evaluation is the user's
    final = train(cfg, str(run), model_fn=FakeModel, collate_fn=collate,
                  dataset_fn=lambda c, split, is_train: FakeBEVDataset(10 if is_train else 0),
                  hooks=[EveryN(2, lambda step, loss: seen.append((step, loss))), EvalHook(3, eval_function)])
    assert seen == [(s, loss) for s, loss in losses_of(run) if s in (2, 4, 6, 7)]  # every 2 steps and the last
    assert len(evaluated) == 3 and final["val"]["mean_iou"] == 0.4  # steps 3, 6 and 7
    assert final["best_iou"] == 0.5 and final["best_step"] == 6
    assert ck.load_checkpoint(run / "checkpoints" / "best.pt")["step"] == 6


def test_train_records_carry_the_seconds_since_train_was_called(tmp_path):
    def slow_dataset(cfg, split, is_train):
        time.sleep(0.3)  # start-up before the first step counts
        return FakeBEVDataset(10 if is_train else 5)

    cfg = fake_cfg(tmp_path, "train.eval_every=0", "train.viz_every=0")
    before = time.perf_counter()
    train(cfg, str(tmp_path / "run"), model_fn=FakeModel, dataset_fn=slow_dataset, collate_fn=collate)
    total = time.perf_counter() - before
    records = train_records(tmp_path / "run")
    elapsed = [r["elapsed"] for r in records]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert elapsed[0] >= 0.6 + records[0]["step_time"]
    # consecutive records are at least the later step apart; the last is within train()'s own wall time
    assert all(b - a >= r["step_time"] for a, b, r in zip(elapsed, elapsed[1:], records[1:]))
    assert elapsed[-1] <= total


# --------------------------------------------------------------------------------------- import graph
def lss_import_graph() -> dict:
    """lss module -> the lss modules it imports anywhere in its source (function bodies included)."""
    root = Path(lss.__file__).parent
    files = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            # a package's __init__ runs before its modules anyway: importing a parent package is no edge
            targets |= {t for t in names if t in files and t != name and not name.startswith(t + ".")}
        graph[name] = targets
    return graph


def find_cycle(graph: dict):
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for t in sorted(graph[node]):
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_reports_the_modules_of_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_lss_has_no_import_cycle_and_the_engine_does_not_import_viz():
    graph = lss_import_graph()
    assert {"lss.engine.train", "lss.engine.optim", "lss.models.build", "lss.data.loader", "lss.viz"} <= set(graph)
    assert find_cycle(graph) is None
    # the engine never imports the pictures but in the demo, a workflow over both (lss.engine.demo)
    assert [m for m, t in graph.items() if m.startswith("lss.engine") and m != "lss.engine.demo"
            and any(x.startswith("lss.viz") for x in t)] == []
    assert any(x.startswith("lss.viz") for x in graph["lss.engine.demo"])
    # pictures and export load a model through the checkpoint code, not the trainer or the evaluator
    trainer = {"lss.engine.train", "lss.engine.eval", "lss.engine.step"}
    assert [m for m, t in graph.items() if m.startswith(("lss.viz", "lss.export")) and t & trainer] == []
    assert "lss.engine.train" not in graph["lss.engine.eval"]
    assert [m for m, t in graph.items() if m.startswith("lss.data") and any(x.startswith(("lss.engine", "lss.models"))
                                                                             for x in t)] == []


def test_importing_the_trainer_does_not_import_viz():
    code = ("import sys, lss.engine.train, lss.engine.eval; "
            "assert 'lss.viz' not in sys.modules, 'lss.viz imported'; print('clean')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "clean", out.stderr


def test_seeding_sets_cudnn_autotuning_from_the_config():
    from lss.engine.distributed import seed_everything

    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled())
    try:
        for flag in (True, False):
            seed_everything(0, deterministic=False, cudnn_benchmark=flag)
            assert torch.backends.cudnn.benchmark is flag
        seed_everything(0, deterministic=True, cudnn_benchmark=True)  # determinism wins: no autotuning
        assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True
        assert load_config(None, ["train.cudnn_benchmark=false"]).train.cudnn_benchmark is False
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[0], saved[1]
        torch.use_deterministic_algorithms(saved[2])


class _PidSet(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        import os

        return {"index": torch.tensor(i), "pid": torch.tensor(os.getpid())}


def test_a_persistent_eval_loader_keeps_its_workers_between_passes_in_order():
    from lss.data.loader import build_eval_loader

    cfg = load_config(None, ["data.workers=1", "eval.batch_size=4"])
    for persistent in (True, False):
        loader = build_eval_loader(cfg, _PidSet(), torch.device("cpu"), persistent=persistent)
        passes = [[b for b in loader] for _ in range(2)]
        for batches in passes:  # every sample once, in order, batches of eval.batch_size
            assert [b["index"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5]]
        pids = [{int(p) for b in batches for p in b["pid"]} for batches in passes]
        assert (pids[0] == pids[1]) is persistent, (persistent, pids)


class _TimedSet(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"index": torch.tensor(i), "loaded_at": torch.tensor(time.time(), dtype=torch.float64)}


def test_an_armed_eval_pass_is_prefetched_and_handed_out_whole():
    from lss.data.loader import build_eval_loader
    from lss.engine.eval import EvalPasses

    cfg = load_config(None, ["data.workers=1", "eval.batch_size=4"])
    passes = EvalPasses(build_eval_loader(cfg, _TimedSet(), torch.device("cpu"), persistent=True))
    passes.arm()
    time.sleep(1.5)  # the worker starts and loads the first batches meanwhile
    taken = time.time()
    armed = list(passes.take())
    assert [b["index"].tolist() for b in armed] == [[0, 1, 2, 3], [4, 5]]  # the whole pass, nothing dropped
    assert armed[0]["loaded_at"].max().item() < taken  # loaded before the pass was asked for
    fresh = list(passes.take())  # not armed: a new pass, loaded after it was asked for
    assert [b["index"].tolist() for b in fresh] == [[0, 1, 2, 3], [4, 5]]
    assert fresh[0]["loaded_at"].min().item() > armed[-1]["loaded_at"].max().item()


def test_the_picture_batch_is_the_first_of_the_pass_and_not_taken_from_it():
    from lss.data.loader import build_eval_loader
    from lss.engine.eval import EvalPasses

    cfg = load_config(None, ["data.workers=1", "eval.batch_size=4"])
    passes = EvalPasses(build_eval_loader(cfg, _PidSet(), torch.device("cpu"), persistent=True))
    passes.arm()
    first = passes.first_batch()
    assert first["index"].tolist() == [0, 1, 2, 3] and passes.first_batch() is first
    assert [b["index"].tolist() for b in passes.take()] == [[0, 1, 2, 3], [4, 5]]
    assert [b["index"].tolist() for b in passes.take()] == [[0, 1, 2, 3], [4, 5]]
    empty = EvalPasses(build_eval_loader(cfg, FakeBEVDataset(0), torch.device("cpu")))
    with pytest.raises(ValueError, match="validation split has no samples"):
        empty.first_batch()


def test_the_eval_hook_starts_the_next_pass_after_the_first_step_and_each_evaluation_but_the_last():
    from types import SimpleNamespace

    calls = []
    trainer = SimpleNamespace(step=0, state={}, cfg=load_config(None, ["train.max_steps=7"]),
                              save=lambda name: calls.append(("save", trainer.step)))
    hook = EvalHook(3, lambda: calls.append(("eval", trainer.step)) or {"iou": {}, "mean_iou": trainer.step},
                    prepare=lambda: calls.append(("prepare", trainer.step)))
    for step in range(1, 8):
        trainer.step = step
        hook.after_step(trainer, {})
    assert [c for c in calls if c[0] != "save"] == [("prepare", 1), ("eval", 3), ("prepare", 3), ("eval", 6),
                                                     ("prepare", 6), ("eval", 7)]


# ------------------------------------------------------------------------ checkpoint reliability
def test_stale_checkpoint_temp_files_are_removed_on_load(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    path = folder / "last.pt"
    ck.save_checkpoint(path, FakeModel(), 3, fake_cfg(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = ck._host()
    killed = folder / f".last.pt.{host}-{dead.pid}.abcd1234.tmp"  # the save of an exited process
    old = folder / ".best.pt.k2j4h5g6.tmp"  # an older release's name, untouched for two hours
    live = folder / f".last.pt.{host}-{os.getppid()}.zzzz9999.tmp"  # a save in progress
    foreign = folder / ".notes.tmp"
    for f in (killed, old, live, foreign):
        f.write_bytes(b"x" * 100)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.utime(foreign, (time.time() - 7200, time.time() - 7200))
    assert ck.load_checkpoint(path)["step"] == 3
    assert not killed.exists() and not old.exists()
    assert live.exists() and foreign.exists()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "stale temp" in ln]
    assert len(lines) == 1 and killed.name in lines[0] and old.name in lines[0] and str(folder) in lines[0]


def test_checkpoint_problems_name_the_path_and_what_to_do(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ck.CheckpointError, match=r"run is a directory: pass a checkpoint file"):
        ck.load_checkpoint(tmp_path / "run")
    with pytest.raises(ck.CheckpointError, match=r"none.pt does not exist: pass the path"):
        ck.load_checkpoint(tmp_path / "none.pt")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ck.CheckpointError, match=r"empty.pt is empty \(0 bytes"):
        ck.load_checkpoint(empty)
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, FakeModel(), 1, fake_cfg(tmp_path))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ck.CheckpointError, match=r"cut.pt cannot be read.*truncated"):
        ck.load_checkpoint(cut)
    foreign = tmp_path / "foreign.pt"
    torch.save([1, 2, 3], foreign)
    with pytest.raises(ck.CheckpointError, match=r"foreign.pt is not an lss checkpoint.*lss train"):
        ck.load_checkpoint(foreign)


@pytest.mark.parametrize("override", ["grid.xbound=[-40.0, 40.0, 0.5]", "grid.dbound=[4.0, 45.0, 2.0]",
                                      "data.final_dim=[256, 704]", "data.classes=[drivable_area, vehicle]"])
def test_checkpoint_trained_on_another_geometry_is_refused(tmp_path, override):
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, FakeModel(), 1, fake_cfg(tmp_path))
    key = override.split("=")[0]
    with pytest.raises(ck.CheckpointError, match=rf"c.pt was trained with {key}=.*the config has {key}="):
        ck.check_config_fits(ck.load_checkpoint(path), fake_cfg(tmp_path, override), path)
    ck.check_config_fits(ck.load_checkpoint(path), fake_cfg(tmp_path), path)


def test_eval_of_a_bad_checkpoint_prints_one_line(tmp_path, capsys):
    from lss.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("data:\n  classes: [vehicle, drivable_area]\n")
    path = tmp_path / "c.pt"
    ck.save_checkpoint(path, FakeModel(), 1, fake_cfg(tmp_path))
    for ckpt, says in ((tmp_path, "is a directory"), (path, "grid.dbound")):
        assert main(["eval", "--config", str(config), "--set", "grid.dbound=[4.0, 45.0, 2.0]",
                     "--ckpt", str(ckpt)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith("lss eval: error: checkpoint") and says in err[0] and str(ckpt) in err[0]
