"""A chat's hot-expert profile at open: which profile it starts from (tqbench.profile.choose), its hottest experts
pinned and preloaded in the expert cache (streaming), and the learner that adds this session's routings."""

from __future__ import annotations

import sys

from tqbench.chat.records import ProfileInfo
from tqbench.chat.request import ProfileOptions
from tqbench.profile import (PIN_SHARE, PREFILL_WEIGHT, SHIPPED_PIN_SHARE, Learner, Profile, ProfileError, ProfileStore,
                             choose, tap)
from tqbench.stream.store import ExpertStore


def start_profile(loaded, opts: ProfileOptions, experts: ExpertStore | None) -> tuple[ProfileInfo | None,
                                                                                     Learner | None]:
    """Choose the profile, pin and preload its hottest experts (streaming), start learning. `experts`: the model's
    routed-expert layout (the streamer's when it streams). (None, None) for a model without routed experts."""
    if experts is not None and loaded.pipeline is not None and loaded.streamer is None:
        experts = experts.only(loaded.pipeline.holds)  # a rank learns its own layers' profile
    if experts is None or not experts.layers:
        return None, None
    store = None
    if opts.learn or opts.file is None:
        try:
            store = ProfileStore(opts.store)
        except ProfileError as e:  # a chat still runs: it just neither learns nor uses what was learned
            print(f"tqbench: warning: {e}; this session does not learn", file=sys.stderr)
    choice = choose(loaded.path, opts.file, force=opts.force, store=store, mature=opts.mature, experts=experts,
                    cold=opts.cold)
    pinned, preload_s = 0, 0.0
    if choice.profile is not None and loaded.streamer is not None:  # share 0: no pins, history seeded
        pinned = _pin(loaded.streamer, choice, opts)
        preload_s = loaded.streamer.stats.preload_s
    learner = None
    if opts.learn and store is not None:
        learner = Learner(store, Profile.empty(choice.fingerprint, choice.geometry))
        tap(loaded.model, learner)
    elif store is not None:
        store.close()
    info = ProfileInfo(source=choice.source, where=choice.where, fingerprint=choice.fingerprint,
                       routings=round(choice.profile.routings) if choice.profile else 0, pinned=pinned,
                       preload_s=preload_s, learning=learner is not None)
    return info, learner


def _pin(streamer, choice, opts: ProfileOptions) -> int:
    """Pin and read the profile's hottest experts (a share of the slots) and seed the cache policy with its counts."""
    p = choice.profile
    weight = PREFILL_WEIGHT if opts.prefill_weight is None else opts.prefill_weight
    share = opts.pin_share
    if share is None:
        share = SHIPPED_PIN_SHARE if choice.source == "shipped" else PIN_SHARE
    counts = {(n, int(e)): float(v) for n, c in p.counts(weight).items() for e, v in enumerate(c) if v > 0}
    return streamer.preload(p.ranked(weight), share, counts)
