"""A chat run by the engine: `ChatSession` keeps the loaded model, its conversation and its profile learner on the
engine thread (tqbench.engine) and hands the faces typed records only.

    chat = ChatSession()
    with chat.open(ChatRequest(model=path)) as job:
        for ev in job: ...       # conversion events (the demo, converted first), ModelChosen, StreamPlan,
                                 # KernelsCompiling... (CUDA), ModelLoaded
    with chat.reply("hello") as job:
        for ev in job: ...       # ReplyStarted, PageIn... (streaming), TokenOut..., ReplyDone; the process's first
                                 # reply on CUDA: MlxWarmup after ReplyStarted, MlxWarmedUp before the first token
    with chat.complete(CompletionRequest(messages=...)) as job:
        for ev in job: ...       # a server's request: ReplyStarted, PageIn..., CompletionDelta..., CompletionDone
    chat.stats(); chat.reset(); chat.close()
    with chat.follow() as job: ...  # a rank other than 0 of a pipeline: rank 0's turns, in step, until it ends

`open` decides what runs (tqbench.chat.stream_plan: resident or streamed, with which budget and why), loads the model,
chooses and preloads the hot-expert profile and starts learning one; a later `open` replaces the model (a new
conversation)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Generator, Iterator, TypeVar

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from tqbench.chat.choose import choose_model
from tqbench.chat.events import (CompletionDelta, CompletionDone, CompletionEvent, ModelChosen, ModelLoaded, OpenEvent,
                                 ReplyDone, ReplyEvent, ReplyStarted, StreamPlan, StreamReport, TokenLogprob, TokenOut,
                                 ToolCall)
from tqbench.chat.profiling import start_profile
from tqbench.chat.records import ConversationStatus, ProfileExport, StreamSetup
from tqbench.chat.request import ChatRequest, CompletionRequest
from tqbench.chat.segment import Segmenter
from tqbench.chat.stream_plan import expert_layout, plan_streaming
from tqbench.distributed.turns import SLOT_CHAT, Leader, end, follow
from tqbench.distributed.world import agree, every, gather_stats, in_step, join
from tqbench.engine import Engine, Job, engine
from tqbench.errors import TqbenchError
from tqbench.machine import DiskSpeed, disk_speed
from tqbench.paths import cache_dir
from tqbench.profile import export_learned
from tqbench.recipe.fit import LAYER_MAJOR_TOKENS
from tqbench.runtime.complete import Completions, chat_prompt, text_prompt
from tqbench.runtime.conversation import Conversation, Sampling, generate
from tqbench.runtime.grammar import check_tool_format, reply_grammar
from tqbench.runtime.load import load, preflight
from tqbench.runtime.prompt_store import PromptStore, model_key
from tqbench.runtime.routing import set_active_experts
from tqbench.runtime.warmup import build_kernels, mlx_warmed, mlx_warmup

R = TypeVar("R")


@dataclass(kw_only=True)
class _Open:
    """A loaded model's state: touched on the engine thread only."""

    conversation: Conversation
    loaded: ModelLoaded
    learner: object | None  # tqbench.profile.Learner while the session learns
    prompt_cache_bytes: int = 0
    completions: object | None = None  # tqbench.runtime.complete.Completions, made by the first completion
    ranks: tuple = ()  # every pipeline rank's RankStats after the last reply (several ranks only)
    can_trim: bool = True  # every rank's prompt caches can be trimmed (several ranks: all agreed)


class ChatSession:
    """One chat, its state on the engine thread. Every method may be called from any other thread."""

    def __init__(self, eng: Engine | None = None) -> None:
        self._engine = eng or engine()
        self._open: _Open | None = None
        self._disk: tuple[str, DiskSpeed | None] | None = None  # (model path, its disk's speed): measured once

    @property
    def loaded(self) -> ModelLoaded | None:
        """The model loaded last (a frozen record: safe to read anywhere)."""
        return self._open.loaded if self._open is not None else None

    # ---- jobs -----------------------------------------------------------------------------------------------------

    def open(self, request: ChatRequest) -> Job[OpenEvent]:
        """Choose (request.model None: the last converted model, else the demo, converting it first with its
        progress events), plan, load; yields ModelChosen, StreamPlan, a KernelsCompiling per fused kernel built for
        the GPU (CUDA only: tqbench.runtime.warmup), then ModelLoaded."""
        request.check()
        return self._engine.submit(lambda: self._load(request))

    def reply(self, text: str, sampling: Sampling | None = None) -> Job[ReplyEvent]:
        """The reply's events; with streaming, each forward pass's PageIn events (one per MoE layer) come before the
        event that follows that pass. A learning session counts each token's routing and saves every few seconds."""
        return self._engine.submit(lambda: self._reply(text, sampling))

    def follow(self) -> Job[ReplyDone]:
        """A rank other than 0 of a pipeline: run every turn rank 0 shares, in step with it, until rank 0 ends
        (tqbench.distributed.turns). Yields one ReplyDone per turn."""
        return self._engine.submit(self._follow)

    def complete(self, request: CompletionRequest,
                 ended: Callable[[ReplyDone], None] = lambda done: None) -> Job[CompletionEvent]:
        """A stateless completion (a server's request) on the loaded model, beside the conversation: its prompt is
        the request's messages or text, reusing the longest prefix an earlier completion left in the prompt cache.
        Yields ReplyStarted, PageIn... (streaming), CompletionDelta..., CompletionDone, then (streaming) a StreamReport
        of the totals so far. The session keeps learning its profile (saved every few seconds, not after each request).
        `ended(done)` gets the reply's summary on the engine thread however it ends, also when the job is stopped
        (finish_reason "cancelled": the job yields nothing more then)."""
        request.check()
        return self._engine.submit(lambda: self._complete(request, ended))

    # ---- calls (run on the engine thread, return at once) ---------------------------------------------------------

    def stats(self) -> StreamReport | None:
        """Streaming figures so far, or None for a resident model (or none loaded)."""
        return self._engine.call(self._stats)

    def last_reply(self) -> ReplyDone | None:
        """The last reply's summary, also of one stopped early (finish_reason "cancelled")."""
        return self._engine.call(lambda: self._current().conversation.last)

    def status(self) -> ConversationStatus:
        def read() -> ConversationStatus:
            conv = self._current().conversation
            return ConversationStatus(turns=conv.turns, tokens=len(conv.tokens), last=conv.last)

        return self._engine.call(read)

    def reset(self) -> None:
        """Forget the conversation (messages and cache)."""
        self._engine.call(lambda: self._current().conversation.reset())

    def export_profile(self, file: str | Path) -> ProfileExport:
        """Save what this session learned, then write the model's learned profile to `file` as `tqbench profile
        export` does (tqbench.profile.export_learned)."""
        return self._engine.call(lambda: self._export(Path(file)))

    def on_engine(self, fn: Callable[[Conversation], R]) -> R:
        """`fn(conversation)` on the engine thread, for tools and tests that reach into the loaded model."""
        return self._engine.call(lambda: fn(self._current().conversation))

    def close(self) -> None:
        """Drop the model (stops its read workers) and save what was learned. Rank 0 of a pipeline first tells the
        other ranks that no more turns come."""
        self._engine.call(self._end_turns)
        self._engine.call(self._drop)

    # ---- on the engine thread -------------------------------------------------------------------------------------

    def _current(self) -> _Open:
        if self._open is None:
            raise TqbenchError("no model is loaded in this chat")
        return self._open

    def _end_turns(self) -> None:
        pipeline = self._open.conversation.loaded.pipeline if self._open is not None else None
        if pipeline is not None and pipeline.rank == 0:
            try:
                end(join())
            except RuntimeError:  # another rank has gone: nobody is left to tell
                pass

    def _drop(self) -> None:
        old, self._open = self._open, None
        if old is not None:
            old.conversation.close()
            if old.conversation.store is not None:
                old.conversation.store.close()
            if old.learner is not None:
                old.learner.close()

    def _load(self, request: ChatRequest) -> Iterator[OpenEvent]:
        path = yield from self._choose(request)
        group = join()  # several ranks (mlx.launch): this one loads its layers; all agree it worked before going on
        t0 = time.perf_counter()
        try:
            preflight(path, request.trust_remote_code)  # before the plan reads the expert map (a missing shard: 3)
            plan = plan_streaming(path, request.stream)
            yield plan
            self._drop()
            loaded = load(path, request.trust_remote_code, streaming=plan.config, store=plan.store, group=group,
                          parallel=request.parallel)
        except TqbenchError as e:
            if group is not None:
                agree(group, e)
            raise
        can_trim = True
        if group is not None:
            agree(group, None)
            can_trim = every(group, can_trim_prompt_cache(make_prompt_cache(loaded.model)))
        routing = set_active_experts(loaded.model, request.max_active_experts) if request.max_active_experts else None
        store = None
        if request.prompt_store and group is None:  # several ranks keep no checkpoints: each holds a part of the state
            runs = f"experts={routing.active}" if routing is not None else ""  # the routing the checkpoints hold
            store = PromptStore(cache_dir() / "prompts", model_key(path, runs))
        conv = Conversation(loaded=loaded, system=request.system, chat_template=request.chat_template,
                            can_trim=can_trim, store=store)
        try:
            yield from build_kernels(loaded.model)  # CUDA: the fused kernels its first token needs, with progress
            experts = loaded.streamer.store if loaded.streamer is not None else plan.store
            if plan.reason == "off":  # the plan read no layout
                experts = expert_layout(path)
            profile, learner = start_profile(loaded, request.profile, experts)
            stream = self._stream_setup(loaded, plan) if loaded.streamer is not None else None
        except BaseException:
            conv.close()
            raise
        info = ModelLoaded(path=str(loaded.path), model_type=loaded.model_type,
                           turboquant_modules=loaded.turboquant_modules, weight_bytes=loaded.weight_bytes,
                           chat_template=conv.chat_template,
                           sampling=Sampling.defaults(loaded.generation_config, **asdict(request.sampling)),
                           seconds=time.perf_counter() - t0, stream=stream,
                           experts_native=routing.native if routing else 0,
                           experts_active=routing.active if routing else 0, profile=profile)
        self._open = _Open(conversation=conv, loaded=info, learner=learner,
                           prompt_cache_bytes=request.prompt_cache_bytes, can_trim=can_trim)
        yield info

    def _choose(self, request: ChatRequest) -> Generator[OpenEvent, None, str]:
        """The model to open: the one asked for, else choose_model's (the demo, converted first when none is)."""
        if request.model is not None:
            yield ModelChosen(path=request.model, why="given")
            return request.model
        chosen = None
        for ev in choose_model():
            if isinstance(ev, ModelChosen):
                chosen = ev
            yield ev
        if chosen is None:
            raise TqbenchError("could not choose a model")
        return chosen.path

    def _stream_setup(self, loaded, plan: StreamPlan) -> StreamSetup:
        st, c = loaded.streamer.stats, loaded.streamer.config
        known = self._disk  # a re-open of the same model measures nothing again
        disk = known[1] if known and known[0] == str(loaded.path) else _disk_of(loaded.path)
        self._disk = (str(loaded.path), disk)
        layers = tuple(sorted((n, lay.experts) for n, lay in loaded.streamer.store.layers.items()))
        return StreamSetup(budget_bytes=st.budget_bytes, slots=st.slots, slot_bytes=st.slot_bytes,
                           staging_bytes=st.staging_bytes, workers=c.workers, policy=c.policy, fanout=c.fanout,
                           page_cache=st.page_cache, lookahead=c.lookahead, reads_in_flight=c.reads_in_flight,
                           disk=disk, layers=layers, why=plan.reason, host_budget_bytes=st.host_budget_bytes,
                           host_slots=st.host_slots, host_why=plan.host_why, cache_routing=c.cache_routing,
                           layer_major_tokens=LAYER_MAJOR_TOKENS if loaded.pipeline is None else 0)

    def _reply(self, text: str, sampling: Sampling | None) -> Iterator:
        state = self._current()
        lockstep = _leader(state)
        yield from self._watched(state, state.conversation.reply(text, sampling or state.loaded.sampling, lockstep),
                                 lockstep)
        if state.learner is not None:
            state.learner.save()  # what the reply taught is in the store while the chat is idle

    def _complete(self, request: CompletionRequest, ended: Callable[[ReplyDone], None]) -> Iterator:
        state = self._current()
        loaded = state.conversation.loaded
        if state.completions is None:
            state.completions = _completions(state)
        if request.messages is not None:
            tokens = chat_prompt(loaded, [dict(m) for m in request.messages],
                                 [dict(t) for t in request.tools] if request.tools else None,
                                 state.conversation.chat_template)
        else:
            tokens = text_prompt(loaded, request.prompt or "")
        given = {k: v for k, v in asdict(request.sampling).items() if v is not None}
        sampling = replace(state.loaded.sampling, **given)
        tools = [dict(t) for t in request.tools] if request.tools else None
        grammar = reply_grammar(tools=tools, tool_choice=request.tool_choice, tool_syntax=sampling.tool_syntax,
                                response_schema=request.response_schema, parallel=request.parallel_tool_calls)
        if grammar is not None:
            if tools and request.response_schema is None:
                check_tool_format(loaded.tokenizer)
            sampling = replace(sampling, grammar=grammar)
        split = Segmenter(loaded.tokenizer, tools, loaded.tokenizer.decode(tokens[-8:]))
        answer = _Answer()
        lockstep = _leader(state)
        for ev in self._watched(state, state.completions.run(tokens, sampling, request.stop, ended, lockstep),
                                lockstep):
            match ev:  # a reply's tokens and end, split into the answer, its reasoning and its tool calls
                case TokenOut():
                    ev = replace(answer.add(ev.id, *split.feed(ev.text, None)), logprob=ev.logprob)
                    if ev.logprob is not None:
                        answer.logprobs.append(ev.logprob)
                case ReplyDone():
                    tail = answer.add(-1, *split.feed("", ev.finish_reason))
                    if tail.content or tail.reasoning or tail.tool_calls:
                        yield tail
                    ev = answer.done(ev)
            yield ev
        if loaded.streamer is not None:
            yield self._stats()

    def _watched(self, state: _Open, events: Iterator, lockstep=None) -> Iterator:
        """A reply's events with, before each, the page-ins of the forward pass that made it (streaming), and the
        routing it taught the learner counted. The process's first forward pass on CUDA: MlxWarmup after
        ReplyStarted (nothing has run yet), MlxWarmedUp before the first token (tqbench.runtime.warmup). Several
        ranks (`lockstep` its turn): once the reply has ended, also stopped early, every rank's streaming figures."""
        streamer = state.conversation.loaded.streamer
        pipeline = state.conversation.loaded.pipeline
        if pipeline is not None:
            events = _across_ranks(events, pipeline)
        warmup, started = None, 0.0
        ended = False  # the reply ended on this rank, or was stopped: not broken by an error
        try:
            for ev in events:
                if state.learner is not None:
                    state.learner.flush()
                if streamer is not None:
                    yield from streamer.drain()
                if warmup is not None and isinstance(ev, (TokenOut, ReplyDone)):
                    yield mlx_warmed(warmup, time.perf_counter() - started)
                    warmup = None
                yield ev
                if isinstance(ev, ReplyStarted):  # the forward passes come next
                    warmup, started = mlx_warmup(), time.perf_counter()
                    if warmup is not None:
                        yield warmup
            ended = True
        except GeneratorExit:  # stopped: the reply's own generator ends it first, on every rank at one token
            ended = True
            raise
        finally:
            events.close()
            if pipeline is not None and ended and lockstep is not None and lockstep.shared:
                # every rank ends its turn here, in step: rank 0 learns how each one streamed
                state.ranks = gather_stats(join(), pipeline, streamer.stats if streamer is not None else None)

    def _follow(self) -> Iterator:
        """Run rank 0's turns on this rank (tqbench.distributed.turns.follow), each on the prompt cache it names."""
        state = self._current()
        loaded = state.conversation.loaded
        done: list[ReplyDone] = []

        def run(turn, lockstep) -> None:
            if turn.slot == SLOT_CHAT:
                held = state.conversation
            else:
                if state.completions is None:
                    state.completions = _completions(state)
                held = state.completions
            held.keep(turn.keep)
            tokens = held.tokens if turn.slot == SLOT_CHAT else held.held
            tokens.extend(turn.tokens)
            sampling = Sampling(max_tokens=turn.max_tokens, temp=turn.temp, top_p=turn.top_p, top_k=turn.top_k,
                                seed=turn.seed)
            for ev in self._watched(state, generate(loaded, list(turn.tokens), held.cache, sampling=sampling,
                                                    cached=turn.keep, held=tokens, lockstep=lockstep,
                                                    slot=turn.slot), lockstep):
                if isinstance(ev, ReplyDone):
                    done.append(ev)
            if state.learner is not None and turn.slot == SLOT_CHAT:  # as rank 0 saves (a server's: now and then)
                state.learner.save()

        def turns() -> Iterator:
            follow(join(), run)
            yield from done

        yield from _across_ranks(turns(), loaded.pipeline)

    def _stats(self) -> StreamReport | None:
        if self._open is None or self._open.conversation.loaded.streamer is None:
            return None
        disk = self._disk[1] if self._disk else None
        learner = self._open.learner  # it counts a reply's routing before each of its events
        return StreamReport.snapshot(self._open.conversation.loaded.streamer.stats, disk, self._open.loaded.profile,
                                     learner.routings if learner is not None else None, self._open.ranks)

    def _export(self, out: Path) -> ProfileExport:
        state = self._current()
        if state.learner is None:
            raise TqbenchError("this session does not learn a profile (a model without routed experts, or no "
                               "profile store)")
        state.learner.flush()
        state.learner.save()
        out.parent.mkdir(parents=True, exist_ok=True)
        p = export_learned(state.conversation.loaded.path, state.learner.store, out)
        return ProfileExport(file=str(out), routings=p.routings, sessions=p.sessions, pins=len(p.ranked()))


@dataclass(kw_only=True)
class _Answer:
    """A completion's answer so far, as its deltas split it."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, token: int, content: str, reasoning: str, calls: tuple[ToolCall, ...]) -> CompletionDelta:
        self.content.append(content)
        self.reasoning.append(reasoning)
        self.calls += calls
        return CompletionDelta(token=token, content=content, reasoning=reasoning, tool_calls=calls)

    def done(self, reply: ReplyDone) -> CompletionDone:
        finish = "tool_calls" if self.calls and reply.finish_reason == "stop" else reply.finish_reason
        return CompletionDone(content="".join(self.content), reasoning="".join(self.reasoning),
                              tool_calls=tuple(self.calls), finish_reason=finish, reply=reply,
                              logprobs=tuple(self.logprobs))


def _leader(state: _Open):
    """Rank 0 of a pipeline: a turn's side that shares it with the other ranks (tqbench.distributed.turns.Leader);
    None on one process."""
    pipeline = state.conversation.loaded.pipeline
    if pipeline is None:
        return None
    return Leader(join())


def _completions(state: _Open):
    loaded = state.conversation.loaded
    return Completions(loaded, state.prompt_cache_bytes, one_cache=loaded.pipeline is not None,
                       can_trim=state.can_trim, store=state.conversation.store)


def _across_ranks(events: Iterator, pipeline) -> Iterator:
    """A reply's events on a rank of a pipeline: a collective that fails because another rank went away is one line."""
    yield from in_step(events, pipeline)


def _disk_of(path) -> DiskSpeed | None:
    """The read bandwidth of the disk holding the model: the one figure `tqbench plan` and the TUI show for that disk
    (tqbench.machine.disk_speed: cached, else measured once and cached). None when it cannot be measured."""
    try:
        return disk_speed(path)
    except (OSError, ValueError):
        return None
