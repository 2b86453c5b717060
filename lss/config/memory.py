"""The memory a config needs at the least, from its sizes alone, so that a grid, input size or image
size too large for the machine is refused with the key and the size before anything is built.

Each estimate is a lower bound: it counts only the largest tensors whose sizes the config fixes
(BEV maps, frustum points and their lookup table, camera inputs and the camera trunk's maps), not
the rest of the network, the optimizer or the allocator's slack. A refusal therefore never stops a
run that could have fit; a config that passes may still run out of memory later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from lss.errors import ConfigError
from lss.geometry import BevGrid, depth_bin_count

# The camera trunk's stem: 32 channels at stride 2.
CAMERA_STEM_CHANNELS = 32
# Maps a convolution -> batch norm -> swish keeps for the backward pass: the convolution's output
# (the norm's input), the normalised map (the swish's input) and the activated one (the next
# convolution's input).
MAPS_PER_CONV = 3
# The BEV encoder's stem (64 channels at stride 2) and its output (128 channels at full size).
BEV_STEM_CHANNELS = 64
BEV_FEATURE_CHANNELS = 128
# What the synthetic renderer keeps per pixel of a camera image (render.CameraModel: ground x/y
# float32, inverse ground depth float64, near/far blend weights and background RGB float32)
RENDER_BYTES_PER_PIXEL = 4 + 4 + 8 + 3 * (4 + 4 + 4)
RENDER_CAMERAS = 6  # a render process keeps the models of all six cameras


@dataclass(frozen=True)
class Need:
    """`size` bytes that the tensors `what` need at the least; `keys` set their size."""

    keys: str
    what: str
    size: int
    advice: str


def host_memory() -> int:
    """The bytes of memory this process may use: physical memory, or a smaller cgroup limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def size_text(size: float) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (binary units: 1 GiB = 2^30 bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def activation_bytes(cfg, device_type: Optional[str]) -> int:
    """Bytes per activation value: 2 where autocast runs in 16 bits (train.amp on CUDA), else 4.
    An unknown device counts 2, the smaller."""
    if cfg.train.amp == "none" or device_type == "cpu":
        return 4
    return 2


def camera_trunk_values(backbone: str, downsample: int = 16) -> float:
    """Activation values per input pixel that a training step of the camera trunk `backbone` keeps
    for the backward pass at the least: for efficientnet-b0 MAPS_PER_CONV maps of the stem and of
    every block's expansion and depthwise convolutions, and each block's output (efficientnet-
    pytorch's block table); for resnet18 two maps per convolution (its output and the normalised
    one; the ReLUs work in place) up to the stage of stride 2 * `downsample`."""
    if backbone == "resnet18":
        stages = [(64, 4), (128, 8), (256, 16), (512, 32)][: {8: 3, 16: 4}[downsample]]
        stem = 2 * 64 / 2**2 + 64 / 4**2  # the 7x7 convolution at stride 2, the max-pool's output
        return stem + sum(4 * 2 * channels / stride**2 for channels, stride in stages)
    from efficientnet_pytorch.utils import get_model_params

    blocks, _ = get_model_params(backbone, None)
    stride = 2
    values = MAPS_PER_CONV * CAMERA_STEM_CHANNELS / stride**2
    for block in blocks:
        for repeat in range(block.num_repeat):
            channels = block.output_filters if repeat else block.input_filters
            expanded = channels * block.expand_ratio
            if block.expand_ratio != 1:
                values += MAPS_PER_CONV * expanded / stride**2
            stride *= 1 if repeat else block.stride[0]
            values += (MAPS_PER_CONV * expanded + block.output_filters) / stride**2
    return values


def training_needs(cfg, batch: int, device_type: Optional[str] = None) -> list[Need]:
    """What one step of `batch` samples needs at the least on `device_type` ("cpu", "cuda" or None
    for not known yet), per part of the network."""
    data, grid, model = cfg.data, cfg.grid, cfg.model
    a = activation_bytes(cfg, device_type)
    cameras = data.num_train_cameras or len(data.cameras)
    height, width = data.final_dim
    bev = BevGrid.from_config(grid)
    depth = depth_bin_count(grid.dbound)
    feature_cells = (height // model.downsample) * (width // model.downsample)
    points = batch * cameras * depth * feature_cells
    # index tensors are int64 from 2^31 entries on (lss.geometry.lut.INDEX32_LIMIT)
    index = 4 if max(points, batch * bev.nz * bev.nx * bev.ny) < 2**31 else 8
    cells = batch * bev.nx * bev.ny
    classes = len(data.classes)
    bev_per_cell = (
        bev.nz * (model.context_channels * a + index)  # bev_pool output and the cell offsets
        + (BEV_STEM_CHANNELS // 4 + BEV_FEATURE_CHANNELS) * a  # encoder stem and output
        + classes * (4 + a)  # targets (float32) and logits
    )
    camera_pixels = batch * cameras * height * width
    return [
        Need(
            "grid.xbound/grid.ybound/grid.zbound",
            f"the BEV grid of {bev.nx} x {bev.ny} x {bev.nz} cells (features, targets, the BEV "
            "encoder's first and last maps)",
            cells * bev_per_cell,
            "use a coarser cell size (the third value) or a smaller range",
        ),
        Need(
            "grid.dbound/data.final_dim",
            f"{points:,} frustum points ({depth} depth bins x {feature_cells} feature cells x "
            f"{cameras} cameras x {batch} samples: ego coordinates, lookup table, depth)",
            points * (3 * 4 + 2 * index + a),
            "use a larger depth step (the third value of grid.dbound) or a smaller data.final_dim",
        ),
        Need(
            "data.final_dim",
            f"camera inputs of {height} x {width} pixels ({cameras} cameras x {batch} samples: "
            "images and the camera trunk's maps)",
            int(
                camera_pixels * (3 * 4 + camera_trunk_values(model.backbone, model.downsample) * a)
            ),
            "use a smaller data.final_dim",
        ),
    ]


def check_fits(
    needs: Sequence[Need],
    available: int,
    where: str,
    scope: str = "one sample",
    error: type[Exception] = ConfigError,
) -> None:
    """`error` naming the keys of the largest need when all of them together exceed `available`
    bytes (`where`: whose memory, e.g. "this machine's memory")."""
    total = sum(n.size for n in needs)
    if total <= available:
        return
    top = max(needs, key=lambda n: n.size)
    raise error(
        f"{top.keys}: {top.what} need at least {size_text(top.size)} for {scope} "
        f"({size_text(total)} with the rest of the network's largest tensors), more than "
        f"{where} ({size_text(available)}); {top.advice}"
    )


def check_config_memory(cfg) -> None:
    """What validate checks: on train.device "cpu", a single sample against this machine's memory;
    with data.make_synthetic_if_missing, the renderer's images. The device's own check of the
    training batch runs when the device is known (check_device_memory)."""
    if cfg.data.make_synthetic_if_missing:
        check_render_memory(cfg.data.synthetic.image_size, "data.synthetic.image_size")
    if cfg.train.device == "cpu":
        check_fits(training_needs(cfg, 1, "cpu"), host_memory(), "this machine's memory")


def check_device_memory(cfg, device) -> None:
    """A training step of train.batch_size samples against the memory of `device` (a
    torch.device), before the datasets and the model are built."""
    import torch

    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).total_memory
        where = f"the memory of {device} ({torch.cuda.get_device_name(device)})"
    else:
        available, where = host_memory(), "this machine's memory"
    batch = cfg.train.batch_size
    needs = training_needs(cfg, batch, device.type)
    check_fits(needs, available, where, f"a batch of {batch} (train.batch_size)")


def check_render_memory(
    image_size: Sequence[int],
    key: str,
    available: Optional[int] = None,
    error: type[Exception] = ConfigError,
) -> None:
    """`error` when rendering synthetic camera images of `image_size` (width, height) needs more
    than `available` bytes (default: this machine's memory); `key` names the setting."""
    width, height = (int(v) for v in image_size)
    need = Need(
        key,
        f"synthetic camera images of {width} x {height} pixels (the renderer's per-pixel maps of "
        f"{RENDER_CAMERAS} cameras)",
        width * height * RENDER_BYTES_PER_PIXEL * RENDER_CAMERAS,
        "use a smaller image size (nuScenes is 1600 x 900)",
    )
    memory = host_memory() if available is None else available
    check_fits([need], memory, "this machine's memory", "one render process", error)
