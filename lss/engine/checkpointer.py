"""A run's checkpoints: the Checkpointer writes checkpoints/last.pt and best.pt (in a background
thread, CheckpointWriter), resumes a run from last.pt and adopts its best.pt, and says in words
what is on disk (for the messages of a failed write, non-finite weights, Ctrl-C or an
out-of-memory step)."""

from __future__ import annotations

import queue
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lss.config import Config
from lss.engine import checkpoint as ckpt_io
from lss.engine.distributed import rng_state, set_rng_state
from lss.errors import CheckpointError

RESUME_HINT = "lss train (the same --config/--set) --out {} --resume"


class CheckpointWriter:
    """Writes checkpoints (checkpoint.atomic_save) in one background thread, in the order
    submitted, so that training goes on while a file is serialized and synced to disk (about 150
    MB for the LSS model with its Adam state).

    `submit(state, path, done, failed)` queues a write of a host snapshot (checkpoint_state(...,
    snapshot=True)); after the file is in place the thread calls `done()`. When a write fails,
    the later queued ones are dropped and the next `submit` or `wait` raises `failed(error)` for
    an OSError (the error itself otherwise). At most `depth` writes wait in the queue (submit
    blocks beyond that), so the host memory of snapshots stays bounded."""

    IDLE_SECONDS = 0.5  # the thread ends after this long without work (a later submit starts one)

    def __init__(self, depth: int = 2):
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(
        self,
        state: dict,
        path: Union[str, Path],
        done: Callable[[], None] = lambda: None,
        failed: Callable[[OSError], BaseException] = lambda e: e,
    ) -> None:
        self._raise_error()
        with self._lock:
            self._queue.put((state, Path(path), done, failed))
            if self._thread is None:
                # not a daemon: an interpreter that exits still finishes the writes
                self._thread = threading.Thread(target=self._run, name="lss-checkpoint-writer")
                self._thread.start()

    def wait(self) -> None:
        """Return once every submitted write is done; raise the error of a failed one (once)."""
        self._queue.join()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            try:
                state, path, done, failed = self._queue.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                if self._error is None:
                    ckpt_io.atomic_save(state, path)
                    done()
            except OSError as e:
                self._error = failed(e)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                del state
                self._queue.task_done()


def read_resume_state(run_dir: Path, cfg: Config) -> dict:
    """checkpoints/last.pt of `run_dir`, refused (CheckpointError naming the keys and both
    values) where `cfg` changes what its weights mean (checkpoint.FIXED_KEYS: grid, input size,
    classes, heads)."""
    path = Path(run_dir) / "checkpoints" / "last.pt"
    state = ckpt_io.load_checkpoint(path)
    hint = (
        f"--resume continues that run with its settings; resume with its own config "
        f"({Path(run_dir) / 'config.yaml'}), or train the new settings into another --out"
    )
    ckpt_io.check_config_fits(state, cfg, path, hint=hint)
    return state


class Checkpointer:
    """checkpoints/<name> of a run (last.pt, best.pt): model, optimizer, scheduler, scaler, step,
    config, RNG states and the hooks' state. `saved`: name -> step of the file on disk."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler,
        is_main: bool,
    ):
        self.run_dir, self.folder, self.cfg = run_dir, run_dir / "checkpoints", cfg
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.is_main = is_main
        self.saved: dict[str, int] = {}
        self._writer = CheckpointWriter()

    def save(self, name: str, step: int, state: dict) -> None:
        """checkpoints/`name` of `step` with the hooks' `state`, on rank 0 (every rank checks the
        weights, so all stop together). Non-finite weights are never written, and a failed write
        leaves the previous file in place. Rank 0 copies the state to host memory here and writes
        the file in the background: a failed write raises at the next save or when training ends
        (`finish`)."""
        path = self.folder / name
        weights = [p.detach().isfinite().all() for p in self.model.parameters()]
        if not bool(torch.stack(weights).all()):
            self.finish()  # the earlier writes: `saved` says what is on disk, their error first
            kept = " (the last good checkpoint is kept)" if name in self.saved else ""
            raise FloatingPointError(
                f"weights are not finite after step {step}; {path} was not written and "
                f"{self.on_disk(name)}{kept}. Lower optim.lr (now {self.cfg.optim.lr:g}) or set "
                f"optim.grad_clip, check the data, then {self.continue_hint()}"
            )
        if not self.is_main:
            self.saved[name] = step
            return
        snapshot = ckpt_io.checkpoint_state(
            self.model,
            step,
            self.cfg,
            self.optimizer,
            self.scheduler,
            self.scaler,
            extra={"rng": rng_state(), "state": dict(state)},
            snapshot=True,
        )

        def failed(e: OSError) -> OSError:  # in the writer's thread, after the earlier writes
            space = ""
            if isinstance(e, ckpt_io.CheckpointWriteError):
                space = (
                    f"; the checkpoint needs {ckpt_io.format_size(e.needed)} and {self.folder} "
                    f"has {ckpt_io.format_size(e.free)} free"
                )
            error = OSError(
                e.errno,
                f"{e.strerror or e} while writing {path}; {self.on_disk(name)}{space}: free some "
                f"space, then {self.continue_hint()}",
            )
            error.__cause__ = e
            return error

        def done() -> None:
            self.saved[name] = step

        self._writer.submit(snapshot, path, done=done, failed=failed)

    def finish(self, report_only: bool = False) -> None:
        """Wait until the checkpoints saved so far are on disk; raise the error of a failed write
        (`report_only`: print it on stderr instead, where another error already ends the run)."""
        try:
            self._writer.wait()
        except Exception as e:  # noqa: BLE001 - any error of the writer's thread
            if not report_only:
                raise
            print(f"lss: {e}", file=sys.stderr)

    def on_disk(self, name: str) -> str:
        """What checkpoints/`name` holds before this save, in words."""
        step = self.saved.get(name)
        if step is None:
            return f"no earlier {name} exists"
        return f"the previous {self.folder / name} (step {step}) is intact"

    def continue_hint(self) -> str:
        if "last.pt" in self.saved:
            return f"continue with `{RESUME_HINT.format(self.run_dir)}`"
        return "start again with --overwrite"

    def last_checkpoint(self) -> str:
        """The last checkpoint on disk and how to continue, in words (once the writes in flight are
        done; a failed one is reported on stderr)."""
        self.finish(report_only=True)
        step = self.saved.get("last.pt")
        if step is None:
            return (
                f"no checkpoint was written (train.ckpt_every={self.cfg.train.ckpt_every}): start "
                "again with --overwrite"
            )
        return (
            f"the last checkpoint is step {step} in {self.folder / 'last.pt'}: continue with "
            f"`{RESUME_HINT.format(self.run_dir)}`"
        )

    def resume(self, state: dict, path: Path) -> tuple[int, dict]:
        """Load a checkpoint's state (read_resume_state) into the model, optimizer, scheduler,
        scaler and RNGs; adopt best.pt beside it. Returns (its step, the hooks' state)."""
        ckpt_io.load_model_state(self.model, state, path)
        parts = (
            ("optimizer", self.optimizer),
            ("scheduler", self.scheduler),
            ("scaler", self.scaler),
        )
        for name, obj in parts:
            if state.get(name) is None:
                raise CheckpointError(
                    f"checkpoint {path} has no {name} state; it cannot be resumed (start a new "
                    "run from it instead)"
                )
            obj.load_state_dict(state[name])
        step, hook_state = state["step"], dict(state["extra"].get("state", {}))
        self.saved["last.pt"] = step
        self._adopt_best(path.parent / "best.pt", step, hook_state)
        if "rng" in state["extra"]:
            set_rng_state(state["extra"]["rng"])
        return step, hook_state

    def _adopt_best(self, path: Path, step: int, hook_state: dict) -> None:
        """last.pt is written before the evaluation of its step, so best.pt may hold a newer best
        than last.pt's state: take it when it comes from a step the resumed run has done."""
        if not path.is_file():
            return
        best = ckpt_io.load_checkpoint(path)
        if best["step"] > step:
            return
        self.saved["best.pt"] = best["step"]
        state = best["extra"].get("state", {})
        if state.get("best_step") is not None and state["best_step"] > (
            hook_state.get("best_step") or -1
        ):
            hook_state.update(best_iou=state["best_iou"], best_step=state["best_step"])
