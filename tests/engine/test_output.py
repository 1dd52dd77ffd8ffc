"""The emit stage: incremental detokenisation, stop strings, EOS and length, streamed text."""

from __future__ import annotations

import random

import pytest

from helpers import byte_tokenizer
from specdecode.engine import GenerationConfig
from specdecode.engine.output import MAX_PENDING, OutputTracker

EOS = 1  # the byte tokenizer's </s>
MIXED = ["a", "b", " ", "\n", "é", "ß", "日本", "語", "😀", "👍🏽", "STOP", "x"]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, the one the byte-level tokenizer's vocabulary is made of."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHARS = _bytes_to_unicode()


def byte_ids(tok, data: bytes) -> list[int]:
    """One token per byte, valid UTF-8 or not."""
    return [tok.convert_tokens_to_ids(BYTE_CHARS[b]) for b in data]


def tracker(
    tok, max_new_tokens: int = 10_000, stops: tuple[str, ...] = (), eos: tuple[int, ...] = (EOS,)
) -> OutputTracker:
    return OutputTracker(tok, frozenset(eos), GenerationConfig(max_new_tokens=max_new_tokens, stop_strings=stops))


def feed(out: OutputTracker, ids: list[int], rounds: list[int]) -> list[str]:
    """Commit ``ids`` in rounds of the given sizes (cycled) until done; the streamed pieces."""
    pieces, at, i = [], 0, 0
    while at < len(ids) and not out.finished:
        size = rounds[i % len(rounds)]
        pieces.append(out.add(ids[at : at + size]).text)
        at, i = at + size, i + 1
    return pieces


def expected_text(tok, ids: list[int], stops: tuple[str, ...]) -> str:
    """The whole-text decode, cut at the earliest stop string."""
    full = tok.decode(ids, skip_special_tokens=True)
    return full[: min((full.find(s) for s in stops if s in full), default=len(full))]


def random_ids(tok, rng: random.Random) -> list[int]:
    """Mixed text, raw random bytes (often invalid UTF-8) or random vocabulary ids."""
    kind = rng.randrange(3)
    if kind == 0:
        text = "".join(rng.choice(MIXED) for _ in range(rng.randint(1, 60)))
        return tok.encode(text, add_special_tokens=False)
    if kind == 1:
        return byte_ids(tok, bytes(rng.randrange(256) for _ in range(rng.randint(1, 120))))
    return [rng.randrange(len(tok)) for _ in range(rng.randint(1, 120))]


def check_random_sequences(tok, seed: int, cases: int) -> None:
    rng = random.Random(seed)
    stop_choices = [(), ("STOP",), ("b\n", "日本"), ("😀a",), ("é", "ab"), ("\ufffd\ufffd",)]
    for case in range(cases):
        ids, stops = random_ids(tok, rng), rng.choice(stop_choices)
        out = tracker(tok, max_new_tokens=len(ids), stops=stops, eos=())
        rounds = [rng.randint(1, 6) for _ in range(5)]
        pieces = feed(out, ids, rounds)
        want = expected_text(tok, out.token_ids, stops)
        assert out.finished and out.text == want, (case, ids, stops, rounds)
        assert "".join(pieces) == want, (case, ids, stops, rounds)
        assert out.finish_reason == (
            "stop" if len(want) < len(tok.decode(out.token_ids, skip_special_tokens=True)) else "length"
        )


def test_text_equals_whole_decode_for_random_sequences(tok):
    check_random_sequences(tok, seed=0, cases=400)


@pytest.mark.parametrize("text", ["aéb", "日本", "x😀y", "👍🏽!"])
def test_character_split_over_rounds_is_released_whole(tok, text):
    out = tracker(tok)
    pieces = feed(out, byte_ids(tok, text.encode()), [1])  # one byte per round
    # Each character comes out, whole, in the round of its last byte; nothing before.
    assert pieces == [piece for char in text for piece in [""] * (len(char.encode()) - 1) + [char]]


def test_clean_part_of_a_round_is_released_before_an_incomplete_character(tok):
    out = tracker(tok)
    data = "héllo 日".encode()
    assert out.add(byte_ids(tok, data[:-1])).text == "héllo "
    assert out.text == "héllo \ufffd"  # the text so far is what the tokens decode to
    assert out.add(byte_ids(tok, data[-1:])).text == "日"


def test_invalid_bytes_are_released_as_replacement_characters(tok):
    out = tracker(tok)
    pieces = feed(out, byte_ids(tok, b"a\x80\x80b\xe6\x97c"), [1])
    assert "".join(pieces) == "a\ufffd\ufffdb\ufffdc"


def test_stop_string_across_rounds(tok):
    out = tracker(tok, stops=("STOP",))
    pieces = feed(out, tok.encode("one ST two STO three STOP four", add_special_tokens=False), [2])
    assert out.finish_reason == "stop"
    assert out.text == "".join(pieces) == "one ST two STO three "
    assert "".join(pieces[:-1]) == "one ST two STO three "[: len("".join(pieces[:-1]))]


def test_stop_string_start_is_held_back_only_while_it_may_match(tok):
    out = tracker(tok, stops=("STOP",))
    assert out.add(tok.encode("abc", add_special_tokens=False)).text == "abc"
    assert out.add(tok.encode("dST", add_special_tokens=False)).text == "d"
    assert out.add(tok.encode("x", add_special_tokens=False)).text == "STx"
    assert out.add(tok.encode("STO", add_special_tokens=False)).text == ""
    assert out.add(tok.encode("P!", add_special_tokens=False)).text == ""
    assert (out.finish_reason, out.text) == ("stop", "abcdSTx")


def test_stop_string_inside_one_round(tok):
    out = tracker(tok, stops=("STOP",))
    ids = tok.encode("abcSTOPdef", add_special_tokens=False)
    event = out.add(ids)
    assert (event.text, out.text, out.finish_reason) == ("abc", "abc", "stop")
    assert event.token_ids == ids == out.token_ids  # the round's tokens are all kept, as committed


def test_earliest_stop_string_wins(tok):
    out = tracker(tok, stops=("cd", "b", "abc"))
    feed(out, tok.encode("xabcd", add_special_tokens=False), [1])
    assert (out.text, out.finish_reason) == ("xa", "stop")


def test_stop_string_made_of_a_character_split_over_rounds(tok):
    out = tracker(tok, stops=("本",))
    pieces = feed(out, byte_ids(tok, "日本語".encode()), [1])
    assert out.finish_reason == "stop" and out.text == "".join(pieces) == "日"
    assert out.count == 6  # the round completing the stop string is the last


def test_eos_ends_the_round_and_is_not_text(tok):
    out = tracker(tok)
    ids = tok.encode("hi", add_special_tokens=False)
    event = out.add(ids + [EOS] + ids)
    assert event.token_ids == ids + [EOS] == out.token_ids
    assert (event.text, out.text, out.finish_reason, out.finished) == ("hi", "hi", "eos", True)


def test_eos_after_an_incomplete_character_flushes_it_as_decoded(tok):
    out = tracker(tok)
    pieces = [out.add(byte_ids(tok, "a日".encode()[:-1])).text, out.add([EOS]).text]
    assert pieces == ["a", "\ufffd"] and out.text == "a\ufffd" == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_in_the_eos_round_reports_stop(tok):
    out = tracker(tok, stops=("STOP",))
    out.add(tok.encode("aSTOP", add_special_tokens=False) + [EOS])
    assert (out.text, out.finish_reason) == ("a", "stop")


def test_length_cuts_the_round(tok):
    out = tracker(tok, max_new_tokens=5, stops=("zz",))
    first = out.add(tok.encode("abc", add_special_tokens=False))
    second = out.add(tok.encode("defgh", add_special_tokens=False))
    assert (first.text, second.text, second.token_ids) == ("abc", "de", tok.encode("de", add_special_tokens=False))
    assert (out.count, out.text, out.finish_reason) == (5, "abcde", "length")


def test_without_a_tokenizer_only_tokens_are_tracked():
    out = OutputTracker(None, frozenset([EOS]), GenerationConfig(max_new_tokens=10, stop_strings=("a",)))
    assert out.add([5, 6]).text == "" and not out.finished
    event = out.add([7, EOS, 8])
    assert (event.token_ids, out.token_ids, out.text, out.finish_reason) == ([7, EOS], [5, 6, 7, EOS], "", "eos")


class CountingTokenizer:
    """Wraps a tokenizer, recording how many token ids each ``decode`` call is given."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def decode(self, ids, skip_special_tokens=False):
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def decode_work_per_round(tok, ids: list[int], rounds: list[int]) -> tuple[list[int], str]:
    counting = CountingTokenizer(tok)
    out = OutputTracker(counting, frozenset(), GenerationConfig(max_new_tokens=len(ids)))
    work, at, i = [], 0, 0
    while not out.finished:
        size = rounds[i % len(rounds)]
        before = len(counting.calls)
        out.add(ids[at : at + size])
        work.append(sum(counting.calls[before:]))
        at, i = at + size, i + 1
    return work, out.text


@pytest.mark.parametrize("kind", ["text", "invalid bytes"])
def test_decode_work_per_round_does_not_grow_with_the_output(tok, kind):
    rng = random.Random(1)
    if kind == "text":
        ids = tok.encode("".join(rng.choice(MIXED) for _ in range(1500)), add_special_tokens=False)
    else:
        ids = byte_ids(tok, bytes(rng.randrange(128, 256) for _ in range(3000)))
    rounds = [1, 5, 2, 4, 3]
    work, text = decode_work_per_round(tok, ids, rounds)
    assert len(ids) > 2500 and text == tok.decode(ids, skip_special_tokens=True)
    # A window is the last round's tokens, the undecided ones and this round's: O(round size),
    # decoded a few times at most; re-decoding the whole output would be thousands of tokens.
    assert max(work) <= 16 * max(rounds)
    half = len(work) // 2
    assert max(work[half:]) <= max(work[:half])


def chain_tokenizer():
    """Byte-level, with tokens that each end inside a character the next token completes."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    lead, rest = "日".encode()[:1], "日".encode()[1:]
    pieces = {"lead": lead, "chain": rest + lead, "tail": rest, "a": b"a"}
    vocab = {"<s>": 0, "</s>": 1} | {"".join(BYTE_CHARS[b] for b in v): i + 2 for i, v in enumerate(pieces.values())}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tk.decoder = decoders.ByteLevel()
    ids = dict(zip(pieces, range(2, 2 + len(pieces))))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>"), ids


def test_a_run_without_clean_boundaries_stays_exact_and_bounded():
    tok, v = chain_tokenizer()
    ids = [v["a"], v["lead"]] + [v["chain"]] * (20 * MAX_PENDING) + [v["tail"], v["a"]]
    for rounds in ([1], [3, 1, 2]):
        work, text = decode_work_per_round(tok, ids, rounds)
        assert text == "a" + "日" * (20 * MAX_PENDING + 1) + "a" == tok.decode(ids)
        assert max(work) <= 8 * (MAX_PENDING + 2 * max(rounds))
    out = tracker(tok)
    pieces = feed(out, ids, [1])
    assert "".join(pieces) == tok.decode(ids) and all("\ufffd" not in p for p in pieces)


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (words carry a leading "▁"; decode drops the first one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<sep>", "▁Hello", "▁world", "!", "▁a", "b"]
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="</s>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", additional_special_tokens=["<sep>"]
    )


def test_sentencepiece_spaces_survive_the_window():
    tok = metaspace_tokenizer()
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(2, 8) for _ in range(rng.randint(1, 30))]
        out = OutputTracker(tok, frozenset(), GenerationConfig(max_new_tokens=len(ids)))
        pieces = feed(out, ids, [rng.randint(1, 4) for _ in range(3)])
        assert out.text == "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdecode.models.loading import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(None))


@pytest.mark.slow
def test_real_tokenizer_random_sequences(smollm2_tokenizer):
    check_random_sequences(smollm2_tokenizer, seed=3, cases=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    ["日本語のテキストです。東京は首都です。", "中文句子没有空格用来测试分词器", "Emoji 😀🎉👍🏽 Ünïcödé — “quotes”"],
)
def test_real_tokenizer_never_streams_half_a_character(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    for size in (1, 2, 3):
        out = OutputTracker(tok, frozenset(), GenerationConfig(max_new_tokens=len(ids)))
        pieces = feed(out, ids, [size])
        assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
