"""Quality you can see: `tqbench eval` (perplexity, and per token against a reference model: KL, top-1 agreement,
top-5 overlap, greedy agreement; or each layer's error). See docs/eval.md."""

from tqbench.eval.records import (EvalProgress, EvalReport, EvalRequest, EvalStarted, GreedyAgreement, LayerError,
                                  TextScore)

__all__ = ["EvalProgress", "EvalReport", "EvalRequest", "EvalStarted", "GreedyAgreement", "LayerError", "TextScore",
           "evaluate"]


def evaluate(request: EvalRequest):
    """The evaluation's events (tqbench.eval.run.evaluate); run it on the engine thread."""
    from tqbench.eval.run import evaluate as run

    return run(request)
