"""Loading a model to run: the architecture from mlx-lm by model_type, with TurboQuant modules swapped in.

Every checkpoint goes through mlx-lm's own loader (`mlx_lm.utils.load_model`: weights, the family's sanitize,
MLX's quantized layers for affine / mxfp4 / compressed-tensors). What tqbench adds is one step inside sanitize: every
module that has a `codebook` becomes a TurboQuant module (tqbench.runtime.layers) whose bits come from the codebook's
length, group size from `in / scales.shape[-1]` and rotation from the module's recorded rotation (tqbench's block) or
its stored signs (TurboQuant-MLX's builds). Our streaming layout's per-expert TurboQuant tensors are stacked here
(`_take_experts`), not by the family's sanitize, which may stack only the tensors it knows (qwen3_moe: `weight`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from tqbench.errors import CheckpointError
from tqbench.layout.names import mlx_module_path
from tqbench.layout.quantization import QuantizationBlock
from tqbench.quant.turboquant import hadamard_ok, rotation_block
from tqbench.runtime.layers import TurboQuantConcat, TurboQuantLinear, TurboQuantSwitchLinear
from tqbench.source.checkpoint import check_shards
from tqbench.source.config import read_config_json
from tqbench.source.naming import PROJECTIONS

TRUSTED_TYPES = ("kimi_k3",)  # model types whose local tokenizer code is run without asking
_TQ_PARAMS = (".codebook", ".signs")
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_TQ_TENSORS = ("weight", "scales", "codebook", "signs", "bias")
# Modules an mlx-lm family concatenates along the output axis in its sanitize: fused name -> the source's parts.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
_PER_EXPERT = re.compile(r"(?P<moe>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<param>weight|scales|bias)")


class LoadError(CheckpointError):
    """A model directory that cannot be run."""


@dataclass(kw_only=True)
class Loaded:
    model: nn.Module
    tokenizer: Any  # mlx_lm's TokenizerWrapper
    config: dict[str, Any]
    path: Path
    model_type: str
    turboquant_modules: int  # stored TurboQuant modules (each part of a fused module counts)
    weight_bytes: int  # bytes of every resident parameter (streamed experts' slot pools not included)
    streamer: Any = None  # tqbench.stream.Streamer when routed experts are streamed
    pipeline: Any = None  # tqbench.distributed.world.Pipeline: this rank's layers, when several ranks run the model

    @property
    def generation_config(self) -> dict[str, Any]:
        p = self.path / "generation_config.json"
        try:
            return json.loads(p.read_text()) if p.is_file() else {}
        except (OSError, json.JSONDecodeError):
            return {}


def model_type(config: dict[str, Any]) -> str:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return str(config.get("model_type") or text.get("model_type") or "")


def needs_remote_code(path: Path) -> bool:
    """Whether the directory's tokenizer (or model) is Python code that ships with it (an `auto_map`)."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            doc = json.loads((path / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("auto_map"):
            return True
    return False


def looks_like_hub_id(given: str) -> bool:
    """`owner/name`: what a hub id looks like, not a path someone typed (`/abs/dir`, `./dir`, `~/dir`, `a/b/c`)."""
    return given.count("/") == 1 and not given.startswith(("/", ".", "~")) and all(given.split("/"))


def trust_decision(given: str, trust_remote_code: bool) -> bool:
    """The trust rule for code that ships with a model: an explicit --trust-remote-code, or a local directory the user
    named whose config says kimi_k3 (Moonshot's tokenizer is such code). Anything else that needs code is refused:
    raises LoadError. Returns whether to let the tokenizer loader run that code."""
    path = Path(given).expanduser()
    if path.exists() and not path.is_dir():
        raise LoadError("not a directory (give the model's directory)", given)
    if not path.is_dir() and not looks_like_hub_id(str(given)):
        raise LoadError("no such model directory", given)
    if not path.is_dir():
        if not trust_remote_code:
            raise LoadError("not a local model directory; a hub model id would run code from the hub, so it is only "
                            "used with --trust-remote-code", given)
        return True
    if trust_remote_code:
        return True
    config = _read_config(path)
    if not needs_remote_code(path):
        return False
    if model_type(config) in TRUSTED_TYPES:
        return True
    raise LoadError(f"its tokenizer is Python code shipped with the model (model_type {model_type(config)!r}); "
                    "pass --trust-remote-code to run it", path)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return read_config_json(path)
    except CheckpointError as e:  # the same line, as a model that cannot be run
        raise LoadError(e.message, e.path) from None


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Library chatter that means nothing to a user (transformers' "You are using a model of type kimi_k3 to
    instantiate a model of type ..." on every load) stays off the screen."""
    loggers = [logging.getLogger(n) for n in ("transformers", "huggingface_hub", "mlx_lm")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def preflight(given: str | Path, trust_remote_code: bool = False) -> tuple[Path, dict[str, Any], bool]:
    """Everything about a model directory that is checked before MLX reads a byte of it, in the order a user meets
    it: the trust rule, a directory, its config, an architecture mlx-lm has, weight files, and every shard's header
    and length (check_shards; once per process while the files are unchanged). Returns (directory, config, whether
    the tokenizer may run shipped code). Raises LoadError or CheckpointError with one line."""
    import mlx_lm.utils as mu

    trust = trust_decision(str(given), trust_remote_code)
    path = Path(given).expanduser()
    if not path.is_dir():
        raise LoadError("not a local model directory (tqbench runs local checkpoints only)", given)
    config = _read_config(path)
    try:
        mu._get_classes(config)
    except ValueError:
        raise LoadError(f"mlx-lm {_mlx_lm_version()} has no architecture for model_type {model_type(config)!r}",
                        path) from None
    if not any(path.glob("model*.safetensors")):
        raise LoadError("no model*.safetensors weight files", path)
    check_shards(path)
    return path, config, trust


def load(given: str | Path, trust_remote_code: bool = False, *, lazy: bool = False, streaming: Any = None,
         store: Any = None, tokenizer: bool = True, group: Any = None, parallel: str = "pipeline") -> Loaded:
    """Load a model directory (tqbench conversion, TurboQuant-MLX build, MLX or source checkpoint) with its tokenizer.
    `streaming` (a tqbench.stream.StreamConfig) keeps routed experts on disk: they are swapped for streamed ones
    before any stacked expert array is evaluated; `store`, the model's ExpertStore where the caller has read it
    already (tqbench.chat.stream_plan), is streamed from instead of reading its layout again. `tokenizer=False` skips the tokenizer (benchmarks that feed token
    ids; Loaded.tokenizer is then None). `group` (MLX's distributed group, tqbench.distributed.world.join): this
    rank keeps only its pipeline layers, and streams only their experts; with `parallel` "tensor" it keeps a slice of
    every layer instead (tqbench.distributed.tensor), its experts resident. Must run on the engine's MLX thread. Raises
    LoadError (or tqbench.stream.StoreError) with one line naming the directory and the problem."""
    import mlx_lm.utils as mu

    from tqbench.cubin import keep_mlx_kernels

    keep_mlx_kernels()
    path, config, trust = preflight(given, trust_remote_code)
    tensor = group is not None and parallel == "tensor"
    if tensor and streaming is not None:
        from tqbench.distributed.tensor import refuse_streaming

        raise refuse_streaming()
    rotations = _recorded_rotations(config, path / "config.json")
    swapped: list[str] = []

    def classes(config: dict[str, Any]):
        model_class, args_class = mu._get_classes(config)
        return _with_turboquant(model_class, path, rotations, swapped), args_class

    overrides = {}
    if isinstance(config.get("quantization"), dict):
        overrides["quantization"] = _without_turboquant(config["quantization"])
    with quiet_libraries():
        try:
            model, config = mu.load_model(path, lazy=True, model_config=overrides, get_model_classes=classes)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise LoadError(f"mlx-lm cannot build the model ({_one_line(e)})", path) from None
        pipeline = None
        if tensor:
            from tqbench.distributed.tensor import shard

            pipeline = shard(group, model)  # before any weight is evaluated: a rank keeps its slices only
        elif group is not None:
            from tqbench.distributed.world import split

            pipeline = split(group, model)  # before any weight is evaluated: the others' layers are never read
        streamer = _stream(model, path, streaming, pipeline, store) if streaming is not None else None
        if not lazy:
            mx.eval(model.parameters())
        if not tokenizer:
            tok = None
        elif not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise LoadError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)", path)
        else:
            try:
                tok = mu.load_tokenizer(path, {"trust_remote_code": trust}, eos_token_ids=config.get("eos_token_id"))
            except (ValueError, OSError) as e:  # transformers: no tokenizer files, a broken tokenizer.json, ...
                raise LoadError(f"cannot load its tokenizer ({_one_line(e)})", path) from None
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return Loaded(model=model, tokenizer=tok, config=config, path=path, model_type=model_type(config),
                  turboquant_modules=len(swapped), weight_bytes=nbytes, streamer=streamer, pipeline=pipeline)


def _stream(model: nn.Module, path: Path, config: Any, pipeline: Any = None, store: Any = None):
    from tqbench.stream.attach import attach
    from tqbench.stream.store import ExpertStore
    from tqbench.stream.streamer import Streamer

    store = store if store is not None else ExpertStore.open(path)
    if pipeline is not None:
        store = store.only(pipeline.holds)
        if not store.layers:  # this rank's layers have no routed experts: nothing to stream
            store.close()
            return None
    streamer = Streamer(store, config)
    attach(model, streamer)
    return streamer


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _without_turboquant(quant: dict[str, Any]) -> dict[str, Any]:
    """The quantization block as mlx-lm's quantize step should see it: defaults plus per-module entries of MLX's own
    modes (TurboQuant modules are swapped before that step and have no `to_quantized`)."""
    out: dict[str, Any] = {"group_size": int(quant.get("group_size") or 64), "bits": int(quant.get("bits") or 4),
                           "mode": quant.get("mode") if quant.get("mode") not in (None, "turboquant") else "affine"}
    for k, v in quant.items():
        if isinstance(v, dict) and "bits" in v and v.get("mode") not in (None, "turboquant"):
            out[k] = v
    return out


def _recorded_rotations(config: dict[str, Any], config_file: Path) -> dict[str, int | None]:
    """mlx-lm module path -> rotation block, for TurboQuant modules whose rotation the config records (tqbench)."""
    block = QuantizationBlock.from_config(config.get("quantization"), config_file)
    if block is None:
        return {}
    out = {}
    for name, q in block.modules.items():
        if q.format == "turboquant" and q.rotation is not None:
            out[mlx_module_path(name)] = q.rotation.get("block") if q.rotation.get("kind") != "none" else None
    return out


def _with_turboquant(model_class: type, path: Path, rotations: dict[str, int | None], swapped: list[str]) -> type:
    """model_class whose sanitize also turns every module with a codebook into a TurboQuant module."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        fused = _take_fused(self, weights)
        side = _take_experts(weights, path)
        side.update({k: weights.pop(k) for k in list(weights) if k.endswith(_TQ_PARAMS)})
        if hasattr(model_class, "sanitize"):
            weights = model_class.sanitize(self, weights)
        _place_router_bias(self, weights)
        for k, v in side.items():
            module, _, param = k.rpartition(".")
            weights[f"{_mlx_path(module, self)}.{param}"] = v
        weights.update(fused)
        swapped.extend(swap_turboquant(self, weights, rotations, path))
        return weights

    return type(model_class.__name__, (model_class,), {"sanitize": sanitize})


def _place_router_bias(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """TurboQuant-MLX's K3 port keeps the router's score correction under the gate (`mlp.gate.e_score_correction_bias`,
    docs/turboquant.md), mlx-lm's kimi_k3 on the MoE block (`mlp.e_score_correction_bias`): moved to where the model
    has it, when only the other name exists in the model."""
    suffix = ".gate.e_score_correction_bias"
    keys = [k for k in weights if k.endswith(suffix)]
    if not keys:
        return
    params = dict(tree_flatten(model.parameters()))
    for k in keys:
        alt = k[: -len(suffix)] + ".e_score_correction_bias"
        if k not in params and alt in params and alt not in weights:
            weights[alt] = weights.pop(k)


def _take_experts(weights: dict[str, mx.array], path: Path) -> dict[str, mx.array]:
    """Our streaming layout's per-expert TurboQuant tensors (`<moe>.experts.E.<proj>.{weight,scales,bias}` next to one
    `<moe>.switch_mlp.<proj>_proj.{codebook,signs}`), taken out of `weights` and stacked in expert order under the
    switch_mlp name. Not left to the family's sanitize: qwen3_moe's, for one, stacks only `weight`, so the scales stayed
    per expert and the module had "no scales tensor"."""
    if not any(k.endswith(".codebook") and ".switch_mlp." in k for k in weights):
        return {}
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for k in weights:
        m = _PER_EXPERT.fullmatch(k)
        if m is None or m["proj"] not in PROJECTIONS:
            continue
        stacked = f"{m['moe']}.switch_mlp.{PROJECTIONS[m['proj']]}_proj"
        if f"{stacked}.codebook" in weights:
            groups.setdefault((stacked, m["param"]), {})[int(m["e"])] = k
    out = {}
    for (stacked, param), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            missing = sorted(set(range(max(keys) + 1)) - set(keys))
            raise LoadError(f"TurboQuant module {stacked}: no {param} tensor for experts {missing}", path)
        out[f"{stacked}.{param}"] = mx.stack([weights.pop(keys[e]) for e in range(len(keys))])
    return out


def _take_fused(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """TurboQuant parts of a module the family fuses (KDA's q/k/v -> qkv_proj), taken out of `weights` before the
    family's sanitize would concatenate their codes, and renamed `<fused>.parts.<i>.<param>`."""
    modules = dict(model.named_modules())
    out = {}
    for key in [k for k in weights if k.endswith(".codebook")]:
        mp = _mlx_path(key[: -len(".codebook")], model)
        parent, _, leaf = mp.rpartition(".")
        for fused, parts in FUSED.items():
            if leaf in parts and mp not in modules and f"{parent}.{fused}" in modules:
                src = key[: -len(".codebook")]
                i = parts.index(leaf)
                for t in _TQ_TENSORS:
                    if f"{src}.{t}" in weights:
                        out[f"{parent}.{fused}.parts.{i}.{t}"] = weights.pop(f"{src}.{t}")
    return out


def _mlx_path(module: str, model: nn.Module) -> str:
    """A side tensor's module path in the model: mlx-lm's renaming, with and without a `language_model.` prefix."""
    mapped = mlx_module_path(module)
    modules = dict(model.named_modules())
    for candidate in (mapped, module):
        if candidate in modules:
            return candidate
    return mapped


def swap_turboquant(model: nn.Module, weights: dict[str, mx.array], rotations: dict[str, int | None],
                    path: Path) -> list[str]:
    """Replace each module that has `<path>.codebook` in `weights` by a TurboQuant module shaped from its tensors.
    Returns the stored TurboQuant modules' paths."""
    modules = dict(model.named_modules())
    new = []
    for key in sorted(k for k in weights if k.endswith(".codebook")):
        p = key[: -len(".codebook")]
        head, sep, tail = p.rpartition(".parts.")
        old = modules.get(p) or (modules.get(head) if sep and tail.isdigit() else None)
        if old is None:
            raise LoadError(f"tensor {key}: the {type(model).__module__.rsplit('.', 1)[-1]} architecture has no module "
                            f"{p}", path)
        try:
            weight, scales, signs, book = (weights[f"{p}.{n}"] for n in ("weight", "scales", "signs", "codebook"))
        except KeyError as e:
            raise LoadError(f"TurboQuant module {p} has a codebook but no {e.args[0].rsplit('.', 1)[-1]} tensor",
                            path) from None
        n, levels = signs.shape[0], book.shape[0]
        if n % scales.shape[-1]:
            raise LoadError(f"tensor {p}.scales: {scales.shape[-1]} groups do not divide the input width {n}", path)
        group = n // scales.shape[-1]
        block = rotations[p] if p in rotations else _rotation_from_signs(signs)
        if block is not None and (n % block or not hadamard_ok(block)):
            raise LoadError(f"module {p}: the recorded rotation block {block} does not rotate its input width {n}",
                            path)
        bias = f"{p}.bias" in weights
        try:
            if weight.ndim == 3:
                m = TurboQuantSwitchLinear(n, scales.shape[-2], weight.shape[0], levels=levels, group_size=group,
                                           block=block, bias=bias)
            else:
                m = TurboQuantLinear(n, scales.shape[-2], levels, group_size=group, block=block, bias=bias)
        except ValueError as e:
            raise LoadError(f"tensor {key}: {e}", path) from None
        if m.weight.shape != weight.shape:
            raise LoadError(f"tensor {p}.weight has shape {tuple(weight.shape)}, but {levels} levels over {n} inputs "
                            f"pack to {tuple(m.weight.shape)}", path)
        expected = None if sep and tail.isdigit() else _linear_shape(old)
        if expected is not None and expected != (scales.shape[-2], n):
            raise LoadError(f"module {p}: the architecture expects (out, in) = {expected}, the checkpoint has "
                            f"{(scales.shape[-2], n)}", path)
        want = old.get("weight").shape[0] if weight.ndim == 3 and old.get("weight") is not None else None
        if want is not None and want != weight.shape[0]:  # a router could pick an expert that is not there
            raise LoadError(f"module {p}: the architecture has {want} experts, the checkpoint {weight.shape[0]}", path)
        new.append((p, m))
    stored = [p for p, _ in new]  # every stored TurboQuant module (fused parts each count)
    new = _group_parts(new, modules, path)
    if new:
        model.update_modules(tree_unflatten(new))
    return stored


def _group_parts(new: list[tuple[str, nn.Module]], modules: dict[str, nn.Module],
                 path: Path) -> list[tuple[str, nn.Module]]:
    """`<fused>.parts.<i>` modules become one TurboQuantConcat at `<fused>`, parts in order."""
    out, groups = [], {}
    for p, m in new:
        head, sep, tail = p.rpartition(".parts.")
        if sep and tail.isdigit() and head in modules:
            groups.setdefault(head, {})[int(tail)] = m
        else:
            out.append((p, m))
    for head, parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise LoadError(f"module {head}: TurboQuant parts {sorted(parts)} are not all present", path)
        out.append((head, TurboQuantConcat([parts[i] for i in range(len(parts))])))
    return out


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    w = module.get("weight") if isinstance(module, nn.Module) else None
    if w is None or w.ndim < 2:
        return None
    if isinstance(module, (nn.QuantizedLinear,)) or "scales" in module:
        return None
    return (w.shape[-2], w.shape[-1])


def _rotation_from_signs(signs: mx.array) -> int | None:
    """A build that records no rotation (TurboQuant-MLX): all +1 signs mean none, else the largest block."""
    if bool(mx.all(signs == 1).item()):
        return None
    return rotation_block(signs.shape[0])
