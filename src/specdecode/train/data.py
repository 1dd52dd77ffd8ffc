"""Offline self-distillation data: the target's own continuations and features, never Spec-Bench.

Two prompt sources, both generated locally:

* instructions made from templates x topics (:func:`instruction_prompts`), answered by the target
  itself (continuously batched greedy decoding on :class:`specdecode.engine.Engine`);
* user turns written by the target itself (self-instruct, as in Magpie: sampled continuations of
  the chat template's empty user turn, :func:`self_instruct_prompts`), answered by the target;
* chunks of the Python standard library's source on disk (code and docstrings), teacher-forced
  in one prefill each, half as plain text and half as an assistant turn under the chat template.

Every sequence is then run once through the native target, recording the last layer's output
(before the final norm) at every position. A shard holds ``tokens`` (int32 [N]), ``features``
(float16 [N, hidden]) and ``offsets`` (int64 [S + 1], sequence boundaries), plus ``heldout``
(int64 [S], 1 for sequences kept out of training, chosen by a hash of their tokens so that a
sequence's split never depends on what else is in the shard).
"""

from __future__ import annotations

import json
import random
import sysconfig
import zlib
from pathlib import Path

import torch

TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give me three tips related to {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Describe the history of {t} briefly.",
    "How would you teach {t} to a beginner?",
    "Write a short poem about {t}.",
    "List five facts about {t}.",
    "Write an email to a friend about {t}.",
    "What is the most common misconception about {t}?",
    "Compare {t} with {u}.",
    "Write a step-by-step guide to getting started with {t}.",
    "Why is {t} important today?",
    "Summarize what people should know about {t} in a few sentences.",
    "Write a Python function related to {t}, with a docstring.",
    "Create a short quiz with answers about {t}.",
    "Write a dialogue between two people discussing {t}.",
    "What questions would an expert ask about {t}?",
]

TOPICS = [
    "gardening",
    "volcanoes",
    "the stock market",
    "machine learning",
    "photosynthesis",
    "jazz music",
    "the French revolution",
    "climate change",
    "sorting algorithms",
    "healthy breakfasts",
    "chess openings",
    "black holes",
    "public transport",
    "the immune system",
    "renewable energy",
    "ancient Rome",
    "coffee",
    "recursion",
    "time management",
    "bird migration",
    "the water cycle",
    "electric cars",
    "databases",
    "meditation",
    "plate tectonics",
    "origami",
    "supply and demand",
    "the human heart",
    "volunteering",
    "prime numbers",
    "baking bread",
    "the Internet",
    "honey bees",
    "job interviews",
    "recycling",
    "linear regression",
    "mountain hiking",
    "the Moon landing",
    "spreadsheets",
    "friendship",
    "probability",
    "solar panels",
    "writing a resume",
    "dinosaurs",
    "the printing press",
    "vaccines",
    "hash tables",
    "learning a language",
    "ocean currents",
    "budget travel",
    "graph theory",
    "tea",
    "the Renaissance",
    "smartphones",
    "sleep",
    "running a marathon",
    "compound interest",
    "rainforests",
    "unit testing",
    "classical music",
    "earthquakes",
    "nutrition labels",
    "regular expressions",
]

# Topics never used for training data: held-out evaluation prompts come from these.
HELDOUT_TOPICS = ["glaciers", "board games", "bicycle repair", "the Silk Road", "binary search"]


def instruction_prompts(n: int, seed: int, topics: list[str] = TOPICS, task_share: float = 0.0) -> list[str]:
    """``n`` distinct user turns (fewer if the sources run out): templates x topics, and with
    probability ``task_share`` a task prompt (:func:`task_prompt`)."""
    rng = random.Random(seed)
    passages = doc_passages(seed) if task_share > 0 else []
    out: dict[str, None] = {}  # ordered set: a repeated prompt would repeat its greedy answer
    for _ in range(20 * n):
        if len(out) == n:
            break
        if passages and rng.random() < task_share:
            out[task_prompt(rng, passages)] = None
            continue
        t, u = rng.sample(topics, 2)
        out[rng.choice(TEMPLATES).format(t=t, u=u)] = None
    return list(out)


ITEMS = ["apples", "notebooks", "tickets", "cupcakes", "marbles", "books", "pencils", "stamps"]
NAMES = ["Maria", "Tom", "Aisha", "Ken", "Lena", "Omar", "Sofia", "Raj"]


def task_prompt(rng: random.Random, passages: list[str]) -> str:
    """A task over a passage (summarise, answer from context, edit) or an arithmetic word problem."""
    passage = rng.choice(passages)
    word = rng.choice([w.strip("*.,:()") for w in passage.split() if len(w) > 6] or ["Python"])
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(3, 9)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice(
        [
            f"Summarize the following text in a few sentences:\n\n{passage}",
            f"Answer the question using only the context.\n\nContext: {passage}\n\nQuestion: What does the context say about {word}?",
            f"Rewrite this text in simpler words:\n\n{passage}",
            f"Fix any mistakes in this text and return it in full:\n\n{passage}",
            f"{name} has {a} {item} and buys {b} packs of {c} more. How many {item} does {name} have now? Think step by step.",
            f"A train travels {a * 5} km in {b} hours. What is its average speed? Show your reasoning.",
            f"What is {a} times {b}, plus {c * 7}? Explain each step.",
        ]
    )


def doc_passages(seed: int, n: int = 2000, max_chars: int = 700) -> list[str]:
    """English prose from the Python documentation shipped with the interpreter (pydoc topics)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n")]
    prose = [p for p in paragraphs if len(p) > 200 and not p.startswith((" ", "*")) and "::=" not in p]
    rng = random.Random(seed)
    return [p[:max_chars] for p in rng.sample(prose, min(n, len(prose)))]


def heldout_prompts(n: int = 4) -> list[str]:
    return [
        TEMPLATES[i % len(TEMPLATES)].format(t=t, u=HELDOUT_TOPICS[i - 1]) for i, t in enumerate(HELDOUT_TOPICS[:n])
    ]


def stdlib_texts(n: int, seed: int, max_chars: int = 1600) -> list[str]:
    """``n`` random chunks of the standard library's ``.py`` files (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n and files:
        path = rng.choice(files)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 200:
            continue
        start = rng.randrange(max(1, len(text) - max_chars))
        start = text.rfind("\n", 0, start) + 1  # begin at a line start
        out.append(text[start : start + max_chars])
    return out


def chat_ids(tokenizer, user: str, assistant: str | None = None) -> list[int]:
    """Token ids of a user turn (and an assistant reply), plain text without a chat template."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": user}]
        if assistant is None:
            enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        else:
            msgs.append({"role": "assistant", "content": assistant})
            enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)
        return list(enc["input_ids"])
    return list(tokenizer.encode(user + ("\n" + assistant if assistant else "\n"), add_special_tokens=False))


def user_turn_prefix(tokenizer) -> list[int] | None:
    """Token ids of the chat template up to an (empty) user message; None without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    sentinel = "\u2063SENTINEL\u2063"
    text = tokenizer.decode(chat_ids(tokenizer, sentinel))
    return list(tokenizer.encode(text[: text.index(sentinel)], add_special_tokens=False))


def self_instruct_prompts(
    target, tokenizer, n: int, seed: int, eos: tuple[int, ...], batch: int = 48, max_tokens: int = 96
) -> list[str]:
    """``n`` distinct user turns written by the target itself (Magpie, arXiv 2406.08464).

    The target continues its chat template's empty user turn, sampled at temperature 1 (top-p
    0.95); turns it ends itself within ``max_tokens`` with at least three words are kept. Fewer
    than ``n`` come back when the target keeps repeating itself or has no chat template.
    """
    from specdecode.core.sampling import SamplingConfig
    from specdecode.engine import Engine, EngineConfig, GenerationConfig

    prefix = user_turn_prefix(tokenizer)
    if prefix is None or n <= 0:
        return []
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    engine = Engine(target, eos_token_ids=eos, config=EngineConfig(max_batch=batch))
    out: dict[str, None] = {}  # ordered set
    drawn = 0
    for _ in range(8):
        want = n - len(out)
        if want <= 0:
            break
        m = want + want // 4 + 1
        configs = [
            GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=seed * 1_000_003 + drawn + i)
            for i in range(m)
        ]
        drawn += m
        turns = [r.token_ids for r in engine.generate([prefix] * m, configs)]
        for t in turns:
            if t and t[-1] in eos:
                text = tokenizer.decode(t[:-1]).strip()
                if len(text.split()) >= 3 and len(out) < n:
                    out[text] = None
    return list(out)


def is_heldout(ids: list[int], fraction: float) -> bool:
    """Whether a sequence is held out: a stable hash of its tokens, so the split of a sequence
    never depends on the rest of the shard."""
    if fraction <= 0:
        return False
    return zlib.crc32(torch.tensor(ids, dtype=torch.int32).numpy().tobytes()) % 10_000 < fraction * 10_000


def generate_responses(
    target, prompts: list[list[int]], max_new: int, batch: int, eos: tuple[int, ...], progress: bool = True
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by the native target, continuously batched.

    Identical to decoding each prompt alone, and ~1.8x the tokens per second of transformers'
    left-padded batched ``generate`` at batch 32 (measured side by side, BENCHMARKS.md).
    """
    from tqdm import tqdm

    from specdecode.engine import Engine, EngineConfig, GenerationConfig

    engine = Engine(target, eos_token_ids=eos, config=EngineConfig(max_batch=batch))
    with tqdm(total=len(prompts), desc="generate", disable=not progress) as bar:
        # A prompt longer than the model's window is answered from its last tokens (the engine
        # refuses over-long requests; the stored sequence keeps the whole prompt).
        keep = max(target.max_length - max_new, 1)
        results = engine.generate(
            [p[-keep:] for p in prompts],
            GenerationConfig(max_new_tokens=min(max_new, target.max_length - 1)),
            on_step=lambda done: bar.update(done - bar.n),
        )
    outs = [r.token_ids for r in results]
    return [p + o for p, o in zip(prompts, outs)]


@torch.inference_mode()
def target_features(target, ids: list[int]) -> torch.Tensor:
    """The native target's pre-norm last-layer features for every position of ``ids`` [n, hidden]."""
    _, hidden = target.forward(torch.tensor([ids]), target.new_cache(len(ids) + 1), last_only=True, return_hidden=True)
    return hidden


def build_dataset(
    model_dir: str | Path,
    out_path: str | Path,
    *,
    n_generated: int = 64,
    gen_tokens: int = 128,
    n_chunks: int = 64,
    chunk_chars: int = 1600,
    seed: int = 0,
    batch: int = 32,
    heldout_fraction: float = 0.05,
    task_share: float = 0.0,
    n_self_instruct: int = 0,
    progress: bool = True,
) -> dict:
    """Write a shard to ``out_path``; return its summary (sequence and token counts).

    Sequences are stored templated answers first, then self-instructed answers, then stdlib chunks.
    """
    from specdecode.models.loading import eos_token_ids, load_tokenizer
    from specdecode.models.native import NativeCausalLM

    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    target = NativeCausalLM.from_pretrained(model_dir)
    eos = eos_token_ids(tok, target.config)
    limit = min(target.max_length, 2048)
    rng = random.Random(seed)

    prompts = [chat_ids(tok, p) for p in instruction_prompts(n_generated, seed, task_share=task_share)]
    sequences = generate_responses(target, prompts, gen_tokens, batch, eos, progress) if prompts else []
    kinds = ["generated"] * len(sequences)
    own = self_instruct_prompts(target, tok, n_self_instruct, seed + 2, eos, batch)
    if own:
        sequences += generate_responses(target, [chat_ids(tok, p) for p in own], gen_tokens, batch, eos, progress)
        kinds += ["self_instruct"] * len(own)
    for j, text in enumerate(stdlib_texts(n_chunks, seed + 1, chunk_chars)):
        if j % 2 == 0:
            ids = list(tok.encode(text, add_special_tokens=False))
        else:
            ask = rng.choice(
                [
                    "Show me some Python code from the standard library.",
                    "Write an example Python module.",
                    "Write Python code with docstrings.",
                    "Continue this Python code.",
                ]
            )
            ids = chat_ids(tok, ask, text)
        if len(ids) >= 8:
            sequences.append(ids)
            kinds.append("stdlib")
    sequences = [s[:limit] for s in sequences]
    feats = [target_features(target, s).half() for s in _bar(sequences, "features", progress)]
    return write_shard(out_path, sequences, kinds, feats, heldout_fraction, seed)


def _bar(items: list, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=not progress)


def write_shard(
    out_path: str | Path,
    sequences: list[list[int]],
    kinds: list[str],
    feats: list[torch.Tensor],
    heldout_fraction: float,
    seed: int,
) -> dict:
    """Store sequences (chat answers first: the trainers' chat stream is the shard's first
    ``generated_sequences``), their fp16 features and the held-out flags; return the summary."""
    from safetensors.torch import save_file

    offsets = [0]
    for s in sequences:
        offsets.append(offsets[-1] + len(s))
    held = [int(is_heldout(s, heldout_fraction)) for s in sequences]
    summary = {
        "sequences": len(sequences),
        "tokens": offsets[-1],
        "generated_sequences": kinds.count("generated") + kinds.count("self_instruct"),
        "self_instruct_sequences": kinds.count("self_instruct"),
        "stdlib_sequences": kinds.count("stdlib"),
        "heldout_sequences": sum(held),
        "seed": seed,
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "tokens": torch.cat([torch.tensor(s, dtype=torch.int32) for s in sequences]),
            "features": torch.cat(feats),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
            "heldout": torch.tensor(held, dtype=torch.int64),
        },
        str(out_path),
        metadata={"summary": json.dumps(summary)},
    )
    return summary


def load_dataset(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        summary = json.loads(f.metadata()["summary"])
    return load_file(str(path)), summary
