"""Surviving interruptions: preemption signals, non-finite numbers, injected faults.

- ``PreemptionGuard`` turns SIGTERM / SIGINT into a request to stop after the current step;
  every rank agrees on the step (a MAX all-reduce of the flag), writes the checkpoint and
  exits 0. A second SIGINT stops at once (KeyboardInterrupt), as users expect of Ctrl-C.
- ``NonFiniteGuard`` applies ``train.nonfinite_policy`` to a step whose loss or gradient
  norm is not finite and counts what it skipped.
- ``FaultInjector`` makes one rank fail on purpose at a given step, so the tests (and an
  operator rehearsing a runbook) can see what a dead rank looks like. It is driven only by
  the ``MOETRAIN_INJECT_FAULT`` environment variable and does nothing when it is unset.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("moetrain")


class PreemptionGuard:
    """Context manager: while active, SIGTERM and SIGINT only set a flag."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionGuard:
        # Signal handlers can only be installed from the main thread (tests may train in
        # another thread: then there is simply no preemption handling).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.signum = signum
        log.warning("received %s: finishing this step, then saving a checkpoint and exiting",
                    signal.Signals(signum).name)

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank was signalled. Collective when distributed: call it on every rank
        at the same point of every step, so that all ranks stop after the same step."""
        flag = torch.tensor([0.0 if self.signum is None else 1.0], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient norm under ``train.nonfinite_policy: halt``."""


class NonFiniteGuard:
    """Decides what a step with a non-finite loss or gradient norm does."""

    def __init__(self, policy: str, max_skips: int):
        self.policy = policy
        self.max_skips = max_skips
        self.skipped = 0

    @staticmethod
    def is_bad(loss: float, grad_norm: float) -> bool:
        return not (math.isfinite(loss) and math.isfinite(grad_norm))

    def on_bad_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Count a skipped step, or raise NonFiniteError when the policy (or the skip budget)
        says to halt. The caller has already left the parameters untouched."""
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.policy == "halt":
            raise NonFiniteError(f"non-finite numbers at {what} (train.nonfinite_policy=halt)")
        self.skipped += 1
        if self.skipped > self.max_skips:
            raise NonFiniteError(
                f"non-finite numbers at {what}: {self.skipped} steps skipped, more than "
                f"train.max_nonfinite_skips={self.max_skips}")
        log.warning("skipping the update of %s (%d skipped so far)", what, self.skipped)


class FaultInjector:
    """``MOETRAIN_INJECT_FAULT="rank=R,step=S,kind=raise|exit|kill[,point=P][,once=F]"``:
    rank R fails at step S, at point P of it: ``step`` (the default) before running the step;
    while saving the checkpoint of step S, ``write`` once its tensor shards are written,
    ``save`` once every file is written but before it is published, or (an asynchronous save,
    ``train.checkpoint_async``) ``stage`` once the state is staged, before the background
    write starts. ``raise`` raises RuntimeError, ``exit`` calls os._exit(3), ``kill`` sends
    itself SIGKILL (from the writing thread too: the whole process dies). With ``once=F`` the
    fault fires only if file F does not exist yet and creates it, so a job restarted by
    ``torchrun --max-restarts`` runs through.
    Unset: nothing happens."""

    ENV = "MOETRAIN_INJECT_FAULT"
    POINTS = ("step", "stage", "write", "save")

    def __init__(self, rank: int):
        spec = os.environ.get(self.ENV, "")
        self.fault: dict[str, str] | None = None
        if spec:
            try:
                fault = dict(part.split("=", 1) for part in spec.split(","))
                int(fault["rank"]), int(fault["step"])
                fault.setdefault("point", "step")
                if fault["kind"] not in ("raise", "exit", "kill"):
                    raise ValueError(fault["kind"])
                if fault["point"] not in self.POINTS:
                    raise ValueError(fault["point"])
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{self.ENV}={spec!r}: expected rank=R,step=S,"
                                 f"kind=raise|exit|kill[,point={'|'.join(self.POINTS)}]"
                                 "[,once=FILE]") from exc
            if int(fault["rank"]) == rank:
                self.fault = fault

    def maybe_fail(self, step: int, point: str = "step") -> None:
        fault = self.fault
        if fault is None or int(fault["step"]) != step or fault["point"] != point:
            return
        if "once" in fault:
            marker = fault["once"]
            if os.path.exists(marker):
                return
            with open(marker, "w") as f:
                f.write(f"fired at step {step} ({point})\n")
        kind = fault["kind"]
        log.error("%s: injected fault %r at step %d (%s)", self.ENV, kind, step, point)
        if kind == "raise":
            raise RuntimeError(f"injected fault at step {step} ({self.ENV})")
        if kind == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


class CollapseMonitor:
    """Watches each MoE layer's busiest expert of every step, and warns of two patterns:

    - **router collapse**: the *same* expert receives at least ``fraction`` of the layer's
      tokens for ``steps`` consecutive steps (the other experts starve);
    - **one expert per batch**: in each of ``steps`` consecutive steps one expert receives at
      least ``fraction`` of the tokens, but not always the same one. The router does not
      tell the tokens apart yet (its input is dominated by a direction every token shares)
      and the balancing losses and bias only rotate which expert takes the batch; capacity
      drops the rest.

    Each warns once per episode (again only after the layer recovered)."""

    def __init__(self, fraction: float | None, steps: int, top_k: int, warnings: Any = None):
        self.warnings = warnings  # a metrics.WarningSummary: repeats summarised per window
        self.fraction = fraction
        self.steps = steps
        self.top_k = top_k
        self.tops: dict[int, list[int]] = {}  # per layer: the streak's busiest experts

    def update(self, step: int, per_layer: dict[int, dict[str, torch.Tensor]]) -> list[int]:
        """Feed one step's per-layer ``pop_stats`` sums; returns the layers warned about."""
        if self.fraction is None:
            return []
        warned = []
        for layer, stats in per_layer.items():
            load_E = stats["tokens_per_expert"].double()
            tokens = float(stats["assignments"]) / self.top_k
            top_share = float(load_E.max()) / max(tokens, 1.0)
            if top_share < self.fraction:
                self.tops[layer] = []
                continue
            tops = self.tops.setdefault(layer, [])
            if len(tops) > self.steps:
                continue  # this episode was warned about; the list stops growing
            tops.append(int(load_E.argmax()))
            if len(tops) != self.steps:
                continue
            warned.append(layer)
            if len(set(tops)) == 1:
                kind = "router collapse"
                args = ("router collapse in moe layer %d: expert %d has received >= %.0f%% of "
                        "the tokens for %d steps (step %d); consider a larger "
                        "moe.aux_loss_coef, moe.global_aux_loss_coef, moe.expert_bias_rate, "
                        "moe.z_loss_coef or moe.quantile_balancing", layer, tops[0],
                        100 * self.fraction, self.steps, step)  # fmt: skip
            else:
                kind = "one expert per batch"
                args = ("moe layer %d routes each batch to one expert: in each of %d steps "
                        "one expert received >= %.0f%% of the tokens, %d different experts in "
                        "turn (experts %s; step %d): the router does not yet tell tokens "
                        "apart, and capacity drops the rest", layer, self.steps,
                        100 * self.fraction, len(set(tops)), " ".join(map(str, tops)),
                        step)  # fmt: skip
            if self.warnings is None:
                log.warning(*args)
            else:
                self.warnings.warn(f"moe layer {layer}: {kind}", step, *args)
        return warned
