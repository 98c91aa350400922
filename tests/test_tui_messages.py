"""tui.messages: every payload has a real type, and every high-rate message says whether queued copies merge."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from rich.text import Text
from textual.app import App
from textual.message import Message

import tqbench.chat.records
import tqbench.convert
import tqbench.convert.calibration_request
import tqbench.events
import tqbench.recipe
import tqbench.runtime.conversation
import tqbench.chat.choose
import tqbench.serve.service
import tqbench.source
import tqbench.stream
import tui.messages as messages
import tui.tally
from tqbench.events import ShardWritten, UnitConverted
from tui.tally import LayerStats

MESSAGES = [c for c in vars(messages).values()
            if isinstance(c, type) and issubclass(c, Message) and c.__module__ == messages.__name__]


def hints(cls) -> dict:
    """The resolved field types, given the engine modules the messages name under TYPE_CHECKING."""
    names = {"CalibrationRequest": tqbench.convert.calibration_request.CalibrationRequest}
    for module in (tqbench.convert, tqbench.events, tqbench.recipe, tqbench.source, tui.tally, tqbench.runtime.conversation,
                   tqbench.chat.choose, tqbench.chat.records, tqbench.stream, tqbench.serve.service):
        names.update({k: v for k, v in vars(module).items() if isinstance(v, type)})
    return typing.get_type_hints(cls, localns=names)


def test_every_payload_has_a_real_type():
    assert len(MESSAGES) >= 18
    for cls in MESSAGES:
        fields = {f.name for f in dataclasses.fields(cls)}
        types = hints(cls)
        for name in fields:
            hint = types[name]
            assert hint is not typing.Any and typing.Any not in typing.get_args(hint), (cls.__name__, name)
            assert hint not in (list, dict, tuple, object), f"{cls.__name__}.{name}: {hint} says nothing of items"
    assert hints(messages.ConvertBegan)["event"] is tqbench.events.ConvertStarted
    assert hints(messages.DestinationChecked)["layout"] is tqbench.convert.Layout
    assert hints(messages.ConvertProgress)["layers"] == tuple[LayerStats, ...]
    assert hints(messages.PlansReady)["plans"] == dict[tqbench.recipe.Recipe, tqbench.recipe.Plan]


def test_importing_the_messages_does_not_import_mlx():
    import subprocess
    import sys

    code = "import sys, tui.messages; print('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_high_rate_messages_say_whether_they_merge():
    doc = messages.__doc__
    for cls in messages.HIGH_RATE:
        assert "can_replace" in vars(cls), f"{cls.__name__} does not say whether it merges"
        assert cls.__name__ in doc, f"{cls.__name__} is not in the module docstring"


def unit(i: int) -> UnitConverted:
    return UnitConverted(name=f"t{i}", layer=0, expert=None, bytes_in=1, bytes_out=1, rel_error=None, done_in=i,
                         total_in=10, elapsed=0.1, rate=1.0, eta=None)


class Sink(App[None]):
    """Records what its handlers receive."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[Message] = []

    def on_convert_shard_written(self, message: messages.ConvertShardWritten) -> None:
        self.got.append(message)

    def on_convert_progress(self, message: messages.ConvertProgress) -> None:
        self.got.append(message)

    def on_machine_chosen(self, message: messages.MachineChosen) -> None:
        self.got.append(message)


async def test_queued_progress_merges_and_shards_do_not():
    app = Sink()
    async with app.run_test() as pilot:
        # Posted in one burst, as a relay worker does while the UI thread is busy.
        shards = [messages.ConvertShardWritten(run_id=1, event=ShardWritten(index=i, total=5, file=f"s{i}", bytes=1,
                                                                            sha256="x")) for i in range(1, 6)]
        progress = [messages.ConvertProgress(run_id=1, unit=unit(i),
                                             layers=(LayerStats(layer=0, units=10, done=i),)) for i in range(5)]
        other_run = messages.ConvertProgress(run_id=2, unit=unit(9), layers=())
        for m in [*shards, *progress, other_run]:
            app.post_message(m)
        await pilot.pause()
        got_shards = [m for m in app.got if isinstance(m, messages.ConvertShardWritten)]
        got_progress = [m for m in app.got if isinstance(m, messages.ConvertProgress)]
        assert [m.event.index for m in got_shards] == [1, 2, 3, 4, 5]  # every shard counts
        assert got_progress[-2:] == [progress[-1], other_run]  # the newest of each run is never dropped
        assert len(got_progress) < len(progress) + 1  # queued ones of the same run merged


def test_payload_types_match_what_the_workers_post(tmp_path):
    """The annotations name what is really posted (checked on real values, not on the annotations alone)."""
    from tqbench.demo import DemoSpec, write_source

    src = write_source(tmp_path / "src", DemoSpec(), seed=0)
    ckpt = tqbench.source.open_checkpoint(src)
    sources = tqbench.recipe.group_sources(ckpt)
    recipe = tqbench.recipe.Recipe.parse("tq4")
    plan = tqbench.recipe.make_plan(sources, recipe)
    lay = tqbench.convert.layout(ckpt, recipe)
    status = tqbench.convert.destination_status(lay, tmp_path / "out")
    values = [
        messages.CheckpointLoaded(load_id=1, checkpoint=ckpt, summary=tqbench.source.summarize(ckpt),
                                  tensors=tqbench.source.select_tensors(ckpt)),
        messages.SourcesGrouped(checkpoint=ckpt, sources=sources),
        messages.PlansReady(request_id=1, checkpoint=ckpt, plans={recipe: plan}),
        messages.RecipeChosen(recipe=recipe),
        messages.DestinationChecked(request_id=1, key=(ckpt, recipe, 5 << 30), layout=lay, status=status,
                                    dest=tmp_path / "out"),
        messages.DestinationChecked(request_id=2, key=(ckpt, recipe, 5 << 30), layout=lay, status=status,
                                    dest=tmp_path / "out",
                                    calibration=tqbench.convert.calibration_request.read_calibration(texts="",
                                                                                                     tokens="8192")),
        messages.ScanStarted(load_id=1, text="opening", path=Path(src)),
        messages.FilterApplied(filter_id=1, pattern="", rows=[(t, (Text(t.entry.name),)) for t in ckpt.tensors[:3]],
                               matches=3, total=3),
    ]
    for m in values:
        for name, hint in hints(type(m)).items():
            if name in {f.name for f in dataclasses.fields(type(m))}:
                assert_is(getattr(m, name), hint, f"{type(m).__name__}.{name}")


def assert_is(value, hint, where: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        assert any(_matches(value, a) for a in args), where
        return
    assert _matches(value, hint), f"{where}: {type(value).__name__} is not {hint}"


def _matches(value, hint) -> bool:
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        return isinstance(value, hint)
    if not isinstance(value, origin):
        return False
    if origin is list:
        return all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
    return True


def test_download_progress_merges_and_a_removal_never_does():
    from tqbench.events import SourceProgress, SourceRemoved
    from tui.messages import ConvertSource

    older = ConvertSource(run_id=1, event=SourceProgress(file="a.safetensors", downloaded=10, to_download=100, rate=5.0,
                                                         on_disk=50, waiting=False))
    newer = ConvertSource(run_id=1, event=SourceProgress(file="a.safetensors", downloaded=20, to_download=100, rate=5.0,
                                                         on_disk=50, waiting=False))
    removal = ConvertSource(run_id=1, event=SourceRemoved(file="a.safetensors", bytes=50, on_disk=0))
    other_run = ConvertSource(run_id=2, event=SourceProgress(file="a.safetensors", downloaded=30, to_download=100,
                                                             rate=5.0, on_disk=50, waiting=False))
    assert newer.can_replace(older)
    assert not newer.can_replace(removal) and not removal.can_replace(older)
    assert not other_run.can_replace(newer)
