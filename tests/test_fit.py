"""Will it fit: sizes, verdicts, the auto cache budget, bytes per token, disk-bound ceilings, the disk test."""

from __future__ import annotations

import json
import os

import pytest

from tqbench.errors import TqbenchError
from tqbench.machine import Machine, default_gpu_limit, disk_cache_file, machine, measure_disk, raisable_limit
from tqbench.recipe.fit import Footprint, Verdict, assess, ceiling, parse_size

GiB, MiB = 2**30, 2**20
# Kimi K3 at tq3a-tqTe-down4-g64, as tests/test_plan.py derives it from the skeleton headers.
K3_PAGE = 2 * 3072 * (4 * 180 + 2 * 56) + 3584 * (4 * 384 + 2 * 48)  # 10,960,896 B
K3_STREAMED = 82_432 * K3_PAGE
K3_RESIDENT = 27_769_880_656
K3 = Footprint(total_bytes=K3_RESIDENT + K3_STREAMED, resident_bytes=K3_RESIDENT, streamed_bytes=K3_STREAMED,
               moe_layers=92, top_k=16, bytes_per_expert=K3_PAGE)
MAC_STUDIO = Machine(memory_bytes=512 * GiB, gpu_limit_bytes=512_000 * MiB,
                     raisable_limit_bytes=raisable_limit(512 * GiB, "darwin"), platform="darwin",
                     disk_bytes_per_s=1.8e9, disk_source="given")


@pytest.mark.parametrize("text,value", [
    ("512GB", 512 * 10**9), ("64GiB", 64 * 2**30), ("1.5TB", 1_500_000_000_000), ("4096", 4096),
    ("4096B", 4096), ("0.5KiB", 512), ("10 MB", 10_000_000), ("512000MiB", 512_000 * 2**20), ("2tib", 2 * 2**40),
    ("1.25G", 1_250_000_000),
    (" 7 gib ", 7 * 2**30), (".5GB", 500_000_000), (1234, 1234),
])
def test_parse_size_is_exact(text, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12XB", "GB", "", "1.1B", "-5GB", "1e9", "0.3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(TqbenchError):
        parse_size(text)


def test_k3_on_the_512gb_mac_studio() -> None:
    """The published run: 512 GB Mac Studio, iogpu.wired_limit_mb=512000, a 506 GB expert cache."""
    f = assess(K3, MAC_STUDIO)
    assert f.verdict is Verdict.STREAMING
    assert f.cache_budget_bytes == 512_000 * MiB - K3_RESIDENT - 3_000_000_000  # limit - resident - 3 GB
    assert round(f.cache_budget_bytes / 1e9) == 506
    assert f.command is None  # the limit is already above what we would advise
    # 92 layers x 16 experts x 10.96 MB = 16.1 GB a token; top-8 halves it
    assert f.bytes_per_token == 92 * 16 * 10_960_896 and round(f.bytes_per_token / 1e9, 1) == 16.1
    assert f.bytes_per_token_reduced == f.bytes_per_token // 2 and f.reduced_k == 8
    assert f.hit_rate == pytest.approx(f.cache_budget_bytes / K3_STREAMED)
    assert f.hit_rate_source == "cache fraction (uniform routing)"
    assert f.tok_s_ceiling == pytest.approx(1.8e9 / (16_134_438_912 * (1 - f.hit_rate)))
    assert f.tok_s_ceiling_reduced == pytest.approx(2 * f.tok_s_ceiling)


def test_ceiling_at_a_given_hit_rate() -> None:
    f = assess(K3, MAC_STUDIO, hit_rate=0.5, reduced_k=4)
    assert f.hit_rate_source == "given"
    assert f.tok_s_ceiling == pytest.approx(1.8e9 / (16_134_438_912 * 0.5))
    assert f.bytes_per_token_reduced == 92 * 4 * K3_PAGE
    assert assess(K3, MAC_STUDIO, hit_rate=1.0).tok_s_ceiling is None  # nothing read from disk
    assert ceiling(None, 10, 0.5) is None and ceiling(2e9, 1e9, 0.0) == 2.0


def test_resident_after_raising_the_wired_limit() -> None:
    mem = 64 * GiB  # 68,719,476,736 B; default Metal limit 75%, raisable to 90% (whole MiB)
    assert default_gpu_limit(mem, "darwin") == int(mem * 0.75)
    assert raisable_limit(mem, "darwin") == 58_982 * MiB
    fp = Footprint(total_bytes=55 * 10**9, resident_bytes=55 * 10**9, streamed_bytes=0)
    f = assess(fp, machine(mem, platform="darwin", disk_bytes_per_s=1e9))
    assert f.verdict is Verdict.RESIDENT_RAISED
    assert f.command == "sudo sysctl iogpu.wired_limit_mb=58982" and f.wired_limit_mb == 58_982
    assert f.cache_budget_bytes is None and f.tok_s_ceiling is None and f.hit_rate_source == "dense model"


def test_small_macs_get_two_thirds() -> None:
    assert default_gpu_limit(16 * 10**9, "darwin") == int(16e9 * 0.66)
    assert raisable_limit(16 * 10**9, "darwin") == 14_400_000_000 // MiB * MiB  # 90% of RAM
    assert raisable_limit(8 * 10**9, "darwin") == 6_500_000_000 // MiB * MiB  # RAM - 1.5 GB is below 90% here
    assert raisable_limit(8 * 10**9, "linux") is None


def test_resident_and_dense_verdicts() -> None:
    linux = machine(100 * 10**9, platform="linux")
    assert linux.gpu_limit_bytes == 100 * 10**9 and linux.raisable_limit_bytes is None
    assert assess(Footprint(total_bytes=90 * 10**9, resident_bytes=90 * 10**9, streamed_bytes=0),
                  linux).verdict is Verdict.RESIDENT
    # 97 + 3 GB reserve = 100 GB: fits exactly; one byte more does not, and a dense model cannot stream
    assert assess(Footprint(total_bytes=97 * 10**9, resident_bytes=97 * 10**9, streamed_bytes=0),
                  linux).verdict is Verdict.RESIDENT
    assert assess(Footprint(total_bytes=97 * 10**9 + 1, resident_bytes=97 * 10**9 + 1, streamed_bytes=0),
                  linux).verdict is Verdict.NO_FIT
    moe = Footprint(total_bytes=60 * 10**9, resident_bytes=10 * 10**9, streamed_bytes=50 * 10**9, moe_layers=10,
                    top_k=8, bytes_per_expert=10**6)
    f = assess(moe, linux)
    assert f.verdict is Verdict.RESIDENT and f.hit_rate == 1.0 and f.tok_s_ceiling is None
    assert f.cache_budget_bytes == 100 * 10**9 - 10 * 10**9 - 3 * 10**9


def test_streaming_and_does_not_fit() -> None:
    m = machine(20 * 10**9, platform="linux", disk_bytes_per_s=2e9)
    moe = Footprint(total_bytes=110 * 10**9, resident_bytes=10 * 10**9, streamed_bytes=100 * 10**9, moe_layers=10,
                    top_k=8, bytes_per_expert=10**7)
    f = assess(moe, m)
    assert f.verdict is Verdict.STREAMING
    assert f.needed_bytes == 10 * 10**9 + 3 * 10**9 + 8 * 10**7
    assert f.cache_budget_bytes == 7 * 10**9 and f.hit_rate == pytest.approx(0.07)
    assert f.tok_s_ceiling == pytest.approx(2e9 / (10 * 8 * 10**7 * 0.93))
    tiny = machine(12 * 10**9, platform="linux")
    lost = assess(moe, tiny)
    assert lost.verdict is Verdict.NO_FIT and lost.cache_budget_bytes is None and lost.command is None
    assert lost.hit_rate is None and lost.tok_s_ceiling is None and lost.bytes_per_token == 10 * 8 * 10**7


def test_bad_inputs() -> None:
    with pytest.raises(TqbenchError, match="hit rate"):
        assess(K3, MAC_STUDIO, hit_rate=1.5)
    with pytest.raises(TqbenchError, match="reduced K"):
        assess(K3, MAC_STUDIO, reduced_k=17)


def test_this_machine() -> None:
    m = machine()
    assert m.memory_bytes > 2**28 and m.gpu_limit_bytes > 0 and m.disk_bytes_per_s is None


def test_disk_measurement_is_cached_per_device(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "disk"
    data.mkdir()
    first = measure_disk(data, size=4 * MiB, block=MiB)
    assert first.bytes_per_s > 0 and not first.cached and first.size == 4 * MiB
    assert first.method in ("O_DIRECT", "F_NOCACHE", "fadvise DONTNEED", "page cache (may be inflated)")
    assert list(data.iterdir()) == []  # the test file is gone
    doc = json.loads(disk_cache_file().read_text())
    assert doc[str(os.stat(data).st_dev)]["bytes_per_s"] == first.bytes_per_s
    again = measure_disk(data, size=4 * MiB, block=MiB)
    assert again.cached and again.bytes_per_s == first.bytes_per_s and again.method == first.method
    fresh = measure_disk(data, size=2 * MiB, block=MiB, refresh=True)
    assert not fresh.cached and fresh.size == 2 * MiB


def test_disk_speed_is_measured_once_per_disk(tmp_path, monkeypatch) -> None:
    """The one disk figure every face uses: none cached at first, then one measurement on the checkpoint's disk,
    then that measurement again (for any directory on the same disk) without measuring."""
    from tqbench.machine import cached_disk_speed, disk_speed

    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert cached_disk_speed(ckpt) is None
    first = disk_speed(ckpt)
    assert not first.cached and first.directory == str(ckpt) and first.size == 128 * MiB
    assert first.source == f"measured, {first.method}"
    entry = json.loads(disk_cache_file().read_text())[str(os.stat(ckpt).st_dev)]
    assert entry["bytes_per_s"] == first.bytes_per_s > 0
    other = tmp_path / "other"
    other.mkdir()
    for again in (cached_disk_speed(other), disk_speed(other)):  # same disk: the same figure, not measured again
        assert again.cached and again.bytes_per_s == first.bytes_per_s
        assert again.source == f"measured earlier, {first.method}"
    assert list(ckpt.iterdir()) == []  # no test file left behind


def test_file_read_speed_reads_whole_blocks_of_existing_files_and_writes_nothing(tmp_path):
    from tqbench.machine import file_read_speed

    block = 1 << 20
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(os.urandom(3 * block + 100))  # 3 whole blocks
    b.write_bytes(os.urandom(block // 2))  # no whole block: skipped
    before = sorted(p.name for p in tmp_path.iterdir())
    s = file_read_speed([b, a], limit=8 * block, block=block)
    assert s.size == 3 * block and s.bytes_per_s > 0 and s.directory == str(tmp_path)
    assert s.method in ("O_DIRECT", "F_NOCACHE", "fadvise DONTNEED", "page cache (may be inflated)")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert file_read_speed([a], limit=2 * block, block=block).size == 2 * block  # the limit holds
    with pytest.raises(OSError):
        file_read_speed([b], block=block)
