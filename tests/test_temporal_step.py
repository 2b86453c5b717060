"""model.temporal.frames: 2 through the engine's training steps: the static-buffer step (train.cuda_graph) follows
the eager steps exactly on the CPU and, captured, on CUDA; the whole train() path (eager steps with the encoder
graphs, or the captured step) runs on CUDA."""
import json
import math

import pytest
import torch

from test_graph_step import _run_both, assert_follows_eager
from test_model import RigDataset, rig_batch, tiny_cfg

TWO_FRAMES = "model.temporal.frames=2"


def two_frame_batch(cfg, batch_size=2, seed=0):
    """rig_batch with a previous frame: other images on the same rig, the ego 1.5 m further on and turned."""
    batch = rig_batch(cfg, batch_size, seed)
    previous = rig_batch(cfg, batch_size, seed + 100)
    for key in ("intrinsics", "sensor2ego_rot", "sensor2ego_trans", "post_rot", "post_trans"):
        batch[f"prev_{key}"] = previous[key]
    batch["prev_images"] = previous["images"]
    yaw = 0.05 * (seed + 1)
    motion = torch.eye(4).repeat(batch_size, 1, 1)
    motion[:, :2, :2] = torch.tensor([[math.cos(yaw), -math.sin(yaw)], [math.sin(yaw), math.cos(yaw)]])
    motion[:, 0, 3] = -1.5
    batch["ego_motion"] = motion
    return batch


def test_two_frame_static_buffer_step_matches_eager_steps_on_cpu():
    cfg = tiny_cfg(TWO_FRAMES)
    eager, graphed, pa, pb, step = _run_both(cfg, "cpu", 3, False, None, two_frame_batch)
    assert all(math.isfinite(v) for v in eager)
    assert eager == graphed
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert {"prev_images", "ego_motion", "prev_sensor2ego_rot"} <= set(step.static)
    assert float(step.model.temporal.conv[0].weight.grad.abs().sum()) > 0  # the fusion learns


@pytest.mark.cuda
def test_two_frame_captured_step_follows_the_eager_trajectory_on_cuda():
    cfg = tiny_cfg(TWO_FRAMES)
    eager, graphed, pa, pb, step = _run_both(cfg, "cuda", 4, True, torch.bfloat16, two_frame_batch)
    assert step.graph is not None
    assert_follows_eager(eager, graphed, pa, pb)


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graph", ["true", "false"])
def test_two_frame_train_runs_on_cuda(tmp_path, cuda_graph):
    from lss.data import collate
    from lss.engine.train import train

    cfg = tiny_cfg(TWO_FRAMES, f"train.cuda_graph={cuda_graph}", "train.device=cuda", "train.batch_size=2",
                   "data.workers=0", "train.log_every=1", "train.eval_every=0", "train.viz_every=0",
                   "train.ckpt_every=0", "train.max_steps=6", "optim.lr=0.005")
    out = tmp_path / "run"
    train(cfg, str(out), dataset_fn=lambda c, split, is_train: RigDataset(c, 8 if is_train else 0, two_frame_batch),
          collate_fn=collate)
    losses = [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(ln)["kind"] == "train"]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
