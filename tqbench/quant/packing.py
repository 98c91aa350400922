"""Packing quantization codes into uint32 words, in vectorised numpy.

Two layouts, both as TurboQuant-MLX stores them (docs/turboquant.md):
- b-bit codes (b = 1..16): floor(32/b) codes per word, LSB first; code j of a word sits at bits [j*b, j*b + b).
  3-bit packs 10 per word and wastes the top 2 bits.
- ternary (codes 0, 1, 2): 20 trits per word, little-endian base 3 (word = sum t_j * 3^j; 3^20 < 2^32).
A row of n codes takes ceil(n / per_word) words; the last word is padded with code 0.
"""

from __future__ import annotations

import math

import numpy as np

TRITS_PER_WORD = 20
_POW3 = 3 ** np.arange(TRITS_PER_WORD, dtype=np.uint64)


def codes_per_word(bits: int, ternary: bool = False) -> int:
    """Codes in one uint32: floor(32 / bits), or 20 trits."""
    if ternary:
        return TRITS_PER_WORD
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be 1..16, got {bits}")
    return 32 // bits


def packed_words(n: int, bits: int, ternary: bool = False) -> int:
    """uint32 words for a row of n codes."""
    return math.ceil(n / codes_per_word(bits, ternary))


def _rows(codes: np.ndarray, per_word: int) -> tuple[np.ndarray, int]:
    """Pad the last axis to whole words and split it into (..., words, per_word)."""
    codes = np.asarray(codes)
    n = codes.shape[-1]
    words = math.ceil(n / per_word)
    pad = words * per_word - n
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), dtype=codes.dtype)], axis=-1)
    return codes.reshape(*codes.shape[:-1], words, per_word).astype(np.uint64), n


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., n] in [0, 2^bits) -> uint32 [..., ceil(n / floor(32/bits))]."""
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    per = codes_per_word(bits)
    grid, _ = _rows(codes, per)
    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(bits))
    # The fields do not overlap, so the sum is the bitwise OR.
    return (grid << shifts).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


def unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """uint32 [..., words] -> codes uint16 [..., n] (the inverse of `pack`)."""
    words = np.asarray(words, dtype=np.uint32)
    per = codes_per_word(bits)
    if words.shape[-1] != math.ceil(n / per):
        raise ValueError(f"{words.shape[-1]} words cannot hold exactly {n} {bits}-bit codes")
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    mask = np.uint32((1 << bits) - 1)
    codes = (words[..., None] >> shifts) & mask
    return codes.reshape(*words.shape[:-1], -1)[..., :n].astype(np.uint16)


def pack_ternary(trits: np.ndarray) -> np.ndarray:
    """Trits [..., n] in {0, 1, 2} -> uint32 [..., ceil(n / 20)], little-endian base 3."""
    trits = np.asarray(trits)
    if trits.size and (trits.min() < 0 or trits.max() > 2):
        raise ValueError("ternary codes must be 0, 1 or 2")
    grid, _ = _rows(trits, TRITS_PER_WORD)
    return (grid * _POW3).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


def unpack_ternary(words: np.ndarray, n: int) -> np.ndarray:
    """uint32 [..., ceil(n / 20)] -> trits uint8 [..., n] (the inverse of `pack_ternary`)."""
    words = np.asarray(words, dtype=np.uint32)
    if words.shape[-1] != math.ceil(n / TRITS_PER_WORD):
        raise ValueError(f"{words.shape[-1]} words cannot hold exactly {n} trits")
    trits = (words[..., None].astype(np.uint64) // _POW3) % 3
    return trits.reshape(*words.shape[:-1], -1)[..., :n].astype(np.uint8)
