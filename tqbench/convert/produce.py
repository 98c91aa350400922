"""Producing the bytes of planned output tensors from source tensors (on the one MLX thread).

A unit is one tensor or one routed expert (gate, up, down). Each module is decoded to float once per unit (for an
expert: only that expert's source bytes), quantized, and handed back as numpy arrays ready to write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import mlx.core as mx
import numpy as np

from tqbench.managed import default_prefetch
from tqbench.quant import turboquant as tq
from tqbench.quant.calibrate import quantize_calibrated
from tqbench.layout.shard_units import Piece, Unit
from tqbench.recipe.plan import ModulePlan
from tqbench.recipe.recipe import Format, Recipe
from tqbench.source.checkpoint import Checkpoint
from tqbench.source.reader import ShardReader, decode_fp8, decode_mxfp4
from tqbench.shards.header import TensorSpec

# Output param -> source param of copied per-expert mxfp4 tensors (the packed bytes are the MLX uint32 codes).
_MXFP4_SOURCE = {"weight": "weight_packed", "scales": "weight_scale"}
_INDEXED_MODULES = 16  # per-expert source modules whose tensor index is kept (a few layers' gate, up and down)


@dataclass(frozen=True, kw_only=True)
class Produced:
    piece: Piece
    data: np.ndarray
    source_bytes: int  # source bytes this piece consumed (counted once per module)
    rel_error: float | None  # relative quantization error of the piece's module (None: copied exactly)


def to_numpy(a: mx.array) -> np.ndarray:
    """An evaluated MLX array as numpy (a view of its memory), bf16 as its uint16 bit pattern. On CUDA its pages start
    moving to the host now, in bulk, ahead of the writer reading them."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    v = np.array(a, copy=False)
    default_prefetch().to_host(v)
    return v


class Producer:
    def __init__(self, ckpt: Checkpoint, recipe: Recipe, reader: ShardReader):
        self.recipe = recipe
        self.reader = reader
        # per-expert source modules' tensors by name, for the few modules being read ahead and converted
        self._names: OrderedDict[int, dict[str, TensorSpec]] = OrderedDict()
        block = (ckpt.config.quantization or {}).get("weight_block_size") or (128, 128)
        self.fp8_block = (int(block[0]), int(block[1]))
        self._last_key: tuple[int, int | None] | None = None
        self._last: tuple[dict[str, np.ndarray], int, float | None] | None = None
        # tqbench.convert.calibration.Statistics for a calibrated recipe (`cal`), set by the pipeline
        self.calibration = None

    # --- source access -------------------------------------------------------------------------------------------

    def source_parts(self, m: ModulePlan, expert: int | None) -> dict[str, TensorSpec]:
        """The module's source tensors by param, for one expert when `expert` is given."""
        s = m.source
        if expert is None or not s.experts:
            return {t.name.param: t.entry for t in s.tensors}
        if s.per_expert:
            module = m.expert_name(expert)  # the source's own per-expert name
            names = self._by_name(m)
            return {t.name.param: names[f"{module}.{t.name.param}"] for t in s.template}
        return {t.name.param: _slice(t.entry, expert, s.experts) for t in s.tensors}

    def _by_name(self, m: ModulePlan) -> dict[str, TensorSpec]:
        """A per-expert module's source tensors by name, indexed for the modules in use only (an index of every
        tensor would grow with the model). Reading ahead asks for the next layers' modules while this one's are
        converted, so the last few are kept: rebuilding an index at every switch cost more than the conversion."""
        names = self._names.get(id(m))
        if names is None:
            names = self._names[id(m)] = {t.entry.name: t.entry for t in m.source.tensors}
            if len(self._names) > _INDEXED_MODULES:
                self._names.popitem(last=False)
        else:
            self._names.move_to_end(id(m))
        return names

    def decode(self, parts: dict[str, TensorSpec], fmt: str) -> mx.array:
        """The module's weight as float32 (out, in)."""
        read = self.reader.read_mlx
        if fmt == "mxfp4":
            return decode_mxfp4(read(parts["weight_packed"]), read(parts["weight_scale"]))
        if fmt == "fp8":
            scale = parts.get("weight_scale_inv") or parts["weight_scale"]
            return decode_fp8(read(parts["weight"]), read(scale), self.fp8_block)
        return read(parts["weight"]).astype(mx.float32)

    # --- per module ----------------------------------------------------------------------------------------------

    def signs(self, m: ModulePlan, n: int) -> np.ndarray:
        """Rotation signs of a module; all +1 when it is stored unrotated (see `rotated`)."""
        if rotated(self.recipe, n):
            return tq.rotation_signs(m.name, n, self.recipe.seed)
        return np.ones(n, np.float16)

    def module_outputs(self, m: ModulePlan, expert: int | None) -> tuple[dict[str, np.ndarray], int, float | None]:
        """All output params of a module (for one expert), the source bytes read, and the relative error."""
        c = m.choice
        parts = self.source_parts(m, expert)
        nbytes = sum(e.nbytes for e in parts.values())
        if c.format in (Format.TURBOQUANT, Format.AFFINE):
            w = self.decode(parts, m.source.format)
            out: dict[str, np.ndarray] = {}
            if c.format is Format.TURBOQUANT:
                kind = "T" if c.ternary else str(c.bits)
                signs = self.signs(m, w.shape[-1])
                rot = mx.array(signs) if signs.min() < 0 else None
                # The codes the in-order pass chose (from these weights, and its H: routed experts' H is not kept),
                # else calibrated from the kept H (one pass), else nearest.
                kept = self.calibration.quantized(m.name, expert) if self.calibration is not None else None
                h = self.calibration.hessian(m.name, expert) if self.calibration is not None and kept is None else None
                if kept is not None:
                    q = kept
                elif h is not None:
                    w = self.calibration.weights(m.name, w)
                    q = quantize_calibrated(w, kind, c.group_size, rot, h, rule=self.recipe.scales)
                else:
                    q = tq.quantize(w, kind, c.group_size, rot, rule=self.recipe.scales)
                out = {"weight": to_numpy(q.weight), "scales": to_numpy(q.scales), "codebook": tq.codebook(kind),
                       "signs": signs}
                err = q.rel_error
            else:
                wq, scales, biases = mx.quantize(w.astype(mx.float16), group_size=c.group_size, bits=c.bits)
                w_hat = mx.dequantize(wq, scales, biases, group_size=c.group_size, bits=c.bits).astype(mx.float32)
                err_a = mx.sqrt(mx.sum((w_hat - w) ** 2) / mx.maximum(mx.sum(w * w), 1e-30))
                mx.eval(wq, scales, biases, err_a)
                out = {"weight": to_numpy(wq), "scales": to_numpy(scales), "biases": to_numpy(biases)}
                err = err_a.item()
            if "bias" in parts:
                out["bias"] = to_numpy(self.reader.read_mlx(parts["bias"]).astype(mx.float16))
            return out, nbytes, err
        # Copied exactly: kept tensors under their source names, mxfp4 experts as MLX uint32 codes + u8 scales.
        out = {}
        for param, e in parts.items():
            raw = self.reader.read_numpy(e)
            if param == "weight_packed" and m.source.format == "mxfp4":
                out["weight"] = raw.reshape(*raw.shape[:-1], -1, 4).view(np.uint32).reshape(*raw.shape[:-1], -1)
            else:
                out[{"weight_scale": "scales"}.get(param, param) if m.source.format == "mxfp4" else param] = raw
        return out, nbytes, None

    def shared(self, p: Piece) -> np.ndarray:
        """A routed-expert module's per-layer codebook or signs: constants of the recipe, no source bytes needed."""
        c = p.module.choice
        if p.param == "codebook":
            return tq.codebook("T" if c.ternary else str(c.bits))
        return self.signs(p.module, p.module.source.shape[1])

    def unit_reads(self, unit: Unit, after: Unit | None) -> list[tuple[TensorSpec, bool]]:
        """The source tensors `unit` will read when produced right after `after` (for prefetching), each with whether
        `decode` reads it (what quantized modules decode to float). A module that `after` ends with is still computed
        then, so its tensors are not read again."""
        last = after.pieces[-1] if after is not None else None
        seen, out = {(id(last.module), last.expert)} if last else set(), []
        for p in unit.pieces:
            key = (id(p.module), p.expert)
            if key not in seen and not shared_expert_piece(p):
                seen.add(key)
                decoded = p.module.choice.format in (Format.TURBOQUANT, Format.AFFINE)
                out.extend((e, decoded and param != "bias")
                           for param, e in self.source_parts(p.module, p.expert).items())
        return out

    def prefetch(self, unit: Unit, after: Unit | None) -> None:
        """Start reading `unit_reads(unit, after)`: what `decode` reads into MLX memory, the rest as bytes."""
        reads = self.unit_reads(unit, after)
        self.reader.prefetch_mlx([e for e, decoded in reads if decoded])
        self.reader.prefetch([e for e, decoded in reads if not decoded])

    def produce(self, unit: Unit) -> list[Produced]:
        """The unit's pieces. A module's outputs are computed once and kept until the next module: its tensors
        may span consecutive units (a quantized Linear's weight, scales, codebook and signs)."""
        results = []
        for p in unit.pieces:
            if shared_expert_piece(p):
                results.append(Produced(piece=p, data=self.shared(p), source_bytes=0, rel_error=None))
                continue
            key = (id(p.module), p.expert)
            first = self._last_key != key
            if first:
                self._last = None  # free the previous module's arrays first
                self._last = self.module_outputs(p.module, p.expert)  # evaluated: nothing pending reads its inputs
                self._last_key = key
                self.reader.discard(list(self.source_parts(p.module, p.expert).values()))  # unread side tensors
                self.reader.release()  # the arena regions it read may be filled again
            outputs, nbytes, err = self._last
            data = outputs[_output_key(p, outputs)]
            if data.nbytes != p.out.nbytes:
                raise AssertionError(f"{p.out.name}: produced {data.nbytes} bytes, planned {p.out.nbytes}")
            results.append(Produced(piece=p, data=data, source_bytes=nbytes if first else 0, rel_error=err))
        return results


def rotated(recipe: Recipe, n: int) -> bool:
    """Whether a TurboQuant module of input length n is rotated: the recipe rotates, and a Hadamard block divides
    n (the whole length, or blockwise as TurboQuant-MLX does: K3's 33,792-wide down_proj in blocks of 3072)."""
    return recipe.rotation and tq.rotation_block(n) is not None


def shared_expert_piece(p: Piece) -> bool:
    """A per-layer tensor that all experts of a routed module share (TurboQuant codebook and signs)."""
    return p.expert is None and bool(p.module.source.experts) and p.param in ("codebook", "signs")


def _output_key(p: Piece, outputs: dict[str, np.ndarray]) -> str:
    """Which produced array a piece is: its param, or for kept tensors its source tensor's param."""
    if p.param in outputs:
        return p.param
    return p.param.rpartition(".")[2]


def _slice(e: TensorSpec, i: int, n: int) -> TensorSpec:
    """Expert i of a stacked tensor with a leading expert axis of n."""
    per = e.nbytes // n
    return TensorSpec(name=f"{e.name}[{i}]", dtype=e.dtype, shape=e.shape[1:], shard=e.shard, offset=e.offset + i * per)

