"""The inputs a calibrated conversion (recipe part `cal`) fits its codes to: each quantized Linear's input second
moments H = X^T X, measured by running the source model itself over calibration text.

- **Text.** The demo's held-out code and chat by default (tqbench.texts; the texts `tqbench eval` scores, so a demo
  evaluation of a `cal` recipe scores text its codes were fitted on: benchmarks/quality.py also measures it
  calibrated on other text), or the user's files (`--calibrate-text`). About `tokens` tokens in windows of WINDOW,
  spread over each text as eval spreads its windows, run in batches of BATCH_WINDOWS.
- **Where.** Every quantized Linear's input is tapped once per distinct input: KDA's q/k/v (fused `qkv_proj` in
  mlx-lm) share one, and so do a gate_proj and its up_proj. H is accumulated in float32 as batches run, never the
  activations themselves: memory is the H matrices (the model's quantized widths squared).
- **Routed experts** see only the tokens routed to them: H per expert, counted. An expert routed few tokens (fewer
  than its input width, H of low rank) would be fitted to a handful of inputs, so every expert's H is shrunk toward
  its layer's: H_e + EXPERT_PRIOR x width x (the mean H over all routed inputs of that projection)
  (tqbench.quant.calibrate.expert_hessian); an expert never routed is fitted to the layer's mean alone.
- **Stored** in the output directory (STATS, replaced atomically) with the digest of the texts, before the first
  shard: a resumed conversion reads it back instead of running the model again, so it writes the same bytes. The
  digest is part of the plan fingerprint (tqbench.convert.pipeline.layout): other texts are another conversion.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from tqbench.atomic import write_bytes
from tqbench.errors import ConvertError
from tqbench.events import Calibrated
from tqbench.layout.names import mlx_module_path
from tqbench.quant.calibrate import expert_hessian
from tqbench.recipe.plan import ModulePlan, Plan
from tqbench.recipe.recipe import Format
from tqbench.texts import Text, default_texts, file_text, plan_windows, token_stream

STATS = ".tqbench-calibration.npz"
DEFAULT_TOKENS = 8192
WINDOW = 256
BATCH_WINDOWS = 8
EXPERT_PRIOR = 1.0  # times the input width: how many tokens of its layer's mean H each expert's H gets
_ROWS_AT_ONCE = 1 << 24  # routed rows x width^2 per scatter of outer products (64 MB of float32)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}  # as tqbench.runtime.load.FUSED


@dataclass(frozen=True, kw_only=True)
class CalibrationRequest:
    """What a calibrated conversion runs the source over: `texts` (files; empty: the demo's held-out texts) and
    about `tokens` tokens of them."""

    texts: tuple[str, ...] = ()
    tokens: int = DEFAULT_TOKENS

    def read(self) -> tuple[Text, ...]:
        """The texts, read (a bad file raises TqbenchError naming it, before anything is converted)."""
        return tuple(file_text(t) for t in self.texts) or default_texts()

    def digest(self) -> str:
        """sha256 of the texts and the token count: what the statistics depend on besides the source."""
        h = hashlib.sha256(f"{self.tokens}|{WINDOW}\n".encode())
        for t in self.read():
            h.update(t.name.encode() + b"\0")
            for d in t.documents:
                h.update(hashlib.sha256(d.encode()).digest())
        return h.hexdigest()


class Statistics:
    """Per tapped input: H (in, in), or (E, in, in) for routed experts, and how many rows made it."""

    def __init__(self, arrays: dict[str, np.ndarray], taps: dict[str, str], meta: dict):
        self.arrays, self.taps, self.meta = arrays, taps, meta
        self._pooled: dict[str, tuple[np.ndarray, float]] = {}

    def hessian(self, module: str, expert: int | None) -> np.ndarray | None:
        """The H a module (one expert of it) is calibrated with; None when no calibration input reached it (its codes
        are then the nearest levels)."""
        tap = self.taps.get(module)
        if tap is None or f"{tap}|h" not in self.arrays:
            return None
        h, count = self.arrays[f"{tap}|h"], self.arrays[f"{tap}|n"]
        if expert is None:
            return h.astype(np.float64) if float(count) > 0 else None
        if tap not in self._pooled:
            self._pooled[tap] = (h.sum(axis=0, dtype=np.float64), float(count.sum()))
        pooled, total = self._pooled[tap]
        if total <= 0:
            return None
        return expert_hessian(h[expert], float(count[expert]), pooled, total, EXPERT_PRIOR * h.shape[-1])

    def save(self, path: Path) -> None:
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.array(json.dumps({"meta": self.meta, "taps": self.taps})), **self.arrays)
        write_bytes(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path) -> Statistics | None:
        try:
            with np.load(path) as z:
                head = json.loads(str(z["__meta__"]))
                arrays = {k: z[k] for k in z.files if k != "__meta__"}
        except (OSError, ValueError, KeyError):
            return None  # unreadable: measured again
        return cls(arrays, head["taps"], head["meta"])


def calibrated_modules(plan: Plan) -> list[ModulePlan]:
    return [m for m in plan.modules if m.choice.format is Format.TURBOQUANT]


def prepare(ckpt_path: Path, plan: Plan, dest: Path, request: CalibrationRequest) -> Iterator[Calibrated]:
    """The statistics for a calibrated conversion into `dest`: read back (a resumed conversion), or measured now and
    stored there. Yields one Calibrated event; returns the Statistics."""
    t0 = time.monotonic()
    digest = request.digest()
    path = dest / STATS
    stats = Statistics.load(path) if path.is_file() else None
    reused = stats is not None and stats.meta.get("digest") == digest
    if not reused:
        stats = measure(ckpt_path, plan, request)
        stats.meta["digest"] = digest
        stats.save(path)
    yield Calibrated(tokens=int(stats.meta["tokens"]), inputs=len(set(stats.taps.values())), modules=len(stats.taps),
                     seconds=time.monotonic() - t0, reused=reused, file=str(path))
    return stats


def measure(ckpt_path: Path, plan: Plan, request: CalibrationRequest) -> Statistics:
    """Run the source model over the calibration windows, tapping each calibrated module's input."""
    from tqbench.runtime.load import load

    texts = request.read()
    loaded = load(ckpt_path)
    model = loaded.model
    modules = dict(model.named_modules())
    taps = {m.name: tap for m in calibrated_modules(plan) if (tap := _tap_path(m.name, modules)) is not None}
    sums = {tap: _Sum(modules[tap]) for tap in sorted(set(taps.values()))}
    model.update_modules(tree_unflatten([(tap, _Tap(modules[tap], s)) for tap, s in sums.items()]))
    streams = {t.name: token_stream(t, loaded.tokenizer) for t in texts}
    windows = plan_windows(streams, WINDOW, request.tokens)
    rows = np.concatenate([w.x for w in windows])
    for b in range(0, len(rows), BATCH_WINDOWS):
        mx.eval(model(mx.array(rows[b:b + BATCH_WINDOWS])))
        mx.eval([a for s in sums.values() if s.h is not None for a in (s.h, s.n)])
    arrays = {}
    for tap, s in sums.items():
        if s.h is not None:  # never called: its modules get nearest rounding
            arrays[f"{tap}|h"], arrays[f"{tap}|n"] = np.array(s.h), np.array(s.n)
    if not taps and calibrated_modules(plan):
        raise ConvertError("calibration found none of the quantized modules in the source model", ckpt_path)
    return Statistics(arrays, taps, {"tokens": int(rows.size), "windows": len(rows)})


def _tap_path(name: str, modules: dict[str, nn.Module]) -> str | None:
    """Where a planned module's input can be seen in the mlx-lm model: its own module, the fused module it is part
    of, or its gate_proj sibling for an up_proj (the same input)."""
    for path in (mlx_module_path(name), name):
        parent, _, leaf = path.rpartition(".")
        if leaf == "up_proj" and f"{parent}.gate_proj" in modules:
            return f"{parent}.gate_proj"
        if path in modules:
            return path
        if leaf in _FUSED and f"{parent}.{_FUSED[leaf]}" in modules:
            return f"{parent}.{_FUSED[leaf]}"
    return None


class _Sum:
    """X^T X and the row count of one input (allocated at its first call, from the input's width), per expert for
    a (Quantized)SwitchLinear (weight (E, out, ...), called with (x, indices, ...))."""

    def __init__(self, module: nn.Module):
        w = module["weight"]
        self.experts = w.shape[0] if w.ndim == 3 else None
        self.h: mx.array | None = None
        self.n: mx.array | None = None

    def add(self, x: mx.array, args: tuple) -> None:
        d = x.shape[-1]
        if self.h is None:
            lead = () if self.experts is None else (self.experts,)
            self.h, self.n = mx.zeros((*lead, d, d), dtype=mx.float32), mx.zeros(lead, dtype=mx.float32)
        if self.experts is None:
            rows = x.reshape(-1, d).astype(mx.float32)
            self.h = self.h + rows.T @ rows
            self.n = self.n + rows.shape[0]
            return
        idx = args[0]  # x (..., 1, 1, d) for every expert of a token, or (..., k, 1, d) / (N, 1, d) one per index
        rows = mx.broadcast_to(x, (*idx.shape, *x.shape[-2:])).reshape(-1, d).astype(mx.float32)
        ids = mx.broadcast_to(idx[..., None], (*idx.shape, x.shape[-2])).reshape(-1)
        step = max(1, _ROWS_AT_ONCE // (d * d))
        for r in range(0, rows.shape[0], step):
            part, who = rows[r:r + step], ids[r:r + step]
            self.h = self.h.at[who].add(part[:, :, None] * part[:, None, :])
            self.n = self.n.at[who].add(1.0)


class _Tap(nn.Module):
    """A module that adds its input to a _Sum, then calls the module it stands for."""

    def __init__(self, inner: nn.Module, sums: _Sum):
        super().__init__()
        self.inner = inner
        self._sums = sums

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        self._sums.add(x, args)
        return self.inner(x, *args, **kwargs)
