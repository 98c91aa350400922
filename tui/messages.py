"""Messages the TUI's thread workers and widgets post: small dataclasses wrapping engine events and values.

Payloads carry the engine's own types (tqbench.source, tqbench.recipe, tqbench.convert, tqbench.events). Those
whose modules are costly to import (tqbench.convert imports MLX) are named under TYPE_CHECKING only: with
`from __future__ import annotations` a dataclass never evaluates its annotations, so importing this module stays
cheap. `typing.get_type_hints` resolves every field given those modules (tests/test_tui.py checks that none is Any).

Each load carries the `load_id` of the worker that posted it (and each request or run its id), so a screen can drop
messages from work that was superseded (thread workers only stop at their next cancellation check).

Merging (Textual's `Message.can_replace`): when a message pump takes a message off its queue and the next queued
one is a message this one `can_replace`, this one is dropped unread. Every message that can come in bursts (HIGH_RATE)
says explicitly whether it merges:

- merged, because the newest carries everything the handler needs: ScanProgress (the running tensor count of a
  load), FilterApplied (the newest filter's rows), RecipeChosen and MachineChosen (the editor's newest recipe or
  machine: held-down keys and fast typing post one per key), ConvertProgress (the per-layer totals are cumulative
  snapshots of a run), ChatConvertProgress (the demo's conversion before a chat: byte counts are cumulative) and
  ChatReplyProgress (a streaming reply's whole text so far, posted at most every ~50 ms), QuickEvalProgress (the
  Recipe screen shows only where a quick eval is now), ConvertSource when it carries download progress (cumulative;
  a source shard removed is never merged away), ConvertCalibrating when it carries the calibration's progress (the
  newest says where it is; the Calibrated that ends it is never merged away);
- never merged, because each one counts: ConvertShardWritten (the screen counts shards written), PlansReady
  (each carries plans the others lack; dropping one would only make the screen plan them again), ChatExperts
  (a streaming reply's expert page-ins since the last batch; the expert view counts every routing) and ServeFeed (a
  server's page-ins and requests since the last batch: the map counts every routing, the log shows every request).

The others (a load starting, finishing or failing, a destination checked, a run beginning, ending or failing) come
once per action and never merge: Message.can_replace's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text
from textual.message import Message

from tqbench.chat.events import SourceProgress
from tqbench.chat.live import ReplyRates
from tqbench.eval.records import EvalProgress, EvalStarted
from tqbench.eval.store import RecipeQuality
from tqbench.events import Calibrated  # at run time: ConvertCalibrating.can_replace tells it apart

if TYPE_CHECKING:
    from tqbench.chat.events import (ConvertFinished, ConvertStarted, ModelChosen, ModelLoaded, PageIn, ReplyDone,
                                     ReplyStarted, ShardWritten, SourceRemoved, StreamReport, UnitConverted)
    from tqbench.convert import DestinationStatus, Layout
    from tqbench.convert.calibration_request import CalibrationRequest
    from tqbench.events import CalibrationProgress
    from tqbench.recipe import Machine, Plan, Recipe, Sources
    from tqbench.serve.service import RequestDone, ServeStatus
    from tqbench.source import Checkpoint, Summary, Tensor
    from tui.tally import LayerStats


# ---- the Source screen ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ScanStarted(Message):
    """A load began: `text` says what is happening (opening a path, writing the demo model)."""

    load_id: int
    text: str
    path: Path | None = None  # the checkpoint directory being opened, once known


@dataclass(kw_only=True)
class ScanProgress(Message):
    """One shard header read (tqbench.events.ShardScanned) plus the running tensor count."""

    load_id: int
    index: int
    total: int
    file: str
    tensors_so_far: int
    fetched_bytes: int = 0  # from the hub so far (a hub repository's headers)

    def can_replace(self, message: Message) -> bool:
        """Merged: a newer progress message of the same load carries a newer count."""
        return isinstance(message, ScanProgress) and message.load_id == self.load_id


@dataclass(kw_only=True)
class CheckpointLoaded(Message):
    """Opening finished (tqbench.events.CheckpointOpened), with the summary and prepared table rows."""

    load_id: int
    checkpoint: Checkpoint
    summary: Summary
    tensors: list[Tensor] = field(repr=False)  # every Tensor, in name order (the filter's input)


@dataclass(kw_only=True)
class LoadFailed(Message):
    """Opening failed: `message` is one line (a TqbenchError's text), never a traceback."""

    load_id: int
    message: str


@dataclass(kw_only=True)
class FilterApplied(Message):
    """The tensor filter's result: the first rows to show and how many tensors matched."""

    filter_id: int
    pattern: str
    rows: list[tuple[Tensor, tuple[Text, ...]]] = field(repr=False)  # the first matches with their table cells
    matches: int
    total: int

    def can_replace(self, message: Message) -> bool:
        """Merged: only the newest filter's rows are shown (one message per keystroke in the filter)."""
        return isinstance(message, FilterApplied)


# ---- the Recipe screen ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class SourcesGrouped(Message):
    """A checkpoint's tensors grouped into output modules (tqbench.recipe.group_sources), done once per checkpoint."""

    checkpoint: Checkpoint  # the checkpoint the grouping is of
    sources: Sources = field(repr=False)


@dataclass(kw_only=True)
class PlansReady(Message):
    """Plans made by a plan worker (tqbench.recipe.make_plan), keyed by recipe."""

    request_id: int
    checkpoint: Checkpoint
    plans: dict[Recipe, Plan] = field(repr=False)

    def can_replace(self, message: Message) -> bool:
        """Never merged: each carries plans the others may lack (the screen caches them all)."""
        return False


@dataclass(kw_only=True)
class PlanFailed(Message):
    """Grouping or planning failed: `message` is one line."""

    message: str


@dataclass(kw_only=True)
class RecipeChosen(Message):
    """The recipe editor holds a new valid recipe (from its controls or a typed name)."""

    recipe: Recipe

    def can_replace(self, message: Message) -> bool:
        """Merged: the screen plans the newest recipe only (a held-down key posts one per repeat)."""
        return isinstance(message, RecipeChosen)


@dataclass(kw_only=True)
class MachineChosen(Message):
    """The memory size or disk bandwidth typed in the recipe editor gave a new machine to plan for."""

    machine: Machine

    def can_replace(self, message: Message) -> bool:
        """Merged: the screen assesses for the newest machine only (typing posts one per keystroke)."""
        return isinstance(message, MachineChosen)


@dataclass(kw_only=True)
class QualitiesRead(Message):
    """The evaluations remembered for a checkpoint (tqbench.eval.store.remembered), by recipe name."""

    checkpoint: Checkpoint
    qualities: dict[str, RecipeQuality]


@dataclass(kw_only=True)
class QuickEvalProgress(Message):
    """A quick eval (tqbench.eval.quick) moved on: the demo's conversion (a calibrated recipe's calibration first),
    then the evaluation (posted at most ~10 times a second)."""

    eval_id: int
    event: (CalibrationProgress | Calibrated | ConvertStarted | UnitConverted | ConvertFinished | EvalStarted
            | EvalProgress)

    def can_replace(self, message: Message) -> bool:
        """Merged: the screen shows where the quick eval is now, which the newest event of the same eval says."""
        return isinstance(message, QuickEvalProgress) and message.eval_id == self.eval_id


@dataclass(kw_only=True)
class QuickEvalDone(Message):
    """A quick eval finished: what the store remembered of it (tqbench.eval.quick.demo_quality; None: nothing)."""

    eval_id: int
    quality: RecipeQuality | None


@dataclass(kw_only=True)
class QuickEvalFailed(Message):
    """A quick eval raised: `message` is one line (a TqbenchError's text)."""

    eval_id: int
    message: str


@dataclass(kw_only=True)
class QuickEvalStopped(Message):
    """A quick eval was stopped (the screen was left): its job is closed on the engine thread."""

    eval_id: int


# ---- the Convert screen -----------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class DestinationChecked(Message):
    """The conversion's layout (tqbench.convert.layout, cached per checkpoint/recipe/shard size and calibration
    digest) and what converting into `dest` would do (tqbench.convert.destination_status), with the shards already
    finished there."""

    request_id: int
    key: tuple[Checkpoint, Recipe, int]  # (checkpoint, recipe, shard size) the layout is for
    layout: Layout = field(repr=False)
    status: DestinationStatus  # with the shards an earlier run finished
    dest: Path
    calibration: CalibrationRequest | None = None  # a calibrated recipe's texts and tokens (in the layout's digest)


@dataclass(kw_only=True)
class DestinationCheckFailed(Message):
    request_id: int
    message: str


@dataclass(kw_only=True)
class ConvertBegan(Message):
    """The engine's ConvertStarted (totals and what earlier runs finished), with every layer's totals as the run
    starts: units of finished shards done, their errors (ConvertStarted.resumed_errors) counted."""

    run_id: int
    event: ConvertStarted
    layers: tuple[LayerStats, ...] = field(default=(), repr=False)  # copies, in layer order


@dataclass(kw_only=True)
class ConvertProgress(Message):
    """The latest UnitConverted with every layer's totals so far (posted at most ~10 times a second; the totals are
    exact because they are counted off the UI thread from every event)."""

    run_id: int
    unit: UnitConverted
    layers: tuple[LayerStats, ...] = field(repr=False)  # copies, in layer order

    def can_replace(self, message: Message) -> bool:
        """Merged: the totals are cumulative, so the newest of the same run says everything."""
        return isinstance(message, ConvertProgress) and message.run_id == self.run_id


@dataclass(kw_only=True)
class ConvertCalibrating(Message):
    """A calibrated conversion (recipe part `cal`) measuring its statistics (CalibrationProgress), or done with them
    (Calibrated: measured, or read back by a resumed run)."""

    run_id: int
    event: CalibrationProgress | Calibrated

    def can_replace(self, message: Message) -> bool:
        """Merged: the newest progress of the same run says everything (the end is never merged away)."""
        return (isinstance(message, ConvertCalibrating) and message.run_id == self.run_id
                and not isinstance(message.event, Calibrated) and not isinstance(self.event, Calibrated))


@dataclass(kw_only=True)
class ConvertSource(Message):
    """A conversion streaming its source from the hub: the downloads (SourceProgress), or a source shard removed
    (SourceRemoved)."""

    run_id: int
    event: SourceProgress | SourceRemoved

    def can_replace(self, message: Message) -> bool:
        """Merged: the newest progress of the same run says everything (a removal is never merged away)."""
        return (isinstance(message, ConvertSource) and message.run_id == self.run_id
                and isinstance(message.event, SourceProgress) and isinstance(self.event, SourceProgress))


@dataclass(kw_only=True)
class ConvertShardWritten(Message):
    run_id: int
    event: ShardWritten

    def can_replace(self, message: Message) -> bool:
        """Never merged: the screen counts the shards written."""
        return False


@dataclass(kw_only=True)
class ConvertDone(Message):
    run_id: int
    event: ConvertFinished


@dataclass(kw_only=True)
class ConvertStopped(Message):
    """A cancelled conversion has stopped: its generator is closed, no shard is half-written."""

    run_id: int


@dataclass(kw_only=True)
class ConvertFailed(Message):
    """The conversion raised: `message` is one line (a TqbenchError's text)."""

    run_id: int
    message: str


# ---- the Chat screen --------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ChatLoadStep(Message):
    """A model load moved on: `text` says what is happening (choosing, converting the demo, loading a path)."""

    load_id: int
    text: str
    converting: bool = False  # the demo is being converted first (progress follows)


@dataclass(kw_only=True)
class ChatConvertProgress(Message):
    """The latest UnitConverted of the demo's conversion (tqbench.chat.choose.choose_model)."""

    load_id: int
    unit: UnitConverted

    def can_replace(self, message: Message) -> bool:
        """Merged: done_in / total_in are cumulative, so the newest of the same load says everything."""
        return isinstance(message, ChatConvertProgress) and message.load_id == self.load_id


@dataclass(kw_only=True)
class ChatModelReady(Message):
    """The model is loaded in the screen's engine session and a conversation started."""

    load_id: int
    chosen: ModelChosen  # which model and why
    loaded: ModelLoaded  # streaming: loaded.stream.layers are the expert view's layers


@dataclass(kw_only=True)
class ChatLoadFailed(Message):
    """Choosing or loading the model failed: `message` is one line, never a traceback."""

    load_id: int
    message: str


@dataclass(kw_only=True)
class ChatReplyBegan(Message):
    """The engine took the turn: how many prompt tokens it processes and how many the cache already holds."""

    turn_id: int
    event: ReplyStarted


@dataclass(kw_only=True)
class ChatReplyNote(Message):
    """A line for the status while a reply has not begun to stream (MLX compiling its kernels before the first
    token)."""

    turn_id: int
    text: str


@dataclass(kw_only=True)
class ChatReplyProgress(Message):
    """A streaming reply so far: its text as runs of (text, thinking), and the tokens generated."""

    turn_id: int
    parts: tuple[tuple[str, bool], ...]
    tokens: int

    def can_replace(self, message: Message) -> bool:
        """Merged: each carries the whole reply so far, so the newest of the same turn says everything."""
        return isinstance(message, ChatReplyProgress) and message.turn_id == self.turn_id


@dataclass(kw_only=True)
class ChatExperts(Message):
    """A batch of a streaming reply's tqbench.stream.PageIn events (posted with the reply's progress, at most every
    ~50 ms), with the reply's rates so far."""

    turn_id: int
    events: tuple[PageIn, ...] = field(repr=False)
    rates: ReplyRates

    def can_replace(self, message: Message) -> bool:
        """Never merged: each batch holds routings the others lack (the expert view counts them all)."""
        return False


@dataclass(kw_only=True)
class ChatReplyEnded(Message):
    """A reply is over: finished (done.finish_reason "stop" or "length"), or stopped with Esc (done.finish_reason
    "cancelled": the partial reply stays in the conversation). `done` is None when the turn was stopped before the
    model began it: the conversation does not hold it."""

    turn_id: int
    parts: tuple[tuple[str, bool], ...]
    done: ReplyDone | None
    stream: StreamReport | None = None  # streaming: the engine's figures after the reply (ChatSession.stats)


@dataclass(kw_only=True)
class ChatReplyFailed(Message):
    """The reply raised: `message` is one line."""

    turn_id: int
    message: str


@dataclass(kw_only=True)
class ChatResetDone(Message):
    """The session forgot the conversation (tqbench.chat.session.ChatSession.reset); `error` is one line if it failed."""

    error: str | None = None


@dataclass(kw_only=True)
class ChatProfileExported(Message):
    """The learned profile was written (tqbench.chat.session.ChatSession.export_profile) to `file`, or `error` (one line)."""

    file: str | None
    routings: float = 0.0
    error: str | None = None


# ---- the Serve screen ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class ServeFeed(Message):
    """A batch of a server's live feed (tqbench.serve: its own Service's watcher, or an attached server's events),
    posted at most every ~100 ms: the page-ins and ended requests since the last batch, and the newest status."""

    feed_id: int
    page_ins: tuple[PageIn, ...] = field(repr=False)
    requests: tuple[RequestDone, ...]
    status: ServeStatus | None

    def can_replace(self, message: Message) -> bool:
        """Never merged: each batch holds routings and requests the others lack."""
        return False


@dataclass(kw_only=True)
class ServeFeedEnded(Message):
    """An attached server's feed ended: `message` says why in one line (unreachable, 401, the server stopped)."""

    feed_id: int
    message: str


@dataclass(kw_only=True)
class ServeStopped(Message):
    """The screen's server closed and its model was dropped; `error` is one line if closing failed."""

    error: str | None = None


# Messages that can come in bursts: each defines can_replace itself (see the module docstring).
HIGH_RATE: tuple[type[Message], ...] = (ScanProgress, FilterApplied, PlansReady, RecipeChosen, MachineChosen,
                                        ConvertProgress, ConvertCalibrating, ConvertSource, ConvertShardWritten,
                                        QuickEvalProgress, ChatConvertProgress, ChatReplyProgress, ChatExperts,
                                        ServeFeed)
