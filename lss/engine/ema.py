"""Exponential moving average of the model's weights (train.ema_decay): evaluation, pictures and the checkpoints'
inference weights use the average, which is smoother than the last step's weights (less seed-to-seed spread)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class ModelEMA:
    """Keeps `shadow` copies of every floating-point parameter and buffer of `model` (found by state_dict name).

    update() after each optimizer step: shadow = d * shadow + (1 - d) * weight with d = min(decay, (1 + n) / (10 + n))
    after n updates, so that early averages are not dominated by the random initialisation.
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ModelEMA: decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self._live = [t for t in self._tensors(model)]
        self.shadow = [t.detach().clone() for t in self._live]

    @staticmethod
    def _tensors(model: nn.Module) -> list[torch.Tensor]:
        return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]

    def current_decay(self) -> float:
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(self.shadow, [t.detach() for t in self._live], weight)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Inside, the model holds the averaged weights; afterwards its own weights are back, bit for bit."""
        saved = [t.detach().clone() for t in self._live]
        for live, avg in zip(self._live, self.shadow):
            live.copy_(avg)
        try:
            yield
        finally:
            for live, own in zip(self._live, saved):
                live.copy_(own)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": [t.clone() for t in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError("the checkpoint's EMA weights do not match the model (different architecture); "
                             "resume with the config the run was started with")
        with torch.no_grad():
            for mine, theirs in zip(self.shadow, shadow):
                mine.copy_(theirs)
        self.updates = int(state["updates"])

    def averaged_state_dict(self, model: nn.Module) -> dict:
        """model.state_dict() with the averaged values in place of the live floating-point ones."""
        out = {}
        averaged = iter(self.shadow)
        for name, t in model.state_dict().items():
            out[name] = next(averaged).clone() if t.is_floating_point() else t.clone()
        return out
