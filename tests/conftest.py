"""Shared fixtures: small real checkpoints built on the fly.

Demo sources and their conversions are built once per test session (`demo_source`, `shipped_demo`, `converted`) and
shared by every module that asks for the same one: read or load them, never change them. A test that changes a model
works on a copy (`converted_copy`, `demo_tq4`, or shutil.copytree of the shared path). Helpers that are not fixtures
(running a model, an expert's bytes, shard headers, ports) are in model_helpers.py."""

from __future__ import annotations

import atexit
import copy
import importlib.util
import os
import shutil
import signal
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


_SHARED: dict[tuple, Path] = {}  # what this test session built once: demo sources and their conversions
_SHARED_STATE: dict[Path, list] = {}  # each shared directory's files (name, size, mtime) as it was built


def _shared_dir(prefix: str) -> Path:
    base = Path(tempfile.mkdtemp(prefix=f"tqbench-tests-{prefix}-"))
    atexit.register(shutil.rmtree, base, True)
    return base


def _tree_state(root: Path) -> list:
    return [(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))]


def _share(key: tuple, build) -> Path:
    """`build(base)` once per test session, in a fresh directory and with its own cache directory (a module or
    session fixture runs outside the per-test one); the path it returns is shared and must not change."""
    if key not in _SHARED:
        base = _shared_dir("shared")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TQBENCH_CACHE_DIR", str(base / "cache"))
            mp.setenv("TIKTOKEN_CACHE_DIR", "")
            path = build(base)
        _SHARED[key] = path
        _SHARED_STATE[path] = _tree_state(path)
    return _SHARED[key]


def demo_source(spec=None, seed: int = 0) -> Path:
    """The seeded random K3-layout demo source `write_source(..., spec, seed)` (default DemoSpec()), written once
    per test session. Shared: read it, or copy it to change it."""
    from tqbench.demo import DemoSpec, write_source

    spec = DemoSpec() if spec is None else spec
    return _share(("source", spec, seed), lambda base: write_source(base / "src", spec, seed=seed))


def shipped_demo() -> Path:
    """A copy of the shipped trained demo (`ensure_demo()` in a cache of its own), made once per test session.
    Shared: read it, or copy it to change it."""
    from tqbench.demo import ensure_demo

    return _share(("shipped",), lambda base: Path(shutil.copytree(ensure_demo(), base / "demo")))


def converted(recipe: str, spec=None, shard_size: int | None = None, seed: int = 0) -> Path:
    """`recipe`'s conversion of the shipped demo (spec None) or of `demo_source(spec, seed)`, at the default shard size
    or `shard_size`: converted once per test session (a conversion of the shipped demo takes 10-30 s on 2 cores).
    Shared by every module that asks for the same conversion: read or load it, never change it (copy it with
    `converted_copy`; the session checks at its end that no shared directory changed)."""
    from tqbench.convert import convert
    from tqbench.recipe import Recipe

    def build(base: Path) -> Path:
        src = shipped_demo() if spec is None else demo_source(spec, seed)
        kw = {} if shard_size is None else {"shard_size": shard_size}
        for _ in convert(src, base / recipe, Recipe.parse(recipe), **kw):
            pass
        return base / recipe

    return _share(("converted", recipe, spec, seed, shard_size), build)


def converted_copy(root: Path, recipe: str, spec=None, shard_size: int | None = None, name: str | None = None) -> Path:
    """A copy of `converted(recipe, spec, shard_size)` at `root/name` (default: the recipe) for a test to change."""
    return Path(shutil.copytree(converted(recipe, spec, shard_size), root / (name or recipe)))


def demo_tq4(root: Path, shard_size: int | None = None, name: str = "tq4") -> Path:
    """The shipped demo converted with tq4 (the conversion profiles/demo-tq4.json was made for), copied into
    `root/name`: converted once per shard size and test session; every caller gets a copy of its own to change."""
    return converted_copy(root, "tq4", shard_size=shard_size, name=name)


@pytest.fixture(scope="session", autouse=True)
def _shared_models_stay_unchanged():
    """Shared sources and conversions are read by many modules: a test that changed one would change what the
    tests after it see. Checked once, at the end of the session (names, sizes and modification times)."""
    yield
    changed = [str(p) for p, state in _SHARED_STATE.items() if p.exists() and _tree_state(p) != state]
    assert not changed, f"a test changed a shared directory (copy it first: converted_copy): {changed}"


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


os.environ.setdefault("TQBENCH_TEST", "1")

# Tests interrupt the processes they start with SIGINT, as Ctrl-C does (serve stops, chat exits 130). A shell without
# job control that starts pytest in the background (`pytest ... &`, nohup, a script's background job) leaves SIGINT
# ignored, and an ignored signal stays ignored in every child: a served model would then never stop (the module
# fixture's teardown waits 60 s and fails) and the Ctrl-C tests fail. Handled, it is reset to the default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture(scope="session")
def tool_tokenizer(tmp_path_factory):
    """mlx-lm's TokenizerWrapper over a demo tokenizer written with today's chat template (it renders tools)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tqbench.demo.spec import DemoSpec
    from tqbench.demo.tokenizer import demo_tokenizer_ranks
    from tqbench.tokenizer import write_tokenizer

    d = tmp_path_factory.mktemp("tool-tokenizer")
    write_tokenizer(d, demo_tokenizer_ranks(DemoSpec()))
    return load_tokenizer(d)
