"""Speedup ceilings of the cost model: the bound and its inverse agree, prefill caps both."""

from __future__ import annotations

import math

import pytest

from specdecode.core.cost_model import speedup_bound, tokens_per_call_needed

CURVE = {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 12.0}  # a flat-ish forward cost c(n)


def test_bound_is_amdahl_over_the_verify_cost():
    # No prefill: MAL tokens per call at c(5)/c(1) = 1.2 per call.
    assert speedup_bound(3.0, 4, CURVE, 0.0) == pytest.approx(3.0 / 1.2)
    # Half the plain time in prefill caps even infinite acceptance below 2x.
    assert speedup_bound(5.0, 4, CURVE, 0.5) == pytest.approx(1 / (0.5 + 0.5 * 1.2 / 5))


@pytest.mark.parametrize("share", [0.0, 0.1, 0.3])
def test_needed_tokens_invert_the_bound(share):
    for target in (1.2, 1.5, 2.0):
        need = tokens_per_call_needed(target, 4, CURVE, share)
        if not math.isinf(need):
            assert speedup_bound(need, 4, CURVE, share) == pytest.approx(target)
            assert need <= 5


def test_out_of_reach_targets_are_infinite():
    assert math.isinf(tokens_per_call_needed(2.5, 4, CURVE, 0.3))  # perfect drafts give 2.27x here
    assert math.isinf(tokens_per_call_needed(3.0, 4, CURVE, 0.4))  # 1/3 < prefill share: unreachable at any k
    assert speedup_bound(5.0, 4, CURVE, 0.3) < 2.5
