"""The Serve screen: the OpenAI-compatible server (tqbench.serve) from the UI, with its expert map live. The second
face of the engine objects `tqbench serve` drives; every line about a server comes from tqbench.serve.report.

Start serving (r, or enter in the serve row's fields): the model the Chat screen would open (the last converted
model, else the demo, converted first if needed) on 127.0.0.1 and the port given (0: any free port), with an optional
API key and the expert cache budget (`fit`, as chat by default; a size streams the experts, and the map shows them),
and the guard on tool calls (`--tool-syntax`: sampled as asked, decoded greedily, or held to the tool's schema).
The screen keeps its own ChatSession and loads it with the Chat screen's load controller (tui.screens.chat_load,
the same ChatRequest path and messages) rather than borrow the Chat screen's session: a server's requests would
otherwise share the engine model with a conversation the user is having, stopping the server must drop the model
it loaded (the session's close) without taking the Chat screen's away, and serving works without the Chat screen
ever being opened. Then a Service and its HTTP Server (listening at once in their own threads); x stops it (the
server's close, then the session's, in a worker), and so does leaving the app (the screen's unmount).

Attach (a, or enter in the attach row's fields): a server another process runs, at its URL (with its API key),
through tqbench.serve.client.watch; unreachable or a refused key is the client's one line in place; x detaches.

Either way a thread worker (tui.screens.serve_relay) reads the feed (PageIn, RequestDone, ServeStatus records) and
posts it in ServeFeed batches; the screen shows the status lines, the log of the last requests, and the page-ins on
the same expert map widget the Chat screen has (tui.widgets.expert_map over tqbench.chat.live.PageInMap, shaped by
the status's streamed layers), or one muted line for a server whose experts are resident.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Header, Input, Label, RichLog, Select, Static
from textual.worker import Worker, WorkerState, get_current_worker

from tqbench.chat.live import PageInMap
from tqbench.chat.request import TOOL_SYNTAX, ChatRequest
from tqbench.errors import TqbenchError
from tqbench.serve import report
from tui.messages import (ChatConvertProgress, ChatLoadFailed, ChatLoadStep, ChatModelReady, ServeFeed, ServeFeedEnded,
                          ServeStopped)
from tui.screens import chat_load
from tui.screens.chat_load import ModelLoad, choosing_line
from tui.screens.chat_relay import one_line
from tui.screens.serve_relay import relay_attach, relay_service
from tui.widgets.conversion_bar import ConversionBar
from tui.widgets.expert_map import ExpertMapView, natural_width
from tui.widgets.footer import FittingFooter
from tui.widgets.inputs import OrderedInput

HOST = "127.0.0.1"
DEFAULT_PORT = "8080"
DEFAULT_URL = "http://127.0.0.1:8080"
LOG_LINES = 200  # requests the log keeps
FEED_GROUP = "serve-feed"
STOP_GROUP = "serve-stop"
IDLE_LINE = "not serving: r serves the Chat screen's model on the port given; a attaches to the URL given"
STOPPING_LINE = "stopping: the running request ends after its current token..."
PORT_ERROR = "port: give 0 (any free port) to 65535"
TOOLS_HINT = "guards on agents' calls (--tool-syntax)"


class ServeInput(OrderedInput):
    """A field of the screen: enter starts (or attaches, in the attach row); the app's one-letter keys type here."""

    hides_app_keys = True
    BINDINGS = [Binding("escape", "screen.leave_input", "Log", key_display="esc")]

    def __init__(self, value: str = "", **kwargs) -> None:
        super().__init__(value, compact=True, select_on_focus=False, **kwargs)


class ServeScreen(Screen):
    """The start row, the attach row, the server's line and status, then the request log beside the expert map."""

    DEFAULT_CSS = """
    ServeScreen .serve-row { height: 1; padding: 0 1; background: $boost; }
    ServeScreen .serve-row Label { width: auto; padding: 0 1 0 0; }
    ServeScreen .serve-row Label.serve-row-title { width: 7; text-style: bold; }
    ServeScreen .serve-row ServeInput { margin: 0 2 0 0; }
    ServeScreen #serve-port { width: 7; }
    ServeScreen #serve-key, ServeScreen #attach-key { width: 16; }
    ServeScreen #serve-budget { width: 10; }
    ServeScreen #serve-tools { width: 12; margin: 0 2 0 0; }
    ServeScreen .serve-hint { color: $text-muted; }
    ServeScreen #attach-url { width: 30; }
    ServeScreen #serve-error { display: none; height: auto; padding: 0 1; color: $text-error;
                               background: $error-muted; text-style: bold; }
    ServeScreen #serve-line { height: auto; padding: 0 1; }
    ServeScreen #serve-status { height: auto; padding: 0 1; }
    ServeScreen #serve-body { height: 1fr; border-top: hkey $foreground 20%; }
    ServeScreen #serve-log { width: 1fr; height: 1fr; padding: 0 1; overflow-x: hidden; }
    ServeScreen #serve-map { display: none; width: 38; border-left: vkey $foreground 20%; }
    ServeScreen #serve-resident { display: none; height: auto; padding: 0 1; color: $text-muted; }
    """
    AUTO_FOCUS = "#serve-log"
    BINDINGS = [
        Binding("r", "start", "Start"),
        Binding("a", "attach", "Attach"),
        Binding("x", "stop", "Stop"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._session = None  # tqbench.chat.session.ChatSession, made on first use (importing it loads MLX)
        self.request = ChatRequest()  # the Chat screen's default: the cache budget field replaces its budget
        self.model = ModelLoad(self, lambda: self.session)
        self.state = "idle"  # idle | loading | serving | stopping | attached
        self.options = None  # tqbench.serve.service.ServeOptions of the server being started
        self.service = None  # tqbench.serve.service.Service while serving
        self.server = None  # tqbench.serve.http.Server while serving
        self.feed_id = 0  # the feed shown: messages of an older one are dropped
        self.status = None  # the newest tqbench.serve.service.ServeStatus
        self.experts: PageInMap | None = None  # the map's state (None: nothing streamed to show)
        self._layers: tuple | None = None  # the shape the map was made for
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(classes="serve-row"):
            yield Label("Serve", classes="serve-row-title")
            yield Label("port")
            yield ServeInput(DEFAULT_PORT, type="integer", max_length=5, id="serve-port")
            yield Label("API key")
            yield ServeInput(placeholder="none", password=True, id="serve-key")
            yield Label("cache budget")
            yield ServeInput(self.request.stream.budget, id="serve-budget")
        with Horizontal(classes="serve-row"):
            yield Label("", classes="serve-row-title")
            yield Label("tool calls")
            yield Select([(s, s) for s in TOOL_SYNTAX], value="sample", allow_blank=False, compact=True,
                         id="serve-tools")
            yield Label(TOOLS_HINT, classes="serve-hint")
        with Horizontal(classes="serve-row"):
            yield Label("Attach", classes="serve-row-title")
            yield Label("URL")
            yield ServeInput(DEFAULT_URL, id="attach-url")
            yield Label("API key")
            yield ServeInput(placeholder="none", password=True, id="attach-key")
        yield ConversionBar(id="serve-bar-row")
        yield Static("", id="serve-error", markup=False)
        yield Static(Content.styled(IDLE_LINE, "$text-muted"), id="serve-line")
        yield Static("", id="serve-status", markup=False)
        yield Static(report.RESIDENT_LINE, id="serve-resident", markup=False)
        with Horizontal(id="serve-body"):
            yield RichLog(max_lines=LOG_LINES, wrap=True, min_width=20, id="serve-log")  # wrapped to its width
            yield ExpertMapView(id="serve-map")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.sub_title = "Serve"
        self.map_view = self.query_one(ExpertMapView)
        self.log_view = self.query_one(RichLog)

    @property
    def session(self):
        """The screen's ChatSession: the served model lives on the engine thread."""
        if self._session is None:
            from tqbench.chat.session import ChatSession

            self._session = ChatSession()
        return self._session

    def field(self, name: str) -> str:
        return self.query_one(f"#{name}", Input).value.strip()

    # ---- starting and stopping a server -------------------------------------------------------------------------

    def action_start(self) -> None:
        if self.state in ("loading", "serving", "stopping"):
            self.notify("Already serving (x stops it first)." if self.state == "serving"
                        else "Wait for the model to load, or the server to stop.", severity="warning")
            return
        from tqbench.serve.http import Server
        from tqbench.serve.service import ServeOptions

        port = self.field("serve-port")
        if not port.isdigit() or int(port) > 65535:
            self._set_error(PORT_ERROR)
            return
        self._detach()
        self._set_error(None)
        try:  # the port first: one that is taken is an error before a model loads
            self.server = Server(HOST, int(port))
        except TqbenchError as e:
            self._set_error(one_line(e))
            return
        self.options = ServeOptions(host=HOST, port=self.server.port, api_key=self.field("serve-key") or None)
        tools = str(self.query_one("#serve-tools", Select).value)
        request = replace(self.request, stream=replace(self.request.stream, budget=self.field("serve-budget") or "fit"),
                          sampling=replace(self.request.sampling, tool_syntax=None if tools == "sample" else tools))
        self.state = "loading"
        self._line(choosing_line())
        self.model.start(request)
        self.refresh_bindings()

    def on_chat_load_step(self, message: ChatLoadStep) -> None:
        if self.model.current(message.load_id):
            self._line(Content.styled(message.text, "$text-muted"))
            bar = self.query_one(ConversionBar)
            if message.converting:
                bar.begin()
            else:
                bar.display = False

    def on_chat_convert_progress(self, message: ChatConvertProgress) -> None:
        if self.model.current(message.load_id):
            self.query_one(ConversionBar).show_unit(message.unit)

    def on_chat_load_failed(self, message: ChatLoadFailed) -> None:
        if not self.model.current(message.load_id):
            return
        self.model.failed()
        self.query_one(ConversionBar).display = False
        if self.server is not None:  # the port it held for the model
            self.server.close()
            self.server = None
        self.state = "idle"
        self._set_error(f"could not load the model: {message.message}")
        self._line(Content.styled(IDLE_LINE, "$text-muted"))
        self.refresh_bindings()

    def on_chat_model_ready(self, message: ChatModelReady) -> None:
        """The model is open: listen, then watch the service."""
        if not self.model.current(message.load_id):
            return
        from tqbench.serve.service import Service

        self.model.ready(message.chosen, message.loaded)
        self.query_one(ConversionBar).display = False
        service = Service(self.session, message.loaded, self.options)
        server = self.server
        server.start(service)
        self.service, self.state = service, "serving"
        self._line(report.serving_line(server.url, service.model_id, bool(self.options.api_key), "x stops"))
        self._new_feed()
        self.log_view.clear()
        self._watch(relay_service, service)
        self.refresh_bindings()

    def action_stop(self) -> None:
        if self.state == "serving":
            server, self.server, self.service = self.server, None, None
            self.state = "stopping"
            self._line(Content.styled(STOPPING_LINE, "$text-muted"))
            self.run_worker(partial(self._close, server), thread=True, group=STOP_GROUP, exit_on_error=False,
                            description="stop serving")
        elif self.state == "attached":
            self._detach()
            self._line(Content.styled(IDLE_LINE, "$text-muted"))
        elif self.state == "loading":
            self.notify("The model is loading: stop the server once it serves.", severity="warning")
        self.refresh_bindings()

    def _close(self, server) -> None:
        """Off the UI thread: the server waits for its handlers, the session for the engine."""
        server.close()
        self.session.close()
        self.post_message(ServeStopped())

    def on_serve_stopped(self, message: ServeStopped) -> None:
        self.feed_id += 1  # the last batches of the closed server's feed are dropped; what it showed stays
        self.state = "idle"
        if message.error is not None:
            self._set_error(f"stopping the server failed: {message.error}")
        self._line(Content.styled(IDLE_LINE, "$text-muted"))
        self.refresh_bindings()

    def on_unmount(self) -> None:
        """Leaving the app: no server, feed or model left behind."""
        self.workers.cancel_group(self, FEED_GROUP)
        if self.server is not None:
            self.server.close()
            self.server = self.service = None
        if self._session is not None:
            self._session.close()

    # ---- attaching to a server another process runs -------------------------------------------------------------

    def action_attach(self) -> None:
        if self.state in ("loading", "serving", "stopping"):
            self.notify("This screen is serving: x stops it, then attach.", severity="warning")
            return
        url = self.field("attach-url")
        if not url:
            self._set_error("URL: give the server's address, e.g. " + DEFAULT_URL)
            return
        self._set_error(None)
        self._new_feed()
        self.log_view.clear()
        self.state = "attached"
        self._line(Content.styled(f"attaching to {url}...", "$text-muted"))
        self._watch(relay_attach, url, self.field("attach-key") or None)
        self.refresh_bindings()

    def on_serve_feed_ended(self, message: ServeFeedEnded) -> None:
        if message.feed_id != self.feed_id:
            return
        if self.state == "attached":  # the screen's own server (its watcher failed) keeps serving until x
            self.state = "idle"
        self._set_error(message.message)
        if self.status is None:
            self._line(Content.styled(IDLE_LINE, "$text-muted"))
        self.refresh_bindings()

    def _detach(self) -> None:
        if self.state == "attached":
            self.workers.cancel_group(self, FEED_GROUP)
            self.feed_id += 1
            self.state = "idle"

    # ---- the feed -------------------------------------------------------------------------------------------------

    def _new_feed(self) -> None:
        """A new server or attachment: drop the older feed's messages and what it showed."""
        self.feed_id += 1
        self.status = None
        self._shape(None)
        self.query_one("#serve-status", Static).update("")

    def _watch(self, relay, *args) -> None:
        self.run_worker(partial(self._relay, relay, self.feed_id, *args), thread=True, exclusive=True,
                        group=FEED_GROUP, exit_on_error=False, description="watch the server")

    def _relay(self, relay, feed_id: int, *args) -> None:
        worker = get_current_worker()
        relay(self.post_message, *args, feed_id, lambda: worker.is_cancelled)

    def on_serve_feed(self, message: ServeFeed) -> None:
        if message.feed_id != self.feed_id:
            return
        st = message.status
        if st is not None:
            if self.status is None and self.state == "attached":
                self._line(report.attached_line(st))
            self.status = st
            self._shape(st.layers)
            self.query_one("#serve-status", Static).update("\n".join(report.status_lines(st)))
        if self.experts is not None and message.page_ins:
            self.experts.apply(message.page_ins)
            self.map_view.update_view(force=bool(message.requests))
        for r in message.requests:
            self.log_view.write(report.request_line(r))

    def _shape(self, layers: tuple | None) -> None:
        """The map for the server's streamed layers (None: no server; (): resident experts, one line instead)."""
        if layers == self._layers:
            return
        self._layers = layers
        self.experts = PageInMap(dict(layers)) if layers else None
        self.map_view.set_model(self.experts)
        self.map_view.display = self.experts is not None
        self.query_one("#serve-resident").display = layers == ()
        if self.experts is not None:
            self.map_view.styles.width = max(36, min(natural_width(self.experts) + 2, self.size.width * 2 // 5))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that ended with an exception it did not turn into a message still ends as one line."""
        if event.state is not WorkerState.ERROR:
            return
        text = one_line(event.worker.error)
        if event.worker.group == chat_load.GROUP:
            self.post_message(ChatLoadFailed(load_id=self.model.load_id, message=text))
        elif event.worker.group == STOP_GROUP:
            self.post_message(ServeStopped(error=text))
        elif event.worker.group == FEED_GROUP:
            self.post_message(ServeFeedEnded(feed_id=self.feed_id, message=text))

    # ---- keys and lines -------------------------------------------------------------------------------------------

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id.startswith("attach-"):
            self.action_attach()
        else:
            self.action_start()
        self.log_view.focus()  # the screen's keys (x stops) work at once

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.focused, Input) and action in ("start", "attach", "stop"):
            return False  # these keys type in the fields (enter starts or attaches there)
        if action == "stop":
            return self.state in ("serving", "attached", "loading")
        return True

    def action_leave_input(self) -> None:
        self.log_view.focus()

    def _line(self, text: Content | str) -> None:
        self.query_one("#serve-line", Static).update(Content(text) if isinstance(text, str) else text)

    def _set_error(self, text: str | None) -> None:
        self.error = text
        line = self.query_one("#serve-error", Static)
        line.update(text or "")
        line.display = text is not None
