"""Kimi tokenizer files: tiktoken round trips, special-token ids, transformers agreement, the BPE trainer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from tqbench.tokenizer import (
    CHAT_TEMPLATE,
    PAT_STR,
    load_encoding,
    read_tiktoken_model,
    special_tokens,
    train_bpe,
    write_tiktoken_model,
    write_tokenizer,
)

CORPUS = (
    "def square(x):\n    return x * x  # the square of x\n\n"
    "Hello, world! The experts route tokens; the router picks the top experts.\n"
    "naïve café — 日本語のテキスト 🙂 numbers 12345 and 3.14159\n"
) * 4
SAMPLES = [
    "hello world",
    "def square(x):\n    return x ** 2  # squared\n",
    "naïve café — 日本語 🙂\t\r\n  trailing spaces   ",
    "Don't stop: it's 2026, y'all'll see 1234567.",
    "",
]


@pytest.fixture
def tok_dir(tmp_path):
    write_tokenizer(tmp_path, train_bpe(CORPUS.encode(), 100))
    return tmp_path


def test_bpe_trainer_matches_hand_computed_merges():
    # aaabdaaabac: aa (4x); then ab and (aa, a) tie at 2 -> the lower pair (a, b); then (aa, ab) -> aaab;
    # then four pairs tie at 1 -> (a, c).
    ranks = train_bpe(b"aaabdaaabac", 4)
    assert {t: r for t, r in ranks.items() if r >= 256} == {b"aa": 256, b"ab": 257, b"aaab": 258, b"ac": 259}
    assert all(ranks[bytes([b])] == b for b in range(256))
    # Merges never cross the regex split: "ab ab" is the chunks "ab" and " ab".
    assert {t: r for t, r in train_bpe(b"ab ab", 5).items() if r >= 256} == {b"ab": 256, b" ab": 257}
    # Deterministic, and stops when no pair is left.
    assert train_bpe(CORPUS.encode(), 100) == train_bpe(CORPUS.encode(), 100)
    assert len(train_bpe(b"abc", 10)) == 258


def test_tiktoken_file_round_trip(tmp_path):
    ranks = train_bpe(CORPUS.encode(), 60)
    path = write_tiktoken_model(tmp_path / "tiktoken.model", ranks)
    assert read_tiktoken_model(path) == ranks
    first = path.read_text().splitlines()[:2]
    assert first == ["AA== 0", "AQ== 1"]  # base64(b"\x00") rank 0, base64(b"\x01") rank 1


def test_special_token_ids():
    k3 = special_tokens(163584)
    assert len(k3) == 256 and sorted(k3.values()) == list(range(163584, 163840))
    assert (k3["[BOS]"], k3["[EOS]"], k3["<|end_of_msg|>"], k3["[UNK]"], k3["[PAD]"]) == (
        163584, 163585, 163586, 163838, 163839)  # fmt: skip
    assert (k3["<|open|>"], k3["<|close|>"], k3["<|sep|>"]) == (163587, 163588, 163589)
    assert k3["<|reserved_token_163590|>"] == 163590


def test_encoding_round_trips_and_specials(tok_dir):
    enc = load_encoding(tok_dir)
    base = len(read_tiktoken_model(tok_dir / "tiktoken.model"))
    assert base == 256 + 100 and enc.n_vocab == base + 256
    for s in SAMPLES:
        assert enc.decode(enc.encode(s)) == s
    assert enc.encode(" square") == [enc.encode_single_token(b" square")]  # a merged token
    ids = enc.encode("<|open|>hi<|end_of_msg|>[PAD]", allowed_special="all")
    assert ids[0] == base + 3 and ids[-2:] == [base + 2, base + 255]
    assert enc.encode("[BOS]", allowed_special="all") == [base]


def test_transformers_agrees_with_tiktoken(tok_dir):
    assert PAT_STR == TikTokenConverter().pattern  # transformers splits text with this regex
    enc = load_encoding(tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    base = enc.n_vocab - 256
    assert len(tok) == enc.n_vocab
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        base, base + 2, base + 255, base + 254)  # fmt: skip
    for s in SAMPLES + [CORPUS, "<|open|>message<|sep|>x<|end_of_msg|>"]:
        ids = enc.encode(s, allowed_special="all")
        assert tok.encode(s, add_special_tokens=True) == ids
        assert tok.decode(ids) == s
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == '<|open|>message role="user"<|sep|>hi<|end_of_msg|><|open|>message role="assistant"<|sep|>'
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == "<|end_of_msg|>"
