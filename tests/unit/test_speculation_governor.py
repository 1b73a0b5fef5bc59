"""worker.generate.SpeculationGovernor: which kind of step (speculative or plain) a generation
takes next, from the timed steps it has seen. Scripted timings, no engine."""
from __future__ import annotations

import pytest

from worker.generate import SpeculationGovernor


def run(gov: SpeculationGovernor, steps: int, timing) -> str:
    """`steps` steps, each in the mode the governor asks for, timed by timing(i, speculating)
    -> (tokens, seconds); returns the modes taken, 'S' (speculative) or 'p' (plain)."""
    modes = []
    for i in range(steps):
        spec = gov.speculate()
        n, secs = timing(i, spec)
        gov.observe(spec, n, secs)
        modes.append("S" if spec else "p")
    return "".join(modes)


def test_speculation_that_pays_is_kept_and_plain_steps_are_probed_ever_less_often():
    gov = SpeculationGovernor(warm=8, probe=4, period=32)
    # speculative steps: 3 tokens in 2 ms (1500 tok/s); plain: 1 token in 1 ms (1000 tok/s)
    modes = run(gov, 8 + 4 + 32 + 4 + 64 + 4 + 128, lambda i, s: (3, 0.002) if s else (1, 0.001))
    # each probe that confirms speculation doubles the wait for the next
    assert modes == "S" * 8 + "p" * 4 + "S" * 32 + "p" * 4 + "S" * 64 + "p" * 4 + "S" * 128
    assert gov.rate(True) == pytest.approx(1500) and gov.rate(False) == pytest.approx(1000)


def test_speculation_that_loses_is_dropped_and_retried_now_and_then():
    gov = SpeculationGovernor(warm=8, probe=4, period=32)
    # a verify costing 3 plain steps that returns 2 tokens: 667 tok/s against 1000
    modes = run(gov, 8 + 4 + 32 + 4 + 64, lambda i, s: (2, 0.003) if s else (1, 0.001))
    assert modes == "S" * 8 + "p" * 4 + "p" * 32 + "S" * 4 + "p" * 64


def test_the_choice_follows_the_text():
    gov = SpeculationGovernor(warm=8, probe=4, period=32)
    # drafts rejected for the first 60 steps (1 token per 3 ms), then accepted (5 tokens per 3 ms)
    modes = run(gov, 8 + 4 + 32 + 4 + 64 + 4 + 32,
                lambda i, s: ((1 if i < 60 else 5), 0.003) if s else (1, 0.001))
    # the probe at steps 44..47 still sees rejections (the next wait doubles); the one at
    # 112..115 sees acceptance (its own steps: 5 tokens per 3 ms > 1000 tok/s): speculation
    # comes back, with the first wait again
    assert modes[:12] == "S" * 8 + "p" * 4
    assert modes[12:44] == "p" * 32 and modes[44:48] == "S" * 4 and modes[48:112] == "p" * 64
    assert modes[112:116] == "S" * 4 and modes[116:] == "S" * 32


def test_a_run_first_step_does_not_count():
    gov = SpeculationGovernor(warm=8, probe=4, period=32)
    # each run's first step pays the switch (10 ms here): left out, so speculation still wins
    first = {0, 8, 12}
    modes = run(gov, 8 + 4 + 32, lambda i, s: ((3, 0.010) if i in first else (3, 0.002)) if s
                else ((1, 0.010) if i in first else (1, 0.001)))
    assert modes == "S" * 8 + "p" * 4 + "S" * 32
    assert gov.rate(True) == pytest.approx(1500)


def test_a_small_difference_does_not_switch():
    gov = SpeculationGovernor(warm=8, probe=4, period=32, margin=0.05)
    # plain 3 % faster than speculation: within the margin, the kept mode stays
    modes = run(gov, 8 + 4 + 32, lambda i, s: (1, 0.00103) if s else (1, 0.001))
    assert modes == "S" * 8 + "p" * 4 + "S" * 32


def test_observing_a_step_of_the_other_mode_is_an_error():
    gov = SpeculationGovernor()
    assert gov.speculate() is True
    with pytest.raises(ValueError, match="did not ask for"):
        gov.observe(False, 1, 0.001)


def test_the_wait_between_probes_is_capped():
    gov = SpeculationGovernor(warm=8, probe=4, period=32, max_period=64)
    modes = run(gov, 8 + 4 + 32 + 4 + 64 + 4 + 64 + 4, lambda i, s: (3, 0.002) if s else (1, 0.001))
    assert modes == "S" * 8 + "p" * 4 + "S" * 32 + "p" * 4 + "S" * 64 + "p" * 4 + "S" * 64 + "p" * 4
