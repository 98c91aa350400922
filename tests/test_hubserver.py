"""The loopback hub (tests/hubserver.py) against the real huggingface_hub client, over real HTTP."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers, http_backoff

from hubserver import HubServer, RequestRecord

REPO = "org/tiny"
CONFIG = b'{"model_type": "tiny", "hidden_size": 64}\n'


def safetensors_bytes(n_floats: int, seed: int = 0) -> bytes:
    """A real safetensors file: one F32 tensor of `n_floats` deterministic values."""
    data = hashlib.shake_256(f"seed{seed}".encode()).digest(4 * n_floats)
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, len(data)]}}).encode()
    return struct.pack("<Q", len(header)) + header + data


def write_repo(folder: Path, config: bytes = CONFIG, seed: int = 0) -> Path:
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(safetensors_bytes(50_000, seed))  # 200 KB, an LFS file by its name
    (folder / "tokenizer" / "vocab.txt").write_bytes(b"a\nb\nc\n")
    (folder / ".gitattributes").write_bytes(b"*.safetensors filter=lfs\n")  # a dotfile: not published
    return folder


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def repo(tmp_path, hub) -> tuple[Path, str]:
    folder = write_repo(tmp_path / "v1")
    return folder, hub.add_repo(REPO, folder)


def download(hub: HubServer, cache: Path, filename: str, **kwargs) -> bytes:
    return Path(hf_hub_download(REPO, filename, cache_dir=cache, endpoint=hub.endpoint, **kwargs)).read_bytes()


def test_model_info_lists_the_files_with_sizes_and_hashes(hub, repo):
    folder, sha = repo
    info = HfApi(endpoint=hub.endpoint).model_info(REPO, files_metadata=True)
    assert (info.id, info.sha, info.private) == (REPO, sha, False)
    assert len(sha) == 40 and int(sha, 16) >= 0
    siblings = {s.rfilename: s for s in info.siblings}
    assert sorted(siblings) == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    for name, sibling in siblings.items():
        assert sibling.size == (folder / name).stat().st_size
    config = siblings["config.json"]
    git_oid = subprocess.run(["git", "hash-object", str(folder / "config.json")], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert (config.blob_id, config.lfs) == (git_oid, None)
    weights = (folder / "model.safetensors").read_bytes()
    lfs = siblings["model.safetensors"].lfs
    assert (lfs.sha256, lfs.size) == (hashlib.sha256(weights).hexdigest(), len(weights))
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{lfs.sha256}\nsize {len(weights)}\n"
    assert lfs.pointer_size == len(pointer)

    plain = HfApi(endpoint=hub.endpoint).model_info(REPO)  # without ?blobs=true: names only
    assert [(s.rfilename, s.size, s.lfs) for s in plain.siblings][0] == ("config.json", None, None)


def test_download_small_and_redirected_files_then_cached(hub, repo, tmp_path):
    folder, sha = repo
    cache = tmp_path / "hf"
    assert download(hub, cache, "config.json") == CONFIG
    assert download(hub, cache, "model.safetensors") == (folder / "model.safetensors").read_bytes()
    weights_size = (folder / "model.safetensors").stat().st_size
    stats = hub.stats()
    assert dict(stats.file_bytes) == {"config.json": len(CONFIG), "model.safetensors": weights_size}
    assert stats.body_bytes == len(CONFIG) + weights_size
    sha256 = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    # The LFS file's HEAD stops at the 302 (the CDN is another origin); the GET goes straight to the CDN.
    assert stats.log == (
        RequestRecord("HEAD", f"/{REPO}/resolve/main/config.json", None, 200),
        RequestRecord("GET", f"/{REPO}/resolve/main/config.json", None, 200),
        RequestRecord("HEAD", f"/{REPO}/resolve/main/model.safetensors", None, 302),
        RequestRecord("GET", f"/cdn/{sha256}/model.safetensors", None, 200),
    )
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == sha

    hub.reset_stats()
    assert download(hub, cache, "config.json") == CONFIG
    assert download(hub, cache, "model.safetensors") == (folder / "model.safetensors").read_bytes()
    stats = hub.stats()
    assert (stats.body_bytes, dict(stats.file_bytes), stats.requests) == (0, {}, 2)
    assert [r.method for r in stats.log] == ["HEAD", "HEAD"]


def test_range_get_sends_exactly_the_range(hub, repo):
    folder, _ = repo
    weights = (folder / "model.safetensors").read_bytes()
    url = hf_hub_url(REPO, "model.safetensors", endpoint=hub.endpoint)
    response = http_backoff("GET", url, headers={**build_hf_headers(), "Range": "bytes=8-99"})
    assert (response.status_code, response.content) == (206, weights[8:100])
    assert response.headers["Content-Range"] == f"bytes 8-99/{len(weights)}"
    stats = hub.stats()
    assert (dict(stats.file_bytes), stats.body_bytes) == ({"model.safetensors": 92}, 92)
    assert [(r.path.split("/")[1], r.range, r.status) for r in stats.log] == [
        ("org", "bytes=8-99", 302), ("cdn", "bytes=8-99", 206)]

    tail = http_backoff("GET", url, headers={"Range": f"bytes={len(weights) - 5}-"})
    assert (tail.status_code, tail.content) == (206, weights[-5:])
    small = http_backoff("GET", hf_hub_url(REPO, "config.json", endpoint=hub.endpoint), headers={"Range": "bytes=-3"})
    assert (small.status_code, small.content, small.headers["Accept-Ranges"]) == (206, CONFIG[-3:], "bytes")
    outside = http_backoff("GET", url, headers={"Range": f"bytes={len(weights)}-"})
    assert (outside.status_code, outside.headers["Content-Range"]) == (416, f"bytes */{len(weights)}")


def test_safetensors_header_read_through_ranges(hub, repo):
    meta = HfApi(endpoint=hub.endpoint).parse_safetensors_file_metadata(REPO, "model.safetensors")
    tensor = meta.tensors["w"]
    assert (tensor.dtype, tensor.shape, tensor.data_offsets) == ("F32", [50_000], (0, 200_000))


def test_dropped_connection_resumes_with_a_range(hub, tmp_path):
    # The client resumes from the last whole chunk it handed over (DOWNLOAD_CHUNK_SIZE, 10 MiB): bytes received
    # after it are fetched again. Dropped right at a chunk's end, the resumed download sends nothing twice.
    folder = tmp_path / "v1"
    folder.mkdir()
    weights = hashlib.shake_256(b"weights").digest(DOWNLOAD_CHUNK_SIZE + 300_000)
    (folder / "model.safetensors").write_bytes(weights)
    hub.add_repo(REPO, folder)
    hub.drop_once("model.safetensors", after_bytes=DOWNLOAD_CHUNK_SIZE)
    assert download(hub, tmp_path / "hf", "model.safetensors") == weights
    stats = hub.stats()
    assert stats.file_bytes["model.safetensors"] == stats.body_bytes == len(weights)
    gets = [(r.range, r.status) for r in stats.log if r.method == "GET"]
    assert gets == [(None, 200), (f"bytes={DOWNLOAD_CHUNK_SIZE}-", 206)]


def test_http_get_resumes_a_partial_file_with_a_range(hub, repo, tmp_path):
    # hf_hub_download deletes a failed download's partial file, so resuming across runs is up to the caller:
    # http_get(resume_size=n) asks for the rest with a Range.
    folder, _ = repo
    weights = (folder / "model.safetensors").read_bytes()
    partial = tmp_path / "model.safetensors.part"
    partial.write_bytes(weights[:1000])
    with partial.open("ab") as f:
        http_get(hf_hub_url(REPO, "model.safetensors", endpoint=hub.endpoint), f, resume_size=1000,
                 expected_size=len(weights))
    assert partial.read_bytes() == weights
    stats = hub.stats()
    assert stats.file_bytes["model.safetensors"] == len(weights) - 1000
    assert [(r.range, r.status) for r in stats.log] == [("bytes=1000-", 302), ("bytes=1000-", 206)]


def test_moved_branch_keeps_old_commits(hub, repo, tmp_path):
    old_folder, old_sha = repo
    new_folder = write_repo(tmp_path / "v2", config=b'{"model_type": "tiny", "hidden_size": 128}\n', seed=1)
    new_sha = hub.add_repo(REPO, new_folder)
    assert new_sha != old_sha
    api = HfApi(endpoint=hub.endpoint)
    assert api.model_info(REPO).sha == new_sha
    assert api.model_info(REPO, revision="main").sha == new_sha
    assert api.model_info(REPO, revision=old_sha).sha == old_sha
    cache = tmp_path / "hf"
    assert download(hub, cache, "model.safetensors") == (new_folder / "model.safetensors").read_bytes()
    assert download(hub, cache, "config.json", revision=old_sha) == CONFIG
    old_weights = (old_folder / "model.safetensors").read_bytes()
    assert download(hub, cache, "model.safetensors", revision=old_sha) == old_weights

    assert hub.add_repo(REPO, new_folder) not in (old_sha, new_sha)  # same files again: still a new commit
    dev_sha = hub.add_repo(REPO, old_folder, branch="refs/pr/1")
    assert api.model_info(REPO, revision="refs/pr/1").sha == dev_sha
    assert download(hub, cache, "config.json", revision="refs/pr/1") == CONFIG


def test_missing_repo_revision_and_file_raise_the_hub_errors(hub, repo, tmp_path):
    api = HfApi(endpoint=hub.endpoint)
    cache = tmp_path / "hf"
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/nothing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/nothing", "config.json", cache_dir=cache, endpoint=hub.endpoint)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        download(hub, cache, "config.json", revision="0" * 40)
    with pytest.raises(RemoteEntryNotFoundError):
        download(hub, cache, "missing.bin")
    assert [(r.status, r.path) for r in hub.stats().log] == [
        (404, "/api/models/org/nothing"), (404, "/org/nothing/resolve/main/config.json"),
        (404, f"/api/models/{REPO}/revision/no-such-branch"), (404, f"/{REPO}/resolve/{'0' * 40}/config.json"),
        (404, f"/{REPO}/resolve/main/missing.bin")]


def test_snapshot_download_lists_the_tree(hub, repo, tmp_path):
    folder, sha = repo
    snapshot = Path(snapshot_download(REPO, cache_dir=tmp_path / "hf", endpoint=hub.endpoint))
    assert snapshot.name == sha
    names = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert names == ["config.json", "model.safetensors", "tokenizer/vocab.txt"]
    assert all((snapshot / name).read_bytes() == (folder / name).read_bytes() for name in names)
    top = HfApi(endpoint=hub.endpoint).list_repo_tree(REPO)
    assert sorted(entry.path for entry in top) == ["config.json", "model.safetensors", "tokenizer"]


def test_big_sparse_file_is_served_from_its_folder(hub, tmp_path):
    folder = tmp_path / "big"
    folder.mkdir()
    size = 64 * 1024 * 1024
    with open(folder / "big.bin", "wb") as f:
        f.truncate(size)
    hub.add_repo(REPO, folder)
    sibling = HfApi(endpoint=hub.endpoint).model_info(REPO, files_metadata=True).siblings[0]
    assert (sibling.size, sibling.lfs.size) == (size, size)  # an LFS file, its stand-in sha256 never read 64 MiB
    with open(folder / "big.bin", "r+b") as f:  # changed after add_repo: served as it is now, so never copied
        f.seek(size - 4)
        f.write(b"tail")
    url = hf_hub_url(REPO, "big.bin", endpoint=hub.endpoint)
    response = http_backoff("GET", url, headers={"Range": "bytes=-6"})
    assert (response.status_code, response.content) == (206, b"\0\0tail")
    assert hub.stats().file_bytes["big.bin"] == 6


def test_hf_endpoint_environment_in_a_fresh_process(hub, repo, tmp_path):
    folder, _ = repo
    code = "from huggingface_hub import hf_hub_download; print(hf_hub_download('org/tiny', 'model.safetensors'))"
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.is_relative_to(tmp_path / "hf")
    assert path.read_bytes() == (folder / "model.safetensors").read_bytes()
    assert hub.stats().file_bytes["model.safetensors"] == path.stat().st_size
