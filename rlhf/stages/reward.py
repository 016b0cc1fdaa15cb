"""Stage `reward`: the proxy reward model RL optimises, trained as in the paper's gold-relabelling protocol.

1. sample two responses per reward prompt from the SFT policy; 2. label each pair with the gold judge
(chosen = higher gold score; ties dropped); 3. train a Bradley-Terry reward model initialised from the SFT
policy; 4. report its agreement with gold on held-out pairs. Outputs: data/reward/{model,pairs},
data/metrics/reward.json.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm

from rlhf import runtime
from rlhf.config import Config
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample, stage_engine
from rlhf.io import atomic_dir, write_json
from rlhf.models.batch import attention_and_positions, pad_left, pad_right
from rlhf.models.forward import pooled_hidden, sequence_scores

HEAD_L2 = (1e-3, 1e-2, 1e-1, 1.0)  # reward.trainable=head: L2 strengths tried (on standardised features)


def sample_pairs(cfg: Config, policy, tokenizer, prompts: list[str], device, chunk: int = 64) -> pd.DataFrame:
    """Two SFT samples per prompt, decoded up to their first EOS (kept as token ids too, for training), sampled by
    reward.engine."""
    from rlhf.models.loading import encode_prompts

    params = SamplingParams(k=2, max_new_tokens=cfg.reward.response_length, temperature=cfg.reward.temperature)
    rows = []
    sft, length = cfg.path("sft"), params.max_new_tokens
    prompt_ids = encode_prompts(tokenizer, prompts, cfg.data.chat_template)
    with stage_engine(cfg.reward.engine, sft, tokenizer, prompt_ids, length, device, cfg.seed) as engine:
        for s in sample(policy, tokenizer, prompt_ids, params, chunk, device, desc="reward: pairs", engine=engine):
            ids, texts = s.batch.response_ids(), s.texts
            for j in range(len(texts) // 2):
                a, b = 2 * j, 2 * j + 1
                rows.append({"a": texts[a], "b": texts[b], "a_ids": ids[a], "b_ids": ids[b]})
    return pd.DataFrame([{"prompt": p, "prompt_ids": i, **row} for p, i, row in zip(prompts, prompt_ids, rows)])


def label_with_gold(pairs: pd.DataFrame, judge, min_margin: float) -> pd.DataFrame:
    """The paper's relabelling: chosen = the response gold prefers (each read as its prompt's continuation); near-ties
    are dropped, not guessed."""
    prompts = list(pairs["prompt"])
    ga, gb = judge.score(prompts, list(pairs["a"])), judge.score(prompts, list(pairs["b"]))
    a_wins = ga >= gb
    out = pd.DataFrame(
        {
            "prompt": pairs["prompt"],
            "prompt_ids": pairs["prompt_ids"],
            "chosen": pairs["a"].where(a_wins, pairs["b"]),
            "rejected": pairs["b"].where(a_wins, pairs["a"]),
            "chosen_gold": pd.Series(ga).where(a_wins, gb).astype(float),
            "rejected_gold": pd.Series(gb).where(a_wins, ga).astype(float),
            "chosen_ids": pairs["a_ids"].where(a_wins, pairs["b_ids"]),
            "rejected_ids": pairs["b_ids"].where(a_wins, pairs["a_ids"]),
        }
    )
    keep = (out["chosen_gold"] - out["rejected_gold"]) > min_margin
    return out[keep].reset_index(drop=True)


def _pair_inputs(tokenizer, df: pd.DataFrame, device) -> tuple:
    """Chosen then rejected of a batch of pairs as model inputs: sequences, attn, positions (2n, C+T) on `device`,
    the prompt width C and each response's last index (2n,)."""
    prompt_ids, prompt_mask = pad_left(list(df["prompt_ids"]) * 2, tokenizer.pad_token_id)
    responses = list(df["chosen_ids"]) + list(df["rejected_ids"])
    width = max(1, max(len(r) for r in responses))
    resp = pad_right(responses, width, tokenizer.pad_token_id)
    lengths = torch.tensor([len(r) for r in responses], device="cpu")  # I/O: from Python lists
    resp_mask = torch.arange(width, device="cpu")[None, :] < lengths[:, None]
    attn, positions = attention_and_positions(prompt_mask, resp_mask)
    seq, attn, positions = (t.to(device) for t in (torch.cat([prompt_ids, resp], 1), attn, positions))
    return seq, attn, positions, prompt_ids.shape[1], (lengths - 1).clamp(min=0).to(device)


def _pair_scores(model, tokenizer, df: pd.DataFrame, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward of chosen and rejected for a batch of pairs. Shapes (n,), (n,)."""
    scores = sequence_scores(model, *_pair_inputs(tokenizer, df, device))
    return scores[: len(df)], scores[len(df) :]


@torch.no_grad()
def normalize(model, tokenizer, df: pd.DataFrame, batch_size: int, device) -> dict:
    """reward.normalize: the raw scores' mean and std over the SFT samples of the pairs `df` (chosen and rejected),
    kept in the model's config, so that every later read (rlhf.models.forward.sequence_scores) gives those samples
    mean 0 and std 1. Source: Ziegler et al. 2019 (lm-human-preferences), which normalises its reward model on the
    initial policy's samples before RL. A Bradley-Terry fit fixes only score differences: its offset (the head has
    no bias) and scale come out of the fit, and the missing-EOS penalty (train.penalty_reward_value, which replaces
    a score) and kl_coef mean something else for every fit. Seen on SmolLM2 (2026-12-03): SFT samples scored ~-5,
    so the penalty of -1 rewarded not ending, and online DPO's EOS rate fell from 0.56 to 0.06."""
    model.eval()
    model.config.reward_normalization = None  # the raw head
    batches = range(0, len(df), batch_size)
    raw = torch.cat([torch.cat(_pair_scores(model, tokenizer, df.iloc[i : i + batch_size], device)) for i in batches])
    raw = raw.double()
    mean, std = float(raw.mean()), float(raw.std())
    if not std > 1e-6:
        raise ValueError(f"reward: the reward model scores its {len(raw)} SFT samples alike (std {std:.2g})")
    model.config.reward_normalization = [mean, std]
    return {"raw_score_mean": mean, "raw_score_std": std}


@torch.no_grad()
def agreement(model, tokenizer, df: pd.DataFrame, batch_size: int, device) -> float:
    model.eval()
    wins = []
    for i in range(0, len(df), batch_size):
        chosen, rejected = _pair_scores(model, tokenizer, df.iloc[i : i + batch_size], device)
        wins.append((chosen > rejected).float())
    return float(torch.cat(wins).mean()) if wins else float("nan")


def train_reward_model(cfg: Config, model, tokenizer, train_df: pd.DataFrame, device) -> float:
    """Bradley-Terry: minimise -log sigmoid(r_chosen - r_rejected). Returns the last epoch's mean loss."""
    rc = cfg.reward
    steps_per_epoch = math.ceil(len(train_df) / rc.batch_size)
    total = max(1, int(steps_per_epoch * rc.epochs))
    opt = runtime.adamw(model.parameters(), device, lr=rc.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / total)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(total), desc="reward: training")
    for step in bar:
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(train_df), generator=gen).tolist()
        idx = order[(step % steps_per_epoch) * rc.batch_size : (step % steps_per_epoch + 1) * rc.batch_size]
        chosen, rejected = _pair_scores(model, tokenizer, train_df.iloc[idx], device)
        loss = -F.logsigmoid(chosen - rejected).mean()
        if not torch.isfinite(loss):
            raise RuntimeError(f"reward model loss became {loss.item()} at step {step}; nothing was saved")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return sum(losses[-steps_per_epoch:]) / len(losses[-steps_per_epoch:])


@torch.no_grad()
def _pooled_differences(model, tokenizer, df: pd.DataFrame, batch_size: int, device) -> torch.Tensor:
    """Pooled hidden state of chosen minus that of rejected, per pair (n, H): what a linear head scores."""
    model.eval()
    diffs = []
    for i in tqdm(range(0, len(df), batch_size), desc="reward: features"):
        pooled = pooled_hidden(model, *_pair_inputs(tokenizer, df.iloc[i : i + batch_size], device)).float()
        diffs.append(pooled[: len(pooled) // 2] - pooled[len(pooled) // 2 :])
    return torch.cat(diffs)


def _bradley_terry_linear(x: torch.Tensor, l2: float) -> torch.Tensor:
    """w (H,) minimising mean(-log sigmoid(x @ w)) + l2 |w|^2, by L-BFGS: Bradley-Terry with the reward linear in
    the features. x (n, H): chosen minus rejected features."""
    w = torch.zeros(x.shape[1], device=x.device, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -F.logsigmoid(x @ w).mean() + l2 * w.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def fit_head(cfg: Config, model, tokenizer, train_df: pd.DataFrame, device) -> dict:
    """reward.trainable=head: the backbone stays the SFT's; the score head is fitted on one forward pass over the
    pairs (features standardised, L2 strength chosen from HEAD_L2 on a fifth of the training pairs held out)."""
    x = _pooled_differences(model, tokenizer, train_df, cfg.reward.batch_size, device)
    scale = x.std(0).clamp(min=1e-6)  # hidden states have a few huge dimensions; one L2 suits all once scaled
    z = x / scale
    order = torch.randperm(len(z), generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    n_val = max(1, len(z) // 5)
    val, fit = z[order[:n_val]], z[order[n_val:]]
    accuracy = {l2: float(((val @ _bradley_terry_linear(fit, l2)) > 0).float().mean()) for l2 in HEAD_L2}
    l2 = max(HEAD_L2, key=lambda c: (accuracy[c], c))  # a tie goes to the stronger regulariser
    w = _bradley_terry_linear(z, l2)
    with torch.no_grad():
        model.score.weight.copy_((w / scale)[None].to(model.score.weight.dtype))
    return {"train_loss": float(-F.logsigmoid(z @ w).mean()), "head_l2": l2, "head_val_agreement": accuracy[l2]}


def _check_depth(cfg: Config) -> None:
    from transformers import AutoConfig

    depth = AutoConfig.from_pretrained(str(cfg.path("sft"))).num_hidden_layers
    if cfg.reward.num_layers is not None and cfg.reward.num_layers > depth:
        raise ValueError(f"reward.num_layers={cfg.reward.num_layers}: the SFT model in {cfg.path('sft')} has {depth}")


def _check_vocabulary(pretrained: str, hub: bool, model, tokenizer) -> None:
    """A pretrained RM reads the policy's token ids (it is saved and used with the SFT tokenizer): one trained with
    another tokenizer would score other words than the policy wrote, silently. Its own tokenizer (when its folder or
    hub repo has one) must map every token to the same id; without one, its embedding must at least cover them all."""
    from rlhf.models.loading import load_tokenizer

    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise ValueError(
            f"reward.pretrained: {pretrained} embeds {rows} token ids, the SFT policy's tokenizer has {len(tokenizer)}:"
            f" it was trained with another tokenizer"
        )
    if not hub and not any((Path(pretrained) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        own = load_tokenizer(pretrained, hub=hub).get_vocab()
    except OSError:  # a hub repo with weights only (its weights just loaded from there, so the hub answers)
        return
    policy = tokenizer.get_vocab()
    if own != policy:
        differ = len({t for t in own.keys() | policy.keys() if own.get(t) != policy.get(t)})
        raise ValueError(
            f"reward.pretrained: {pretrained}'s tokenizer is not the SFT policy's ({differ} of "
            f"{len(own.keys() | policy.keys())} tokens have another id or none): it would score other words than "
            f"the policy wrote"
        )


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import PreferencePairs, Prompts, validate
    from rlhf.data.splits import load_split, save_splits
    from rlhf.models.loading import (
        load_causal_lm,
        load_reward_model,
        load_tokenizer,
        reward_model_from_causal,
        save_pretrained,
    )
    from rlhf.rewards.gold import GoldJudge

    if cfg.train.reward == "rule":
        return _no_reward_model(cfg)
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.reward.engine == "hf":  # alone on its cores (a vLLM engine in this process binds its own threads)
        torch.set_num_threads(runtime.threads_alone())
    judge = GoldJudge.load(cfg.path("gold"))
    tokenizer = load_tokenizer(cfg.path("sft"))
    prompts = list(load_split(cfg.path("prepared"), "reward_prompts", Prompts)["prompt"])
    device = runtime.device()
    _check_depth(cfg)
    if cfg.reward.pretrained:  # nothing to train: pairs only to measure its agreement with gold; loaded and checked
        # before the pairs are sampled, so that a bad one fails at once
        prompts = prompts[: max(4, int(len(prompts) * cfg.reward.eval_fraction))]
        hub = not Path(cfg.reward.pretrained).is_dir()
        pretrained = load_reward_model(cfg.reward.pretrained, hub=hub).to(device)
        _check_vocabulary(cfg.reward.pretrained, hub, pretrained, tokenizer)
    policy = load_causal_lm(cfg.path("sft")).to(device) if cfg.reward.engine == "hf" else None
    pairs = label_with_gold(sample_pairs(cfg, policy, tokenizer, prompts, device), judge, cfg.reward.min_gold_margin)
    if len(pairs) < 4:
        raise ValueError(f"reward: only {len(pairs)} pairs with a gold preference; raise data.n_reward_prompts")
    n_test = len(pairs) if cfg.reward.pretrained else max(2, int(len(pairs) * cfg.reward.eval_fraction))
    test_df, train_df = pairs.iloc[:n_test], pairs.iloc[n_test:]
    if cfg.reward.pretrained:
        model = pretrained
        trained = {"pretrained": cfg.reward.pretrained}
    else:
        rc = cfg.reward
        model = reward_model_from_causal(cfg.path("sft"), num_layers=rc.num_layers, pooling=rc.pooling).to(device)
        if rc.trainable == "head":
            trained = fit_head(cfg, model, tokenizer, train_df, device)
        else:
            trained = {"train_loss": train_reward_model(cfg, model, tokenizer, train_df, device)}
        trained["agreement_train"] = agreement(model, tokenizer, train_df.iloc[:512], rc.batch_size, device)
    if cfg.reward.normalize:  # on the pairs it was fitted on (a pretrained RM: on all of them)
        fitted_on = test_df if cfg.reward.pretrained else train_df
        trained.update(normalize(model, tokenizer, fitted_on, cfg.reward.batch_size, device))
    metrics = {
        "n_pairs": len(pairs),
        "n_test": n_test,
        **trained,
        "agreement_heldout": agreement(model, tokenizer, test_df, cfg.reward.batch_size, device),
        "gold_margin_mean": float((pairs["chosen_gold"] - pairs["rejected_gold"]).mean()),
    }
    columns = ["prompt", "chosen", "rejected", "chosen_gold", "rejected_gold"]
    frames = {"train": train_df, "test": test_df}  # a pretrained RM has no train split
    splits = {name: df[columns].reset_index(drop=True) for name, df in frames.items() if len(df)}
    for name, df in splits.items():
        validate(df, PreferencePairs, f"reward pairs ({name})")
    with atomic_dir(cfg.path("reward")) as tmp:
        save_pretrained(model, tokenizer, tmp / "model")
        save_splits(splits, tmp / "pairs")
        write_json(cfg.path("metrics", "reward.json"), metrics)  # outputs go together: before the folder moves in
    print(  # the time is printed, not kept in reward.json: a tracked file changing every run hides whether results did
        f"reward: {len(pairs)} gold-labelled pairs; held-out agreement with gold {metrics['agreement_heldout']:.3f}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    return metrics


def _no_reward_model(cfg: Config) -> dict:
    """train.reward: rule (the math task) scores with the verifier: no reward model to train; data/reward says so."""
    metrics = {"reward": "rule", "reward_model": None}
    with atomic_dir(cfg.path("reward")) as tmp:
        write_json(tmp / "rule.json", {"reward": "rule", "format_bonus": cfg.train.format_bonus})
        write_json(cfg.path("metrics", "reward.json"), metrics)
    print("reward: train.reward is rule: the math verifier scores RL samples; no reward model to train")
    return metrics
