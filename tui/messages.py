"""Messages the TUI's thread workers post: small dataclasses wrapping engine events.

Each load carries the `load_id` of the worker that posted it, so a screen can drop messages from a load that was
superseded (thread workers only stop at their next cancellation check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message


@dataclass
class ScanStarted(Message):
    """A load began: `text` says what is happening (opening a path, writing the demo model)."""

    load_id: int
    text: str
    path: Any = None  # the Path being opened, once known


@dataclass
class ScanProgress(Message):
    """One shard header read (tqbench.events.ShardScanned) plus the running tensor count."""

    load_id: int
    index: int
    total: int
    file: str
    tensors_so_far: int

    def can_replace(self, message: Message) -> bool:
        # A newer progress message of the same load makes this one stale: queued duplicates merge.
        return isinstance(message, ScanProgress) and message.load_id == self.load_id


@dataclass
class CheckpointLoaded(Message):
    """Opening finished (tqbench.events.CheckpointOpened), with the summary and prepared table rows."""

    load_id: int
    checkpoint: Any  # tqbench.source.Checkpoint
    summary: Any  # tqbench.source.Summary
    tensors: list = field(repr=False)  # every Tensor, in name order (the filter's input)


@dataclass
class LoadFailed(Message):
    """Opening failed: `message` is one line (a TqbenchError's text), never a traceback."""

    load_id: int
    message: str


@dataclass
class FilterApplied(Message):
    """The tensor filter's result: the first rows to show and how many tensors matched."""

    filter_id: int
    pattern: str
    rows: list = field(repr=False)  # table cells of the first matches (at most the row limit)
    matches: int
    total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, FilterApplied)


@dataclass
class SourcesGrouped(Message):
    """A checkpoint's tensors grouped into output modules (tqbench.recipe.group_sources), done once per checkpoint."""

    checkpoint: Any  # tqbench.source.Checkpoint the grouping is of
    sources: Any = field(repr=False)  # tqbench.recipe.Sources


@dataclass
class PlansReady(Message):
    """Plans made by a plan worker (tqbench.recipe.make_plan), keyed by Recipe."""

    request_id: int
    checkpoint: Any
    plans: dict = field(repr=False)  # Recipe -> Plan


@dataclass
class PlanFailed(Message):
    """Grouping or planning failed: `message` is one line."""

    message: str


@dataclass
class RecipeChosen(Message):
    """The recipe editor holds a new valid recipe (from its controls or a typed name)."""

    recipe: Any  # tqbench.recipe.Recipe


@dataclass
class MachineChosen(Message):
    """The memory size or disk bandwidth typed in the recipe editor gave a new machine to plan for."""

    machine: Any  # tqbench.recipe.Machine


# ---- the Convert screen ---------------------------------------------------------------------------------------------

@dataclass
class DestinationChecked(Message):
    """The conversion's layout (tqbench.convert.layout, cached per checkpoint/recipe/shard size) and what converting
    into `dest` would do (tqbench.convert.destination_status), with the shards already finished there."""

    request_id: int
    key: Any  # (checkpoint, recipe, shard_size) the layout is for
    layout: Any = field(repr=False)  # tqbench.convert.Layout
    status: Any  # tqbench.convert.DestinationStatus (with the shards an earlier run finished)
    dest: Any  # Path


@dataclass
class DestinationCheckFailed(Message):
    request_id: int
    message: str


@dataclass
class ConvertBegan(Message):
    """The engine's ConvertStarted: totals and what an earlier run finished."""

    run_id: int
    event: Any  # tqbench.events.ConvertStarted


@dataclass
class ConvertProgress(Message):
    """The latest UnitConverted with every layer's totals so far (posted at most ~10 times a second; the totals are
    exact because they are counted off the UI thread from every event)."""

    run_id: int
    unit: Any  # tqbench.events.UnitConverted
    layers: tuple = field(repr=False)  # tui.tally.LayerStats copies, in layer order

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ConvertProgress) and message.run_id == self.run_id


@dataclass
class ConvertShardWritten(Message):
    run_id: int
    event: Any  # tqbench.events.ShardWritten


@dataclass
class ConvertDone(Message):
    run_id: int
    event: Any  # tqbench.events.ConvertFinished


@dataclass
class ConvertStopped(Message):
    """A cancelled conversion has stopped: its generator is closed, no shard is half-written."""

    run_id: int


@dataclass
class ConvertFailed(Message):
    """The conversion raised: `message` is one line (a TqbenchError's text)."""

    run_id: int
    message: str
