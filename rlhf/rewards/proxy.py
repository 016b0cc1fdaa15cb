"""Reward functions the online loop can optimise: the proxy RM (default), the gold judge directly, or the math task's
rule verifier.

All take the post-processed batch (`ModelInput`, on any device) and its response texts and return one score per
sequence (N,): the proxy RM on its own device, the gold judge on the CPU. Evaluation always uses gold. A
`RewardSpec` names a reward function without loading it, so the async engine's process can build its own copy and
score batches while the learner trains.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlhf.models.batch import ModelInput, host_list, row_chunks
from rlhf.models.forward import cat_rows, sequence_scores


class ProxyReward:
    """Bradley-Terry reward model read at the last real response token (the EOS when present)."""

    needs_texts = False  # reads token ids only: the async engine's process skips decoding for it

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None, chunk: int = 64, bf16=False):
        """device: where `model` lives (default: where its parameters are); bf16: the run trains in bf16 mixed
        precision, and the reward model computes as the policy does, under bf16 autocast."""
        self.model = model
        model.eval()  # (a DeepSpeed engine's eval() returns None)
        self.device = device if device is not None else next(model.parameters()).device
        self.chunk, self.bf16 = chunk, bf16

    def placed(self, place, device: torch.device) -> ProxyReward:
        """The same reward with its model put on the training device by `place` (a move, or a DeepSpeed wrap)."""
        return ProxyReward(place(self.model), device, self.chunk, self.bf16)

    @torch.no_grad()
    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        batch = batch.to(self.device)
        last = batch.response_mask.sum(1).clamp(min=1) - 1
        chunks = row_chunks(self.chunk, batch.sequences, batch.attn, batch.positions, last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext():
            scores = [sequence_scores(self.model, s, a, p, batch.context, rows_last) for s, a, p, rows_last in chunks]
        return cat_rows(scores)


def by_prompt(batch: ModelInput, table: dict[tuple[int, ...], str], name: str, kind: str) -> list[str]:
    """`table`'s value for each row's prompt (B*K rows, prompt-major), found by the prompt's real token ids (from the
    attention mask); a ValueError naming the reward and the kind of prompt it knows when one is not among its keys."""
    k = batch.sequences.shape[0] // len(batch.prompt_ids)
    ids = batch.prompt_ids.masked_fill(batch.attn[::k, : batch.context] == 0, -1)  # -1: left padding
    # one read of a device batch (evaluation); the loop's host batch is read without one
    rows = host_list(ids if ids.device.type == "cpu" else ids.cpu())
    prompts = [tuple(i for i in row if i >= 0) for row in rows]
    missing = sum(p not in table for p in prompts)
    if missing:
        raise ValueError(f"{name}: {missing} of {len(prompts)} prompts are not {kind}")
    return [table[p] for p in prompts for _ in range(k)]


class GoldReward:
    """The gold judge as a reward function: RL's reward with train.reward=gold (an upper-bound experiment: no proxy
    to over-optimise), and the gold of every run's training samples. The judge reads each response as the
    continuation of its prompt, whose text (as the prepared data has it, not as the tokenizer decodes it) is looked
    up by its token ids."""

    needs_texts = True

    def __init__(self, judge, prompts: dict[tuple[int, ...], str]):
        """prompts: token ids (as the loop encodes them) -> prompt text."""
        self.judge, self.prompts = judge, prompts

    def placed(self, place, device: torch.device) -> GoldReward:
        return self  # scikit-learn on the CPU: texts in, scores out

    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        prompts = by_prompt(batch, self.prompts, "gold reward", "prompts of the task")
        return torch.as_tensor(self.judge.score(prompts, texts), dtype=torch.float32)


class RuleReward:
    """The math task's verifier (rlhf.rewards.rule): 1 when a response's final number is its problem's answer.

    A batch carries token ids, not problems: each row's prompt (its real tokens, from the attention mask) is looked
    up among the task's prompts, encoded exactly as the loop encodes them (`encode_prompts`)."""

    needs_texts = True

    def __init__(self, answers: dict[tuple[int, ...], str], format_bonus: float = 0.0):
        self.answers, self.format_bonus = answers, format_bonus

    def placed(self, place, device: torch.device) -> RuleReward:
        return self  # text in, numbers out, on the CPU

    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        from rlhf.rewards.rule import rule_score

        answers = by_prompt(batch, self.answers, "rule reward", "problems of the math task")
        scores = [rule_score(text, answer, self.format_bonus) for text, answer in zip(texts, answers)]
        return torch.tensor(scores, dtype=torch.float32)


@dataclass(frozen=True)
class RewardSpec:
    """train.reward as a picklable recipe: "proxy" reads the reward model in `folder`; "gold" the judge in `folder`
    and the prompts of the prepared data in `prompts_folder`; "rule" the math problems of the prepared data in
    `folder`. Prompts are tokenised with the tokenizer in `tokenizer_folder` and data.chat_template `chat_template`, as
    the loop does, so that a batch's prompt ids find their text (gold) or problem (rule)."""

    kind: Literal["proxy", "gold", "rule"]
    folder: str
    tokenizer_folder: str | None = None
    chat_template: str = "none"
    format_bonus: float = 0.0
    bf16: bool = False  # the proxy RM computes under bf16 autocast (train.mixed_precision: bf16)
    prompts_folder: str | None = None  # gold: the prepared data whose prompts the judge reads
    source: str = "math"  # data.source: the task whose prompt splits are read

    @classmethod
    def of(cls, config, format_bonus: float | None = None) -> RewardSpec:
        """train.reward of `config` (a rlhf.config.Config); format_bonus overrides the rule's (0: the verifier only)."""
        c = config.train
        if c.reward == "rule":
            bonus = c.format_bonus if format_bonus is None else format_bonus
            return cls("rule", str(config.path("prepared")), str(config.path("sft")), config.data.chat_template, bonus)
        if c.reward == "gold":
            return cls.gold(config)
        return cls("proxy", str(config.path("reward", "model")), bf16=c.mixed_precision == "bf16")

    @classmethod
    def gold(cls, config) -> RewardSpec:
        """The gold judge of `config`'s task as a reward function (RL's reward, or the gold of training samples)."""
        tokenizer, template = str(config.path("sft")), config.data.chat_template
        prepared, source = str(config.path("prepared")), config.data.source
        return cls("gold", str(config.path("gold")), tokenizer, template, prompts_folder=prepared, source=source)

    def build(self):
        if self.kind == "rule":
            return RuleReward(self._answers(), self.format_bonus)
        if self.kind == "gold":
            from rlhf.rewards.gold import GoldJudge

            prompts: dict[tuple[int, ...], str] = {}
            for ids, prompt, _ in self._prompts(self.prompts_folder, "prompt"):
                prompts.setdefault(ids, prompt)  # prompts the tokenizer encodes alike differ in words it lacks only
            return GoldReward(GoldJudge.load(Path(self.folder)), prompts)
        from rlhf.models.loading import load_reward_model

        return ProxyReward(load_reward_model(Path(self.folder)).requires_grad_(False), bf16=self.bf16)

    def _answers(self) -> dict[tuple[int, ...], str]:
        """Every problem's prompt as token ids -> its answer."""
        answers: dict[tuple[int, ...], str] = {}
        for ids, prompt, answer in self._prompts(self.folder, "answer"):
            if answers.setdefault(ids, answer) != answer:  # e.g. numbers the vocabulary lacks
                raise ValueError(
                    f"rule reward: the tokenizer in {self.tokenizer_folder} encodes problems with other answers "
                    f"alike, e.g. {prompt!r}; it cannot tell which answer a sample is for"
                )
        return answers

    def _prompts(self, folder: str | None, column: str) -> list[tuple[tuple[int, ...], str, str]]:
        """(token ids, prompt, its `column`) of every prompt of the prepared data in `folder`, over the splits the
        loop and evaluation sample."""
        from rlhf.data.splits import load_task_split
        from rlhf.models.loading import encode_prompts, load_tokenizer

        tokenizer = load_tokenizer(Path(self.tokenizer_folder))
        rows = []
        for split in ("rl_prompts", "eval_prompts"):
            df = load_task_split(Path(folder), split, self.source)
            ids = encode_prompts(tokenizer, list(df["prompt"]), self.chat_template)
            rows += [(tuple(i), prompt, value) for i, prompt, value in zip(ids, df["prompt"], df[column])]
        return rows
