"""Chat as engine jobs, the same for both faces: a `tqbench.engine.Session` holds the loaded model and its
Conversation on the engine thread; the faces submit `open_model`, `reply` and `reset` and read plain events.

    session = Session()
    with session.submit(lambda s: open_model(s, path)) as job: loaded = job.result()[-1]
    with session.submit(lambda s: reply(s, "hello", loaded.sampling)) as job:
        for ev in job: ...            # ReplyStarted, TokenOut..., ReplyDone
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator

from tqbench.engine import Session
from tqbench.runtime.chat import Conversation, ReplyDone, ReplyStarted, Sampling, TokenOut

KEY = "conversation"
LEARNER = "profile-learner"
DISK = "disk-speed"  # (model path, tqbench.recipe.fit.DiskSpeed of its disk) for the streamed model


@dataclass(frozen=True)
class ProfileOptions:
    file: str | None = None  # --profile FILE
    learn: bool = True  # --no-learn turns it off
    pin_share: float | None = None  # of the expert cache's slots pinned from the profile (streaming only); None:
    # tqbench.profile.PIN_SHARE for a learned or given profile, SHIPPED_PIN_SHARE for a shipped one
    force: bool = False  # use a file made for another model of the same geometry
    store: str | None = None  # the learned profiles' directory (default: the user cache)
    mature: int | None = None  # routings before the learned profile is used (default tqbench.profile.MATURE)
    cold: bool = False  # --cold: start from no profile (still learns unless learn is off)
    prefill_weight: float | None = None  # a prompt's routings next to decode's when ranking pins (None: the default)


def _profile(session: Session, loaded: Any, opts: ProfileOptions) -> dict | None:
    """Choose the profile, pin and preload its hottest experts (streaming), start learning. None for a model
    without streamable routed experts (nothing to profile)."""
    from tqbench.profile import (PIN_SHARE, PREFILL_WEIGHT, SHIPPED_PIN_SHARE, Learner, Profile, ProfileError,
                                 ProfileStore, choose, tap)
    from tqbench.stream.store import ExpertStore, StoreError

    experts = loaded.streamer.store if loaded.streamer is not None else None
    if experts is None:
        try:
            experts = ExpertStore.open(loaded.path)
        except (StoreError, OSError):
            return None  # no routed experts to profile
        experts.close()
    store = None
    if opts.learn or opts.file is None:
        try:
            store = ProfileStore(opts.store)
        except ProfileError as e:  # a chat still runs: it just neither learns nor uses what was learned
            print(f"tqbench: warning: {e}; this session does not learn", file=sys.stderr)
    choice = choose(loaded.path, opts.file, opts.force, store, opts.mature, experts, opts.cold)
    pinned, preload_s = 0, 0.0
    if choice.profile is not None and loaded.streamer is not None:  # share 0: no pins, history seeded
        p = choice.profile
        pw = PREFILL_WEIGHT if opts.prefill_weight is None else opts.prefill_weight
        share = opts.pin_share
        if share is None:
            share = SHIPPED_PIN_SHARE if choice.source == "shipped" else PIN_SHARE
        weights = {(n, int(e)): float(v) for n, c in p.counts(pw).items() for e, v in enumerate(c) if v > 0}
        pinned = loaded.streamer.preload(p.ranked(pw), share, weights)
        preload_s = loaded.streamer.stats.preload_s
    if opts.learn and store is not None:
        learner = Learner(store, Profile.empty(choice.fingerprint, choice.geometry))
        tap(loaded.model, learner)
        session.state[LEARNER] = learner
    elif store is not None:
        store.close()
    return {"source": choice.source, "where": choice.where, "fingerprint": choice.fingerprint,
            "routings": round(choice.profile.routings) if choice.profile else 0, "pinned": pinned,
            "preload_s": round(preload_s, 3), "learning": bool(opts.learn and store is not None)}


def profile_info(session: Session) -> dict | None:
    """What `open_model` decided about the profile (also for --stats-json). Use with session.call."""
    return session.state.get("profile-info")


@dataclass(frozen=True)
class ModelLoaded:
    path: str
    model_type: str
    turboquant_modules: int
    weight_bytes: int  # the resident parameters as held in memory
    chat_template: bool  # False: a base model, turns are plain text
    sampling: Sampling  # defaults from generation_config.json and the user's options
    seconds: float
    stream: dict | None = None  # streaming: budget_bytes, slots, slot_bytes, staging_bytes, workers, policy, fanout
    experts_native: int = 0  # routed experts per token as trained (0: not a MoE model we route)
    experts_active: int = 0  # as run (--max-active-experts)
    profile: dict | None = None  # source, where, routings, pinned, preload_s, learning, fingerprint


def open_model(session: Session, path: str, trust_remote_code: bool = False, system: str | None = None,
               chat_template: bool = True, streaming: Any = None, max_active_experts: int = 0,
               profile: ProfileOptions | None = None, **sampling: Any) -> Iterator[ModelLoaded]:
    """Load `path` (replacing any model the session holds) and start a conversation. `streaming`: a
    tqbench.stream.StreamConfig to keep routed experts on disk. `profile`: which hot-expert profile to start from
    and whether to learn one (MoE models with routed experts only)."""
    import time

    from tqbench.runtime.load import load

    t0 = time.perf_counter()
    for key in (KEY, LEARNER):
        old = session.state.pop(key, None)
        if old is not None:
            old.close()
    loaded = load(path, trust_remote_code, streaming=streaming)
    native = active = 0
    if max_active_experts:
        from tqbench.runtime.routing import set_active_experts

        ae = set_active_experts(loaded.model, max_active_experts)
        native, active = ae.native, ae.active
    conv = Conversation(loaded, system=system, chat_template=chat_template)
    session.state[KEY] = conv
    prof = _profile(session, loaded, profile or ProfileOptions())
    session.state["profile-info"] = prof
    stream = None
    if loaded.streamer is not None:
        st, c = loaded.streamer.stats, loaded.streamer.config
        known = session.state.get(DISK)  # (model path, speed): a re-open of the same model measures nothing again
        disk = known[1] if known and known[0] == str(loaded.path) else _disk_speed(loaded.path)
        session.state[DISK] = (str(loaded.path), disk)
        stream = {"budget_bytes": st.budget_bytes, "slots": st.slots, "slot_bytes": st.slot_bytes,
                  "staging_bytes": st.staging_bytes, "workers": c.workers, "policy": c.policy, "fanout": c.fanout,
                  "page_cache": st.page_cache, "lookahead": c.lookahead, "reads_in_flight": c.reads_in_flight,
                  **_disk_fields(disk)}
    yield ModelLoaded(str(loaded.path), loaded.model_type, loaded.turboquant_modules, loaded.weight_bytes,
                      conv.chat_template, Sampling.defaults(loaded.generation_config, **sampling),
                      time.perf_counter() - t0, stream, native, active, prof)


def reply(session: Session, text: str, sampling: Sampling) -> Iterator[ReplyStarted | TokenOut | ReplyDone | Any]:
    """The reply's events; with streaming, each forward pass's PageIn events (one per MoE layer) come before the
    event that follows that pass. A learning session counts each token's routing and saves every few seconds."""
    conv = conversation(session)
    streamer = conv.loaded.streamer
    learner = session.state.get(LEARNER)
    for ev in conv.reply(text, sampling):
        if learner is not None:
            learner.flush()
        if streamer is not None:
            yield from streamer.drain()
        yield ev


def stream_stats(session: Session) -> dict | None:
    """Streaming totals and per-layer figures (StreamStats.to_dict()), with this disk's measured read bandwidth
    (`disk_bytes_per_s`, `disk_source`) and the bandwidth the page-ins got (`disk_bytes_per_s_on_misses`: bytes read
    on the critical path over the time waited for them), or None for a resident model. Use with session.call."""
    streamer = conversation(session).loaded.streamer
    if streamer is None:
        return None
    d = streamer.stats.to_dict()
    d.update(_disk_fields((session.state.get(DISK) or (None, None))[1]))
    d["disk_bytes_per_s_on_misses"] = d["critical_bytes"] / d["stall_s"] if d["stall_s"] > 0 else None
    return d


def _disk_speed(path) -> Any:
    """The read bandwidth of the disk holding the model: the measurement `tqbench plan` cached for that disk, else a
    quick one reading the model's own shards (at most 128 MB, page cache bypassed; nothing written). None when
    neither works."""
    from pathlib import Path

    from tqbench.recipe.fit import cached_disk_speed, file_read_speed

    try:
        return cached_disk_speed(path) or file_read_speed(list(Path(path).glob("*.safetensors")))
    except (OSError, ValueError):
        return None


def _disk_fields(disk: Any) -> dict:
    return {"disk_bytes_per_s": disk.bytes_per_s if disk else None, "disk_source": disk.source if disk else None}


def export_profile(session: Session, file: str) -> dict:
    """Save what this session learned, then write the model's learned profile to `file` as `tqbench profile export`
    does (tqbench.profile.export_learned). Returns file, routings, sessions and pins. Use with session.call."""
    from pathlib import Path

    from tqbench.errors import TqbenchError
    from tqbench.profile import export_learned

    learner = session.state.get(LEARNER)
    if learner is None:
        raise TqbenchError("this session does not learn a profile (a model without routed experts, or no profile "
                           "store)")
    learner.flush()
    learner.save()
    out = Path(file)
    out.parent.mkdir(parents=True, exist_ok=True)
    p = export_learned(conversation(session).loaded.path, learner.store, out)
    return {"file": str(out), "routings": p.routings, "sessions": p.sessions, "pins": len(p.ranked())}


def last_reply(session: Session) -> ReplyDone | None:
    """The summary of the last reply, also of one stopped early (finish_reason "cancelled"). Use with session.call."""
    return conversation(session).last


def reset(session: Session) -> None:
    """Forget the conversation (messages and cache). Use with session.call."""
    conversation(session).reset()


def conversation(session: Session) -> Conversation:
    conv = session.state.get(KEY)
    if conv is None:
        raise RuntimeError("no model is loaded in this session")
    return conv
