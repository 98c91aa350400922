"""One rank of tests/test_distributed_tensor.py, started by `mlx.launch`: loads a model whole and sharded across the
ranks (tensor parallel), compares their logits for the given token ids, then tries a model that cannot be sharded and
a streamed one. Prints one JSON line with what it found, prefixed by its rank."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

from tqbench.distributed.world import join
from tqbench.errors import TqbenchError
from tqbench.runtime.load import load
from tqbench.stream.streamer import StreamConfig


def shapes(model) -> dict[str, list[int]]:
    """Packed weights of a few modules: a sharded-to-all one, an all-to-sharded one and the routed experts."""
    layer0, layer1 = model.layers[0], model.layers[1]
    down = layer0.mlp.down_proj
    return {"dense down_proj": list(getattr(down, "inner", down).weight.shape),
            "dense up_proj": list(layer0.mlp.up_proj.weight.shape),
            "experts down_proj": list(layer1.mlp.switch_mlp.down_proj.weight.shape)}


def error(fn) -> str | None:
    try:
        fn()
    except TqbenchError as e:
        return str(e)
    return None


def main(path: str, tokens: str, unsliceable: str) -> None:
    group = join()
    whole = load(path, tokenizer=False)
    sharded = load(path, tokenizer=False, group=group, parallel="tensor")
    x = mx.array([json.loads(tokens)])
    a, b = whole.model(x), sharded.model(x)
    mx.eval(a, b)
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    out = {"rank": group.rank(), "dtype": str(whole.model.layers[0].input_layernorm.weight.dtype),
           "max_diff": float(np.abs(a - b).max()), "max_logit": float(np.abs(a).max()),
           "argmax_equal": bool((a.argmax(-1) == b.argmax(-1)).all()), "whole": shapes(whole.model),
           "sharded": shapes(sharded.model), "layers": [sharded.pipeline.start, sharded.pipeline.end],
           "cannot_slice": error(lambda: load(unsliceable, tokenizer=False, group=group, parallel="tensor")),
           "streamed": error(lambda: load(path, tokenizer=False, group=group, parallel="tensor",
                                          streaming=StreamConfig(budget_bytes=1 << 20)))}
    print(f"rank {group.rank()}: {json.dumps(out)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
