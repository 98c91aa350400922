"""The Recipe screen's quick eval: convert the demo with a recipe (unless that conversion exists) and evaluate it
against the demo on QUICK_TOKENS tokens of its held-out texts; the result is remembered (tqbench.eval.store) for the
screen to show next to the recipe's size. Runs on the engine thread; yields the conversion's events, then the
evaluation's."""

from __future__ import annotations

from typing import Iterator

from tqbench.eval.records import EvalRequest
from tqbench.eval.store import RecipeQuality

QUICK_TOKENS = 1024


def quick_eval(recipe: str, tokens: int = QUICK_TOKENS, store: str | None = None) -> Iterator:
    from tqbench.convert import convert
    from tqbench.demo import ensure_demo
    from tqbench.destination import default_dest
    from tqbench.eval.run import evaluate
    from tqbench.layout.names import INDEX_FILE
    from tqbench.recipe import Recipe

    demo = ensure_demo()
    chosen = Recipe.parse(recipe)
    dest = default_dest(demo, chosen.name)
    if not (dest / INDEX_FILE).is_file():
        yield from convert(demo, dest, chosen)
    yield from evaluate(EvalRequest(model=str(dest), against=str(demo), tokens=tokens, prompts=0, store=store))


def demo_quality(recipe: str, store: str | None = None) -> RecipeQuality | None:
    """What the latest evaluation of `recipe`'s conversion of the demo measured (None: never evaluated)."""
    from tqbench.demo import ensure_demo
    from tqbench.eval.store import remembered
    from tqbench.recipe import Recipe
    from tqbench.source.opening import open_checkpoint

    return remembered(open_checkpoint(ensure_demo()), store).get(Recipe.parse(recipe).name)
