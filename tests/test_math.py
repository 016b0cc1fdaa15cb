"""The math task: the rule verifier (rlhf.rewards.rule) on tricky outputs, the problem generator (rlhf.data.math)
checked against an independent solver, the schema that refuses bad answers; then its parts in the pipeline (splits,
the rule reward on a batch, chat-template prompts, evaluation arithmetic, the config rules). The whole task end to
end: tests/test_pipeline.py."""

from __future__ import annotations

import re
import shutil
from decimal import Decimal

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ci_config, run_cli

from rlhf.config import ConfigError
from rlhf.data.math import INSTRUCTION, build_splits, problems
from rlhf.data.schemas import DataError, MathProblems, validate
from rlhf.data.splits import load_task_split, split_schemas
from rlhf.models.batch import assemble
from rlhf.models.loading import encode_prompts, load_smollm2_tokenizer, load_tokenizer, save_pretrained
from rlhf.models.tiny import build_tiny_model, train_word_tokenizer
from rlhf.rewards.proxy import RewardSpec, RuleReward
from rlhf.rewards.rule import final_answer, parse_answer, rule_score
from rlhf.stages import prepare, sft
from rlhf.stages.evaluate import summarise_math
from rlhf.trainers.setup import load_rl_prompts

MATH = ("data.source=math", "train.reward=rule", "train.trainer=grpo")
# A real Jinja chat template (the tiny tokenizer has none): a user turn in words the tiny vocabularies know
TEMPLATE = "{% for m in messages %}the {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} is it{% endif %}"

# (response, its final number, stated after "answer")
CASES = [
    ("The answer is 42 apples.", "42", True),
    ("Answer: -7", "-7", True),
    ("So the answer is 12 + 30 = 42", "42", True),  # an equation after the marker: its result
    ("12 + 30 = 42", "42", False),
    ("12 + 30 = 42, then 42 - 2 = 40", "40", False),  # the last "=" wins
    ("First 12, then 30 more: 42", "42", False),  # several numbers, no marker: the last
    ("It costs $1,250 in total", "1250", False),  # thousands commas
    ("12,000,000 people", "12000000", False),
    ("values 3,4", "4", False),  # not a thousands group: two numbers
    ("The answer is 1,2345", "1", True),  # "1,2345" is 1 then 2345: the first after the marker
    ("answer: \u22125 degrees", "-5", True),  # Unicode minus
    ("It weighs 42kg.", "42", False),  # units, a full stop
    ("x = 42.0", "42.0", False),
    ("the ANSWER is 8. Earlier I said 3 and 5.", "8", True),  # the marker decides, not the last number
]


@pytest.mark.parametrize("response, number, stated", CASES)
def test_the_verifier_reads_the_final_answer_by_its_rules(response, number, stated):
    assert final_answer(response) == (Decimal(number), stated)


@pytest.mark.parametrize("response", ["", "   ", "no number here", "The answer is unknown.", "=", "12 = 4 answer"])
def test_a_response_without_a_final_number_scores_zero_and_never_raises(response):
    assert final_answer(response)[0] is None
    assert rule_score(response, "4") == 0.0


def test_the_score_is_exact_match_plus_an_optional_format_bonus():
    assert rule_score("The answer is 42.", "42") == 1.0
    assert rule_score("x = 42.0", "42") == 1.0  # equal as numbers
    assert rule_score("41.99", "42") == 0.0
    assert rule_score("The answer is 42.", "42", format_bonus=0.1) == pytest.approx(1.1)
    assert rule_score("The answer is 41.", "42", format_bonus=0.1) == pytest.approx(0.1)  # the form, not the value
    assert rule_score("42", "42", format_bonus=0.1) == 1.0
    assert rule_score("-5", "-5") == 1.0
    with pytest.raises(ValueError, match="answer 'forty' is not a number"):
        parse_answer("forty")


def _solve(prompt: str) -> int:
    """The answer read back from the problem's text, independently of the generator's own arithmetic."""
    n = [int(x) for x in re.findall(r"\d+", prompt)]
    patterns = [
        (r"has \d+ \w+\. \w+ gets \d+ more\.", lambda: n[0] + n[1]),
        (r"had \d+ \w+ and gave away \d+\.", lambda: n[0] - n[1]),
        (r"fills \d+ boxes with \d+ \w+ each\.", lambda: n[0] * n[1]),
        (r"shares \d+ \w+ equally among \d+ friends\.", lambda: n[0] // n[1]),
        (r"it was \d+ degrees\. By night it fell by \d+", lambda: n[0] - n[1]),
    ]
    value = next(f() for pattern, f in patterns if re.search(pattern, prompt))
    if then := re.search(r"Then \w+ (buys|loses) (\d+)\.", prompt):
        value += int(then.group(2)) * (1 if then.group(1) == "buys" else -1)
    return value


def test_generated_problems_are_reproducible_distinct_and_correct():
    df = problems(600, seed=7)
    validate(df, MathProblems, "generated problems")
    pd.testing.assert_frame_equal(df, problems(600, seed=7))  # the seed decides everything
    assert not df["prompt"].equals(problems(600, seed=8)["prompt"])
    assert df["prompt"].is_unique and df["difficulty"].value_counts().to_dict() == {1: 200, 2: 200, 3: 200}
    assert [_solve(p) for p in df["prompt"]] == df["answer"].astype(int).tolist()
    divisions = df[df["prompt"].str.contains("equally")]
    assert len(divisions) > 10  # exact: the solver's integer division gave the stated answer for each
    negative = df[df["answer"].astype(int) < 0]
    assert len(negative) > 5 and negative["prompt"].str.contains("degrees").all()  # only temperatures go below 0


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda df: df.drop(columns="answer"), "missing column: answer"),
        (lambda df: df.assign(answer=["forty"] + df["answer"].tolist()[1:]), "column 'answer': str_matches"),
        (lambda df: df.assign(answer=["4 apples"] + df["answer"].tolist()[1:]), "column 'answer': str_matches"),
        (lambda df: df.assign(answer=[None] + df["answer"].tolist()[1:]), "column 'answer'"),
        (lambda df: df.assign(difficulty=[4] + df["difficulty"].tolist()[1:]), "column 'difficulty': isin"),
    ],
)
def test_the_schema_refuses_a_problem_whose_answer_is_missing_or_not_a_number(change, message):
    with pytest.raises(DataError, match=re.escape(message)):
        validate(change(problems(6, seed=1)), MathProblems, "problems.csv")


# --- the task in the pipeline: splits, the reward on a batch, chat-template prompts, evaluation arithmetic ---------


def test_the_task_splits_are_disjoint_and_match_their_schemas():
    cfg = ci_config("unused", *MATH, "data.n_sft=30", "data.n_rl_prompts=40", "data.n_eval_prompts=20")
    splits = build_splits(cfg.data, cfg.seed)
    for name, schema in split_schemas("math").items():
        validate(splits[name], schema, name)
    assert {name: len(df) for name, df in splits.items()} == {"rl_prompts": 40, "eval_prompts": 20, "sft": 30}
    rl, ev = set(splits["rl_prompts"]["prompt"]), set(splits["eval_prompts"]["prompt"])
    assert not rl & ev and all(p.endswith(INSTRUCTION) for p in rl | ev)
    assert not set(splits["sft"]["prompt"]) & (rl | ev)
    assert all(final_answer(t) == (Decimal(t[14:-1]), True) for t in splits["sft"]["completion"])  # "The answer is N."


def _batch(prompts: list[list[int]], k: int, pad: int = 0):
    responses = torch.full((len(prompts) * k, 3), 9)  # the texts are passed alongside: the tokens do not matter
    return assemble(prompts, responses, k, pad_id=pad, eos_id=1)


def test_the_rule_reward_finds_each_rows_problem_by_its_prompt_tokens():
    reward = RuleReward({(5, 6, 7): "12", (0, 8): "-3"}, format_bonus=0.0)  # (0, 8) starts with the pad id
    texts = ["The answer is 12.", "13", "it is -3 degrees", "no number at all"]
    assert reward(_batch([[5, 6, 7], [0, 8]], k=2), texts).tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="1 of 2 prompts are not problems of the math task"):
        reward(_batch([[5, 6, 7], [4]], k=2), texts)


def test_prompts_go_through_the_chat_template_only_when_auto_and_the_tokenizer_has_one(ci_stages):
    tokenizer = load_tokenizer(ci_stages / "sft")
    texts = ["this movie is good"]
    plain = tokenizer(texts)["input_ids"]
    assert encode_prompts(tokenizer, texts, "auto") == plain  # the tiny tokenizer has no template
    tokenizer.chat_template = TEMPLATE
    wrapped = encode_prompts(tokenizer, texts, "auto")
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": texts[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert wrapped == [expected] and tokenizer.decode(wrapped[0]) == "the this movie is good is it"  # the template's
    assert "<unk>" not in tokenizer.decode(plain[0])
    assert encode_prompts(tokenizer, texts, "none") == plain


def test_the_loop_and_the_rule_reward_encode_prompts_alike_with_a_chat_template(tmp_path):
    """The reward finds a problem by its token ids: the loop's prompts (chat template on) must be among its keys."""
    data = tmp_path / "data"
    cfg = ci_config(data, *MATH)
    prepare.run(cfg)
    texts = sft.plain_texts(load_task_split(data / "prepared", "sft", "math"))
    tokenizer = train_word_tokenizer(texts, cfg.model.vocab_size)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(data / "sft")
    ids = load_rl_prompts(cfg, load_tokenizer(data / "sft"))
    answers = RewardSpec.of(cfg).build().answers
    assert len(answers) == cfg.data.n_rl_prompts + cfg.data.n_eval_prompts  # no two problems encode alike
    assert ids and all(tuple(p) in answers for p in ids)
    assert tokenizer.decode(ids[0]).startswith("the ") and tokenizer.decode(ids[0]).endswith("is it")


def test_math_evaluation_arithmetic():
    right = {"policy": np.array([1, 1, 0, 1]), "sft": np.array([0, 1, 0, 0])}
    sampled = {"policy": np.array([[1, 0], [1, 1], [0, 0], [0, 1]]), "sft": np.array([[0, 0], [1, 0], [0, 1], [0, 0]])}
    kl = {"policy": np.array([0.1, 0.3, 0.2, 0.2, 0.0, 0.4, 0.2, 0.2])}
    m = summarise_math(right, sampled, kl, np.array([1, 1, 2, 3]), k=2)
    assert m["accuracy/policy"] == 0.75 and m["accuracy/sft"] == 0.25 and m["accuracy/gain"] == 0.5
    assert m["pass_at_2/policy"] == 0.75 and m["pass_at_2/sft"] == 0.5
    assert m["sample_accuracy/policy"] == 0.5 and m["sample_accuracy/sft"] == 0.25
    assert m["accuracy/policy_difficulty_1"] == 1.0 and m["accuracy/sft_difficulty_1"] == 0.5
    assert m["accuracy/policy_difficulty_3"] == 1.0 and m["accuracy/sft_difficulty_2"] == 0.0
    assert m["kl/policy_sft_mean"] == pytest.approx(0.2) and m["n_prompts"] == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=math"], "train.reward: rule scores the math task"),
        (["train.reward=rule"], "got data.source=reviews, train.reward=rule"),
        (["data.source=math", "train.reward=rule", "train.trainer=ppo"], "ppo's value model starts from a reward"),
    ],
)
def test_the_task_and_the_reward_go_together(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ci_config("unused", *overrides)


def test_sft_on_plain_texts_is_refused_for_a_model_in_its_chat_template(ci_stages, tmp_path):
    """A model with a chat template gets its RL prompts in it: SFT on plain text would train it outside it."""
    model = tmp_path / "chat-model"
    shutil.copytree(ci_stages / "sft", model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    overrides = [f"data_dir={tmp_path / 'data'}", "model.source=local", f"model.path={model}"]
    shutil.copytree(ci_stages / "prepared", tmp_path / "data" / "prepared")
    proc = run_cli("--profile", "ci", "sft", *overrides)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "rlhf sft: error: sft.train: the SFT split is plain text" in proc.stderr
    assert "data.chat_template: none" in proc.stderr and not (tmp_path / "data" / "sft").exists()


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_sft_pairs_put_the_prompt_as_the_loop_does_and_learn_the_completion_alone(chat_template):
    """SmolLM2's own chat template: the prompt tokens are exactly the loop's (encode_prompts), the learnt tokens are
    the completion and the end of the assistant's turn (its EOS, <|im_end|>), where RL samples must stop."""
    tokenizer = load_smollm2_tokenizer()
    pairs = pd.DataFrame(
        {"prompt": ["Ana has 3 apples and gets 4 more. How many? " + INSTRUCTION], "completion": ["The answer is 7."]}
    )
    [seq], [n_prompt] = sft.encode_examples(tokenizer, pairs, max_length=200, chat_template=chat_template)
    assert seq[:n_prompt] == encode_prompts(tokenizer, list(pairs["prompt"]), chat_template)[0]
    learnt = tokenizer.decode(seq[n_prompt:])
    assert learnt == ("" if chat_template == "auto" else " ") + "The answer is 7.<|im_end|>"
    assert ("<|im_start|>assistant" in tokenizer.decode(seq[:n_prompt])) == (chat_template == "auto")
    with pytest.raises(ConfigError, match=r"sft.max_length \(20\) leaves no completion token"):
        sft.encode_examples(tokenizer, pairs, max_length=20, chat_template=chat_template)


def test_sft_on_the_math_pairs_trains_a_model_in_its_chat_template(tmp_path):
    """The sft stage on the math task with a chat template: not refused, and the tokens it learns are the
    completions and EOS only (train_tokens), the prompts in the template."""
    data = tmp_path / "data"
    sizes = ("data.n_sft=40", "sft.epochs=1.0", "sft.max_length=128", "model.max_position_embeddings=128")
    cfg = ci_config(data, *MATH, *sizes)
    prepare.run(cfg)
    pairs = load_task_split(data / "prepared", "sft", "math")
    tokenizer = train_word_tokenizer(sft.plain_texts(pairs), cfg.model.vocab_size)
    tokenizer.chat_template = TEMPLATE
    model = tmp_path / "chat-model"
    save_pretrained(build_tiny_model(cfg.model, tokenizer, cfg.seed), tokenizer, model)
    chat = ci_config(data, *MATH, *sizes, "model.source=local", f"model.path={model}")
    metrics = sft.run(chat)
    train_rows = pairs.iloc[sft.split_heldout(pairs, chat.sft.heldout_texts, chat.seed)[0]]
    completions = tokenizer(list(train_rows["completion"]), add_special_tokens=False)["input_ids"]
    assert metrics["train_tokens"] == sum(len(c) + 1 for c in completions)  # + EOS; no prompt token
    assert metrics["steps"] >= 1 and metrics["train_loss"] < metrics["train_loss_initial"]
    assert load_tokenizer(data / "sft").chat_template == TEMPLATE


def test_a_tokenizer_that_encodes_two_problems_alike_is_refused_not_guessed(tmp_path):
    """A vocabulary without the numbers makes "has 3 apples" and "has 4 apples" one token sequence: the reward
    could not tell which answer a sample is for, so it refuses to start."""
    data = tmp_path / "data"
    cfg = ci_config(data, *MATH)
    prepare.run(cfg)
    texts = sft.plain_texts(load_task_split(data / "prepared", "sft", "math"))
    train_word_tokenizer(texts, vocab_size=40).save_pretrained(data / "sft")  # the most frequent words only
    with pytest.raises(ValueError, match="encodes problems with other answers alike"):
        RewardSpec.of(cfg).build()
