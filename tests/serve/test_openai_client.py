"""The official ``openai`` client against a real server: chat and completions, streaming and not,
with and without ``speculative``; greedy outputs equal ``specdecode generate``'s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from helpers import run_cli
from serving import openai_client
from specdecode.api import SpeculativeGenerator

MESSAGES = [{"role": "user", "content": "Count: one two three one two"}]
SPECS = [None, False, {"method": "ngram", "k": 3}, {"method": "suffix", "k": 2}, {"method": "ngram", "k": "auto"}]


@pytest.fixture(scope="module")
def alone(tiny_loaded):
    """What each prompt gives alone, plainly (the reference every served output must equal)."""
    gen = SpeculativeGenerator(tiny_loaded, method="none")
    return lambda prompt, n, chat: gen.generate(prompt, max_new_tokens=n, chat=chat)


def test_models_lists_the_served_model_and_its_methods(server):
    models = openai_client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert "ngram" in models.data[0].model_extra["methods"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: json.dumps(s))
def test_chat_greedy_equals_plain_decoding(server, alone, spec):
    extra = {} if spec is None else {"speculative": spec}
    out = openai_client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body=extra
    )
    ref = alone(MESSAGES[0]["content"], 24, True)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.prompt_tokens + out.usage.completion_tokens == out.usage.total_tokens
    block = out.usage.model_extra.get("speculative")
    if spec is False:
        assert block is None
    else:
        assert block["method"] in ("ngram", "suffix") and block["target_calls"] >= 1
        assert 0 <= block["accepted_tokens"] <= block["drafted_tokens"]


@pytest.mark.parametrize("spec", [False, {"method": "ngram", "k": 4}], ids=["plain", "ngram"])
def test_streamed_chat_joins_to_the_same_text(server, alone, spec):
    chunks = list(
        openai_client(server).chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": spec},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone(MESSAGES[0]["content"], 24, True).text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_completions_stream_and_not_equal_generate_without_template(server, alone):
    client = openai_client(server)
    ref = alone("def fib(n):", 20, False)
    out = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=20, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model="tiny",
        prompt="def fib(n):",
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"speculative": {"k": 2}},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text


def test_served_greedy_equals_the_cli_generate(server, tiny_model_dir):
    out = openai_client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    rc, stdout, _ = run_cli(
        [
            "generate",
            MESSAGES[0]["content"],
            "--target",
            str(tiny_model_dir),
            "--method",
            "ngram",
            "--max-new-tokens",
            "16",
            "--json",
        ]
    )
    assert rc == 0
    assert out.choices[0].message.content == json.loads(stdout)["text"]


def test_several_requests_at_once_each_equal_their_own_run(server, alone):
    prompts = [f"request {i}: " + "ab" * i for i in range(8)]
    client = openai_client(server)

    def call(i: int) -> str:
        spec = SPECS[i % len(SPECS)]
        out = client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=12 + i, temperature=0, extra_body={"speculative": spec}
        )
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(call, range(8)))
    assert texts == [alone(p, 12 + i, False).text for i, p in enumerate(prompts)]


def test_n_choices_and_seeded_sampling(server):
    client = openai_client(server)
    greedy = client.completions.create(model="tiny", prompt="xyz", max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 24
    kw = dict(model="tiny", prompt="xyz", max_tokens=12, temperature=1.0, n=4, seed=7)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # a seed fixes every choice
    assert len({c.text for c in first.choices}) > 1  # ...and the choices differ from each other


def test_logprobs_are_the_targets_own(server):
    out = openai_client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy takes the argmax
        assert entry.logprob <= 0
    legacy = openai_client(server).completions.create(
        model="tiny", prompt="abc", max_tokens=5, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text or len(lp.tokens) == 5
    assert lp.text_offset == sorted(lp.text_offset)


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(tiny_loaded):
    """The second conversation starting with the same system prompt reuses its prefill: usage
    says how many prompt tokens came from the cache (OpenAI's ``prompt_tokens_details``), the
    metrics count them, and the answers are what a cold generator gives."""
    from serving import metric, start_server

    system = {"role": "system", "content": "You answer in lists of words, lower case, no punctuation at all."}
    asks = [[system, {"role": "user", "content": text}] for text in ("colours?", "fruits, please")]
    live = start_server(tiny_loaded, method="ngram")
    try:
        client = openai_client(live)
        outs = [client.chat.completions.create(model="tiny", messages=m, max_tokens=12, temperature=0) for m in asks]
        first, second = (o.usage.prompt_tokens_details for o in outs)
        assert first is None or not first.cached_tokens
        assert second.cached_tokens >= 64 and second.cached_tokens % 16 == 0
        assert metric(live, "prefix_cache_hits_total") == second.cached_tokens
        assert metric(live, "prefix_cache_queries_total") == sum(o.usage.prompt_tokens for o in outs)
        salted = [  # another tenant's scope: nothing reused until it has stored its own
            client.chat.completions.create(
                model="tiny", messages=asks[1], max_tokens=12, temperature=0, extra_body={"cache_salt": "tenant-b"}
            ).usage.prompt_tokens_details
            for _ in range(2)
        ]
        assert (salted[0] is None or not salted[0].cached_tokens) and salted[1].cached_tokens >= 64
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            client.chat.completions.create(model="tiny", messages=asks[1], max_tokens=2, extra_body={"cache_salt": 5})
    finally:
        live.stop()
    cold = SpeculativeGenerator(tiny_loaded, method="none", prefix_cache_mb=0)
    tok = tiny_loaded.tokenizer
    for out, messages in zip(outs, asks):
        ids = list(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        )
        assert out.choices[0].message.content == cold.generate(ids, max_new_tokens=12).text
