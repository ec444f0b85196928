"""Learning-rate schedules (no TensorFlow): the rate at each epoch, and the same after a resume."""
import math

import pytest

from orchestrator.train.schedules import build
from orchestrator.core.spec import LearningRateSpec


def _rates(schedule, epochs, lr=1.0, start=0):
    out = []
    for e in range(start, epochs):
        lr = schedule(e, lr)
        out.append(lr)
    return out


def test_step_decay_from_the_compiled_rate_or_initial():
    s = build(LearningRateSpec("step_decay", {"factor": 0.5, "every": 2}), 0.1, 6)
    assert _rates(s, 6) == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    s = build(LearningRateSpec("step_decay", {"initial": 1.0, "factor": 0.1, "every": 1}), 0.1, 3)
    assert _rates(s, 3) == pytest.approx([1.0, 0.1, 0.01])


def test_cosine_with_warmup_reaches_the_minimum_at_the_last_epoch():
    s = build(LearningRateSpec("cosine", {"minimum": 0.0, "warmup_epochs": 2}), 0.4, 6)
    rates = _rates(s, 7)
    assert rates[:2] == pytest.approx([0.2, 0.4])
    assert rates[2] == pytest.approx(0.4)
    assert rates[4] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))
    assert rates[6] == pytest.approx(0.0) and all(a >= b for a, b in zip(rates[1:], rates[2:]))


def test_piecewise_changes_at_the_boundaries():
    s = build(LearningRateSpec("piecewise", {"boundaries": [2, 4], "values": [0.3, 0.2, 0.1]}),
              9.0, 6)
    assert _rates(s, 6) == [0.3, 0.3, 0.2, 0.2, 0.1, 0.1]


def test_user_function_gets_epoch_and_current_rate():
    seen = []

    def fn(epoch, lr):
        seen.append((epoch, lr))
        return lr * 0.5

    s = build(LearningRateSpec("function"), 1.0, 3, function=fn)
    assert _rates(s, 3, lr=0.8) == [0.4, 0.2, 0.1]
    assert seen == [(0, 0.8), (1, 0.4), (2, 0.2)]


@pytest.mark.parametrize("spec", [
    LearningRateSpec("step_decay", {"factor": 0.5, "every": 2}),
    LearningRateSpec("cosine", {"minimum": 0.01, "warmup_epochs": 1}),
    LearningRateSpec("piecewise", {"boundaries": [3], "values": [0.1, 0.01]}),
])
def test_a_resumed_run_gets_the_same_rate_at_each_epoch(spec):
    # the built-ins depend on the epoch and the compiled rate only, not on the restored rate
    full = _rates(build(spec, 0.1, 8), 8, lr=0.1)
    for k in range(1, 8):
        resumed = build(spec, 0.1, 8)  # a new worker: compiled rate 0.1, restored rate full[k-1]
        assert full[:k] + _rates(resumed, 8, lr=full[k - 1], start=k) == full
