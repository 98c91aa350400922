"""The random demo's tokenizer: a small byte-level BPE trained on a fixed text (the shipped demo's tokenizer is trained
on its corpus by `scripts/train_demo.py` instead)."""

from __future__ import annotations

from tqbench.demo.spec import DemoSpec
from tqbench.tokenizer import train_bpe

# The random demo tokenizer's training text: a little prose and a little Python; random demos' bytes depend on it.
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


def demo_tokenizer_ranks(spec: DemoSpec) -> dict[bytes, int]:
    """The random demo's tokenizer: `spec.bpe_merges` merges trained on `DEMO_CORPUS`."""
    ranks = train_bpe(DEMO_CORPUS.encode(), spec.bpe_merges)
    if len(ranks) != spec.base_vocab:
        raise ValueError(f"the demo corpus supports only {len(ranks) - 256} merges, {spec.bpe_merges} asked")
    return ranks
