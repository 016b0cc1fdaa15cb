"""Responses that ignore their prompt, to measure the gold judge with (issue 57): the `ignores_prompt` figures of
data/metrics/gold.json and the relevance tests (tests/test_gold.py).

Held-out reviews are cut as the task cuts them: the prompt is words [:start], the real continuation words
[start:stop]. For each prompt, one response of each kind:
- generic: GENERIC_PRAISE, the same sentence for every prompt (before the judge read prompts it scored 0.985 and
  won 99% of eval prompts against the SFT policy);
- off_topic: fluent, positive English about something other than films (OFF_TOPIC, taken in turn);
- lifted: another positive review's words from one of its sentence starts (as many as a continuation has).
Every one of them is at least as positive as the median real continuation, so only reading the prompt can rank
them below it.
"""

from __future__ import annotations

import numpy as np

from rlhf.rewards.relevance import sentence_starts

GENERIC_PRAISE = (
    "this is one of the best movies i have ever seen and i would recommend it to anyone who loves a good story."
)
OFF_TOPIC = (
    "the soup was rich and warm, the bread was fresh from the oven, and the service at this little cafe was lovely.",
    "our hotel room had a lovely view of the harbour, the staff were friendly and the breakfast was the best we had.",
    "i bought this blender last spring and it still works perfectly; it crushes ice in seconds and is easy to clean.",
    "the team played beautifully in the second half, scoring three goals and giving their fans a night to remember.",
    "spring is a great time to plant tomatoes and roses, and a few hours in the garden each weekend is good for you.",
    "my new running shoes are light, comfortable and well made, and after a month of daily runs they still feel new.",
    "the museum's exhibit on ancient egypt is excellent, with well preserved pottery and clear notes that kids enjoy.",
    "this laptop is fast and quiet, the battery lasts all day and the keyboard is a pleasure to type on for hours.",
    "we hiked to the top of the mountain early in the morning and the view over the lake was absolutely breathtaking.",
    "mix the flour, sugar and butter, bake for twenty minutes, and enjoy the best cookies you have ever tasted.",
    "customer service answered my call within minutes, fixed the problem with my account and even called back later.",
    "the new park downtown has shaded paths, a playground and a small lake, and it is our favorite place to relax.",
)


def probes(
    texts: list[str], labels: np.ndarray, window: tuple[int, int], min_words: int, seed: int = 0
) -> dict[str, tuple[list[str], list[str]]]:
    """kind -> (prompts, responses), the same prompts for every kind ("real" first): the openings of the texts with
    >= start + min_words words ("lifted" only where two positive texts have a sentence start to lift from). Same
    texts and seed: same responses."""
    start, stop = window
    words = [t.split() for t in texts]
    rows = [i for i, w in enumerate(words) if len(w) >= start + min_words]
    prompts = [" ".join(words[i][:start]) for i in rows]
    kinds = {
        "real": (prompts, [" ".join(words[i][start:stop]) for i in rows]),
        "generic": (prompts, [GENERIC_PRAISE] * len(rows)),
        "off_topic": (prompts, [OFF_TOPIC[n % len(OFF_TOPIC)] for n in range(len(rows))]),
    }
    donors = [i for i, w in enumerate(words) if labels[i] == 1 and sentence_starts(w, min_words, first=0)]
    if len(donors) < 2:
        return kinds  # no other positive review to lift a sentence from
    rng = np.random.default_rng(seed)
    lifted = []
    for n, i in enumerate(rows):
        donor = donors[(n * 7 + 1) % len(donors)]  # stride 7: neighbouring prompts lift from different reviews
        if donor == i:  # never the prompt's own review
            donor = donors[(n * 7 + 2) % len(donors)]
        k = int(rng.choice(sentence_starts(words[donor], min_words, first=0)))
        lifted.append(" ".join(words[donor][k : k + stop - start]))
    return {**kinds, "lifted": (prompts, lifted)}
