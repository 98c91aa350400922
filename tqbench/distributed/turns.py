"""Rank 0 shares the requests: each turn it generates goes to the other ranks, which run the same generation in step.

Only rank 0 hears a user or a client. Every forward pass of a pipeline needs every rank, so before a generation rank 0
sends the turn to the others (`Leader.begin`): which prompt cache it continues (`slot`: the chat's conversation or the
server's completions), how many of that cache's tokens it keeps, the new token ids, and the sampling (with the seed
every rank samples with, so a sampled token is the same everywhere). After each token rank 0 says whether the reply
goes on (`Leader.steps`): a reply that ends on rank 0 for any reason (end of message, max tokens, a stop string, the
user's Ctrl-C, a client gone) ends on every rank at the same token. When rank 0 is done it sends the end (`end`).
The other ranks `follow`: receive a turn, run it, until the end comes.

Every message is a collective of the group (`all_sum` of int arrays to which the other ranks give zeros): a header of
fixed size, then the token ids; one int a token for the go-on. Engine thread (MLX)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from tqbench.errors import TqbenchError

SLOT_CHAT, SLOT_COMPLETIONS = 0, 1  # the prompt cache a turn continues: the conversation, or the server's
_TURN, _END = 1, 2
_HEADER = 9  # kind, slot, keep, tokens, max_tokens, top_k, seed, temp and top_p (float64 bits)


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One generation, as every rank runs it."""

    slot: int
    keep: int  # the tokens of the slot's prompt cache it continues from (the rest is dropped first)
    tokens: tuple[int, ...]  # the new tokens to process
    max_tokens: int
    temp: float
    top_p: float
    top_k: int
    seed: int  # every rank seeds its sampler with it


def _sum(group, values: np.ndarray):
    """`values` of rank 0 on every rank (the others give zeros): the turn's one transport. Waits for mlx-lm's
    generation stream first: a forward pass it still runs has collectives in flight that must end before this one."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    out = mx.distributed.all_sum(mx.array(values), group=group)
    mx.eval(out)
    return np.array(out)


def _header(group, header: np.ndarray | None) -> np.ndarray:
    return _sum(group, header if header is not None else np.zeros(_HEADER, dtype=np.int64))


def _float_bits(x: float) -> int:
    return int(np.array([x], dtype=np.float64).view(np.int64)[0])


def _bits_float(n: int) -> float:
    return float(np.array([n], dtype=np.int64).view(np.float64)[0])


def share(group, turn: Turn) -> None:
    """Rank 0: send a turn to the others."""
    h = np.array([_TURN, turn.slot, turn.keep, len(turn.tokens), turn.max_tokens, turn.top_k, turn.seed,
                  _float_bits(turn.temp), _float_bits(turn.top_p)], dtype=np.int64)
    _header(group, h)
    _sum(group, np.array(turn.tokens, dtype=np.int32))


def end(group) -> None:
    """Rank 0: tell the others there are no more turns."""
    h = np.zeros(_HEADER, dtype=np.int64)
    h[0] = _END
    _header(group, h)


def receive(group) -> Turn | None:
    """Another rank: the next turn rank 0 shares, None at the end."""
    h = [int(v) for v in _header(group, None)]
    if h[0] == _END:
        return None
    if h[0] != _TURN:
        raise TqbenchError(f"rank {group.rank()}: rank 0 sent an unknown message ({h[0]}): the ranks are out of step")
    tokens = _sum(group, np.zeros(h[3], dtype=np.int32))
    return Turn(slot=h[1], keep=h[2], tokens=tuple(int(t) for t in tokens), max_tokens=h[4], temp=_bits_float(h[7]),
                top_p=_bits_float(h[8]), top_k=h[5], seed=h[6])


def _go_on(group, go: bool) -> bool:
    """Rank 0's word after a token: True, the reply goes on (the other ranks give nothing)."""
    return bool(_sum(group, np.array([1 if go else 0], dtype=np.int32))[0])


class Lockstep:
    """One generation in step with the other ranks, as `tqbench.runtime.conversation.generate` drives it: `begin` before the
    first forward pass, then its tokens through `steps`. Rank 0's (`Leader`) sends, the others' (`Follower`) receive.
    `shared`: the turn has gone to the other ranks (after that, every rank ends the reply at the same token)."""

    leader = False
    shared = False

    def __init__(self, group) -> None:
        self.group = group

    def begin(self, slot: int, keep: int, tokens: list[int], sampling) -> int:
        """The seed every rank samples this turn with."""
        raise NotImplementedError

    def steps(self, steps: Iterator) -> Iterator:
        """`steps` (mlx-lm's response per token), each followed by rank 0's go-on: the reply ends on every rank at
        the token where it ends on rank 0. The consumer closing it there (its reply ended) counts as rank 0's stop."""
        told = True
        try:
            for r in steps:
                told = False
                yield r
                told = True
                if not _go_on(self.group, self.leader):
                    return
        finally:
            if not told:  # closed at a token: rank 0 stops there (another rank, whose reply ended there, hears it)
                _go_on(self.group, False)
            steps.close()


class Leader(Lockstep):
    """Rank 0's side of one turn."""

    leader = True

    def begin(self, slot: int, keep: int, tokens: list[int], sampling) -> int:
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
        share(self.group, Turn(slot=slot, keep=keep, tokens=tuple(tokens), max_tokens=sampling.max_tokens,
                               temp=sampling.temp, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed))
        self.shared = True
        return seed


class Follower(Lockstep):
    """Another rank's side of one turn rank 0 shared."""

    shared = True

    def __init__(self, group, turn: Turn) -> None:
        super().__init__(group)
        self.turn = turn

    def begin(self, slot: int, keep: int, tokens: list[int], sampling) -> int:
        return self.turn.seed


def follow(group, run: Callable[[Turn, Follower], None]) -> int:
    """Another rank: run each turn rank 0 shares (`run(turn, its Follower)`, which generates in step) until rank 0
    ends. Returns the turns run."""
    turns = 0
    while (turn := receive(group)) is not None:
        run(turn, Follower(group, turn))
        turns += 1
    return turns
