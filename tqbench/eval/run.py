"""`evaluate(request)`: the generator behind `tqbench eval` and the Recipe screen's quick eval. Runs on the engine
thread (tqbench.engine); yields EvalStarted, EvalProgress events and one EvalReport, every number evaluated.

Both models load as a chat loads them (tqbench.runtime.load, experts streamed when asked or when a model does not fit)
and run window by window on the same token ids, so a model larger than memory is evaluated with one expert cache per
model and a source checkpoint (mxfp4, bf16) as it is, without converting it.

Windows are scored in batched passes, or token by token through a KV cache (`decode`, and always with cache routing,
which acts in decode passes only): then each pass routes one token, so the expert cache sees what a chat's decode
does (misses and cache-routing substitutions per token)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np

from tqbench.errors import TqbenchError
from tqbench.eval.layers import describe, layer_errors, layer_list
from tqbench.eval.metrics import window_sums
from tqbench.eval.records import (EvalProgress, EvalReport, EvalRequest, EvalStarted, GreedyAgreement, LayerError,
                                  TextScore, TierShares)
from tqbench.texts import Windows, default_texts, digest, file_text, plan_windows, token_stream

BATCH_TOKENS = 2048  # tokens per forward pass (whole windows)


def evaluate(request: EvalRequest) -> Iterator:
    """Under a launcher of several ranks (tqbench.distributed.world.join) every rank runs it with the same request:
    each holds its layers of both models and takes part in every forward pass; each rank's report is the same, its
    streaming figures (read bytes, misses) its own layers'. Rank 0 alone remembers the result."""
    from tqbench.distributed.world import agree, in_step, join

    group = join()
    if group is None:
        return (yield from _evaluate(request, None))
    loaded: list = []
    try:
        _check(request, group)
        for path, stream in _models(request):
            loaded.append(_load(path, stream, request.trust_remote_code, group))
    except TqbenchError as e:  # every rank learns which one failed, and why
        _close(*loaded)
        agree(group, e)
        raise
    agree(group, None)
    return (yield from in_step(_evaluate(request, loaded), loaded[0].pipeline))


def _check(request: EvalRequest, group=None) -> tuple:
    """The texts, read; both models' files checked before either loads."""
    from tqbench.runtime.load import preflight

    request.check()
    if group is not None and request.layers:
        raise TqbenchError(f"--layers compares each layer with the reference's, and under {group.size()} ranks each "
                           "holds some layers only: run it on one process")
    texts = tuple(file_text(t) for t in request.texts) or default_texts()  # a bad file fails before any load
    for path in (request.model, request.against):
        if path is not None:
            preflight(path, request.trust_remote_code)
    return texts


def _models(request: EvalRequest) -> list[tuple[str, object]]:
    """(path, stream request) of MODEL and SRC, which routes natively."""
    out = [(request.model, request.stream)]
    if request.against is not None:
        out.append((request.against, replace(request.stream, cache_routing=0.0)))
    return out


def _close(*loaded) -> None:
    for m in loaded:
        if m is not None and m.streamer is not None:
            m.streamer.close()


def _evaluate(request: EvalRequest, loaded: list | None) -> Iterator:
    """`loaded`: both models, loaded already (several ranks); None: loaded here."""
    from tqbench.runtime.routing import native_top_k, set_active_experts

    texts = _check(request)
    t0 = time.perf_counter()
    model = ref = None
    try:
        if loaded is None:
            loaded = []  # what loaded is closed, also when the second model fails
            for path, stream in _models(request):
                loaded.append(_load(path, stream, request.trust_remote_code))
        model, ref = loaded[0], loaded[1] if len(loaded) > 1 else None
        native = active = native_top_k(model.model)
        if request.max_active_experts:
            active = set_active_experts(model.model, request.max_active_experts).active
        if request.scores_tools:
            return (yield from _tool_eval(request, model, ref, active=active, native=native, t0=t0))
        streams = {t.name: token_stream(t, model.tokenizer) for t in texts}
        if ref is not None:
            _same_tokens(texts, streams, ref.tokenizer, request.against)
        windows = plan_windows(streams, request.window, request.tokens)
        forget = _page_in_sink(model, ref)
        total = sum(w.tokens for w in windows)
        margin, decode = request.stream.cache_routing, request.token_by_token
        yield EvalStarted(model=str(model.path), against=str(ref.path) if ref else None,
                          texts=tuple(w.name for w in windows), windows=sum(len(w.x) for w in windows),
                          window=request.window, tokens=total, max_active_experts=active, native_experts=native,
                          layers=request.layers, cache_routing=margin, decode=decode,
                          asked_tokens=request.tokens if _ran_short(windows, streams, request) else 0)
        misses = substitutions = tiers = None
        if request.layers:
            scores, greedy = (), None
            layers = yield from _layers(model.model, ref.model, windows, total, forget)
            overall = None
        else:
            layers = ()
            before = _counts(model)
            score = _score_decode if decode else _score
            scores = yield from score(model.model, ref.model if ref else None, windows, total, forget)
            if before is not None:  # per scored token: per pass when token by token
                after = _counts(model)
                misses, substitutions = (after[0] - before[0]) / total, (after[1] - before[1]) / total
                gpu, host, disk = after[2] - before[2], after[3] - before[3], after[0] - before[0]
                routed = max(1, gpu + host + disk)
                tiers = TierShares(gpu=gpu / routed, host=host / routed, disk=disk / routed)
            overall = scores[0]
            for s in scores[1:]:
                overall = overall.plus(s, "all")
            greedy = None
            if ref is not None and request.prompts and request.generate:
                greedy = yield from _greedy(model.model, ref.model, windows, request, forget)
        report = EvalReport(model=str(model.path), against=str(ref.path) if ref else None, recipe=_recipe(model.path),
                            window=request.window, max_active_experts=active, native_experts=native,
                            texts=tuple(scores), total=overall, greedy=greedy, layers=tuple(layers),
                            text_digest=digest(windows), seconds=time.perf_counter() - t0,
                            model_bytes=model.weight_bytes, model_read_bytes=_read_bytes(model),
                            against_read_bytes=_read_bytes(ref) if ref is not None else None, cache_routing=margin,
                            decode=decode, model_misses_per_token=misses, model_substitutions_per_token=substitutions,
                            model_tiers=tiers)
        first = model.pipeline is None or model.pipeline.rank == 0
        if ref is not None and overall is not None and not margin and first:  # a recipe's quality, not a routing's
            from tqbench.eval.store import remember

            remember(report, ref.path, request.store)
        yield report
    finally:
        _close(*(loaded or ()))


def _tool_eval(request: EvalRequest, model, ref, active: int, native: int, t0: float) -> Iterator:
    """--tools: the tool-call cases scored (tqbench.eval.tools), one EvalReport with `tools` and no texts."""
    import hashlib

    from tqbench.eval.tools import TOOL_SET, load_cases, score_tools

    cases = load_cases(request.tools_file, request.tool_cases)
    yield EvalStarted(model=str(model.path), against=str(ref.path) if ref else None, texts=(), windows=0, window=0,
                      tokens=0, max_active_experts=active, native_experts=native, layers=False,
                      cache_routing=request.stream.cache_routing, tool_cases=len(cases),
                      tool_set=request.tools_file or TOOL_SET)
    score = yield from score_tools(model, ref, cases, temp=request.tool_temp, tool_syntax=request.tool_syntax)
    digest_of = hashlib.sha256(json.dumps([c.where for c in cases] + [c.name for c in cases]).encode()).hexdigest()
    report = EvalReport(model=str(model.path), against=str(ref.path) if ref else None, recipe=_recipe(model.path),
                     window=0, max_active_experts=active, native_experts=native, texts=(), total=None, greedy=None,
                     layers=(), text_digest=digest_of, seconds=time.perf_counter() - t0,
                     model_bytes=model.weight_bytes, model_read_bytes=_read_bytes(model),
                     against_read_bytes=_read_bytes(ref) if ref is not None else None,
                     cache_routing=request.stream.cache_routing, tools=score)
    if ref is not None and not request.stream.cache_routing and (model.pipeline is None or model.pipeline.rank == 0):
        from tqbench.eval.store import remember

        remember(report, ref.path, request.store)  # a recipe's tool calls, beside its KL on the Recipe screen
    yield report


def _load(path: str, stream, trust_remote_code: bool, group=None):
    from tqbench.chat.stream_plan import plan_streaming
    from tqbench.runtime.load import load

    plan = plan_streaming(path, stream)
    return load(path, trust_remote_code, streaming=plan.config, store=plan.store, group=group)


def _ran_short(windows: list, streams: dict, request: EvalRequest) -> bool:
    """The texts hold fewer windows than --tokens asks for (plan_windows takes what there is)."""
    per_text = max(1, round(request.tokens / request.window / max(len(streams), 1)))
    return any(len(w.x) < per_text for w in windows)


def _same_tokens(texts, streams: dict[str, np.ndarray], tokenizer, against: str) -> None:
    for t in texts:
        if not np.array_equal(token_stream(t, tokenizer), streams[t.name]):
            raise TqbenchError(f"its tokenizer reads text {t.name!r} differently from the model's: a per-token "
                               "comparison needs one vocabulary", against)


def _recipe(path: Path) -> str | None:
    try:
        return json.loads((path / "convert-report.json").read_text())["recipe"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_bytes(loaded) -> int | None:
    if loaded.streamer is None:
        return None
    st = loaded.streamer.stats
    return st.critical_bytes + st.speculative_bytes + st.preload_bytes


def _counts(loaded) -> tuple[int, int, int, int] | None:
    """(expert misses, cache-routing substitutions, GPU-cache hits, host-tier hits) of a streamed model so far; None
    when its experts are resident."""
    if loaded.streamer is None:
        return None
    st = loaded.streamer.stats
    return st.misses, st.substitutions, st.hits_gpu, st.hits_host


def _page_in_sink(*loaded):
    """Streamed models log a PageIn per layer and pass for a chat's live view; an evaluation shows none: the
    returned function drops them (called after every pass, so they never pile up)."""
    streamers = [m.streamer for m in loaded if m is not None and m.streamer is not None]

    def forget() -> None:
        for s in streamers:
            s.drain()

    return forget


def _batches(windows: list[Windows], window: int):
    per = max(1, BATCH_TOKENS // window)
    for w in windows:
        for i in range(0, len(w.x), per):
            yield w.name, mx.array(w.x[i: i + per]), mx.array(w.y[i: i + per])


def _score(model, ref, windows: list[Windows], total: int, forget) -> Iterator:
    """Batched passes of whole windows."""
    batches = _batches(windows, windows[0].x.shape[1])
    return (yield from _scored(model, ref, batches, windows=windows, total=total, forget=forget,
                               logits=lambda m, x: m(x)))


def _score_decode(model, ref, windows: list[Windows], total: int, forget) -> Iterator:
    """One window at a time, token by token through a KV cache: each pass is one token, as in a chat's decode."""
    def one_by_one(m, x: mx.array) -> mx.array:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(m)
        out = []
        for t in range(x.shape[1]):
            out.append(m(x[:, t:t + 1], cache=cache))
            mx.eval(out[-1])
        return mx.concatenate(out, axis=1)

    rows = ((w.name, mx.array(w.x[i:i + 1]), mx.array(w.y[i:i + 1])) for w in windows for i in range(len(w.x)))
    return (yield from _scored(model, ref, rows, windows=windows, total=total, forget=forget, logits=one_by_one))


def _scored(model, ref, batches, windows: list[Windows], total: int, forget, logits) -> Iterator:
    """Sums per text over `batches` ((text, inputs, targets) each), `logits(model, inputs)` giving each model's."""
    t0, done = time.perf_counter(), 0
    sums: dict[str, list] = {w.name: [0, 0, 0.0, 0.0, 0.0, 0, 0.0, ()] for w in windows}  # tokens windows nll, ref:
    # nll kl top1 top5, per-window kl
    for name, x, y in batches:
        mine = logits(model, x)
        mx.eval(mine)  # one model's pass, then the other's: several ranks must run their collectives in one order
        s = window_sums(mine, y, logits(ref, x) if ref is not None else None)
        acc = sums[name]
        acc[0] += s.tokens
        acc[1] += int(x.shape[0])
        acc[2] += s.nll
        if s.kl is not None:
            acc[3] += s.ref_nll
            acc[4] += s.kl
            acc[5] += s.top1
            acc[6] += s.top5
            acc[7] += s.kl_windows
        done += s.tokens
        forget()
        yield EvalProgress(stage="score", done=done, total=total, elapsed_s=time.perf_counter() - t0)
    if ref is None:
        return [TextScore(name=name, tokens=a[0], windows=a[1], nll_sum=a[2]) for name, a in sums.items()]
    return [TextScore(name=name, tokens=a[0], windows=a[1], nll_sum=a[2], ref_nll_sum=a[3], kl_sum=a[4],
                      top1_agree=a[5], top5_overlap_sum=a[6], kl_windows=a[7]) for name, a in sums.items()]


def _greedy(model, ref, windows: list[Windows], request: EvalRequest, forget) -> Iterator:
    from mlx_lm.generate import generate_step

    prompts = []
    for i in range(max(len(w.x) for w in windows)):  # the texts' windows in turn: code, chat, code, ...
        prompts += [w.x[i, : request.prompt_tokens] for w in windows if i < len(w.x)]
    prompts = prompts[: request.prompts]
    total, t0 = len(prompts) * request.generate, time.perf_counter()  # tokens compared: each prompt's, once
    done, alike, same = 0, [], []

    def argmax(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    for p in prompts:
        outs = []
        for m in (model, ref):
            out = []
            for tok, _ in generate_step(mx.array(p), m, max_tokens=request.generate, sampler=argmax):
                out.append(int(tok))
            outs.append(out)
            done += request.generate // 2 if m is model else request.generate - request.generate // 2
            forget()
            yield EvalProgress(stage="greedy", done=done, total=total, elapsed_s=time.perf_counter() - t0)
        a, b = outs
        first = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
        alike.append(first)
        same.append(sum(u == v for u, v in zip(a, b)))
    return GreedyAgreement(prompts=len(prompts), generated=request.generate, alike=tuple(alike),
                           same_position=tuple(same))


def _layers(model, ref, windows: list[Windows], total: int, forget) -> Iterator:
    t0, done = time.perf_counter(), 0
    sums = None
    for _, x, _ in _batches(windows, windows[0].x.shape[1]):
        part = layer_errors(model, ref, x)
        sums = part if sums is None else [(a + c, b + d) for (a, b), (c, d) in zip(sums, part)]
        done += int(x.size)
        forget()
        yield EvalProgress(stage="layers", done=done, total=total, elapsed_s=time.perf_counter() - t0)
    out = []
    for i, (layer, (diff, norm)) in enumerate(zip(layer_list(model), sums)):
        attn, mlp = describe(layer)
        out.append(LayerError(layer=i, attention=attn, mlp=mlp, rel_error=(diff / norm) ** 0.5 if norm > 0 else 0.0))
    return out
