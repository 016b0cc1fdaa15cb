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

from rlhf.models.batch import ModelInput
from rlhf.models.forward import sequence_scores


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
        s, a, p = batch.sequences, batch.attn, batch.positions
        chunks = [slice(i, i + self.chunk) for i in range(0, len(s), self.chunk)]
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext():
            scores = [sequence_scores(self.model, s[c], a[c], p[c], batch.context, last[c]) for c in chunks]
        return torch.cat(scores)


class GoldReward:
    """The gold judge as the RL reward (an upper-bound experiment: no proxy to over-optimise)."""

    needs_texts = True

    def __init__(self, judge):
        self.judge = judge

    def placed(self, place, device: torch.device) -> GoldReward:
        return self  # scikit-learn on the CPU: texts in, scores out

    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        return torch.as_tensor(self.judge.score(texts), dtype=torch.float32)


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

        k = len(texts) // len(batch.prompt_ids)
        prompt_mask = batch.attn[::k, : batch.context].bool().cpu()
        prompts = [tuple(row[mask].tolist()) for row, mask in zip(batch.prompt_ids.cpu(), prompt_mask)]
        missing = sum(p not in self.answers for p in prompts)
        if missing:
            raise ValueError(f"rule reward: {missing} of {len(prompts)} prompts are not problems of the math task")
        answers = [self.answers[p] for p in prompts for _ in range(k)]
        scores = [rule_score(text, answer, self.format_bonus) for text, answer in zip(texts, answers)]
        return torch.tensor(scores, dtype=torch.float32)


@dataclass(frozen=True)
class RewardSpec:
    """train.reward as a picklable recipe: "proxy" reads the reward model in `folder`, "gold" the judge in `folder`,
    "rule" the math problems of the prepared data in `folder` (tokenised with the tokenizer in `tokenizer_folder`
    and data.chat_template `chat_template`, as the loop does)."""

    kind: Literal["proxy", "gold", "rule"]
    folder: str
    tokenizer_folder: str | None = None
    chat_template: str = "none"
    format_bonus: float = 0.0
    bf16: bool = False  # the proxy RM computes under bf16 autocast (train.mixed_precision: bf16)

    @classmethod
    def of(cls, config, format_bonus: float | None = None) -> RewardSpec:
        """train.reward of `config` (a rlhf.config.Config); format_bonus overrides the rule's (0: the verifier only)."""
        c = config.train
        if c.reward == "rule":
            bonus = c.format_bonus if format_bonus is None else format_bonus
            return cls("rule", str(config.path("prepared")), str(config.path("sft")), config.data.chat_template, bonus)
        folder = config.path("gold") if c.reward == "gold" else config.path("reward", "model")
        return cls(c.reward, str(folder), bf16=c.mixed_precision == "bf16")

    def build(self):
        if self.kind == "rule":
            return RuleReward(self._answers(), self.format_bonus)
        if self.kind == "gold":
            from rlhf.rewards.gold import GoldJudge

            return GoldReward(GoldJudge.load(Path(self.folder)))
        from rlhf.models.loading import load_reward_model

        return ProxyReward(load_reward_model(Path(self.folder)).requires_grad_(False), bf16=self.bf16)

    def _answers(self) -> dict[tuple[int, ...], str]:
        """Every problem's prompt as token ids -> its answer, over the splits the loop and evaluation sample."""
        from rlhf.data.splits import load_task_split
        from rlhf.models.loading import encode_prompts, load_tokenizer

        tokenizer = load_tokenizer(Path(self.tokenizer_folder))
        answers: dict[tuple[int, ...], str] = {}
        for split in ("rl_prompts", "eval_prompts"):
            df = load_task_split(Path(self.folder), split, "math")
            ids = encode_prompts(tokenizer, list(df["prompt"]), self.chat_template)
            for prompt, ids_, answer in zip(df["prompt"], ids, df["answer"]):
                if answers.setdefault(tuple(ids_), answer) != answer:  # e.g. numbers the vocabulary lacks
                    raise ValueError(
                        f"rule reward: the tokenizer in {self.tokenizer_folder} encodes problems with other answers "
                        f"alike, e.g. {prompt!r}; it cannot tell which answer a sample is for"
                    )
        return answers
