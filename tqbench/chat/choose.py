"""Which model `tqbench chat` opens when none is named: the last converted model, else the demo converted with
DEMO_RECIPE (converting it first, with the conversion's own progress events)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from tqbench.events import ModelChosen
from tqbench.layout.names import INDEX_FILE
from tqbench.state import last_model, remember_model

DEMO_RECIPE = "tq4"  # the demo's chat default (see docs/demo-model.md for each recipe's quality on it)


def demo_converted_path(recipe: str = DEMO_RECIPE) -> Path:
    """Where the demo's conversion with `recipe` goes: the directory the TUI's Convert screen offers for it too."""
    from tqbench.demo import demo_path
    from tqbench.destination import default_dest

    return default_dest(demo_path(), recipe)


def default_model(recipe: str = DEMO_RECIPE) -> Path | None:
    """The last converted model, else the demo's conversion if it exists (none is made here)."""
    last = last_model()
    if last is not None:
        return last
    dest = demo_converted_path(recipe)
    return dest if (dest / INDEX_FILE).is_file() else None


def choose_model(recipe: str = DEMO_RECIPE) -> Iterator[ModelChosen | Any]:
    """Yields conversion events if the demo has to be converted, then ModelChosen. Runs on the engine thread."""
    from tqbench.convert import convert
    from tqbench.demo import ensure_demo
    from tqbench.recipe import Recipe

    last = last_model()
    if last is not None:
        yield ModelChosen(path=str(last), why="last converted model")
        return
    dest = demo_converted_path(recipe)
    if (dest / INDEX_FILE).is_file():
        yield ModelChosen(path=str(dest), why="demo (converted earlier)")
        return
    chosen = Recipe.parse(recipe)
    yield from convert(ensure_demo(), dest, chosen)
    remember_model(dest)
    yield ModelChosen(path=str(dest), why=f"demo, converted now with {chosen.name}")
