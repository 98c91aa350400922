"""The inputs a calibrated conversion (recipe part `cal`) fits its codes to: each quantized Linear's input second
moments H = X^T X (and, in order, a correction of its weights), measured by running the source model itself
over calibration text.

- **Text.** The demo's held-out code and chat by default (tqbench.texts; the texts `tqbench eval` scores, so a demo
  evaluation of a `cal` recipe scores text its codes were fitted on: benchmarks/quality.py also measures it
  calibrated on other text), or the user's files (`--calibrate-text`). About `tokens` tokens in windows of WINDOW,
  spread over each text as eval spreads its windows, run in batches of BATCH_WINDOWS.
- **Where.** Every quantized Linear's input is tapped once per distinct input: KDA's q/k/v (fused `qkv_proj` in
  mlx-lm) share one, and so do a gate_proj and its up_proj. A dense input's H is accumulated in float32 as batches
  run, never the activations themselves: memory is the H matrices (the model's quantized widths squared).
- **Routed experts** see only the tokens routed to them: H per expert, counted. In order, a routed input keeps its
  rows and the experts each went to (tokens x width, plus indices) until its modules are calibrated, and each
  expert's H is made from its own rows then, one at a time, and dropped: an H per expert for every expert at once
  (experts x width^2: 46 GB for one K3 layer's gate inputs) is never held, and only the counts are stored. One pass
  (`sequential=False`) still accumulates H per expert, for the conversion to calibrate from. An expert routed few
  tokens (fewer than its input width, H of low rank) would be fitted to a handful of inputs, so every expert's H is
  shrunk toward its layer's: H_e + EXPERT_PRIOR x width x (the mean H over all routed inputs of that projection)
  (tqbench.quant.calibrate.expert_hessian); an expert never routed is fitted to the layer's mean alone.
- **In order, one pass** (`sequential`, the default). Fitting every layer to the source model's own inputs ignores
  that the converted model feeds each module the *calibrated* modules' outputs. So the modules are calibrated in the
  order a forward pass reaches them: every batch of windows runs through the source model and through a copy of it,
  each in a greenlet of its own on the one thread, and each pauses at every tapped input. When all have reached the
  same tap, the inputs are counted there, that tap's modules are calibrated and their values (dequantized; routed
  experts too) put into the copy, and all go on to the next tap. Each dense Linear gets the copy's inputs X~
  (H = X~^T X~) and the correction A = I + (X - X~)^T X~ (H~ + damp)^-1 (least squares of the source's outputs
  X W^T on X~; I exactly at the first tap): its codes are fitted to W A. Routed experts keep the source model's
  inputs (the two models may route a token differently). Each model runs the windows once: the cost is two passes,
  whatever the depth (the layer-by-layer form this replaced reran the prefix for every layer: 18 passes on the demo).
  `--calibrate-one-pass` measures the source model's inputs alone.
- **Run as the conversion goes** (PassStatistics): the conversion writes units in the order a forward pass reaches
  them (the embedding first, then layer by layer, lm_head last), so when it asks for a module's codes the pass runs
  on until that module's input is calibrated, and the codes the in-order pass chose to put the module into the copy
  are what it writes (not chosen again), then dropped. Nothing is stored: a resumed conversion runs the pass again
  from the start, which gives the same codes (the same inputs, in the same order, on the one thread), and writes the
  shards not finished. The texts' digest is part of the plan fingerprint (tqbench.convert.pipeline.layout): other
  texts are another conversion. `keep` saves the statistics (STATS) at the end, for tests and analysis.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from tqbench.atomic import write_bytes
from tqbench.convert.calibration_request import WINDOW, CalibrationRequest
from tqbench.errors import ConvertError
from tqbench.events import CalibrationProgress, Calibrated
from tqbench.layout.names import mlx_module_path
from tqbench.convert.produce import rotated
from tqbench.quant import turboquant as tq
from tqbench.quant.calibrate import damped, expert_hessian, quantize_calibrated
from tqbench.recipe.plan import ModulePlan, Plan
from tqbench.recipe.recipe import Format
from tqbench.texts import plan_windows, token_stream

STATS = ".tqbench-calibration.npz"
BATCH_WINDOWS = 8
EXPERT_PRIOR = 1.0  # times the input width: how many tokens of its layer's mean H each expert's H gets
_ROWS_AT_ONCE = 1 << 24  # routed rows x width^2 per scatter of outer products (64 MB of float32)
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}  # as tqbench.runtime.load.FUSED
_FUSED_PARTS = ("q_proj", "k_proj", "v_proj")  # their rows' order in qkv_proj


class Statistics:
    """Per tapped input: H (in, in), or (E, in, in) for routed experts, and how many rows made it. In order, a routed
    tap's H per expert is never kept: `routed` holds its inputs (rows, and the experts each row went to) while its
    modules are calibrated, and each expert's H is made from them when asked for (only `|n`, the counts, is kept)."""

    def __init__(self, arrays: dict[str, np.ndarray], taps: dict[str, str], meta: dict,
                 routed: dict[str, tuple[np.ndarray, np.ndarray]] | None = None):
        self.arrays, self.taps, self.meta = arrays, taps, meta
        self.routed = routed or {}  # tap -> (rows (R, in) float32, experts (R, k) int: each row's experts)
        self._pooled: dict[str, tuple[np.ndarray, float]] = {}
        self._members: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # routed tap: experts sorted, their rows

    def hessian(self, module: str, expert: int | None) -> np.ndarray | None:
        """The H a module (one expert of it) is calibrated with; None when no calibration input reached it (its codes
        are then the nearest levels)."""
        tap = self.taps.get(module)
        if tap in self.routed and expert is not None:
            return self._routed_hessian(tap, expert)
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

    def _routed_hessian(self, tap: str, expert: int) -> np.ndarray | None:
        """One expert's H from the tap's routed rows (X_e^T X_e over the rows routed to it), shrunk toward the mean
        over every routing (rows counted once per expert they went to) as `hessian` does with stored H."""
        rows, experts = self.routed[tap]
        if tap not in self._pooled:
            weight = (experts >= 0).sum(axis=1).astype(np.float32)  # routings per row
            self._pooled[tap] = ((rows * weight[:, None]).T @ rows, float(weight.sum()))
            flat = experts.reshape(-1)
            owner = np.repeat(np.arange(len(rows)), experts.shape[1])[flat >= 0]
            flat = flat[flat >= 0]
            order = np.argsort(flat, kind="stable")  # each expert's rows together, in the order they came
            self._members[tap] = (flat[order], owner[order])
        pooled, total = self._pooled[tap]
        if total <= 0:
            return None
        by_expert, owner = self._members[tap]
        start, stop = np.searchsorted(by_expert, [expert, expert + 1])
        mine = rows[owner[start:stop]]
        return expert_hessian(mine.T @ mine, len(mine), pooled, total, EXPERT_PRIOR * rows.shape[-1])

    def quantized(self, module: str, expert: int | None) -> tq.Quantized | None:
        """The codes the in-order pass chose for a module (one expert of it) when it put the module's calibrated
        values into the copy: what the conversion writes, so it does not compute them a second time; None where the
        pass kept none (one pass, or a module the copy could not take)."""
        codes = self.arrays.get(f"{module}|codes")
        if codes is None:
            return None
        scales, error = self.arrays[f"{module}|scales"], self.arrays[f"{module}|error"]
        if expert is not None:
            codes, scales, error = codes[expert], scales[expert], error[expert]
        return tq.Quantized(weight=mx.array(codes), scales=mx.array(scales), rel_error=float(error))

    def keep_quantized(self, module: str, qs: list[tq.Quantized], experts: bool) -> None:
        """Keep a module's codes (`qs`: one, or one per expert) for `quantized`."""
        stack = np.stack if experts else (lambda a: a[0])
        self.arrays[f"{module}|codes"] = stack([np.array(q.weight) for q in qs])
        self.arrays[f"{module}|scales"] = stack([np.array(q.scales) for q in qs])
        self.arrays[f"{module}|error"] = stack([np.array(q.rel_error, dtype=np.float64) for q in qs])

    def weights(self, module: str, w: mx.array) -> mx.array:
        """The weights a module's codes are fitted to: w itself, or w A where sequential calibration measured the
        correction A (its output on the source model's inputs, from the calibrated model's)."""
        tap = self.taps.get(module)
        a = self.arrays.get(f"{tap}|a") if tap is not None else None
        return w if a is None else w.astype(mx.float32) @ mx.array(a)

    def save(self, path: Path) -> None:
        """An .npz (np.load reads it) with fixed entry dates: the same statistics are the same bytes."""
        buf = io.BytesIO()
        head = np.array(json.dumps({"meta": self.meta, "taps": self.taps}))
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, array in [("__meta__", head), *sorted(self.arrays.items())]:
                one = io.BytesIO()
                np.save(one, array, allow_pickle=False)
                z.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), one.getvalue())
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


class PassStatistics(Statistics):
    """The in-order pass run as the conversion needs it. Asking for a module's codes, H or correction runs the pass
    until that module's input is calibrated (one pass, `sequential=False`: to its end); the codes the conversion took
    are dropped then, so about one layer's codes are held, not the model's. `events()` hands over the progress made
    meanwhile; `finish()` runs the pass to its end and yields Calibrated. With `keep`, nothing is dropped and the
    statistics are saved there at the end (tests and analysis)."""

    def __init__(self, ckpt_path: Path, plan: Plan, request: CalibrationRequest, *, keep: Path | None = None):
        super().__init__({}, {}, {})
        self._steps = measure(ckpt_path, plan, request, into=self)
        self._sequential, self._digest, self._keep = request.sequential, request.digest(), keep
        self._calibrated: set[str] = set()  # taps done
        self._pending: list[CalibrationProgress] = []
        self._taken: dict[str, int] = {}  # module -> experts whose codes the conversion took
        self._done = self._started = False
        self.seconds = 0.0  # spent in the pass

    def _advance(self) -> bool:
        self._started = True  # the first step loads the models and sets the taps
        t0 = time.monotonic()
        try:
            ev = next(self._steps)
        except StopIteration:
            self._done = True
            return False
        finally:
            self.seconds += time.monotonic() - t0
        self._pending.append(ev)
        self._calibrated.add(ev.at)
        return True

    def _until(self, module: str) -> None:
        if not self._started:
            self._advance()
        tap = self.taps.get(module)
        while tap is not None and not self._done and (not self._sequential or tap not in self._calibrated):
            self._advance()

    def hessian(self, module: str, expert: int | None) -> np.ndarray | None:
        self._until(module)
        return super().hessian(module, expert)

    def weights(self, module: str, w: mx.array) -> mx.array:
        self._until(module)
        return super().weights(module, w)

    def quantized(self, module: str, expert: int | None) -> tq.Quantized | None:
        self._until(module)
        q = super().quantized(module, expert)
        if q is not None and self._keep is None:  # written once: its codes go when all of them were taken
            self._taken[module] = self._taken.get(module, 0) + 1
            if expert is None or self._taken[module] == self.arrays[f"{module}|codes"].shape[0]:
                for part in ("codes", "scales", "error"):
                    del self.arrays[f"{module}|{part}"]
        return q

    def events(self) -> list[CalibrationProgress]:
        """The progress made since the last call."""
        out, self._pending = self._pending, []
        return out

    def finish(self) -> Iterator[CalibrationProgress | Calibrated]:
        """The pass to its end (the taps no module of this run's shards needed), then Calibrated."""
        while self._advance():
            pass
        yield from self.events()
        if self._keep is not None:
            self.meta["digest"] = self._digest
            self.save(self._keep)
        yield Calibrated(tokens=int(self.meta["tokens"]), inputs=len(set(self.taps.values())), modules=len(self.taps),
                         seconds=self.seconds, file=str(self._keep or ""))


def measure(ckpt_path: Path, plan: Plan, request: CalibrationRequest, *,
            into: Statistics) -> Iterator[CalibrationProgress]:
    """Run the source model over the calibration windows, tapping each calibrated module's input, into `into` (its
    taps and meta are set before the first step); yields CalibrationProgress after every step. Sequential: the
    source model and a copy run the windows in step, tap by tap (_staged); each Linear gets H of its inputs in the
    copy (X~), whose modules before it hold their calibrated values, and the correction A that makes its target the
    source model's output: W' = W A, A = I + (X - X~)^T X~ (H~ + damp)^-1 (least squares of X W^T on X~)."""
    from tqbench.runtime.load import load

    texts = request.read()
    loaded = load(ckpt_path)
    model = loaded.model
    modules = dict(model.named_modules())
    taps = {m.name: tap for m in calibrated_modules(plan) if (tap := _tap_path(m.name, modules)) is not None}
    if not taps and calibrated_modules(plan):
        raise ConvertError("calibration found none of the quantized modules in the source model", ckpt_path)
    sums = _tapped(model, modules, taps)
    streams = {t.name: token_stream(t, loaded.tokenizer) for t in texts}
    windows = plan_windows(streams, WINDOW, request.tokens)
    rows = np.concatenate([w.x for w in windows])
    arrays, meta = into.arrays, into.meta
    into.taps.update(taps)
    meta.update(tokens=int(rows.size), windows=len(rows))
    groups: dict[str, list[ModulePlan]] = {}
    for m in calibrated_modules(plan):
        if m.name in taps:
            groups.setdefault(taps[m.name], []).append(m)
    clock = _Clock(tokens=int(rows.size), weights={tap: sum(m.source.params for m in g) for tap, g in groups.items()})
    if not request.sequential:
        batches = range(0, len(rows), BATCH_WINDOWS)
        for b in _one_pass(model, rows, sums):
            yield clock.step(done=b + 1, total=len(batches), step="batches", at=f"batch {b + 1}",
                             fraction=(b + 1) / len(batches))
        _keep(arrays, sums, None, set(sums))
        return
    copy = load(ckpt_path, tokenizer=False).model
    copy_modules = dict(copy.named_modules())
    copy_sums = _tapped(copy, copy_modules, taps)

    def calibrate(tap: str) -> None:
        _keep(arrays, sums, copy_sums, {tap})
        routed = sums[tap].routed_rows()
        _calibrated_into(copy, copy_modules, groups.get(tap, []), Statistics(arrays, taps, {}, routed), plan)
        sums[tap].rows, sums[tap].experts_of = [], []  # calibrated: its inputs go

    order: list[str] = []
    meta["order"] = order  # filled as the pass goes
    for tap in _staged(model, copy, rows, sums, copy_sums, calibrate=calibrate):
        order.append(tap)
        yield clock.step(done=len(order), total=len(sums), step="inputs", at=tap, fraction=clock.weighed(order))


@dataclass(kw_only=True)
class _Clock:
    """The calibration's progress events: the weighed fraction done and the time since the pass started."""

    tokens: int
    weights: dict[str, int]  # per tap: the weights of its calibrated modules
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    def weighed(self, done: list[str]) -> float:
        total = sum(self.weights.values())
        return sum(self.weights.get(t, 0) for t in done) / total if total else 1.0

    def step(self, *, done: int, total: int, step: str, at: str, fraction: float) -> CalibrationProgress:
        return CalibrationProgress(done=done, total=total, step=step, at=at, tokens=self.tokens, fraction=fraction,
                                   elapsed=time.monotonic() - self.start)


def _one_pass(model: nn.Module, rows: np.ndarray, sums: dict[str, _Sum]) -> Iterator[int]:
    """The windows through the source model, batch by batch, every tap counting its inputs; yields each batch's
    number (from 0) once counted."""
    for i, b in enumerate(range(0, len(rows), BATCH_WINDOWS)):
        mx.eval(model(mx.array(rows[b:b + BATCH_WINDOWS])))
        mx.eval([a for s in sums.values() if s.h is not None for a in (s.h, s.n)])
        yield i


def _staged(model: nn.Module, copy: nn.Module, rows: np.ndarray, sums: dict[str, _Sum], copy_sums: dict[str, _Sum], *,
            calibrate: Callable[[str], None]) -> Iterator[str]:
    """Sequential calibration in one pass of each model. Every batch of windows runs through `model` and through
    `copy` in greenlets of their own (MLX stays on this thread), and each pauses at every tap, handing over its
    input. When all of them have reached the same tap: the source model's inputs are counted (routed experts: their
    rows and experts, until calibrated; dense: kept for the cross term), then the copy's (H~, C = X~^T X),
    `calibrate(tap)` puts that tap's calibrated modules into the copy, and all go on, each calling the module
    (calibrated, in the copy) with its input.
    A tap reached again later in the same pass (a module called twice) counts nothing more. Yields each tap once
    calibrated, in order (the forward passes wait meanwhile: closing the generator drops them)."""
    from greenlet import getcurrent, greenlet

    for tap, s in sums.items():
        s.active, s.pause = True, True
        s.capture = [] if s.experts is None else None
        s.keep_rows = s.experts is not None  # routed: its rows until calibrated, no H per expert
        c = copy_sums[tap]
        c.active, c.pause, c.partner = s.experts is None, True, s
    here = getcurrent()
    runs = []
    for b in range(0, len(rows), BATCH_WINDOWS):
        batch = mx.array(rows[b:b + BATCH_WINDOWS])
        for m in (model, copy):  # the logits are never needed: the graph past the last tap is dropped unevaluated
            runs.append(greenlet(lambda m=m, batch=batch: m(batch) is None, parent=here))
    states = [g.switch() for g in runs]
    while any(isinstance(p, _Paused) for p in states):
        tap = states[0].tap if isinstance(states[0], _Paused) else None
        if tap is None or any(not isinstance(p, _Paused) or p.tap != tap for p in states):
            raise ConvertError(f"calibration: the batches reached different modules ({tap} first); the model's forward "
                               "pass must call the same modules in the same order for every batch")
        for source, mine in zip(states[0::2], states[1::2]):
            sums[tap].add(source.x, source.args)
            copy_sums[tap].add(mine.x, mine.args)
            mx.eval([a for s in (sums[tap], copy_sums[tap]) for a in (s.h, s.n, s.c, *s.rows[-1:], *s.experts_of[-1:])
                     if a is not None])
        calibrate(tap)
        for s in (sums[tap], copy_sums[tap]):
            s.active = s.pause = False  # counted and calibrated: a second call of it passes straight through
        yield tap
        states = [g.switch() for g in runs]


def _tapped(model: nn.Module, modules: dict[str, nn.Module], taps: dict[str, str]) -> dict[str, _Sum]:
    """A _Tap in front of every tapped input. A module that shares another's input (an up_proj its gate_proj's) gets
    one too that counts nothing: mlx-lm may call it first (kimi_k3's MLP calls up_proj before gate_proj), and in
    order it must wait there until both are calibrated."""
    sums = {tap: _Sum(modules[tap]) for tap in sorted(set(taps.values()))}
    for tap, s in sums.items():
        s.tap = tap
    shared = {p: tap for name, tap in taps.items()
              if (p := next((q for q in (mlx_module_path(name), name) if q in modules), tap)) != tap}
    model.update_modules(tree_unflatten([(tap, _Tap(modules[tap], s)) for tap, s in sums.items()]
                                        + [(p, _Tap(modules[p], sums[tap], counts=False)) for p, tap in shared.items()]))
    return sums


def _keep(arrays: dict[str, np.ndarray], sums: dict[str, _Sum], copy_sums: dict[str, _Sum] | None,
          active: set[str]) -> None:
    """The statistics of the `active` taps, as arrays. A tap never called keeps none: its modules get nearest
    rounding."""
    for tap in active:
        s = sums[tap] if copy_sums is None or sums[tap].experts is not None else copy_sums[tap]
        if s.keep_rows and s.n is not None:
            arrays[f"{tap}|n"] = np.array(s.n)  # the counts; each expert's H is made from the rows (routed_rows)
            continue
        if s.h is None:
            continue
        arrays[f"{tap}|h"], arrays[f"{tap}|n"] = np.array(s.h), np.array(s.n)
        if s.c is not None:  # A = I + (C^T - H~) (H~ + damp I)^-1, C = X~^T X
            h = np.array(s.h, dtype=np.float64)
            c = np.array(s.c, dtype=np.float64)
            arrays[f"{tap}|a"] = (np.eye(len(h)) + np.linalg.solve(damped(h), (c.T - h).T).T).astype(np.float32)


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


def _calibrated_into(model: nn.Module, modules: dict[str, nn.Module], group: list[ModulePlan], stats: Statistics,
                     plan: Plan) -> None:
    """Replace the weights of `group`'s Linears in the running model by their calibrated codes' values, so the next
    layers are measured on the inputs the converted model will give them. Modules that are not a plain Linear or a
    (mxfp4 / float) SwitchLinear in the model stay as they are."""
    for m in group:
        if m.experts:
            _experts_into(model, modules, m, stats, plan)
            continue
        h = stats.hessian(m.name, None)
        if h is None:
            continue
        path = next((p for p in (mlx_module_path(m.name), m.name) if p in modules), None)
        parent, _, leaf = (path or mlx_module_path(m.name)).rpartition(".")
        out, n = m.source.shape
        rows = slice(0, out)
        if path is None and leaf in _FUSED and f"{parent}.{_FUSED[leaf]}" in modules:
            part = _FUSED_PARTS.index(leaf)
            path, rows = f"{parent}.{_FUSED[leaf]}", slice(part * out, (part + 1) * out)
        target = modules.get(path) if path else None
        if not isinstance(target, nn.Linear) or "scales" in target or target.weight.shape[-1] != n:
            continue
        c = m.choice
        kind = "T" if c.ternary else str(c.bits)
        signs = mx.array(tq.rotation_signs(m.name, n, plan.recipe.seed)) if rotated(plan.recipe, n) else None
        w = target.weight
        target_w = stats.weights(m.name, w[rows].astype(mx.float32))
        q = quantize_calibrated(target_w, kind, c.group_size, signs, h, rule=plan.recipe.scales)
        stats.keep_quantized(m.name, [q], experts=False)
        hat = tq.dequantize(q.weight, q.scales, mx.array(tq.codebook(kind)), signs, n).astype(w.dtype)
        target.weight = mx.concatenate([w[:rows.start], hat, w[rows.stop:]]) if rows != slice(0, w.shape[0]) else hat


def _experts_into(model: nn.Module, modules: dict[str, nn.Module], m: ModulePlan, stats: Statistics,
                  plan: Plan) -> None:
    """A routed-expert module's calibrated values (nearest rounding for an expert without statistics) as a float
    SwitchLinear in place of the source's."""
    from mlx_lm.models.switch_layers import SwitchLinear

    path = mlx_module_path(m.name)
    source = modules.get(path)
    if source is None or "bias" in source:
        return
    if "scales" in source:
        try:
            w = mx.dequantize(source.weight, source.scales, source.get("biases"), group_size=source.group_size,
                              bits=source.bits, mode=source.mode)
        except (ValueError, AttributeError):
            return
    else:
        w = source.weight
    experts, out, n = w.shape
    c = m.choice
    kind = "T" if c.ternary else str(c.bits)
    signs = mx.array(tq.rotation_signs(m.name, n, plan.recipe.seed)) if rotated(plan.recipe, n) else None
    book = mx.array(tq.codebook(kind))
    hats, qs = [], []
    for e in range(experts):
        h, we = stats.hessian(m.name, e), w[e].astype(mx.float32)
        q = (quantize_calibrated(we, kind, c.group_size, signs, h, rule=plan.recipe.scales) if h is not None
             else tq.quantize(we, kind, c.group_size, signs, rule=plan.recipe.scales))
        hats.append(tq.dequantize(q.weight, q.scales, book, signs, n))
        qs.append(q)
    stats.keep_quantized(m.name, qs, experts=True)
    new = SwitchLinear(n, out, experts, bias=False)
    new.weight = mx.stack(hats)  # float32: gather_mm on the CPU takes float32 only
    mx.eval(new.weight)
    current = dict(model.named_modules())[path]
    if isinstance(current, _Tap):
        current.inner = new
    else:
        model.update_modules(tree_unflatten([(path, new)]))


class _Sum:
    """X^T X and the row count of one input (allocated at its first call, from the input's width), per expert for
    a (Quantized)SwitchLinear (weight (E, out, ...), called with (x, indices, ...))."""

    def __init__(self, module: nn.Module):
        w = module["weight"]
        self.experts = w.shape[0] if w.ndim == 3 else None
        self.h: mx.array | None = None
        self.n: mx.array | None = None
        self.c: mx.array | None = None  # X~^T X: this copy's inputs against the source model's (partner's)
        self.active = True
        self.capture: list[mx.array] | None = None  # the source model's side: inputs handed to the copy
        self.partner: _Sum | None = None  # the copy's side: the source model's _Sum of the same tap
        self.tap = ""  # the tapped module's path
        self.pause = False  # staged: the tap hands its input to _staged and waits (a greenlet) instead of counting it
        self.keep_rows = False  # routed experts, in order: keep the input rows and their experts, not H per expert
        self.rows: list[mx.array] = []
        self.experts_of: list[mx.array] = []

    def routed_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{tap: (rows, experts)} of a routed tap that kept its rows (every batch's, in order), else {}."""
        if not self.rows:
            return {}
        width = max(e.shape[1] for e in self.experts_of)
        ids = [np.pad(np.array(e), ((0, 0), (0, width - e.shape[1])), constant_values=-1) for e in self.experts_of]
        return {self.tap: (np.concatenate([np.array(r) for r in self.rows]), np.concatenate(ids))}

    def add(self, x: mx.array, args: tuple) -> None:
        if not self.active:
            return
        d = x.shape[-1]
        if self.experts is None:
            rows = x.reshape(-1, d).astype(mx.float32)
            if self.capture is not None:
                self.capture.append(rows)
                return
            if self.h is None:
                self.h, self.n = mx.zeros((d, d), dtype=mx.float32), mx.zeros((), dtype=mx.float32)
            self.h = self.h + rows.T @ rows
            self.n = self.n + rows.shape[0]
            if self.partner is not None:
                cross = rows.T @ self.partner.capture.pop(0)
                self.c = cross if self.c is None else self.c + cross
            return
        idx = args[0]  # x (..., 1, 1, d) for every expert of a token, or (..., k, 1, d) / (N, 1, d) one per index
        if self.keep_rows:  # one row per distinct input, with the experts it goes to: (R, d) and (R, k or 1)
            rows = x.reshape(-1, d).astype(mx.float32)
            ids = idx.reshape(rows.shape[0], -1).astype(mx.int32)
            if self.n is None:
                self.n = mx.zeros((self.experts,), dtype=mx.float32)
            self.n = self.n.at[ids.reshape(-1)].add(1.0)
            self.rows.append(rows)
            self.experts_of.append(ids)
            return
        if self.h is None:
            self.h = mx.zeros((self.experts, d, d), dtype=mx.float32)
            self.n = mx.zeros((self.experts,), dtype=mx.float32)
        rows = mx.broadcast_to(x, (*idx.shape, *x.shape[-2:])).reshape(-1, d).astype(mx.float32)
        ids = mx.broadcast_to(idx[..., None], (*idx.shape, x.shape[-2])).reshape(-1)
        step = max(1, _ROWS_AT_ONCE // (d * d))
        for r in range(0, rows.shape[0], step):
            part, who = rows[r:r + step], ids[r:r + step]
            self.h = self.h.at[who].add(part[:, :, None] * part[:, None, :])
            self.n = self.n.at[who].add(1.0)


class _Tap(nn.Module):
    """A module that adds its input to a _Sum (or, in order, waits for its tap's turn), then calls the module it
    stands for."""

    def __init__(self, inner: nn.Module, sums: _Sum, counts: bool = True):
        super().__init__()
        self.inner = inner
        self._sums = sums
        self._counts = counts  # False: a module sharing the tap's input (it only waits there)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if self._sums.pause:
            from greenlet import getcurrent

            getcurrent().parent.switch(_Paused(tap=self._sums.tap, x=x, args=args))  # back once calibrated
        elif self._counts:
            self._sums.add(x, args)
        return self.inner(x, *args, **kwargs)


@dataclass(frozen=True, kw_only=True)
class _Paused:
    """A forward pass waiting at a tap (sequential calibration), with the input it will call the module with."""

    tap: str
    x: mx.array
    args: tuple
