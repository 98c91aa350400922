"""Learning a profile during a session: every MoE layer's routing is recorded (lazily: the indices are evaluated
together, once per token, not with an extra host sync per layer) and committed to the store every few seconds and
at the end, so a crash or kill -9 loses at most one interval."""

from __future__ import annotations

import re
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tqbench.profile.profile import Profile
from tqbench.profile.store import ProfileStore

SAVE_EVERY_S = 5.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Learner:
    def __init__(self, store: ProfileStore, blank: Profile, every_s: float | None = None):
        self.store = store
        self.blank = blank
        self.delta = blank.scaled(0.0)
        self.every_s = SAVE_EVERY_S if every_s is None else every_s  # read now: tests shorten it per process
        self._pending: list[tuple[int, mx.array, bool]] = []
        self._saved_once = False
        self._last_save = time.monotonic()
        self.saves = 0
        self.routings = 0  # counted by this session so far: saved, or saved at the next save

    def observe(self, layer: int, indices: mx.array, prefill: bool) -> None:
        self._pending.append((layer, indices, prefill))

    def flush(self) -> None:
        """Count what was recorded (one evaluation for all of it) and save when the interval has passed."""
        if self._pending:
            mx.eval([i for _, i, _ in self._pending])
            experts = self.blank.geometry.experts
            for layer, indices, prefill in self._pending:
                if layer not in self.delta.decode:
                    continue
                ids = np.array(indices).ravel()
                (self.delta.prefill if prefill else self.delta.decode)[layer] += np.bincount(ids, minlength=experts)
                self.delta.routings += ids.size
                self.routings += ids.size
            self._pending.clear()
        if time.monotonic() - self._last_save >= self.every_s:
            self.save()

    def save(self) -> None:
        self._last_save = time.monotonic()
        if self.delta.routings <= 0:
            return
        self.store.commit(self.delta, first=not self._saved_once)
        self._saved_once = True
        self.saves += 1
        self.delta = self.blank.scaled(0.0)

    def close(self) -> None:
        self.flush()
        self.save()
        self.store.close()


class _Hidden:
    def __init__(self, learner: Learner) -> None:
        self.learner = learner


class RoutingTap(nn.Module):
    """Wraps a MoE layer's experts module (SwitchGLU, or its streamed stand-in) and records the routing it is given."""

    def __init__(self, inner: nn.Module, layer: int, learner: Learner):
        super().__init__()
        self.inner = inner
        self.layer = layer
        self._hidden = _Hidden(learner)  # a plain object: not a child module, not a parameter

    def __call__(self, x: mx.array, indices: mx.array, *args: Any, **kw: Any) -> mx.array:
        prefill = indices.ndim >= 2 and indices.shape[-2] > 1
        self._hidden.learner.observe(self.layer, indices, prefill)
        return self.inner(x, indices, *args, **kw)


def tap(model: nn.Module, learner: Learner) -> int:
    """Wrap every `switch_mlp` of the model's MoE layers; returns how many."""
    from mlx.utils import tree_unflatten

    wraps = []
    for path, m in model.named_modules():
        if path.endswith(".switch_mlp") and (match := _LAYER.search(path)):
            wraps.append((path, RoutingTap(m, int(match.group(1)), learner)))
    if wraps:
        model.update_modules(tree_unflatten(wraps))
    return len(wraps)
