"""The hub, through huggingface_hub: a repository resolved to one commit, byte ranges of its files, and downloads
into the Hugging Face cache (resumable, verified by huggingface_hub). Errors become one line naming the repository.

The endpoint (`HF_ENDPOINT`) and cache (`HF_HUB_CACHE`, `HF_HOME`) are read when used, not when huggingface_hub was
imported, so one process can point at another hub."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator
from urllib.parse import urlsplit

from tqbench.errors import TqbenchError
from tqbench.source.hub.ref import HubRef


class HubError(TqbenchError):
    """The hub refused or could not be reached (one line, naming the repository or file)."""


@dataclass(frozen=True, kw_only=True)
class HubFile:
    name: str
    size: int


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """A repository at one commit, as the hub lists it."""

    repo_id: str
    revision: str  # what was asked for ("main" when nothing was)
    commit: str
    endpoint: str
    files: tuple[HubFile, ...]

    def size(self, name: str) -> int | None:
        return next((f.size for f in self.files if f.name == name), None)

    def where(self, name: str = "") -> str:
        """How errors name the repository (or a file in it)."""
        return f"{self.repo_id}@{self.revision}" + (f"/{name}" if name else "")


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hf_cache() -> Path:
    from huggingface_hub import constants

    if env := os.environ.get("HF_HUB_CACHE"):
        return Path(env).expanduser()
    if env := os.environ.get("HF_HOME"):
        return Path(env).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def snapshot_dir(snap: Snapshot) -> Path:
    """Where huggingface_hub puts this commit's files in its cache (each a link to a blob)."""
    from huggingface_hub.file_download import repo_folder_name

    return hf_cache() / repo_folder_name(repo_id=snap.repo_id, repo_type="model") / "snapshots" / snap.commit


def resolve(ref: HubRef) -> Snapshot:
    """The commit `ref` names now and the files it holds, with their sizes (one API call)."""
    from huggingface_hub import HfApi

    where = str(ref)
    url = endpoint()
    with hub_errors(where, url):
        info = HfApi(endpoint=url).model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    files = tuple(HubFile(name=s.rfilename, size=int(s.size or 0)) for s in info.siblings or ())
    return Snapshot(repo_id=ref.repo_id, revision=ref.revision or "main", commit=info.sha, endpoint=url, files=files)


def read_range(snap: Snapshot, name: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of one file of the commit: one HTTP range request (any thread: no MLX here)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    url = hf_hub_url(snap.repo_id, name, revision=snap.commit, endpoint=snap.endpoint)
    with hub_errors(snap.where(name), snap.endpoint):
        r = http_backoff("GET", url, headers={**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"})
        hf_raise_for_status(r)
    data = r.content
    if r.status_code == 200:  # a server that ignores ranges sends the whole file: keep what was asked for
        data = data[start:end]
    if len(data) != end - start:
        raise HubError(f"asked for bytes {start}-{end - 1}, got {len(data)}", snap.where(name))
    return data


def cached_file(snap: Snapshot, name: str) -> Path | None:
    """The file, when a complete copy of it is in the Hugging Face cache already (no network)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(snap.repo_id, name, cache_dir=hf_cache(), revision=snap.commit)
    return Path(found) if isinstance(found, str) else None


def download(snap: Snapshot, name: str, progress: Callable[[int], None] | None = None) -> Path:
    """The file in the Hugging Face cache, downloaded if it is not there, and resumable: the bytes arrive in
    `blobs/<etag>.tqbench.incomplete` (kept when the process dies, continued by the next call) and the file is then
    placed as huggingface_hub places its own (`blobs/<etag>`, linked from `snapshots/<commit>/<name>`), so any tool
    finds it there. huggingface_hub's own `http_get` moves the bytes and resumes a connection dropped mid-file.
    `progress(n)` hears each chunk's size (any thread; raising from it stops the download, resumable)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers
    from huggingface_hub.utils.tqdm import silent_tqdm  # progress goes to tqbench's events, not a second bar

    link = snapshot_dir(snap) / name
    if link.exists():
        return link
    with hub_errors(snap.where(name), snap.endpoint):
        meta = get_hf_file_metadata(hf_hub_url(snap.repo_id, name, revision=snap.commit, endpoint=snap.endpoint),
                                    endpoint=snap.endpoint, retry_on_errors=True)
        if not meta.etag or meta.size is None:
            raise HubError("the hub gave no ETag or size for it", snap.where(name))
        blob = snapshot_dir(snap).parent.parent / "blobs" / meta.etag
        if not blob.exists():
            headers = build_hf_headers()
            if urlsplit(meta.location).netloc != urlsplit(snap.endpoint).netloc:
                headers.pop("authorization", None)  # the token is for the hub, not for the storage it redirects to
            blob.parent.mkdir(parents=True, exist_ok=True)
            part = blob.with_name(blob.name + ".tqbench.incomplete")
            with open(part, "ab") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise HubError("another process is downloading it", snap.where(name)) from None
                if f.tell() > meta.size:
                    f.truncate(0)
                http_get(meta.location, _Counted(f, progress), resume_size=f.tell(), headers=headers,
                         expected_size=meta.size, displayed_filename=name, tqdm_class=silent_tqdm)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, blob)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tqbench-link")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(blob, link.parent), tmp)
    os.replace(tmp, link)
    return link


class _Counted:
    """A file that tells `progress` how many bytes each write brought."""

    def __init__(self, f: BinaryIO, progress: Callable[[int], None] | None):
        self._f, self._progress = f, progress

    def write(self, data: bytes) -> int:
        n = self._f.write(data)
        if self._progress is not None:
            self._progress(len(data))
        return n

    def __getattr__(self, name: str):
        return getattr(self._f, name)


@contextlib.contextmanager
def hub_errors(where: str, url: str) -> Iterator[None]:
    """huggingface_hub's and the network's errors as one line each."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HTTPError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    try:
        yield
    except GatedRepoError:
        raise HubError("gated repository: accept its terms on the hub and set HF_TOKEN", where) from None
    except RepositoryNotFoundError:
        raise HubError(f"no such repository on {url} (a private one needs HF_TOKEN)", where) from None
    except RevisionNotFoundError:
        raise HubError(f"no such revision on {url}", where) from None
    except RemoteEntryNotFoundError:
        raise HubError(f"no such file on {url}", where) from None
    except LocalEntryNotFoundError:
        raise HubError(f"cannot reach {url} and the file is not in the local cache", where) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise HubError(f"the hub answered HTTP {status}", where) from None
    except HTTPError as e:  # the network: refused, reset, timed out
        raise HubError(f"cannot reach {url} ({type(e).__name__}: {e})", where) from None
