"""Dataset-level IoU: per class, the sum of intersections over the sum of unions across the whole
split."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


class IoUMeter:
    """Accumulates per-class intersection and union counts at several probability thresholds.

    update(logits B x K x nx x ny, targets B x K x nx x ny in {0, 1}); compute() -> dict with "iou"
    (per class at `threshold`), "mean_iou" and "sweep" (threshold -> per-class IoU). A class with an
    empty union has IoU 0.
    """

    def __init__(self, classes: Sequence[str], threshold: float = 0.5, sweep: Sequence[float] = ()):
        self.classes = tuple(classes)
        self.threshold = float(threshold)
        self.thresholds = tuple(sorted({float(threshold), *map(float, sweep)}))
        for t in self.thresholds:
            if not 0.0 < t < 1.0:
                raise ValueError(f"IoU thresholds must lie in (0, 1), got {t}")
        shape = (len(self.thresholds), len(self.classes))
        self.intersection = torch.zeros(shape, dtype=torch.float64)
        self.union = torch.zeros(shape, dtype=torch.float64)
        self._cut: Optional[torch.Tensor] = (
            None  # thresholds as a T x 1 x 1 x 1 x 1 tensor beside the counts
        )

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        if (
            logits.shape != targets.shape
            or logits.dim() != 4
            or logits.shape[1] != len(self.classes)
        ):
            raise ValueError(
                f"IoUMeter.update: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                f"must both be B x {len(self.classes)} x nx x ny"
            )
        probs = logits.float().sigmoid()
        truth = targets > 0.5
        if (
            self.intersection.device != probs.device
        ):  # count where the predictions are: no host sync per batch
            self.intersection, self.union = (
                self.intersection.to(probs.device),
                self.union.to(probs.device),
            )
            self._cut = None
        if self._cut is None:  # the thresholds on the counts' device, copied there once
            self._cut = torch.tensor(self.thresholds, device=probs.device).view(-1, 1, 1, 1, 1)
        pred = probs.unsqueeze(0) > self._cut  # T x B x K x nx x ny
        dims = (1, 3, 4)
        self.intersection += (pred & truth).sum(dim=dims).double()
        self.union += (pred | truth).sum(dim=dims).double()

    def all_reduce(self) -> None:
        """Sum the counts over distributed ranks (a no-op in a single process)."""
        if dist.is_available() and dist.is_initialized():
            for counts in (self.intersection, self.union):
                buf = counts.to(_collective_device())
                dist.all_reduce(buf)
                if buf is not counts:
                    counts.copy_(buf)

    def compute(self) -> dict:
        self.intersection, self.union = self.intersection.cpu(), self.union.cpu()
        iou = torch.where(
            self.union > 0,
            self.intersection / self.union.clamp(min=1),
            torch.zeros_like(self.union),
        )
        at = self.thresholds.index(self.threshold)
        per_class = {c: float(iou[at, k]) for k, c in enumerate(self.classes)}
        return {
            "threshold": self.threshold,
            "iou": per_class,
            "mean_iou": sum(per_class.values()) / max(len(per_class), 1),
            "sweep": {
                f"{t:g}": {c: float(iou[i, k]) for k, c in enumerate(self.classes)}
                for i, t in enumerate(self.thresholds)
            },
            "intersection": {
                c: float(self.intersection[at, k]) for k, c in enumerate(self.classes)
            },
            "union": {c: float(self.union[at, k]) for k, c in enumerate(self.classes)},
        }


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def format_iou_table(result: dict, title: Optional[str] = None) -> str:
    """A plain-text table: one row per class, one column per threshold of the sweep, IoU in
    percent."""
    sweep = result["sweep"]
    thresholds = list(sweep)
    classes = list(result["iou"])
    width = max([len("class")] + [len(c) for c in classes])
    head = f"{'class':<{width}}  " + "  ".join(f"@{t:>5}" for t in thresholds)
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for c in classes:
        lines.append(f"{c:<{width}}  " + "  ".join(f"{100 * sweep[t][c]:6.2f}" for t in thresholds))
    lines.append(f"mean IoU @{result['threshold']:g}: {100 * result['mean_iou']:.2f}")
    return "\n".join(lines)
