"""A checkpoint directory: config, shard headers (never tensor data), every tensor classified, missing shards."""

from __future__ import annotations

from itertools import chain
import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

from tqbench.errors import CheckpointError
from tqbench.layout.quantization import ModuleQuant, QuantizationBlock
from tqbench.events import CheckpointOpened, ShardScanned
from tqbench.source.config import ModelConfig, read_config
from tqbench.source.index import read_index
from tqbench.source.naming import Role, TensorName, classify
from tqbench.shards.header import INDEX_FILE, ShardHeader, TensorSpec, read_header


# Quantization side tensors: they store scales and tables, not parameters.
_METADATA_PARAMS = {"weight_scale", "weight_scale_inv", "scales", "biases", "codebook", "signs", "weight_shape",
                    "weight_zero_point", "weight_global_scale", "input_global_scale"}


@dataclass(frozen=True, slots=True)
class Tensor:
    """One classified tensor. A per-expert tensor (`experts.E.w1.weight_packed`) keeps the classification it shares
    with every expert of its layer and projection, plus its expert number: `name` is built when asked for, so a
    checkpoint of 82,432 experts does not hold half a million classifications."""

    entry: TensorSpec
    kind: TensorName  # the classification (for a per-expert tensor: expert 0's)
    format: str  # storage format of the tensor's module: mxfp4, fp8, mlx-affine, mlx-mxfp4, turboquant, bf16, ...
    params: int  # logical parameters it stores (0 for scales and other side tensors)
    expert: int | None = None  # per-expert tensors: the expert

    @property
    def name(self) -> TensorName:
        t = self.kind
        if self.expert is None:
            return t
        module = t.module.replace(".experts.0.", f".experts.{self.expert}.", 1)
        return TensorName(self.entry.name, t.role, module, t.param, t.layer, self.expert, t.stacked, t.projection,
                          t.attention)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


@dataclass(frozen=True)
class MissingShard:
    file: str
    tensors: tuple[str, ...]  # what the index says lives there


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    shards: tuple[ShardHeader, ...]
    tensors: tuple[Tensor, ...]
    missing: tuple[MissingShard, ...]
    index_total_size: int | None  # bytes the index says the full checkpoint holds

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def present_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's config and headers. Raises CheckpointError (one line, naming the file) on bad input."""
    for event in scan_checkpoint(path):
        if isinstance(event, CheckpointOpened):
            return event.checkpoint
    raise AssertionError("scan_checkpoint ended without a checkpoint")


def scan_checkpoint(path: str | Path) -> Iterator[ShardScanned | CheckpointOpened]:
    """Like open_checkpoint, yielding a ShardScanned event per shard and finally CheckpointOpened."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError("not a directory" if root.exists() else "no such directory", root)
    config = read_config(root)
    index = read_index(root)
    if index is None:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors files: not a model checkpoint", root)
    else:
        files = sorted(index.files)

    shards, missing = [], []
    for i, file in enumerate(files, 1):
        if not (root / file).is_file():
            missing.append(MissingShard(file, tuple(sorted(index.names(file)))))
            continue
        header = read_header(root / file, file)
        if index is not None and not index.matches(file, (t.name for t in header.tensors)):
            lost = index.missing_in(file, {t.name for t in header.tensors})
            if lost is not None:
                raise CheckpointError(f"index maps tensor {lost!r} to {file}, but that shard does not contain it",
                                      index.path)
        shards.append(header)
        yield ShardScanned(i, len(files), file, len(header.tensors))

    entries = [t for h in shards for t in h.tensors]
    seen: set[str] = set()
    for t in entries:
        if t.name in seen:
            first = next(e.shard for e in entries if e.name == t.name)
            raise CheckpointError(f"tensor {t.name!r} appears in both {first} and {t.shard}", root)
        seen.add(t.name)
    del seen

    _check_experts(root, config, chain((t.name for t in entries), (n for m in missing for n in m.tensors)))
    tensors = _classify_all(entries, config)
    yield CheckpointOpened(Checkpoint(root, config, tuple(shards), tensors, tuple(missing),
                                      index.total_size if index else None))


def _check_experts(root: Path, config: ModelConfig, names: Iterable[str]) -> None:
    """An MoE config whose tensors show no routed experts means naming we do not know: refuse loudly."""
    if not config.is_moe:
        return
    if not any(classify(n).role is Role.ROUTED_EXPERT for n in names if "expert" in n or "switch_mlp" in n):
        raise CheckpointError(
            f"config.json declares {config.num_experts} routed experts per layer, but no tensor name was "
            "recognised as a routed expert (unknown expert naming)", root)


def _classify_all(entries: list[TensorSpec], config: ModelConfig) -> tuple[Tensor, ...]:
    templates: dict[str, TensorName] = {}
    kinds = [_classify_cached(t.name, templates) for t in entries]
    # Attention kind is a property of the layer: o_proj of a KDA layer is KDA too. The config's kda_layers win.
    layer_kind: dict[int, str] = {}
    for n, _ in kinds:
        if n.role is Role.ATTENTION and n.attention != "generic" and n.layer is not None:
            layer_kind.setdefault(n.layer, n.attention)
    layer_kind.update({i: "kda" for i in config.kda_layers})
    block = QuantizationBlock.from_config(config.quantization)
    # A module's tensors by param (for the experts of one layer and projection: the first expert's, as all are alike).
    modules: dict[str, dict[str, TensorSpec]] = defaultdict(dict)
    for t, (n, _) in zip(entries, kinds):
        modules[n.module].setdefault(n.param, t)

    out = []
    shared: dict[object, object] = {}  # one object per distinct int (params, expert numbers)
    for t, (n, expert) in zip(entries, kinds):
        if n.role is Role.ATTENTION and n.attention == "generic" and n.layer in layer_kind:
            n = replace(n, attention=layer_kind[n.layer])
        parts = modules[n.module]
        entry = block.module(n.module) if block else None
        fmt = entry.format if entry else module_format(parts, config)
        params = _params(t, n, parts, fmt, config, entry)
        out.append(Tensor(t, n, fmt, shared.setdefault(params, params), shared.setdefault(expert, expert)))
    return tuple(out)


_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


def _classify_cached(name: str, templates: dict[str, TensorName]) -> tuple[TensorName, int | None]:
    """classify(), memoised for per-expert names by the name with its expert number blanked (K3 has 82,432 experts
    x 6 tensors): (the classification of expert 0's name, the expert), or (classify(name), None)."""
    m = _EXPERT_NUMBER.search(name)
    if not m:
        return classify(name), None
    key = name[: m.start(1)] + "0" + name[m.end(1) :]
    template = templates.get(key)
    if template is None:
        template = templates[key] = classify(key)
    if template.expert is None:
        return classify(name), None
    return template, int(m.group(1))


def module_format(parts: dict[str, TensorSpec], config: ModelConfig) -> str:
    """The storage format of one module from the side tensors next to its weight."""
    w = parts.get("weight")
    if "weight_packed" in parts:
        scale = parts.get("weight_scale")
        fmt = str((config.quantization or {}).get("format", ""))
        if "nvfp4" in fmt or "weight_global_scale" in parts:
            return "nvfp4"
        if "mxfp4" in fmt or (scale is not None and scale.dtype == "U8"):
            return "mxfp4"
        return "compressed-tensors"
    if w is None:
        first = next(iter(parts.values()))
        return first.dtype.lower()
    if w.dtype.startswith("F8"):
        return "fp8"
    if w.dtype == "U32" and "codebook" in parts:
        return "turboquant"
    if w.dtype == "U32" and "scales" in parts:
        return "mlx-affine" if "biases" in parts else f"mlx-{_mlx_mode(parts)}"
    return w.dtype.lower()


def _mlx_mode(parts: dict[str, TensorSpec]) -> str:
    return "mxfp4" if parts["scales"].dtype == "U8" else "quantized"


def _params(t: TensorSpec, n: TensorName, parts: dict[str, TensorSpec], fmt: str, config: ModelConfig,
            entry: ModuleQuant | None = None) -> int:
    if n.param in _METADATA_PARAMS:
        return 0
    if entry is not None and n.param == "weight" and "scales" in parts:  # a tqbench output: the config has g
        return math.prod(t.shape[:-1]) * parts["scales"].shape[-1] * entry.group_size
    if fmt in ("mxfp4", "nvfp4") and n.param == "weight_packed":
        return t.numel * 2  # two 4-bit codes per byte
    if fmt in ("mlx-affine", "mlx-mxfp4", "mlx-quantized") and n.param == "weight":
        group = 32 if fmt == "mlx-mxfp4" else int((config.quantization or {}).get("group_size", 64))
        return math.prod(t.shape[:-1]) * parts["scales"].shape[-1] * group
    if fmt == "turboquant" and n.param == "weight" and "signs" in parts:
        return math.prod(t.shape[:-1]) * parts["signs"].shape[-1]
    return t.numel
