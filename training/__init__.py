"""The code that trained the shipped demo model (`tqbench/demo/checkpoint/`, see docs/demo-model.md): not part of
tqbench and not shipped in its wheel; `scripts/`, `benchmarks/` and the tests import it from the repository root.

- `corpus`: the training text, the Python standard library's own source, and its held-out split;
- `conversations`: the chat demo's conversations mined from the standard library, and the mixed code + chat stream;
- `delta`: a chunked gated delta rule that trains the KDA layers a chunk of time steps at a time;
- `flat_adamw`: AdamW over all trainable parameters as one vector;
- `modelstats`: perplexity and routing traces of a loaded mlx-lm model, and their statistics.
"""
