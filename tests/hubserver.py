"""A loopback HTTP server that serves fixture repositories the way huggingface.co does, for the real
huggingface_hub client on its plain-HTTP path (no xet): model info, file tree, resolve (HEAD and GET, LFS files
redirected to a CDN), byte ranges, and on request a connection dropped mid-download.

The CDN is a second listener of the same server on its own port: a different origin, as cdn-lfs.hf.co is, so the
client stops at the hub's 302 and reads the file's metadata from it (X-Linked-Etag, X-Linked-Size) exactly as it
does against huggingface.co (it follows redirects that stay on the same origin)."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from urllib.parse import SplitResult, parse_qs, quote, unquote, urlsplit

GIT_MAX_SIZE = 1024 * 1024  # files up to this size are stored in git, bigger ones (and any *.safetensors) in LFS
HASH_LIMIT = 16 * 1024 * 1024  # LFS files up to this size get their real sha256; bigger ones a stand-in
CHUNK = 1024 * 1024
COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # decoded, without the query
    range: str | None  # the request's Range header
    status: int


@dataclass(frozen=True)
class HubStats:
    file_bytes: Mapping[str, int]  # repo-relative file path -> content bytes sent
    body_bytes: int  # every response body byte sent (file content, JSON, error bodies)
    requests: int
    log: tuple[RequestRecord, ...]


@dataclass(frozen=True)
class _Blob:
    path: str  # relative to the repo root, "/"-separated
    source: Path  # served from here at request time
    size: int
    blob_id: str  # git oid: of the content, or of the LFS pointer for LFS files
    lfs_sha256: str | None  # None: stored in git

    @property
    def etag(self) -> str:
        return self.lfs_sha256 or self.blob_id

    @property
    def pointer_size(self) -> int:
        return len(_lfs_pointer(self.lfs_sha256 or "", self.size))


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: Mapping[str, _Blob]
    created: str  # "%Y-%m-%dT%H:%M:%S.%fZ", the hub's format


@dataclass
class _Repo:
    default_branch: str
    created: str
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, _Commit] = field(default_factory=dict)  # sha -> commit, oldest first


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    """What git stores in place of an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _snapshot(path: str, source: Path) -> _Blob:
    """Size and hashes of one file as they are now; big files are never read."""
    st = source.stat()
    if st.st_size <= GIT_MAX_SIZE and not path.endswith(".safetensors"):
        return _Blob(path, source, st.st_size, _git_oid(source.read_bytes()), None)
    if st.st_size <= HASH_LIMIT:
        sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    else:
        sha256 = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    return _Blob(path, source, st.st_size, _git_oid(_lfs_pointer(sha256, st.st_size)), sha256)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HubServer:
    """`with HubServer() as hub:` serves the repos given to `hub.add_repo` at `hub.endpoint` until the block ends."""

    def __init__(self) -> None:
        self.endpoint = ""
        self.cdn_endpoint = ""
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._lfs_blobs: dict[str, _Blob] = {}  # sha256 -> blob, what the CDN serves
        self._drops: dict[str, int] = {}  # file path -> body bytes to send before dropping the connection
        self._connections: set[socket.socket] = set()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        self.reset_stats()

    def __enter__(self) -> HubServer:
        for role in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
            server.daemon_threads = True
            server.hub, server.role = self, role  # type: ignore[attr-defined]
            thread = threading.Thread(target=server.serve_forever, args=(0.05,), name=f"hubserver-{role}", daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        # The CDN under another host name, as the Hub's is (huggingface_hub follows a redirect to the same host and
        # would read the CDN's headers, which have no X-Repo-Commit); both listen on 127.0.0.1.
        hub, cdn = (s.server_address[1] for s in self._servers)
        self.endpoint, self.cdn_endpoint = f"http://127.0.0.1:{hub}", f"http://localhost:{cdn}"
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # idle keep-alive connections would hold their handler threads forever
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join()
        self._servers.clear()
        self._threads.clear()

    def add_repo(self, repo_id: str, folder: Path, branch: str = "main") -> str:
        """Publish `folder`'s files (recursively, no dotfiles) as a new commit of `repo_id` on `branch` and return
        its sha. Files are served from `folder` at request time, never copied: give each commit a folder of its own
        (an old commit stays servable by its sha only while its folder is unchanged)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"not a folder: {folder}")
        files = {}
        for source in sorted(folder.rglob("*")):
            rel = source.relative_to(folder)
            if source.is_file() and not any(part.startswith(".") for part in rel.parts):
                files[rel.as_posix()] = _snapshot(rel.as_posix(), source)
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(default_branch=branch, created=_now()))
            parent = repo.branches.get(branch, "")
            listing = [repo_id, branch, parent, len(repo.commits), [[p, b.etag] for p, b in files.items()]]
            sha = hashlib.sha1(json.dumps(listing).encode()).hexdigest()
            repo.commits[sha] = _Commit(sha, MappingProxyType(files), _now())
            repo.branches[branch] = sha
            for blob in files.values():
                if blob.lfs_sha256:
                    self._lfs_blobs.setdefault(blob.lfs_sha256, blob)
        return sha

    def stats(self) -> HubStats:
        with self._lock:
            return HubStats(MappingProxyType(dict(self._file_bytes)), self._body_bytes, len(self._log),
                            tuple(self._log))

    def reset_stats(self) -> None:
        with self._lock:
            self._file_bytes: dict[str, int] = {}
            self._body_bytes = 0
            self._log: list[RequestRecord] = []

    def drop_once(self, filename: str, after_bytes: int) -> None:
        """The next GET of `filename`'s content sends its headers (full Content-Length), then only `after_bytes` body
        bytes, then closes the connection."""
        with self._lock:
            self._drops[filename] = after_bytes

    # Used by the request handler.

    def _lookup(self, repo_id: str, revision: str | None) -> tuple[_Repo | None, _Commit | None]:
        """The repo and the commit a revision (branch, commit sha, None: the default branch) names."""
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                return None, None
            revision = revision or repo.default_branch
            sha = revision if COMMIT_SHA.fullmatch(revision) else repo.branches.get(revision, "")
            return repo, repo.commits.get(sha)

    def _lfs_blob(self, sha256: str) -> _Blob | None:
        with self._lock:
            return self._lfs_blobs.get(sha256)

    def _take_drop(self, path: str) -> int | None:
        with self._lock:
            return self._drops.pop(path, None)

    def _count(self, n: int, path: str | None = None) -> None:
        if not n:  # a whole send's settling count: it may come after the client has the bytes and the stats were reset
            return
        with self._lock:
            self._body_bytes += n
            if path is not None:
                self._file_bytes[path] = self._file_bytes.get(path, 0) + n

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._log.append(record)

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(conn)


class _RangeNotSatisfiable(Exception):
    pass


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single byte range; None for no (or an unusable, so ignored) Range header."""
    match = RANGE.fullmatch(header.strip()) if header else None
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":  # bytes=-n: the last n bytes
        start, end = max(size - int(last), 0), size
    else:
        start, end = int(first), size if last == "" else min(int(last) + 1, size)
    if start >= size or start >= end:
        raise _RangeNotSatisfiable
    return start, end


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

    def setup(self) -> None:
        super().setup()
        self.hub._track(self.connection, True)

    def finish(self) -> None:
        self.hub._track(self.connection, False)
        super().finish()

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: object) -> None:
        pass  # the request log is in the stats

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    # Routing.

    def _dispatch(self, head: bool) -> None:
        self._head = head
        try:
            self._route(urlsplit(self.path))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-response

    def _route(self, url: SplitResult) -> None:
        self._log_path = unquote(url.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if self.server.role == "cdn":  # type: ignore[attr-defined]
            if url.path.startswith("/cdn/"):
                return self._cdn(url.path[len("/cdn/"):])
        elif url.path.startswith("/api/models/"):
            return self._api(url.path[len("/api/models/"):], query)
        elif "/resolve/" in url.path:
            repo_id, rest = url.path[1:].split("/resolve/", 1)
            revision, _, path = rest.partition("/")
            return self._resolve(unquote(repo_id), unquote(revision), unquote(path))
        self._error(404, None, f"no route for {url.path}")

    def _api(self, rest: str, query: dict[str, str]) -> None:
        tree_path = None
        if "/tree/" in rest:
            repo_id, rest = rest.split("/tree/", 1)
            revision, _, tree_path = rest.partition("/")
        elif "/revision/" in rest:
            repo_id, revision = rest.split("/revision/", 1)
        else:
            repo_id, revision = rest, None
        repo_id = unquote(repo_id)
        repo, commit = self._commit_or_error(repo_id, revision and unquote(revision))
        if commit is None:
            return
        if tree_path is not None:
            return self._tree(commit, unquote(tree_path).strip("/"), query.get("recursive", "").lower() == "true")
        blobs = query.get("blobs", "").lower() in ("true", "1")
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None, "sha": commit.sha,
            "lastModified": commit.created, "createdAt": repo.created, "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [self._sibling(blob, blobs) for blob in commit.files.values()],
            "usedStorage": sum(blob.size for blob in commit.files.values()),
        }
        self._send_json(200, info)

    @staticmethod
    def _sibling(blob: _Blob, blobs: bool) -> dict:
        if not blobs:
            return {"rfilename": blob.path}
        sibling = {"rfilename": blob.path, "size": blob.size, "blobId": blob.blob_id}
        if blob.lfs_sha256:
            sibling["lfs"] = {"sha256": blob.lfs_sha256, "size": blob.size, "pointerSize": blob.pointer_size}
        return sibling

    def _tree(self, commit: _Commit, under: str, recursive: bool) -> None:
        prefix = f"{under}/" if under else ""
        if under and under not in commit.files and not any(p.startswith(prefix) for p in commit.files):
            return self._error(404, "EntryNotFound", f"{under} does not exist", {"X-Repo-Commit": commit.sha})
        folders: set[str] = set()
        entries = []
        for path, blob in commit.files.items():
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": blob.blob_id, "size": blob.size, "path": path}
                if blob.lfs_sha256:
                    entry["lfs"] = {"oid": blob.lfs_sha256, "size": blob.size, "pointerSize": blob.pointer_size}
                entries.append(entry)
        dirs = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                for f in sorted(folders)]
        self._send_json(200, dirs + entries)

    def _resolve(self, repo_id: str, revision: str, path: str) -> None:
        _, commit = self._commit_or_error(repo_id, revision)
        if commit is None:
            return
        blob = commit.files.get(path)
        if blob is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist at {revision}",
                               {"X-Repo-Commit": commit.sha})
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{blob.blob_id}"'}
        if blob.lfs_sha256 is None:
            return self._send_content(blob, blob.path, headers)
        location = f"{self.hub.cdn_endpoint}/cdn/{blob.lfs_sha256}/{quote(blob.path)}"
        self._send(302, {**headers, "Location": location, "X-Linked-Etag": f'"{blob.lfs_sha256}"',
                         "X-Linked-Size": str(blob.size)}, b"")

    def _cdn(self, rest: str) -> None:
        sha256, _, path = rest.partition("/")
        blob = self.hub._lfs_blob(sha256)
        if blob is None:
            return self._error(404, None, "no such object")
        path = unquote(path)
        name = path.rsplit("/", 1)[-1]
        self._send_content(blob, path, {"ETag": f'"{blob.lfs_sha256}"',
                                        "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; "
                                                               f'filename="{name}";'})

    def _commit_or_error(self, repo_id: str, revision: str | None) -> tuple[_Repo | None, _Commit | None]:
        """The commit, or None once the hub's 404 for a missing repo or revision is sent."""
        repo, commit = self.hub._lookup(repo_id, revision)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
        return repo, commit

    # Responses.

    def _error(self, status: int, code: str | None, message: str, extra: Mapping[str, str] | None = None) -> None:
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {}), **(extra or {}),
                   "Content-Type": "application/json"}
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _send_json(self, status: int, document: object) -> None:
        self._send(status, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(document).encode())

    def _send(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self._start(status, {**headers, "Content-Length": str(len(body))})
        if not self._head:
            self._write(body)

    def _start(self, status: int, headers: Mapping[str, str]) -> None:
        self.hub._record(RequestRecord(self.command, self._log_path, self.headers.get("Range"), status))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_content(self, blob: _Blob, path: str, headers: Mapping[str, str]) -> None:
        """The file's bytes (or the requested range of them), counted under `path` as they are written."""
        try:
            span = _parse_range(self.headers.get("Range"), blob.size)
        except _RangeNotSatisfiable:
            return self._send(416, {**headers, "Content-Range": f"bytes */{blob.size}"}, b"")
        start, end = span or (0, blob.size)
        content_headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                           "Content-Length": str(end - start)}
        if span:
            content_headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        self._start(206 if span else 200, content_headers)
        if self._head:
            return
        drop = self.hub._take_drop(path)
        stop = end if drop is None else min(end, start + drop)
        with blob.source.open("rb") as f:
            f.seek(start)
            for offset in range(start, stop, CHUNK):
                self._write(f.read(min(CHUNK, stop - offset)), path)
        if drop is not None:
            self.close_connection = True  # the body ends short: the client sees the connection drop

    def _write(self, data: bytes, path: str | None = None) -> None:
        """Send `data`, counting each piece just before it goes out: a client that got the bytes finds them counted
        (while a send is under way, the stats may count its bytes not yet sent)."""
        view = memoryview(data)
        while view:
            self.hub._count(len(view), path)
            try:
                sent = self.connection.send(view)
            except OSError:
                self.hub._count(-len(view), path)
                raise
            self.hub._count(sent - len(view), path)  # a partial send: the rest goes in the next round
            view = view[sent:]
