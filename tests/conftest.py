import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for ``helpers``
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from specdecode.runtime import free_cores  # noqa: E402

# Threads that outnumber free cores stall at every OpenMP barrier on a busy 2-core machine. Under
# pytest-xdist the workers share the cores: each gets its share (measuring would race the others).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS) if _WORKERS else free_cores())


@pytest.fixture
def one_thread():
    """Tiny models: a second intra-op thread only adds synchronisation cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- scheduling under pytest-xdist (``make test`` runs ``-n auto --dist loadgroup``) ------------------
# Tests of one file share a worker (their module fixtures load real models once), except the files
# named here, whose tests are long and independent and spread over the workers one function each.
# Ray tests all share one worker: two local Ray clusters at once kill each other's Serve actors.
SPLIT_BY_FUNCTION = ("tests/engine/test_real_model.py", "tests/proposers/test_hybrid.py")
RAY_FILES = ("tests/serve/test_ray.py", "tests/serve/test_cli_serve.py", "tests/serve/test_ray_config.py")
# The longest groups go first, so that no worker is left running one of them alone at the end.
LONG_FIRST = (
    "tests/engine/test_qwen_pair.py",
    "tests/engine/test_real_model.py",
    "tests/proposers/test_hybrid.py",
    "ray",
    "tests/engine/test_conformance.py",
    "tests/proposers/test_eagle.py",
    "tests/engine/test_tree_decoding.py",
)


def _group(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    if path in RAY_FILES:
        return "ray"
    if path in SPLIT_BY_FUNCTION:
        return f"{path}::{getattr(item, 'originalname', item.name)}"
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        group = _group(item)
        return next((i for i, name in enumerate(LONG_FIRST) if group.startswith(name)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: collection order within a rank
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
