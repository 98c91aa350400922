"""Shared fixtures: small real checkpoints built on the fly."""

from __future__ import annotations

import atexit
import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tqbench.skeleton import K3_TEXT_CONFIG, k3_config, k3_tensor_specs, write_skeleton


def small_k3_text(layers: int = 4, experts: int = 8) -> dict:
    """A K3-architecture text config shrunk to a few KB of headers."""
    text = copy.deepcopy(K3_TEXT_CONFIG)
    text.update(hidden_size=64, num_hidden_layers=layers, vocab_size=256, intermediate_size=128,
                num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, num_experts=experts, num_experts_per_token=2,
                num_shared_experts=1, moe_intermediate_size=64, routed_expert_hidden_size=32, attn_res_block_size=2)
    text["linear_attn_config"] = dict(text["linear_attn_config"], num_heads=2, head_dim=16,
                                      kda_layers=[i + 1 for i in range(layers) if (i + 1) % 4],
                                      full_attn_layers=[i + 1 for i in range(layers) if (i + 1) % 4 == 0])
    return text


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own tqbench cache dir and tiktoken cache, never the user's."""
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path_factory.mktemp("tqcache")))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture
def small_k3(tmp_path) -> Path:
    """A header-only K3-layout checkpoint: 4 layers (MLA at 4), 8 experts, several shards."""
    text = small_k3_text()
    return write_skeleton(tmp_path / "small-k3", k3_config(text), k3_tensor_specs(text), shard_size=64 * 1024)


_DEMO_TQ4: dict[int | None, Path] = {}  # shard size -> the conversion this test session made once


def demo_tq4(root: Path, shard_size: int | None = None, name: str = "tq4") -> Path:
    """The demo converted with tq4 (the conversion profiles/demo-tq4.json was made for), copied into `root/name`.
    Converted once per shard size and test session (about 30 s each on 2 cores), with its own cache directory (a
    module fixture runs outside the per-test one); every caller gets a copy of its own to change."""
    from tqbench.convert import convert
    from tqbench.demo import ensure_demo
    from tqbench.recipe import Recipe

    if shard_size not in _DEMO_TQ4:
        base = Path(tempfile.mkdtemp(prefix="tqbench-demo-tq4-"))
        atexit.register(shutil.rmtree, base, True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TQBENCH_CACHE_DIR", str(base / "cache"))
            kw = {} if shard_size is None else {"shard_size": shard_size}
            list(convert(ensure_demo(), base / "tq4", Recipe.parse("tq4"), **kw))
        _DEMO_TQ4[shard_size] = base / "tq4"
    return Path(shutil.copytree(_DEMO_TQ4[shard_size], root / name))


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


os.environ.setdefault("TQBENCH_TEST", "1")


@pytest.fixture(scope="session")
def k3_skeleton(tmp_path_factory) -> Path:
    """The full Kimi K3 source layout as sparse header-only shards (~130 MB of headers, 1.56 TB apparent)."""
    from tqbench.skeleton import write_k3_skeleton

    return write_k3_skeleton(tmp_path_factory.mktemp("k3") / "Kimi-K3")


def load_script(path: Path):
    """A script that is not a package module (benchmarks/, scripts/) imported from its file."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(path).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
