"""StepLogs: what one training step reports, read from the device only where a reader needs it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch


class StepLogs(Mapping):
    """The logs of one step: host values, plus the step's loss terms as device tensors copied to
    pinned host memory behind the step. Reading one of those waits for that copy (the one host sync
    of a step), so the loop reads them only where it must: at the logging interval, and for the
    finiteness check before the next step's update.

    `host` is not part of the mapping: the loop's own clock for this step ("start": before the batch
    was fetched, "fetched", "ran": after the step was queued, all time.perf_counter() values;
    "wait": seconds the host waited for the device in a loss check), for the timing hook."""

    def __init__(self, tensors: Optional[dict] = None, **values: float):
        self._values = dict(values)
        self._pending: Optional[tuple] = None
        self.host: dict[str, float] = {"wait": 0.0}
        if tensors:
            names = sorted(tensors)
            stacked = torch.stack([tensors[k].detach().float() for k in names])
            if stacked.is_cuda:
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending = (names, host, event)
            else:
                self._values.update(zip(names, stacked.tolist()))

    def add(self, **values: float) -> None:
        self._values.update(values)

    def _resolve(self) -> None:
        names, host, event = self._pending
        event.synchronize()
        self._values.update(zip(names, host.tolist()))
        self._pending = None

    def __getitem__(self, key: str) -> float:
        if self._pending is not None and key in self._pending[0]:
            self._resolve()
        return self._values[key]

    def __iter__(self):
        pending = self._pending[0] if self._pending is not None else ()
        return iter([*self._values, *pending])

    def __len__(self) -> int:
        return len(self._values) + (len(self._pending[0]) if self._pending is not None else 0)
