"""Checkpoints straight from the hub, against the loopback hub (tests/hubserver.py) and the real huggingface_hub client:
plans from headers alone (the bytes fetched counted by the server), conversions that stream their source (the disk
they hold measured as they run, the output identical to converting a local copy), kill -9 anywhere, a dropped
connection, a revision that moved."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import tqbench
from conftest import converted, demo_source, file_bytes
from hubserver import HubServer
from tqbench import units
from tqbench.convert import convert
from tqbench.convert.pipeline import READ_AHEAD
from tqbench.demo import DemoSpec
from tqbench.events import ConvertFinished, ConvertStarted, ShardWritten, SourceRemoved
from tqbench.recipe import Recipe

REPO = "org/demo"
RECIPE = "tq3a-tqTe-down4-g64"
SHARD = 150_000  # several output shards for the ~1.3 MB source (as tests/test_convert.py)
SPEC = DemoSpec(routed_expert_hidden_size=64, moe_intermediate_size=128)
CHUNK = 16 * 1024  # huggingface_hub's download chunk, shrunk so a 330 KB shard downloads in many pieces
# Files that say where and when they were made, not what was converted.
RUN_RECORDS = {"convert-report.json", ".tqbench-convert.json"}


@pytest.fixture(scope="module")
def source() -> Path:
    return demo_source(SPEC)  # shared with other modules (read-only)


@pytest.fixture(scope="module")
def reference(source) -> Path:
    """The same source converted from its directory (shared with other modules, read-only)."""
    return converted(RECIPE, SPEC, SHARD)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A loopback hub serving nothing yet, with this process (and its children) pointed at it and a fresh cache."""
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def header_bytes(shard: Path) -> int:
    """8 + the JSON header's length, read from the file itself."""
    with open(shard, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def outputs(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in file_bytes(folder).items() if k not in RUN_RECORDS}


def deleted_but_open() -> list[str]:
    """Files this process holds open that were deleted: their disk space is not free yet."""
    found = []
    for p in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(p)
        except OSError:  # closed meanwhile
            continue
        if target.endswith(" (deleted)"):
            found.append(target)
    return found


def source_on_disk(cache: Path) -> int:
    """Bytes of shard data in the Hugging Face cache now: complete blobs and partial downloads of the shards (the
    small files, config and tokenizer, are not counted). Measured from the directory, not from tqbench's events."""
    blobs = cache / "models--org--demo" / "blobs"
    total = 0
    for p in blobs.iterdir() if blobs.is_dir() else ():
        try:
            size = p.stat().st_size
        except FileNotFoundError:  # a download finishing renames its partial file while we look
            continue
        total += size if size > 100_000 else 0
    return total


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    """tqbench in a fresh process, with huggingface_hub's download chunk shrunk to CHUNK."""
    code = (f"import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = {CHUNK}; "
            "from tqbench.cli.main import run; run()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **env})


def convert_cli(env: dict, dst: Path, *extra: str, repo: str = REPO) -> subprocess.CompletedProcess:
    return cli(env, "convert", "--hf-path", repo, "--mlx-path", str(dst), "--recipe", RECIPE,
               "--shard-size", str(SHARD), *extra)


# --- inspect and plan from headers ---------------------------------------------------------------------------------


def test_inspect_and_plan_read_headers_only(hub, source, capsys, monkeypatch):
    commit = hub.add_repo(REPO, source)
    got = tqbench(capsys, monkeypatch, "inspect", REPO, "--json")
    assert got.code == 0, got.err
    remote = json.loads(got.out)
    local = json.loads(tqbench(capsys, monkeypatch, "inspect", source, "--json").out)
    # Reported exactly as for the directory, named by the repository at its commit.
    assert remote.pop("path") == f"{REPO}@{commit}"
    hub_record = remote.pop("hub")
    assert local.pop("hub") is None and local.pop("path") == str(source)
    assert remote == local
    # What the server sent of each shard is its header, to the byte; of the index only its first 4 KB (the metadata;
    # the file listing is one complete model-0000N-of-00004 series, so its weight_map is not needed); config.json.
    sent = hub.stats().file_bytes
    headers = {p.name: header_bytes(p) for p in shards(source)}
    assert {f: sent.get(f, 0) for f in headers} == headers
    assert sent["model.safetensors.index.json"] == 4096
    assert sent["config.json"] == (source / "config.json").stat().st_size
    assert hub_record["fetched_bytes"] == sum(headers.values()) + 4096 + sent["config.json"]
    assert hub_record["commit"] == commit and hub_record["revision"] == "main"

    # Again: the headers come from tqbench's cache (keyed by commit), config.json from the Hugging Face cache.
    hub.reset_stats()
    got = tqbench(capsys, monkeypatch, "plan", REPO, "--json", "--disk-gbps", "2")
    assert got.code == 0, got.err
    doc = json.loads(got.out)
    assert doc["hub"]["fetched_bytes"] == 0 and doc["hub"]["headers_cached"] == len(headers)
    assert sum(hub.stats().file_bytes.values()) == 0
    local_plan = json.loads(tqbench(capsys, monkeypatch, "plan", source, "--json", "--disk-gbps", "2").out)
    for remote_plan, plan in zip(doc["plans"], local_plan["plans"]):
        disk = remote_plan.pop("disk_from_hub")
        assert remote_plan == plan
        two_largest = sum(sorted((p.stat().st_size for p in shards(source)), reverse=True)[:2])
        assert disk["source_window_bytes"] == two_largest
        assert disk["total_bytes"] == plan["bytes"]["total"] + two_largest


@pytest.mark.slow
def test_k3_is_planned_from_its_headers(hub, k3_skeleton, capsys, monkeypatch):
    """The full K3 layout (292 shards, 497k tensors): the plan fetches each shard's header and config.json, nothing
    else (the 59 MB index is not needed when the listing is one complete series)."""
    hub.add_repo("moonshotai/Kimi-K3", k3_skeleton)
    got = tqbench(capsys, monkeypatch, "plan", "moonshotai/Kimi-K3", "--json", "--memory", "512GB",
                  "--disk-gbps", "5")
    assert got.code == 0, got.err
    fetched = json.loads(got.out)["hub"]["fetched_bytes"]
    headers = sum(header_bytes(p) for p in shards(k3_skeleton))
    assert fetched == headers + (k3_skeleton / "config.json").stat().st_size + 4096
    sent = hub.stats().file_bytes
    assert sent.keys() == {p.name for p in shards(k3_skeleton)} | {"config.json", "model.safetensors.index.json"}
    assert sent["model.safetensors.index.json"] == 4096
    assert 70e6 < fetched < 80e6  # every header of 497k tensors; 1.56 TB of shards


def test_a_missing_repository_or_revision_is_one_line(hub, source, capsys, monkeypatch):
    hub.add_repo(REPO, source)
    for ref, words in ((f"{REPO}x", "no such repository"), (f"{REPO}@v9", "no such revision")):
        got = tqbench(capsys, monkeypatch, "plan", ref)
        assert got.code == 1
        assert got.err.count("\n") == 1 and words in got.err and ref in got.err, got.err


# --- converting while the source streams in ------------------------------------------------------------------------


@pytest.mark.parametrize("read_ahead", [0, READ_AHEAD])  # the CPU's default, and a GPU's (spans many test shards)
def test_conversion_from_the_hub_holds_two_shards_and_equals_a_local_one(hub, source, reference, tmp_path,
                                                                        monkeypatch, read_ahead):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    commit = hub.add_repo(REPO, source)
    largest = sorted((p.stat().st_size for p in shards(source)), reverse=True)
    cache, dst = tmp_path / "hf-cache", tmp_path / "out"
    high, removed = 0, []
    for ev in convert(REPO, dst, Recipe.parse(RECIPE), SHARD, read_ahead=read_ahead):
        high = max(high, source_on_disk(cache))  # the generator is paused here: the disk as it is at this point
        if isinstance(ev, SourceRemoved):
            removed.append(ev.file)
            assert not [f for f in deleted_but_open() if "hf-cache" in f]  # removed means its space is free
        done = ev
    assert isinstance(done, ConvertFinished)
    assert largest[0] < high <= largest[0] + largest[1]  # more than one shard at a time, never more than two
    assert removed == [p.name for p in shards(source)]  # each, once converted
    assert source_on_disk(cache) == 0
    assert outputs(dst) == outputs(reference)
    assert json.loads((dst / "convert-report.json").read_text())["source"] == f"{REPO}@{commit}"
    sent = hub.stats().file_bytes  # each shard's header (opening), then the shard once
    assert {p.name: sent[p.name] for p in shards(source)} == {p.name: header_bytes(p) + p.stat().st_size
                                                             for p in shards(source)}


def test_a_dropped_connection_resumes_mid_shard(hub, source, reference, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    hub.add_repo(REPO, source)
    second = shards(source)[1]
    for ev in convert(REPO, tmp_path / "out", Recipe.parse(RECIPE), SHARD):
        if isinstance(ev, ConvertStarted):  # the headers are read: the next request for it is its download
            hub.drop_once(second.name, 10 * CHUNK)
    assert outputs(tmp_path / "out") == outputs(reference)
    ranges = [r.range for r in hub.stats().log if r.path.startswith("/cdn/") and r.path.endswith(second.name)]
    assert ranges[-2:] == [None, f"bytes={10 * CHUNK}-"]  # the second request picks up where the first broke off
    assert hub.stats().file_bytes[second.name] == header_bytes(second) + second.stat().st_size


def test_only_its_own_downloads_go_and_keep_source_keeps_them(hub, source, reference, tmp_path, monkeypatch):
    from huggingface_hub import hf_hub_download

    commit = hub.add_repo(REPO, source)
    cache = tmp_path / "hf-cache"
    theirs = shards(source)[2].name  # in the cache before tqbench ran: the user's, read in place and kept
    hf_hub_download(REPO, theirs, revision=commit, cache_dir=cache, endpoint=hub.endpoint)
    snapshot = cache / "models--org--demo" / "snapshots" / commit
    events = list(convert(REPO, tmp_path / "out", Recipe.parse(RECIPE), SHARD))
    assert sorted(e.file for e in events if isinstance(e, SourceRemoved)) == sorted(
        p.name for p in shards(source) if p.name != theirs)
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == [theirs]
    assert (snapshot / theirs).read_bytes() == (source / theirs).read_bytes()
    assert outputs(tmp_path / "out") == outputs(reference)

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "kept"))
    events = list(convert(REPO, tmp_path / "out2", Recipe.parse(RECIPE), SHARD, keep_source=True))
    assert not any(isinstance(e, SourceRemoved) for e in events)
    kept = tmp_path / "kept" / "models--org--demo" / "snapshots" / commit
    assert {p.name: p.read_bytes() for p in kept.glob("*.safetensors")} == {
        p.name: p.read_bytes() for p in shards(source)}


def test_too_little_disk_is_refused_before_a_byte_is_downloaded(hub, source, tmp_path, capsys, monkeypatch):
    hub.add_repo(REPO, source)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    got = tqbench(capsys, monkeypatch, "convert", "--hf-path", REPO, "--mlx-path", tmp_path / "out", "--recipe",
                  RECIPE, "--shard-size", SHARD)
    two_largest = sum(sorted((p.stat().st_size for p in shards(source)), reverse=True)[:2])
    assert got.code == 1 and got.err.count("\n") == 1, got.err
    assert f"source shards {units.size(two_largest)} at once), {units.size(1000)} free" in got.err, got.err
    sent = hub.stats().file_bytes  # the headers, to plan; no shard's data
    assert {p.name: sent[p.name] for p in shards(source)} == {p.name: header_bytes(p) for p in shards(source)}


# --- kill -9 anywhere, a moved revision ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["download:5", "download:30", "unit:40", "mark:1", "mark:2", "final:1"])
def test_kill_anywhere_and_the_rerun_is_identical_without_fetching_again(hub, source, reference, tmp_path, kill):
    commit = hub.add_repo(REPO, source)
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "TQBENCH_CACHE_DIR")}
    dst, cache = tmp_path / "out", tmp_path / "hf-cache" / "models--org--demo"
    killed = convert_cli({**env, "TQBENCH_TEST_KILL": kill}, dst)
    assert killed.returncode == -9, killed.stderr
    # What the kill left: shards complete on disk, shards converted and removed, at most one partial download.
    linked = {p.name for p in (cache / "snapshots" / commit).glob("*.safetensors")}
    removed = {ln.split()[2] for ln in killed.stderr.splitlines() if ln.startswith("  removed source")}
    partial = sum(p.stat().st_size for p in (cache / "blobs").glob("*.tqbench.incomplete"))
    assert (partial > 0) == kill.startswith("download")  # killed mid-download: part of a shard is on disk
    hub.reset_stats()
    resumed = convert_cli(env, dst)
    assert resumed.returncode == 0, resumed.stderr
    assert outputs(dst) == outputs(reference)
    assert source_on_disk(tmp_path / "hf-cache") == 0
    again = hub.stats().file_bytes  # headers come from tqbench's cache now: only shard data
    for p in shards(source):
        if p.name in linked | removed:
            assert again.get(p.name, 0) == 0, p.name  # on disk, or converted durably: never fetched again
    rest = sum(p.stat().st_size for p in shards(source) if p.name not in linked | removed)
    assert sum(again.get(p.name, 0) for p in shards(source)) == rest - partial  # a cut-off download continues


@pytest.mark.slow
def test_a_moved_revision_is_refused_and_the_old_commit_finishes(hub, source, reference, tmp_path):
    old = hub.add_repo(REPO, source)
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "TQBENCH_CACHE_DIR")}
    dst = tmp_path / "out"
    assert convert_cli({**env, "TQBENCH_TEST_KILL": "unit:60"}, dst).returncode == -9
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    (moved / "generation_config.json").write_text('{"temperature": 0.5}\n')
    new = hub.add_repo(REPO, moved)
    refused = convert_cli(env, dst)
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert "\n" not in line and old[:12] in line and new[:12] in line and f"--hf-path {REPO}@{old}" in line, line
    finished = convert_cli(env, dst, repo=f"{REPO}@{old}")
    assert finished.returncode == 0, finished.stderr
    assert outputs(dst) == outputs(reference)


def test_progress_reaches_the_cli(hub, source, tmp_path):
    """Piped: the download and removal lines between the conversion's, and one ETA in the progress lines."""
    hub.add_repo(REPO, source)
    env = {k: os.environ[k] for k in ("HF_ENDPOINT", "HF_HUB_CACHE", "TQBENCH_CACHE_DIR")}
    done = convert_cli(env, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"converting {REPO}@")
    assert [ln.split()[2] for ln in lines if ln.startswith("  removed source")] == [p.name for p in shards(source)]
    assert any(" s left" in ln for ln in lines if ln.startswith("convert "))


# --- the TUI -------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # the TUI converting from a loopback hub (~5 s)
async def test_tui_opens_a_repository_and_converts_it_while_it_downloads(hub, source, reference, tmp_path,
                                                                         monkeypatch):
    from textual.widgets import Input, Static

    from tui.app import TqbenchApp
    from tui.screens.convert import ConvertScreen
    from tui.screens.open import OpenScreen
    from tui.widgets.summary import SummaryPanel
    from tui_helpers import settle, wait_for

    commit = hub.add_repo(REPO, source)
    monkeypatch.chdir(tmp_path)  # the default output of a hub source is ./<name>-<recipe>
    app = TqbenchApp(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("o")
        assert isinstance(app.screen, OpenScreen)
        app.screen.query_one(Input).value = REPO
        await pilot.press("enter")
        await wait_for(pilot, lambda: f"{REPO}@main" in str(app.screen.query_one(SummaryPanel).render()),
                       "the repository's summary")
        summary = str(app.screen.query_one(SummaryPanel).render())
        fetched = sum(header_bytes(p) for p in shards(source)) + 4096 + (source / "config.json").stat().st_size
        assert f"{REPO}@main ({commit[:12]})" in summary and f"{units.size(fetched)} fetched" in summary
        assert app.screen.sub_title == f"Source: {REPO}@main ({commit[:12]})"
        await pilot.press("c")
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, ConvertScreen)
        assert screen.query_one("#dest", Input).value == f"demo-{RECIPE}"
        screen.query_one("#shard-size", Input).value = str(SHARD)
        await settle(pilot)
        await pilot.press("r")
        await wait_for(pilot, lambda: screen.finished_event is not None, "the conversion", seconds=120)
        downloads = str(screen.query_one("#convert-download", Static).render())  # the last shard's removal
        assert downloads.startswith("source  removed model-00004-of-00004.safetensors"), downloads
    assert outputs(tmp_path / f"demo-{RECIPE}") == outputs(reference)
    assert source_on_disk(tmp_path / "hf-cache") == 0


def test_an_output_started_from_another_commit_is_a_conflict_before_it_starts(hub, source, tmp_path):
    """What the TUI's Convert screen asks before a run: an output begun from a commit the revision has moved past
    needs replacing (after the user agrees), never resuming with other bytes."""
    from tqbench.convert import destination_status, layout
    from tqbench.source import open_checkpoint

    old = hub.add_repo(REPO, source)
    dst = tmp_path / "out"
    run = convert(REPO, dst, Recipe.parse(RECIPE), SHARD)
    for ev in run:
        if isinstance(ev, ShardWritten):
            break
    run.close()  # stopped cleanly after the first shard: resumable
    assert destination_status(layout(open_checkpoint(REPO), Recipe.parse(RECIPE), SHARD), dst).state == "resumable"
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    (moved / "generation_config.json").write_text('{"temperature": 0.5}\n')
    new = hub.add_repo(REPO, moved)
    status = destination_status(layout(open_checkpoint(REPO), Recipe.parse(RECIPE), SHARD), dst)
    assert status.state == "conflict"
    assert old[:12] in status.detail and new[:12] in status.detail and f"{REPO}@{old}" in status.detail
    at_old = destination_status(layout(open_checkpoint(f"{REPO}@{old}"), Recipe.parse(RECIPE), SHARD), dst)
    assert at_old.state == "resumable" and at_old.done_shards == 1


def test_a_calibrated_recipe_from_the_hub_is_refused_before_a_byte_is_downloaded(hub, source, tmp_path, capsys,
                                                                                  monkeypatch):
    """Calibrated rounding runs the source model over text, which needs every source shard on disk at once; a
    conversion from the hub holds two: one line saying so, and no shard's data fetched."""
    hub.add_repo(REPO, source)
    got = tqbench(capsys, monkeypatch, "convert", "--hf-path", REPO, "--mlx-path", tmp_path / "out", "--recipe",
                  RECIPE + "-cal", "--shard-size", SHARD)
    assert got.code == 1 and got.err.count("\n") == 1, got.err
    assert "calibrated rounding (cal) runs the source model" in got.err and "download" in got.err, got.err
    sent = hub.stats().file_bytes  # the headers, to plan; no shard's data
    assert {p.name: sent[p.name] for p in shards(source)} == {p.name: header_bytes(p) for p in shards(source)}
    assert not (tmp_path / "out").exists()
