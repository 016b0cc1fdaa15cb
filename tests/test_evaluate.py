"""The evaluate stage's pure measures (the stage itself runs in tests/test_pipeline.py)."""

from __future__ import annotations

import pytest

from rlhf.stages.evaluate import diversity


def test_diversity_tells_one_text_for_every_prompt_from_varied_text():
    praise = "this is one of the best movies i have ever seen"
    varied = ["the plot drags in the middle", "a fine cast, a thin script", "i laughed twice, then slept"]
    same = diversity([praise] * 3)
    assert same["repeated"] == 1.0
    assert same["distinct_1"] == pytest.approx(10 / 30) and same["distinct_2"] == pytest.approx(9 / 27)
    different = diversity(varied)
    assert different["repeated"] == 0.0 and different["distinct_2"] == 1.0
    # case and punctuation do not make a copy new; one of four repeated by another: half the responses
    assert diversity(["Great film!", "great film", "a slow start", "dull"])["repeated"] == 0.5


def test_diversity_of_empty_responses_is_defined():
    assert diversity(["", ""]) == {"distinct_1": 0.0, "distinct_2": 0.0, "repeated": 1.0}
    assert diversity([]) == {"distinct_1": 0.0, "distinct_2": 0.0, "repeated": 0.0}
