"""A checkpoint directory: config, shard headers (never tensor data), every tensor classified, missing shards."""

from __future__ import annotations

from itertools import chain
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tqbench.errors import CheckpointError, ExitCode
from tqbench.layout.quantization import ModuleQuant, QuantizationBlock
from tqbench.events import CheckpointOpened, ShardScanned
from tqbench.source.config import ModelConfig, read_config
from tqbench.source.index import ShardIndex, read_index
from tqbench.source.naming import Role, TensorName, classify
from tqbench.shards.header import DTYPE_SIZES, INDEX_FILE, ShardHeader, TensorSpec, read_header


# Quantization side tensors: they store scales and tables, not parameters.
_METADATA_PARAMS = {"weight_scale", "weight_scale_inv", "scales", "biases", "codebook", "signs", "weight_shape",
                    "weight_zero_point", "weight_global_scale", "input_global_scale"}


@dataclass(slots=True, eq=False, kw_only=True)
class Kind:
    """What one or many tensors are: every expert's tensor of one layer, projection and param in one shard shares one
    Kind. `name` is the classification (for per-expert tensors: expert 0's). `format` and `params` are filled in
    once, when the checkpoint has read every header (a module's side tensors may lie in another shard)."""

    name: TensorName
    dtype: str
    shape: tuple[int, ...]
    shard: str
    split: int = -1  # per-expert kinds: where the expert number goes in name.name
    format: str = ""  # storage format of the tensor's module: mxfp4, fp8, mlx-affine, mlx-mxfp4, turboquant, bf16...
    params: int = 0  # logical parameters one tensor stores (0 for scales and other side tensors)

    def tensor_name(self, expert: int | None) -> str:
        n = self.name.name
        return n if expert is None else f"{n[:self.split]}{expert}{n[self.split + 1:]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """One classified tensor: its shared Kind, its absolute offset in its shard and, for a per-expert tensor, the
    expert. Names and header entries are built when asked for, so a checkpoint of 82,432 experts (half a million
    tensors) holds one small record per tensor."""

    info: Kind
    offset: int
    expert: int | None = None

    @property
    def entry(self) -> TensorSpec:
        k = self.info
        return TensorSpec(name=k.tensor_name(self.expert), dtype=k.dtype, shape=k.shape, shard=k.shard,
                          offset=self.offset)

    @property
    def kind(self) -> TensorName:
        return self.info.name

    @property
    def format(self) -> str:
        return self.info.format

    @property
    def params(self) -> int:
        return self.info.params

    @property
    def name(self) -> TensorName:
        t = self.info.name
        if self.expert is None:
            return t
        module = t.module.replace(".experts.0.", f".experts.{self.expert}.", 1)
        return TensorName(name=self.info.tensor_name(self.expert), role=t.role, module=module, param=t.param,
                          layer=t.layer, expert=self.expert, stacked=t.stacked, projection=t.projection,
                          attention=t.attention)

    @property
    def nbytes(self) -> int:
        k = self.info
        return math.prod(k.shape) * DTYPE_SIZES[k.dtype]


@dataclass(frozen=True, kw_only=True)
class ShardSummary:
    """A shard as the checkpoint keeps it: its ShardHeader's facts, without its tensor entries (only their count)."""

    file: str
    path: Path
    file_size: int
    data_start: int  # 8 + header length
    metadata: dict[str, str]
    tensors: int  # how many


class IncompleteCheckpoint(CheckpointError):
    """Shards the index names are not there: what is present can be inspected, not run."""

    exit_code = ExitCode.INCOMPLETE


@dataclass(frozen=True, kw_only=True)
class MissingShard:
    file: str
    tensors: tuple[str, ...]  # what the index says lives there


@dataclass(frozen=True, kw_only=True)
class HubOrigin:
    """Where a checkpoint opened from the hub comes from, and what opening it fetched."""

    repo_id: str
    revision: str  # as asked: a branch, tag or commit ("main" when none was)
    commit: str  # what it resolved to
    endpoint: str
    fetched_bytes: int  # from the network by this open: shard headers and small files (not the API's listing)
    headers_cached: int  # shard headers read from tqbench's cache instead
    shards_local: int  # shards already downloaded into the Hugging Face cache (headers read from disk)

    @property
    def name(self) -> str:
        """The exact source: the repository at its commit."""
        return f"{self.repo_id}@{self.commit}"

    @property
    def label(self) -> str:
        """For display: the revision asked for and the commit it is."""
        short = self.commit[:12]
        return f"{self.repo_id}@{short}" if self.commit.startswith(self.revision) else \
            f"{self.repo_id}@{self.revision} ({short})"


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    path: Path  # the directory: for a hub checkpoint, its commit's folder in the Hugging Face cache
    config: ModelConfig
    shards: tuple[ShardSummary, ...]
    tensors: tuple[Tensor, ...]
    missing: tuple[MissingShard, ...]
    index_total_size: int | None  # bytes the index says the full checkpoint holds
    origin: HubOrigin | None = None  # set for a checkpoint on the hub: its shards may not be on disk

    @property
    def name(self) -> str:
        """How reports name the source: its directory, or the hub repository at its commit."""
        return self.origin.name if self.origin else str(self.path)

    @property
    def label(self) -> str:
        return self.origin.label if self.origin else str(self.path)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def present_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def scan_directory(path: str | Path) -> Iterator[ShardScanned | CheckpointOpened]:
    """A checkpoint directory's config and headers: a ShardScanned event per shard and finally CheckpointOpened
    (tqbench.source.opening also opens hub repositories)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError("not a directory" if root.exists() else "no such directory", root)
    config = read_config(root)
    index = read_index(root)
    files = shard_files(root, index)
    yield from assemble(root, config, shard_headers(root, index, files), len(files),
                        index.total_size if index else None)


def assemble(root: Path, config: ModelConfig, headers: Iterable[ShardHeader | MissingShard], count: int,
             index_total_size: int | None, origin: Callable[[], HubOrigin] | None = None,
             fetched: Callable[[], int] = lambda: 0, where: str | None = None,
             ) -> Iterator[ShardScanned | CheckpointOpened]:
    """The checkpoint from its config and its shards' validated headers, one ShardScanned per shard. `origin` gives
    a hub checkpoint's origin once every header is read; `fetched` the bytes fetched so far; errors name `where`
    (default: the directory)."""
    where = where or root
    table = _Table()
    shards, missing, tensors = [], [], []
    for i, header in enumerate(headers, 1):
        if isinstance(header, MissingShard):
            missing.append(header)
            continue
        tensors.extend(table.add(where, t) for t in header.tensors)
        shards.append(ShardSummary(file=header.file, path=header.path, file_size=header.file_size,
                                   data_start=header.data_start, metadata=header.metadata, tensors=len(header.tensors)))
        del header
        yield ShardScanned(index=i, total=count, file=shards[-1].file, tensors=shards[-1].tensors,
                           fetched_bytes=fetched())

    table.check_experts(where, config, (n for m in missing for n in m.tensors))
    table.resolve(config, f"{where}/config.json")
    yield CheckpointOpened(checkpoint=Checkpoint(path=root, config=config, shards=tuple(shards), tensors=tuple(tensors),
                                                 missing=tuple(missing), index_total_size=index_total_size,
                                                 origin=origin() if origin else None))


def shard_files(root: Path, index: ShardIndex | None) -> list[str]:
    """The shard files of a checkpoint: those its index names, else every *.safetensors file in it."""
    if index is not None:
        return sorted(index.files)
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors files: not a model checkpoint", root)
    return files


def shard_headers(root: Path, index: ShardIndex | None, files: list[str]) -> Iterator[ShardHeader | MissingShard]:
    """Each shard's validated header (read_header: JSON, dtypes, offsets, the file long enough for its tensors) and
    checked against the index; a MissingShard for a file the index names that is not there."""
    for file in files:
        if not (root / file).is_file():
            yield MissingShard(file=file, tensors=tuple(sorted(index.names(file))) if index else ())
            continue
        header = read_header(root / file, file)
        if index is not None and not index.matches(file, (t.name for t in header.tensors)):
            lost = index.missing_in(file, {t.name for t in header.tensors})
            if lost is not None:
                raise CheckpointError(f"index maps tensor {lost!r} to {file}, but that shard does not contain it",
                                      index.path)
        yield header


def check_shards(path: str | Path) -> None:
    """What a loader needs before it reads a byte (MLX's own loader stops with a traceback on a truncated shard or a
    garbage header): every shard present, each header valid, every tensor inside its file, the index right. Headers
    only, as `inspect` reads them. Raises CheckpointError, or IncompleteCheckpoint (exit 3) naming the missing
    shards."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) + [root / INDEX_FILE]
    seen = tuple((f.name, st.st_size, st.st_mtime_ns, st.st_ino) for f in files if (st := _stat(f)) is not None)
    if _checked.get(root.resolve()) == seen:
        return  # checked already, in this process, and not changed since (a chat checks before its plan and load)
    index = read_index(root)
    missing = [h for h in shard_headers(root, index, shard_files(root, index)) if isinstance(h, MissingShard)]
    if missing:
        names = ", ".join(m.file for m in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        tensors = sum(len(m.tensors) for m in missing)
        raise IncompleteCheckpoint(f"{len(missing)} shard(s) missing: {names} (the index puts {tensors:,} tensors "
                                   "there); it cannot run without them", root)
    _checked[root.resolve()] = seen


_checked: dict[Path, tuple] = {}  # directory -> its files' (name, size, mtime, inode) when check_shards passed


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")


class _Table:
    """The kinds of a checkpoint's tensors while its headers are read, one entry at a time: classification is done
    once per kind (K3 has 82,432 experts x 6 tensors), and nothing per tensor is kept but its Tensor."""

    def __init__(self) -> None:
        self.templates: dict[str, TensorName] = {}  # classification by name (per-expert: by expert 0's name)
        self.kinds: dict[tuple, Kind] = {}
        self.seen: dict[str, str] = {}  # shard by name, for tensors that are not per-expert
        self.experts_seen: dict[int, dict[str, bytearray]] = {}  # per template: shard -> experts seen (a bitmap)
        self.numbers: dict[int, int] = {}  # one object per expert number

    def add(self, root: str | Path, t: TensorSpec) -> Tensor:
        name, expert, split = self._classify(t.name)
        key = (id(name), t.dtype, t.shape, t.shard, split)
        k = self.kinds.get(key)
        if k is None:
            k = self.kinds[key] = Kind(name=name, dtype=t.dtype, shape=t.shape, shard=t.shard, split=split)
        if expert is None:
            first = self.seen.setdefault(t.name, t.shard)
            if first != t.shard:
                raise CheckpointError(f"tensor {t.name!r} appears in both {first} and {t.shard}", root)
        else:
            self._see_expert(root, t, name, expert)
            expert = self.numbers.setdefault(expert, expert)
        return Tensor(info=k, offset=t.offset, expert=expert)

    def _see_expert(self, root: Path, t: TensorSpec, name: TensorName, expert: int) -> None:
        seen = self.experts_seen.setdefault(id(name), {})  # shard -> bitmap of the experts it holds
        byte, bit = divmod(expert, 8)
        for shard, bits in seen.items():
            if byte < len(bits) and bits[byte] >> bit & 1:
                raise CheckpointError(f"tensor {t.name!r} appears in both {shard} and {t.shard}", root)
        bits = seen.setdefault(t.shard, bytearray())
        if byte >= len(bits):
            bits.extend(bytes(byte + 1 - len(bits)))
        bits[byte] |= 1 << bit

    def _classify(self, name: str) -> tuple[TensorName, int | None, int]:
        """(classification, expert, where the expert number is): per-expert names are classified by the name with
        their expert number as 0. A number written with leading zeros is kept whole (classified on its own)."""
        m = _EXPERT_NUMBER.search(name)
        if m and (m.group(1) == "0" or not m.group(1).startswith("0")):
            key = name[: m.start(1)] + "0" + name[m.end(1):]
            template = self.templates.get(key)
            if template is None:
                template = self.templates[key] = classify(key)
            if template.expert is not None:
                return template, int(m.group(1)), m.start(1)
        exact = self.templates.get(name)
        if exact is None:
            exact = self.templates[name] = classify(name)
        return exact, None, -1

    def check_experts(self, root: str | Path, config: ModelConfig, missing: Iterable[str]) -> None:
        """An MoE config whose tensors show no routed experts means naming we do not know: refuse loudly."""
        if not config.is_moe:
            return
        names = chain((k.name.name for k in self.kinds.values()), missing)
        if not any(classify(n).role is Role.ROUTED_EXPERT for n in names if "expert" in n or "switch_mlp" in n):
            raise CheckpointError(
                f"config.json declares {config.num_experts} routed experts per layer, but no tensor name was "
                "recognised as a routed expert (unknown expert naming)", root)

    def resolve(self, config: ModelConfig, config_file: str | Path) -> None:
        """Fill in every Kind's format and parameters, and the attention kind of layers' generic tensors."""
        kinds = list(self.kinds.values())
        # Attention kind is a property of the layer: o_proj of a KDA layer is KDA too. The config's kda_layers win.
        layer_kind: dict[int, str] = {}
        for k in kinds:
            n = k.name
            if n.role is Role.ATTENTION and n.attention != "generic" and n.layer is not None:
                layer_kind.setdefault(n.layer, n.attention)
        layer_kind.update({i: "kda" for i in config.kda_layers})
        # A module's tensors by param (for the experts of one layer and projection: expert 0's, as all are alike).
        modules: dict[str, dict[str, TensorSpec]] = defaultdict(dict)
        for k in kinds:
            modules[k.name.module].setdefault(k.name.param,
                                              TensorSpec(name=k.name.name, dtype=k.dtype, shape=k.shape, shard=k.shard))
        block = QuantizationBlock.from_config(config.quantization, config_file)
        resolved: dict[int, TensorName] = {}
        for k in kinds:
            n = k.name
            if n.role is Role.ATTENTION and n.attention == "generic" and n.layer in layer_kind:
                n = k.name = resolved.get(id(n)) or resolved.setdefault(id(n), replace(n, attention=layer_kind[n.layer]))
            parts = modules[n.module]
            entry = block.module(n.module) if block else None
            k.format = entry.format if entry else module_format(parts, config)
            k.params = _params(TensorSpec(name=n.name, dtype=k.dtype, shape=k.shape), n, parts, fmt=k.format,
                               config=config, entry=entry)


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
