"""Where this process runs: its device, its autocast, its RNG state and, under `torchrun
--nproc_per_node=K -m lss train ...`, the process group (a single process needs none of it)."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import numpy as np
import torch
import torch.distributed as dist

from lss.config import Config, ConfigError

AutocastFn = Callable[[], ContextManager]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group that torchrun describes in RANK/WORLD_SIZE/LOCAL_RANK (NCCL on GPU,
    gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


# what gloo's TCP transport says when the process at the other end of a collective is gone
GLOO_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting")


def lost_peer(error: BaseException, info: DistInfo) -> bool:
    """Whether `error` is a collective operation of a torchrun run that failed (a process of the
    run ended or cannot be reached), as opposed to an error of this process's own."""
    if not info.enabled:
        return False
    return isinstance(error, dist.DistError) or any(s in str(error) for s in GLOO_PEER_LOST)


def lost_peer_message(error: BaseException, info: DistInfo, step: int, checkpoint: str) -> str:
    """The message of ProcessGroupError for `error` (lost_peer), raised at `step` on rank
    `info.rank`; `checkpoint`: what is on disk and how to continue (rank 0 writes checkpoints)."""
    reason = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    where = checkpoint if info.is_main else "rank 0 writes the checkpoints (its message says which)"
    return (
        f"rank {info.rank} of {info.world_size} stops at step {step}: a collective operation "
        f"with the other processes failed ({type(error).__name__}: {reason[:300]}). Most likely "
        "another process of this run has ended or cannot be reached; its own error comes first "
        f"in the log. {where}"
    )


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def device_type(cfg: Config) -> str:
    """ "cuda" or "cpu", as train.device asks ("auto": CUDA when a GPU is visible)."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device='cuda' but no CUDA GPU is visible; use --set train.device=cpu"
        )
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def select_device(cfg: Config, dist_info: Optional[DistInfo] = None) -> torch.device:
    """The device of this process: its torchrun local rank's GPU, the current GPU, or the CPU."""
    if device_type(cfg) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", dist_info.local_rank if dist_info else torch.cuda.current_device())


def seed_everything(seed: int, deterministic: bool, cudnn_benchmark: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault(
            "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
        )  # cuBLAS needs it for deterministic GEMMs
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        torch.backends.cudnn.benchmark = cudnn_benchmark


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    # RNG states must be CPU byte tensors; a checkpoint's map_location may have moved them
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


@contextlib.contextmanager
def preserved_rng():
    """Evaluation and pictures inside leave the training RNG stream as it was (the curve does not
    depend on how often they run)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def autocast_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for the camera/BEV networks, or None (fp32). Autocast applies on CUDA
    only."""
    amp = cfg.train.amp
    if device.type != "cuda" or amp == "none":
        return None
    return torch.bfloat16 if amp == "bf16" else torch.float16


def build_autocast(cfg: Config, device: torch.device) -> AutocastFn:
    """A factory of the forward pass's autocast context (train.amp on CUDA; a no-op context
    otherwise)."""
    dtype = autocast_dtype(cfg, device)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def to_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }
