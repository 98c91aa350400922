"""Will it fit: a plan's footprint against a machine's memory, GPU working-set limit and disk bandwidth.

Rules (docs/expert-streaming.md):
- resident: the whole model + a 3 GB reserve (1.1 GB runtime + 1.9 GB KV cache) fits under the GPU working-set limit;
- resident after raising the limit (macOS): it fits under the limit `sudo sysctl iogpu.wired_limit_mb=N` allows. The
  default Metal limit is estimated as TurboQuant-MLX measured it (66% of RAM up to 36 GB, 75% above); the raised limit
  is 90% of RAM while leaving the OS at least 1.5 GB (TurboQuant-MLX's planner rule);
- streaming (MoE only): non-expert weights + reserve + one layer's top-k experts fit; the expert cache gets
  the rest: budget = limit - resident bytes - 3 GB (TurboQuant-MLX's `--cache-budget-gb auto`);
- otherwise it does not fit. Dense models are resident or do not fit.
Disk bound: tok/s <= bandwidth / (MoE layers x K x bytes per expert x (1 - hit rate)). Without a given hit rate the
estimate is the fraction of experts the cache holds (uniform routing); real routing is skewed, so real hit rates are
higher. Everything here is a plain frozen value; sizes are bytes, GB = 10^9 and GiB = 2^30. The machine itself (its
memory, GPU limits and disk bandwidth) is tqbench/machine.py's.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from fractions import Fraction

from tqbench.errors import TqbenchError
from tqbench.machine import MiB, Machine

RUNTIME_RESERVE = 1_100_000_000
KV_RESERVE = 1_900_000_000
RESERVE = RUNTIME_RESERVE + KV_RESERVE


class Verdict(StrEnum):
    RESIDENT = "resident"
    RESIDENT_RAISED = "resident after raising the GPU wired limit"
    STREAMING = "streaming"
    NO_FIT = "does not fit"


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """What a converted model needs: all of it, the non-expert part, and the routed-expert pages."""

    total_bytes: int
    resident_bytes: int  # everything but routed-expert pages
    streamed_bytes: int  # routed-expert weight/scales, paged per expert
    moe_layers: int = 0
    top_k: int = 0
    bytes_per_expert: int = 0  # one expert's page in one layer (the largest layer's when they differ)

    @property
    def is_moe(self) -> bool:
        return self.streamed_bytes > 0


@dataclass(frozen=True, kw_only=True)
class Fit:
    verdict: Verdict
    memory_bytes: int
    gpu_limit_bytes: int
    limit_bytes: int  # the limit the verdict assumes (raised where that is the advice)
    reserve_bytes: int
    needed_bytes: int  # resident: total + reserve; streaming: resident + reserve + one layer's top-k experts
    wired_limit_mb: int | None  # N for `sudo sysctl iogpu.wired_limit_mb=N` when the advice is to raise it
    command: str | None
    cache_budget_bytes: int | None  # auto expert-cache budget (MoE models that fit only)
    top_k: int
    reduced_k: int
    bytes_per_token: int  # expert bytes one token reads at native top-k (0 for dense models)
    bytes_per_token_reduced: int  # at reduced_k
    hit_rate: float | None
    hit_rate_source: str  # given, cache fraction (uniform routing), resident, dense model, does not fit
    disk_bytes_per_s: float | None
    tok_s_ceiling: float | None  # disk-bound ceiling at top_k; None when not disk-bound or no bandwidth
    tok_s_ceiling_reduced: float | None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


# --- sizes -------------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]i?)?(b?)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """`512GB` -> 512 * 10^9, `64GiB` -> 64 * 2^30, `1.5TB`, `4096` (bytes). Exact: decimal arithmetic, and the result
    must be a whole number of bytes. K/M/G/T without `i` are decimal (SI), with `i` binary."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise TqbenchError(f"cannot read {text!r} as a size (examples: 512GB, 64GiB, 1.5TB, 4096)")
    unit = (m.group(2) or "").lower()
    value = Fraction(m.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise TqbenchError(f"size {text!r} is not a whole number of bytes")
    return int(value)


# --- the verdict ---------------------------------------------------------------------------------------------------

def assess(fp: Footprint, m: Machine, hit_rate: float | None = None, reduced_k: int | None = None) -> Fit:
    """The verdict, cache budget, bytes per token and disk-bound ceilings of one footprint on one machine."""
    if hit_rate is not None and not 0.0 <= hit_rate <= 1.0:
        raise TqbenchError(f"hit rate must be between 0 and 1, got {hit_rate}")
    top_k = fp.top_k if fp.is_moe else 0
    reduced = (reduced_k if reduced_k is not None else max(1, top_k // 2)) if fp.is_moe else 0
    if fp.is_moe and not 1 <= reduced <= max(top_k, 1):
        raise TqbenchError(f"reduced K must be between 1 and the native top-k {top_k}, got {reduced}")
    raised = max(m.gpu_limit_bytes, m.raisable_limit_bytes or 0)
    whole = fp.total_bytes + RESERVE
    streaming = fp.resident_bytes + RESERVE + top_k * fp.bytes_per_expert

    if whole <= m.gpu_limit_bytes:
        verdict, limit, needed = Verdict.RESIDENT, m.gpu_limit_bytes, whole
    elif whole <= raised:
        verdict, limit, needed = Verdict.RESIDENT_RAISED, raised, whole
    elif fp.is_moe and streaming <= raised:
        verdict, limit, needed = Verdict.STREAMING, raised, streaming
    else:
        verdict, limit, needed = Verdict.NO_FIT, raised, whole if not fp.is_moe else streaming
    wired = limit // MiB if verdict is not Verdict.NO_FIT and limit > m.gpu_limit_bytes else None
    command = f"sudo sysctl iogpu.wired_limit_mb={wired}" if wired else None

    budget = None
    if fp.is_moe and verdict is not Verdict.NO_FIT:
        budget = max(0, limit - fp.resident_bytes - RESERVE)
    per_token = fp.moe_layers * top_k * fp.bytes_per_expert
    per_token_reduced = fp.moe_layers * reduced * fp.bytes_per_expert
    if not fp.is_moe:
        hit, hit_source = None, "dense model"
    elif verdict is Verdict.NO_FIT:
        hit, hit_source = None, "does not fit"
    elif verdict in (Verdict.RESIDENT, Verdict.RESIDENT_RAISED):
        hit, hit_source = 1.0, "resident"
    elif hit_rate is not None:
        hit, hit_source = hit_rate, "given"
    else:
        hit, hit_source = min(1.0, (budget or 0) / fp.streamed_bytes), "cache fraction (uniform routing)"
    return Fit(verdict=verdict, memory_bytes=m.memory_bytes, gpu_limit_bytes=m.gpu_limit_bytes, limit_bytes=limit,
               reserve_bytes=RESERVE, needed_bytes=needed, wired_limit_mb=wired, command=command,
               cache_budget_bytes=budget, top_k=top_k, reduced_k=reduced, bytes_per_token=per_token,
               bytes_per_token_reduced=per_token_reduced, hit_rate=hit, hit_rate_source=hit_source,
               disk_bytes_per_s=m.disk_bytes_per_s, tok_s_ceiling=ceiling(m.disk_bytes_per_s, per_token, hit),
               tok_s_ceiling_reduced=ceiling(m.disk_bytes_per_s, per_token_reduced, hit))


def ceiling(disk_bytes_per_s: float | None, bytes_per_token: int, hit_rate: float | None) -> float | None:
    """Disk-bound tokens per second: bandwidth / (bytes per token x miss rate). None when nothing is read from disk
    (no experts, a hit rate of 1, or no bandwidth known)."""
    if not disk_bytes_per_s or not bytes_per_token or hit_rate is None or hit_rate >= 1.0:
        return None
    return disk_bytes_per_s / (bytes_per_token * (1.0 - hit_rate))


# ---- a long prompt, layer by layer (tqbench.runtime.prefill) ----------------------------------------------------------

LAYER_MAJOR_TOKENS = 16384  # a layer-by-layer window: the prompt tokens whose activations are held at once
PREFILL_CHUNK = 2048  # mlx-lm's prefill step: the tokens each chunk's attention runs at once


@dataclass(frozen=True, kw_only=True)
class PrefillBound:
    """How a streamed model processes a long prompt: layer by layer in windows of `window_tokens`, each routed expert
    read once per window, holding about `bytes_per_token` of activations per token of the window and each chunk's
    attention mask (one byte per token and key it may see)."""

    bytes_per_token: int
    window_tokens: int = LAYER_MAJOR_TOKENS
    chunk_tokens: int = PREFILL_CHUNK

    def held_bytes(self, tokens: int) -> int:
        """What a window of `tokens` holds beyond one chunk's processing: every token's activations, and every
        chunk's mask over the keys before it and its own, with half again for what these terms leave out (the
        demo measured 1.24x their sum at 5,999 tokens: tests/test_prefill.py)."""
        masks = sum(min(self.chunk_tokens, tokens - a) * min(a + self.chunk_tokens, tokens)
                    for a in range(0, tokens, self.chunk_tokens))
        return (self.bytes_per_token * tokens + masks) * 3 // 2

    @property
    def window_bytes(self) -> int:
        return self.held_bytes(self.window_tokens)

    def to_dict(self) -> dict:
        return {"activation_bytes_per_token": self.bytes_per_token, "window_tokens": self.window_tokens,
                "window_activation_bytes": self.window_bytes}


def prefill_bound(config: dict) -> PrefillBound:
    """The activations a layer-by-layer prefill holds per prompt token, in bf16: each chunk's hidden state between
    layers (with a K3's attention-residual snapshots, one per block of layers, and the layer's working copies), a MoE
    layer's input for every token (each chunk's and the joined copy) and its experts' outputs (k per token: joined,
    then split back). The experts' products themselves run one chunk's tokens at a time (tqbench.stream.streamer's
    ROWS_AT_ONCE), as chunk by chunk."""
    text = config.get("text_config") or config
    hidden = int(text.get("hidden_size") or 0)
    latent = int(text.get("routed_expert_hidden_size") or hidden)
    k = int(text.get("num_experts_per_token") or text.get("num_experts_per_tok") or 0)
    layers = int(text.get("num_hidden_layers") or 0)
    block = text.get("attn_res_block_size")
    snapshots = 1 + (-(-layers // int(block)) if block else 0)
    return PrefillBound(bytes_per_token=2 * hidden * (snapshots + 2) + 2 * 2 * latent + 2 * 2 * k * latent)
