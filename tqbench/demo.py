"""The built-in demo model: a tiny Kimi K3 in the layout of Moonshot's HF release.

Same config keys, tensor names, dtypes and mxfp4 compressed-tensors experts as the real checkpoint, so every tool can be
tried on it and `mlx_lm.load` runs it. Two kinds share one writer (`write_checkpoint`, which takes a weights source):

- the shipped demo (`tqbench/demo_model/`, copied into the user cache by `ensure_demo`): trained on the Python standard
  library's own source by `scripts/train_demo.py` (see docs/demo-model.md); its weights come from an mlx-lm model's
  parameters through `mlx_weights`;
- seeded random checkpoints of any `DemoSpec` (`write_source`, for tests and scaled-up benchmark models): each tensor
  from its own seed, so the files are byte-identical for a given spec and seed.

Names, shapes and dtypes come from `tqbench.skeleton` (the K3 layout): routed experts U8 (mxfp4), `A_log`, `dt_bias`
and `e_score_correction_bias` F32, everything else BF16. This module never imports MLX.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from tqbench.paths import cache_dir
from tqbench.quant.mxfp4 import pack_mxfp4
from tqbench.layout.names import shard_file
from tqbench.skeleton import K3_TEXT_CONFIG, k3_tensor_specs
from tqbench.tokenizer import NAMED_SPECIAL, NUM_SPECIAL, train_bpe, write_tokenizer
from tqbench.shards.header import TensorSpec
from tqbench.shards.writer import ShardWriter, to_bf16

DEMO_VERSION = 2  # bump whenever the default demo's bytes change: the cached copy is found by this name
SHIPPED_DEMO = Path(__file__).parent / "demo_model"  # the trained demo checkpoint inside the package

# A weights source: the data of one tensor of the plan, in its file dtype (bf16 as uint16 bits, experts as U8).
WeightSource = Callable[[TensorSpec], np.ndarray]

# The demo tokenizer's training text: a little prose and a little Python, fixed forever for a given DEMO_VERSION.
DEMO_CORPUS = """\
Kimi K3 is a mixture of experts. Each token is routed to a few experts out of many, so most of the weights sit
idle for any one token. The experts are stored in mxfp4: two four-bit codes per byte and one shared scale for
every thirty-two weights. The attention alternates between linear attention (Kimi Delta Attention) and multi-head
latent attention every fourth layer, and attention residuals mix snapshots of the residual stream.
A workbench streams the experts from disk, keeps the hot ones in memory and measures what it costs.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps; the fox runs on. Numbers: 0 1 2 3 42 1024 65536.

def route(scores, bias, top_k):
    \"\"\"Pick the top-k experts of each token.\"\"\"
    order = sorted(range(len(scores)), key=lambda i: -(scores[i] + bias[i]))
    chosen = order[:top_k]
    total = sum(scores[i] for i in chosen)
    return [(i, scores[i] / total) for i in chosen]


class Expert:
    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x):
        return self.down(situ(self.gate(x), self.up(x)))


for layer in range(4):
    for expert in range(16):
        print(f"layer {layer} expert {expert}: {expert * 3 + layer}")
"""


@dataclass(frozen=True)
class DemoSpec:
    """The shape of a demo model. The defaults give a 0.85 MB checkpoint; scale any field up for benchmarks."""

    hidden_size: int = 64
    num_hidden_layers: int = 4
    mla_every: int = 4  # MLA at 1-indexed layers divisible by this, and at the last layer (K3: 4, 8, ..., 92, 93)
    intermediate_size: int = 128  # the dense MLP of the first layers
    first_k_dense_replace: int = 1
    num_experts: int = 16
    num_experts_per_token: int = 4
    moe_intermediate_size: int = 64
    routed_expert_hidden_size: int = 32  # the latent size the routed experts work in
    num_shared_experts: int = 1
    num_attention_heads: int = 4  # MLA
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    kda_num_heads: int = 4
    kda_head_dim: int = 16
    conv_kernel: int = 4
    attn_res_block_size: int = 2
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    bpe_merges: int = 256  # tokenizer: 256 bytes + merges, then the 256 specials
    num_shards: int = 4

    def __post_init__(self):
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 32 for mxfp4 experts")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"cannot route to {self.num_experts_per_token} of {self.num_experts} experts")

    @property
    def base_vocab(self) -> int:
        return 256 + self.bpe_merges

    @property
    def vocab_size(self) -> int:
        return self.base_vocab + NUM_SPECIAL

    @property
    def full_attn_layers(self) -> list[int]:
        n = self.num_hidden_layers
        return sorted({i for i in range(1, n + 1) if i % self.mla_every == 0} | {n})

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers]

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


# The shipped demo: hidden 128, 8 layers (KDA, MLA at 4 and 8), layer 0 dense, 7 LatentMoE layers of 64 experts top-4
# in a 64-wide latent space plus 2 shared experts, a 4096-merge BPE. About 8 M parameters, 2.9 M active per token.
TRAINED_SPEC = DemoSpec(
    hidden_size=128,
    num_hidden_layers=8,
    mla_every=4,
    intermediate_size=384,
    first_k_dense_replace=1,
    num_experts=64,
    num_experts_per_token=4,
    moe_intermediate_size=64,
    routed_expert_hidden_size=64,
    num_shared_experts=2,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    kda_num_heads=4,
    kda_head_dim=32,
    attn_res_block_size=4,
    bpe_merges=4096,
    num_shards=4,
)


def demo_path() -> Path:
    return cache_dir() / "demo" / f"kimi-k3-demo-v{DEMO_VERSION}"


def ensure_demo(force: bool = False) -> Path:
    """The demo checkpoint in the cache: a copy of the shipped trained one, made first if missing (again if `force`).

    A copy, not the package folder itself, so that the path is writable and stable across reinstalls and tools that
    write next to a checkpoint never touch the installed package (or, in an editable install, the source tree)."""
    path = demo_path()
    if force or not path.is_dir():
        if not (SHIPPED_DEMO / "config.json").is_file():
            raise FileNotFoundError(f"the shipped demo model is missing: {SHIPPED_DEMO}")
        _build(path, lambda tmp: _copy_files(SHIPPED_DEMO, tmp), replace=force)
    return path


def _copy_files(src: Path, dest: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith((".", "__")):
            shutil.copyfile(f, dest / f.name)


# ---- config ----------------------------------------------------------------------------------------------------------


def _special_ids(spec: DemoSpec) -> dict[str, int]:
    ids = {name: spec.base_vocab + i for i, name in NAMED_SPECIAL.items()}
    return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|end_of_msg|>"], "pad_token_id": ids["[PAD]"]}


def text_config(spec: DemoSpec) -> dict:
    """The `text_config` of the demo: every key of K3's, with the demo's sizes."""
    return {
        **K3_TEXT_CONFIG,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "intermediate_size": spec.intermediate_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": 1048576,
        "activation_situ_beta": spec.situ_beta,
        "activation_situ_linear_beta": spec.situ_linear_beta,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "num_experts": spec.num_experts,
        "num_experts_per_token": spec.num_experts_per_token,
        "num_shared_experts": spec.num_shared_experts,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "routed_expert_hidden_size": spec.routed_expert_hidden_size,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "linear_attn_config": {
            **K3_TEXT_CONFIG["linear_attn_config"],
            "num_heads": spec.kda_num_heads,
            "head_dim": spec.kda_head_dim,
            "short_conv_kernel_size": spec.conv_kernel,
            "kda_layers": spec.kda_layers,
            "full_attn_layers": spec.full_attn_layers,
        },
        "attn_res_block_size": spec.attn_res_block_size,
        "torch_dtype": "bfloat16",
        **_special_ids(spec),
    }


def source_config(spec: DemoSpec) -> dict:
    """config.json of a K3-layout source checkpoint for `spec`."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": "torch.uint8",
        "zp_dtype": None,
    }
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        # Only the routed experts are quantized; every other Linear stays bf16.
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|down)_proj$",
            "re:.*block_sparse_moe\\.gate$",
            "re:.*routed_expert_(down|up)_proj$",
            "re:.*_res_proj$",
        ],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        **_special_ids(spec),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text_config(spec),
        "quantization_config": quant,
    }


# ---- tensors ---------------------------------------------------------------------------------------------------------


def tensor_plan(spec: DemoSpec) -> list[TensorSpec]:
    """Every tensor of the demo source checkpoint in file order (the K3 layout from `tqbench.skeleton`)."""
    return k3_tensor_specs(text_config(spec))


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


@lru_cache(maxsize=1)
def _expert(seed: int, base: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """One routed expert matrix, std 1/sqrt(fan_in), packed to mxfp4 (seeded by its name without the suffix)."""
    w = _rng(seed, base).standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)
    return pack_mxfp4(w)


def _array(seed: int, t: TensorSpec) -> np.ndarray:
    """The tensor's data in its file dtype (bf16 as uint16 bits), chosen by its name."""
    name, shape = t.name, t.shape
    rng = _rng(seed, name)
    if name.endswith((".weight_packed", ".weight_scale")):
        base, packed = name.rsplit(".", 1)[0], name.endswith("_packed")
        packed_w, scales = _expert(seed, base, shape[0], shape[1] * (2 if packed else 32))
        return packed_w if packed else scales
    if name.endswith("norm.weight"):
        x = np.ones(shape)
    elif name.endswith(".A_log"):  # log of a decay rate in [1, 16], as mlx-lm and transformers initialise it
        x = np.log(rng.uniform(1.0, 16.0, shape))
    elif name.endswith(".dt_bias"):  # inverse softplus of a step in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        x = dt + np.log(-np.expm1(-dt))
    elif name.endswith(".e_score_correction_bias"):  # skewed: low-numbered experts are favoured
        x = np.linspace(0.3, -0.3, shape[0]) + 0.05 * rng.standard_normal(shape)
    elif name.endswith("embed_tokens.weight"):
        x = rng.standard_normal(shape, dtype=np.float32)
    else:  # projections [out, in] and conv1d [D, 1, k]: std 1/sqrt(fan_in)
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(math.prod(shape[1:]) ** -0.5)
    x = x.astype(np.float32)
    return to_bf16(x) if t.dtype == "BF16" else x


def _shard_index(sizes: list[int], n: int) -> list[int]:
    """A contiguous split of tensors into at most n shards of similar bytes, numbered 0..m-1 without gaps."""
    total, start, raw = sum(sizes) or 1, 0, []
    for size in sizes:
        raw.append(min(n - 1, (start + size // 2) * n // total))
        start += size
    ids = {r: k for k, r in enumerate(sorted(set(raw)))}
    return [ids[r] for r in raw]


# ---- weights from a trained mlx-lm model -----------------------------------------------------------------------------


def mlx_weights(spec: DemoSpec, params: Mapping[str, np.ndarray]) -> WeightSource:
    """A weights source from the float parameters of mlx-lm's kimi_k3 `Model` built for `spec` (names as
    `mlx.utils.tree_flatten(model.parameters())` gives them): the inverse of that model's `sanitize`.

    Routed experts are packed with our exact mxfp4 packer, `A_log`, `dt_bias` and the router bias stay F32 and the rest
    is rounded to bf16. mlx-lm keeps one `A_log` per KDA head and reads the first `heads` values of the source's
    `[heads * head_dim]` tensor, so the per-head values are written there, repeated to fill the tensor."""
    p = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    P = spec.kda_num_heads * spec.kda_head_dim

    @lru_cache(maxsize=1)
    def expert(key: str, e: int) -> tuple[np.ndarray, np.ndarray]:
        return pack_mxfp4(p[key][e])

    def value(name: str) -> np.ndarray:
        n = name.removeprefix("language_model.")
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", n)
        if m is None:
            return p["language_model." + n]
        lp, rest = f"language_model.model.layers.{m.group(1)}", m.group(2)
        if x := re.match(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight_(packed|scale)$", rest):
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[x.group(2)]
            packed, scales = expert(f"{lp}.mlp.switch_mlp.{proj}.weight", int(x.group(1)))
            return packed if x.group(3) == "packed" else scales
        if rest == "block_sparse_moe.gate.e_score_correction_bias":
            return p[f"{lp}.mlp.e_score_correction_bias"]
        if rest.startswith("block_sparse_moe."):
            return p[f"{lp}.mlp.{rest.removeprefix('block_sparse_moe.')}"]
        a = f"{lp}.self_attn."
        if x := re.match(r"self_attn\.([qkv])_proj\.weight$", rest):
            return p[a + "qkv_proj.weight"][P * "qkv".index(x.group(1)):][:P]
        if x := re.match(r"self_attn\.([qkv])_conv1d\.weight$", rest):  # MLX [3P, k, 1] -> source [P, 1, k]
            return p[a + "qkv_conv.conv.weight"][P * "qkv".index(x.group(1)):][:P].transpose(0, 2, 1)
        if rest == "self_attn.A_log":
            return np.resize(p[a + "A_log"], P)
        if rest == "self_attn.kv_b_proj.weight":  # embed_q [H, kv_lora, nope] + unembed_out [H, v, kv_lora]
            wk, wv = p[a + "embed_q.weight"], p[a + "unembed_out.weight"]
            return np.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(-1, wk.shape[1])
        return p[f"{lp}.{rest}"]

    def source(t: TensorSpec) -> np.ndarray:
        x = value(t.name)
        if x.shape != t.shape:
            raise ValueError(f"{t.name}: the model gives shape {x.shape}, the K3 layout wants {t.shape}")
        if t.dtype == "U8":
            return x
        x = np.ascontiguousarray(x, dtype=np.float32)
        return to_bf16(x) if t.dtype == "BF16" else x

    return source


def random_weights(seed: int) -> WeightSource:
    """Seeded random weights (each tensor from its own seed, chosen by name)."""
    return lambda t: _array(seed, t)


# ---- the training corpus of the shipped demo: the Python standard library's own source -------------------------------

# Skipped besides site-packages: test suites, and generated data rather than code (codec tables, pydoc's topic texts,
# the build's sysconfig data and config directory).
CORPUS_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"})
HELDOUT_EVERY = 20  # one file in 20 (by a hash of its relative path) is held out for validation


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """The corpus: every `.py` file of the standard library at `root` (default: the running interpreter's) outside
    the skipped directories, as sorted relative POSIX paths."""
    root = Path(root or stdlib_root())
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        dirs = rel.split("/")[:-1]
        if any(d in CORPUS_SKIP_DIRS or d.startswith("config-") for d in dirs) or rel.startswith("_sysconfigdata"):
            continue
        if f.is_file():
            out.append(rel)
    return sorted(out)


def is_heldout(rel: str) -> bool:
    """Whether a corpus file belongs to the validation split: decided by its relative path alone."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % HELDOUT_EVERY == 0


def encode_files(encoding, root: Path, files: list[str], eos: int) -> np.ndarray:
    """Token ids of `files` (UTF-8 text, in order), each followed by `eos`, as one uint32 stream."""
    ids: list[int] = []
    for rel in files:
        ids += encoding.encode_ordinary((Path(root) / rel).read_text(encoding="utf-8"))
        ids.append(eos)
    return np.array(ids, dtype=np.uint32)


def special_ids(spec: DemoSpec) -> dict[str, int]:
    """bos, eos (a chat turn's end, also the end of a training document) and pad ids of a demo's vocabulary."""
    return _special_ids(spec)


# ---- writing ---------------------------------------------------------------------------------------------------------


def write_checkpoint(dest: Path, spec: DemoSpec, weights: WeightSource, ranks: dict[bytes, int]) -> Path:
    """Write a K3-layout source checkpoint for `spec` (tensors from `weights`, a tiktoken vocabulary `ranks` of
    `spec.base_vocab` tokens) to `dest`, replacing it, atomically: it is built in a temporary directory next to `dest`
    and renamed into place."""
    if len(ranks) != spec.base_vocab:
        raise ValueError(f"the tokenizer has {len(ranks)} tokens, the spec wants {spec.base_vocab}")
    return _build(Path(dest), lambda tmp: _write_into(tmp, spec, weights, ranks), replace=True)


def write_source(dest: Path, spec: DemoSpec = DemoSpec(), seed: int = 0) -> Path:
    """Write a seeded random K3-layout source checkpoint for `spec` to `dest` (replacing it), atomically."""
    return write_checkpoint(dest, spec, random_weights(seed), demo_tokenizer_ranks(spec))


def demo_tokenizer_ranks(spec: DemoSpec) -> dict[bytes, int]:
    """The random demo's tokenizer: `spec.bpe_merges` merges trained on `DEMO_CORPUS`."""
    ranks = train_bpe(DEMO_CORPUS.encode(), spec.bpe_merges)
    if len(ranks) != spec.base_vocab:
        raise ValueError(f"the demo corpus supports only {len(ranks) - 256} merges, {spec.bpe_merges} asked")
    return ranks


def _build(dest: Path, fill: Callable[[Path], None], replace: bool) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        fill(tmp)
        if dest.exists() and not replace:  # another process finished first
            shutil.rmtree(tmp)
        else:
            _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_into(out: Path, spec: DemoSpec, weights: WeightSource, ranks: dict[bytes, int]) -> None:
    write_tokenizer(out, ranks)
    plan = tensor_plan(spec)
    index = _shard_index([t.nbytes for t in plan], spec.num_shards)
    m = index[-1] + 1
    weight_map: dict[str, str] = {}
    for k in range(m):
        fname = shard_file(k, m)
        tensors = [t for t, i in zip(plan, index) if i == k]
        with ShardWriter(out / fname, tensors, {"format": "pt"}) as w:
            for t in tensors:
                w.write(t.name, weights(t))
                weight_map[t.name] = fname
    total = sum(t.nbytes for t in plan)
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", source_config(spec))
    _write_json(out / "generation_config.json", {**_special_ids(spec), "max_new_tokens": 64})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _swap_into_place(new: Path, dest: Path) -> None:
    """Rename `new` to `dest`; an existing `dest` is moved aside first and deleted after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
        os.replace(dest, old / dest.name)
    try:
        os.replace(new, dest)
    except OSError:
        if dest.exists():  # another process put a complete one there first
            shutil.rmtree(new, ignore_errors=True)
        else:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
