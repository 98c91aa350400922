"""The HTTP face of a Service: Python's ThreadingHTTPServer (the machinery `mlx_lm.server` is built on), one thread
per connection. A handler thread parses and checks, then iterates its request's engine job and writes the answer;
MLX runs on the engine thread only. Server-sent events for `stream: true`.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics (Prometheus
text), and tqbench's own GET /tqbench/status (the ServeStatus as JSON) and GET /tqbench/events (a live feed of
page-ins, requests and status as server-sent events, for a face attaching to a running server)."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tqbench.chat.events import CompletionDelta, CompletionDone, PrefillProgress, ReplyStarted, ToolCall
from tqbench.errors import TqbenchError
from tqbench.serve import openai, wire
from tqbench.serve.metrics import prometheus
from tqbench.serve.service import Service

EVENTS_POLL_S = 0.25
STATUS_EVERY_S = 1.0  # an idle feed sends the status this often


class Server:
    """A socket listening on `host:port` (0: any free port) from the moment it is made, so a port in use is an error
    before a model loads; `start(service)` answers on it until `close()`."""

    def __init__(self, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # close() joins the handler threads: an answer being written is finished before the process leaves
        http_server = type("HTTPServer", (_TrackingServer,), {"address_family": family, "daemon_threads": False,
                                                                "block_on_close": True})
        try:
            self.httpd = http_server((host, port), handler)
        except OSError as e:
            raise TqbenchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._handler = handler
        self.port = self.httpd.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        self._service: Service | None = None

    def start(self, service: Service) -> None:
        """Answer requests for `service` (requests that arrived since the socket opened wait in its backlog)."""
        self._handler.service = service
        service.url = self.url
        self._service = service
        threading.Thread(target=self.httpd.serve_forever, name="tqbench-http", daemon=True).start()

    def close(self) -> None:
        """Stop listening, stop the running requests after their current token, end the idle keep-alive
        connections, and wait for every handler (an answer being written is finished)."""
        if self._service is None:  # never started
            self.httpd.server_close()
            return
        self._service.stop()
        self.httpd.shutdown()
        self.httpd.end_reads()
        self.httpd.server_close()


class _TrackingServer(ThreadingHTTPServer):
    """Knows its open connections, so that closing does not wait for a client's idle keep-alive connection (its
    handler thread blocks reading the next request until the client hangs up)."""

    def __init__(self, *args: Any) -> None:
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(*args)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def end_reads(self) -> None:
        """Every open connection reads as closed: idle handlers end, answers being written still finish."""
        with self._open_lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass


class _Handler(BaseHTTPRequestHandler):
    service: Service
    protocol_version = "HTTP/1.1"
    server_version = "tqbench"
    # TCP_NODELAY: each token's small write leaves at once (with Nagle's algorithm it waits for the client's delayed
    # ACK of the previous write: 40 ms on Linux)
    disable_nagle_algorithm = True

    _answering = False  # the status line of this request's answer is sent

    def log_message(self, format: str, *args: Any) -> None:  # the faces show requests; no access log on stderr
        pass

    def parse_request(self) -> bool:
        self._answering = False
        return super().parse_request()

    def send_response(self, code: int, message: str | None = None) -> None:
        self._answering = True
        super().send_response(code, message)

    # ---- routing --------------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route({"/health": self._health, "/v1/models": self._models, "/metrics": self._metrics,
                     "/tqbench/status": self._status, "/tqbench/events": self._events})

    def do_POST(self) -> None:
        self._route({"/v1/chat/completions": lambda: self._complete("chat"),
                     "/v1/completions": lambda: self._complete("text")})

    def _route(self, routes: dict) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if not self.service.authorized(self.headers.get("Authorization")):
                raise openai.ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                      type="authentication_error", code="invalid_api_key")
            route = routes.get(path)
            if route is None:
                other = "GET" if self.command == "POST" else "POST"
                raise openai.ApiError(405 if path in _ROUTES[other] else 404,
                                      f"{self.command} {path}: no such route on this server")
            route()
        except openai.ApiError as e:
            if e.status != 429:  # the service counted a full queue as rejected already
                self.service.refused()
            self._send_json(e.status, e.body(), e.headers, close=e.status in (413, 411))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug: the client gets a 500 in OpenAI's shape, the server goes on
            if not self._answering:
                err = openai.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                self._send_json(500, err.body(), close=True)
            self.close_connection = True

    # ---- GET ------------------------------------------------------------------------------------------------------

    def _health(self) -> None:
        st = self.service.status()
        self._send_json(200, {"status": "ok", "model": st.model, "running": st.running, "queued": st.queued,
                              "warming_up": self.service.warming_up})

    def _models(self) -> None:
        s = self.service
        self._send_json(200, {"object": "list", "data": [{"id": s.model_id, "object": "model",
                                                           "created": int(time.time() - s.status().uptime_s),
                                                           "owned_by": "tqbench"}]})

    def _metrics(self) -> None:
        body = prometheus(self.service.status()).encode()
        self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

    def _status(self) -> None:
        self._send_json(200, wire.status_dict(self.service.status()))

    def _events(self) -> None:
        """Server-sent events until the client leaves: the status at once, then page-ins, requests and status."""
        self._stream_headers()
        with self.service.watch() as w:
            self._sse(wire.event_dict(self.service.status()))
            quiet = time.monotonic()
            while not self._gone() and not self.service.stopping:
                events = w.get(EVENTS_POLL_S)
                if not events and time.monotonic() - quiet >= STATUS_EVERY_S:  # idle: the status, as a heartbeat
                    events = [self.service.status()]
                for ev in events:
                    self._sse(wire.event_dict(ev))
                    quiet = time.monotonic()
            if not self._gone():  # stopping: what the last request published before it (its record, the status)
                for ev in w.get(0):
                    self._sse(wire.event_dict(ev))

    # ---- POST -----------------------------------------------------------------------------------------------------

    def _complete(self, kind: str) -> None:
        request = openai.parse_request(kind, openai.parse_body(self._body()))
        rid = openai.new_id(kind)
        model = self.service.model_id
        stream = request.stream
        events = self.service.run(request, rid, self._gone)
        done: CompletionDone | None = None
        started = False
        streamed_calls = 0  # tool calls sent so far: the next one's index in the stream
        logprobs = _LogprobChunks(kind) if request.completion.sampling.logprobs is not None else None
        try:
            for ev in events:
                match ev:
                    case ReplyStarted() if stream and not started:
                        started = True
                        self._stream_headers()
                        if kind == "chat":
                            self._sse(openai.chunk(kind, rid, model, role=True))
                    case PrefillProgress() if started:  # a long prompt: the stream stays alive, and says how far
                        self.wfile.write(f": prompt {ev.done}/{ev.total} tokens processed\n\n".encode())
                        self.wfile.flush()
                    case CompletionDelta() if stream:
                        if logprobs is not None and ev.logprob is not None:
                            logprobs.pending.append(ev.logprob)
                        if ev.content or ev.reasoning or ev.tool_calls:  # with the tokens' logprobs since the last
                            self._sse(openai.chunk(kind, rid, model, text=ev.content, reasoning=ev.reasoning,
                                                   tool_calls=_calls(ev.tool_calls, True, streamed_calls),
                                                   logprobs=logprobs.take() if logprobs is not None else None))
                        streamed_calls += len(ev.tool_calls)
                    case CompletionDone():
                        done = ev
        except TqbenchError as e:  # the engine refused the request (a chat template that rejects the messages)
            err = openai.ApiError(400, str(e))
            if started:
                self._sse(err.body())
            else:
                self._send_json(err.status, err.body())
            return
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        if self.service.stopping and (done is None or done.finish_reason == "cancelled"):
            # the server is closing mid-reply: say so, so that a client can tell a cut reply from a finished one
            err = openai.ApiError(503, "the server stopped while this reply was being generated; it was cut short",
                                  type="server_error", code="server_stopped")
            if started:
                self._sse(err.body())
            else:
                self._send_json(err.status, err.body())
            self.close_connection = True
            return
        if done is None:  # the client left: nothing to answer
            self.close_connection = True
            return
        r = done.reply
        use = openai.usage(r.prompt_tokens, r.cached_tokens, r.generated_tokens)
        finish = "length" if done.finish_reason == "cancelled" else done.finish_reason
        if stream:
            self._sse(openai.chunk(kind, rid, model, finish=finish,
                                   logprobs=logprobs.take() if logprobs is not None and logprobs.pending else None))
            if request.include_usage:
                self._sse(openai.chunk(kind, rid, model, use=use))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        else:  # the whole answer, as the engine split it
            lp = None
            if logprobs is not None:
                lp = (openai.chat_logprobs(done.logprobs) if kind == "chat" else openai.text_logprobs(done.logprobs))
            self._send_json(200, openai.response(kind, rid, model, text=done.content, reasoning=done.reasoning,
                                                 tool_calls=_calls(done.tool_calls, False), finish=finish, use=use,
                                                 logprobs=lp))

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            raise openai.ApiError(411, "a Content-Length header is needed")
        try:
            n = int(length)
        except ValueError:
            raise openai.ApiError(400, f"Content-Length {length!r} is not a number") from None
        limit = self.service.options.max_body_bytes
        if n > limit:
            self._discard(n)
            raise openai.ApiError(413, f"the request body is {n:,} bytes; this server takes at most {limit:,}",
                                  code="request_too_large")
        return self.rfile.read(n)

    def _discard(self, n: int) -> None:
        """Read a refused body (up to 64 MiB) so the client can read the answer; larger: the connection closes."""
        if n > 64 << 20:
            return
        while n > 0:
            got = self.rfile.read(min(n, 1 << 20))
            if not got:
                return
            n -= len(got)

    # ---- writing --------------------------------------------------------------------------------------------------

    def _gone(self) -> bool:
        """The client closed its end of the connection (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None,
              close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None, close: bool = False) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers, close)

    def _stream_headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.close_connection = True
        self.end_headers()

    def _sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


_ROUTES = {"GET": ("/health", "/v1/models", "/metrics", "/tqbench/status", "/tqbench/events"),
           "POST": ("/v1/chat/completions", "/v1/completions")}


def _calls(calls: tuple[ToolCall, ...], streaming: bool, first: int = 0) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(calls):
        d: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if streaming:
            d["index"] = first + i
        out.append(d)
    return out


def warn_if_exposed(host: str) -> str | None:
    """The warning a face prints when the server listens beyond this machine."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"warning: listening on {host}: anyone who can reach this machine can use the model"
            " (add --api-key, or keep the default 127.0.0.1)")


class _LogprobChunks:
    """A stream's token logprobs not sent yet: a token whose text is held back (a marker, a stop string's start) sends
    its logprob with the next chunk that has text. Completions' text offsets run on over the whole stream."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.pending: list = []
        self.offset = 0

    def take(self) -> dict:
        entries, self.pending = self.pending, []
        if self.kind == "chat":
            return openai.chat_logprobs(entries)
        out = openai.text_logprobs(entries, self.offset)
        self.offset += sum(len(e.text) for e in entries)
        return out
