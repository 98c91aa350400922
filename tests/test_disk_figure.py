"""One disk, one figure: `tqbench plan`, the chat engine and the TUI's Recipe screen show the same measured read
bandwidth for the same disk, measured once (by whichever runs first), cached per disk, and each says where it comes
from. Every test runs with its own cache directory (conftest), so "nothing cached yet" is real."""

from __future__ import annotations

import json
import os

import pytest
from textual.widgets import Static

from cli_helpers import tqbench
from tqbench.machine import DISK_BLOCK, GB, cached_disk_speed, disk_cache_file, disk_key, disk_speed


def _disk_line(bytes_per_s: float, source: str) -> str:
    """How `tqbench plan`'s machine line says a disk figure."""
    return f"disk {bytes_per_s / GB:.2f} GB/s ({source})"


def test_plan_measures_the_disk_of_a_resident_model_once_and_says_so(small_k3, capsys, monkeypatch):
    """A model that fits (nothing to stream) still gets its disk's figure: measured on the first run, the cached
    figure on the next, the same in --json; a given figure says so."""
    def plan(*args: str) -> str:
        r = tqbench(capsys, monkeypatch, "plan", small_k3, "--memory", "512GB", *args)
        assert r.code == 0 and "Traceback" not in r.err, r.err
        return r.out

    first = plan()
    measured = cached_disk_speed(small_k3)
    assert measured is not None and measured.directory == str(small_k3) and not measured.own_files
    assert _disk_line(measured.bytes_per_s, f"measured, {measured.method}") in first
    assert _disk_line(measured.bytes_per_s, f"measured earlier, {measured.method}") in plan()
    machine = json.loads(plan("--json"))["machine"]
    assert (machine["disk_bytes_per_s"], machine["disk_source"]) == (measured.bytes_per_s,
                                                                     f"measured earlier, {measured.method}")
    assert not any(p.name.startswith(".tqbench-disk") for p in small_k3.iterdir())  # no test file left behind
    assert "disk 1.50 GB/s (given)" in plan("--disk-gbps", "1.5")


def test_a_checkpoint_that_takes_no_test_file_is_measured_from_its_own_files(tmp_path):
    """A path that is no writable directory (here a shard file itself) is measured by reading it, nothing written,
    and the figure is cached for its disk: any directory on that disk then shows it, saying where it came from."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shard = ckpt / "model-00001-of-00001.safetensors"
    shard.write_bytes(os.urandom(DISK_BLOCK + 123))  # one whole read block
    before = sorted(p.name for p in ckpt.iterdir())
    read = disk_speed(shard)
    assert read.own_files and read.size == DISK_BLOCK and not read.cached and read.bytes_per_s > 0
    assert read.source == f"measured, {read.method}, reading the checkpoint's files"
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert list(json.loads(disk_cache_file().read_text())) == [disk_key(ckpt)]
    for again in (cached_disk_speed(ckpt), disk_speed(ckpt), disk_speed(tmp_path)):  # the same disk: not measured
        assert again.cached and again.bytes_per_s == read.bytes_per_s
        assert again.source == f"measured earlier, {read.method}, reading the checkpoint's files"
    assert sorted(p.name for p in ckpt.iterdir()) == before


@pytest.mark.slow  # a conversion, a model load and a TUI run (~20 s)
async def test_chat_plan_and_the_recipe_screen_show_one_figure_for_one_disk(tmp_path, capsys, monkeypatch):
    """The order a new user met three figures in: a streamed chat first (nothing cached), then `tqbench plan` on the
    source beside it, then the TUI's Recipe screen on that source. All three show the chat's measurement."""
    from test_tui_recipe import open_recipe_screen
    from tqbench.chat.request import ChatRequest, ProfileOptions, SamplingRequest, StreamRequest
    from tqbench.chat.session import ChatSession
    from tqbench.convert import convert
    from tqbench.demo import DemoSpec, write_source
    from tqbench.destination import default_dest
    from tqbench.recipe import Recipe
    from tui.app import TqbenchApp
    from tui.widgets.recipe_editor import RecipeEditor

    src = write_source(tmp_path / "src", DemoSpec(), seed=0)
    model = default_dest(src, "tq4")
    list(convert(src, model, Recipe.parse("tq4")))
    assert cached_disk_speed(src) is None and cached_disk_speed(model) is None

    chat = ChatSession()
    try:
        request = ChatRequest(model=str(model), sampling=SamplingRequest(max_tokens=2), chat_template=False,
                              stream=StreamRequest(budget="200kB", workers=1),
                              profile=ProfileOptions(store=str(tmp_path / "store")))
        with chat.open(request) as job:
            loaded = job.result()[-1]
        with chat.reply("def f(x):") as job:
            job.result()
        measured = loaded.stream.disk
        stats = chat.stats().to_dict()
    finally:
        chat.close()
    assert measured is not None and not measured.cached and measured.directory == str(model)
    assert measured.source == f"measured, {measured.method}"
    assert (stats["disk_bytes_per_s"], stats["disk_source"]) == (measured.bytes_per_s, measured.source)
    assert list(json.loads(disk_cache_file().read_text())) == [disk_key(src)]  # one disk, one entry
    earlier = f"measured earlier, {measured.method}"

    r = tqbench(capsys, monkeypatch, "plan", src)
    assert r.code == 0 and "Traceback" not in r.err, r.err
    assert _disk_line(measured.bytes_per_s, earlier) in r.out
    r = tqbench(capsys, monkeypatch, "plan", src, "--json")
    machine = json.loads(r.out)["machine"]
    assert (machine["disk_bytes_per_s"], machine["disk_source"]) == (measured.bytes_per_s, earlier)

    app = TqbenchApp(src)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_recipe_screen(pilot, disk="")  # the disk field empty: the checkpoint's disk
        editor = screen.query_one(RecipeEditor)
        assert (editor.machine.disk_bytes_per_s, editor.machine.disk_source) == (measured.bytes_per_s, earlier)
        assert f"disk: {earlier}" in str(screen.query_one("#machine-note", Static).render())
        assert screen.query_one("#disk").placeholder == f"{measured.bytes_per_s / GB:.2f}"
    assert list(json.loads(disk_cache_file().read_text())) == [disk_key(src)]  # nobody measured again
