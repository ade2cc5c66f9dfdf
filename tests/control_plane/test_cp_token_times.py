"""TokenTimes: what the front door's inter-token and per-output-token histograms observe."""

from __future__ import annotations

import pytest

from control_plane.run import TokenTimes


def test_gaps_are_one_per_token_after_each_completions_first() -> None:
    times = TokenTimes()
    times.relayed(0, 1, 10.0)
    times.relayed(1, 2, 10.5)  # completion 1's first response carries two tokens
    times.relayed(0, 1, 11.0)
    times.relayed(0, 2, 12.0)  # two tokens a second after the previous one: 0.5 s each
    times.relayed(1, 0, 13.0)  # a response without tokens (a final one) changes nothing
    assert times.gaps == pytest.approx([0.0, 1.0, 0.5, 0.5])
    assert times.count == {0: 4, 1: 2}
    assert sorted(times.per_output_token()) == pytest.approx([0.0, 2.0 / 3])
