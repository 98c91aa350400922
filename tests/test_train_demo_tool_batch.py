"""scripts/train_demo.py's tool batches: whole conversations padded to a width rounded up to the step (few shapes, so
CUDA compiles few kernels), with the loss on the assistant's tokens only, checked against a per-row construction;
`--cache-limit-gb` caps MLX's buffer cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def td():
    spec = importlib.util.spec_from_file_location("train_demo_tool_batch", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tool_batch_pads_to_the_width_step_and_masks_all_but_the_assistants_tokens(td):
    rng = np.random.default_rng(3)
    lengths = np.array([5, 130, 9, 257])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = rng.integers(10, 1000, int(lengths.sum())).astype(np.int32)
    mask = rng.integers(0, 2, int(lengths.sum())).astype(np.int8)
    pad = 7
    for pick, step, width in (([0, 2], 128, 128), ([0, 1], 128, 256), ([3], 128, 256), ([1, 3], 64, 256),
                              ([0, 2], 1, 8)):
        x, y = td.tool_batch((tokens, mask, starts, lengths), np.array(pick), pad, width_step=step)
        assert x.shape == y.shape == (len(pick), width)
        for row, c in enumerate(pick):
            t = tokens[starts[c]:starts[c] + lengths[c]]
            m = mask[starts[c]:starts[c] + lengths[c]]
            n = len(t) - 1
            assert x[row, :n].tolist() == t[:-1].tolist()
            assert set(x[row, n:].tolist()) <= {pad}
            want = [int(t[i + 1]) if m[i + 1] else -1 for i in range(n)] + [-1] * (width - n)
            assert y[row].tolist() == want


def test_cache_limit_sets_mlxs_cap_in_gib_and_zero_leaves_it(td):
    import mlx.core as mx

    before = mx.set_cache_limit(3 << 30)  # a known cap to come back to
    try:
        assert td.set_cache_limit(0) is None and mx.set_cache_limit(3 << 30) == 3 << 30  # untouched
        assert td.set_cache_limit(1.5) == 1610612736
        assert mx.set_cache_limit(3 << 30) == 1610612736  # what MLX held: 1.5 GiB
    finally:
        mx.set_cache_limit(before)
