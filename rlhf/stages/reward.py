"""Stage `reward`: the proxy reward model RL optimises, trained as in the paper's gold-relabelling protocol.

1. sample two responses per reward prompt from the SFT policy; 2. label each pair with the gold judge
(chosen = higher gold score; ties dropped); 3. train a Bradley-Terry reward model initialised from the SFT
policy; 4. report its agreement with gold on held-out pairs. Outputs: data/reward/{model,pairs},
data/metrics/reward.json.
"""

from __future__ import annotations

import math
import time

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm

from rlhf.algorithms.common import truncate_after_eos
from rlhf.config import Config
from rlhf.generation.base import SamplingParams, pad_left
from rlhf.generation.hf import HFEngine
from rlhf.io import atomic_dir, write_json
from rlhf.trainers.forward import attention_and_positions, sequence_scores


def sample_pairs(cfg: Config, policy, tokenizer, prompts: list[str], chunk: int = 64) -> pd.DataFrame:
    """Two SFT samples per prompt, decoded up to their first EOS (kept as token ids too, for training)."""
    engine = HFEngine(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
    params = SamplingParams(k=2, max_new_tokens=cfg.reward.response_length, temperature=cfg.reward.temperature)
    rows = []
    for i in tqdm(range(0, len(prompts), chunk), desc="reward: sampling pairs"):
        batch = prompts[i : i + chunk]
        engine.submit(tokenizer(batch)["input_ids"], params)
        tokens, mask, _ = truncate_after_eos(engine.receive().responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(tokens.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
        ids = [row[m].tolist() for row, m in zip(tokens, mask)]
        for j, prompt in enumerate(batch):
            rows.append({"prompt": prompt, "a": texts[2 * j], "b": texts[2 * j + 1], "a_ids": ids[2 * j], "b_ids": ids[2 * j + 1]})
    return pd.DataFrame(rows)


def label_with_gold(pairs: pd.DataFrame, judge, min_margin: float) -> pd.DataFrame:
    """The paper's relabelling: chosen = the response gold prefers; near-ties are dropped, not guessed."""
    ga, gb = judge.score(list(pairs["a"])), judge.score(list(pairs["b"]))
    a_wins = ga >= gb
    out = pd.DataFrame({
        "prompt": pairs["prompt"],
        "chosen": pairs["a"].where(a_wins, pairs["b"]),
        "rejected": pairs["b"].where(a_wins, pairs["a"]),
        "chosen_gold": pd.Series(ga).where(a_wins, gb).astype(float),
        "rejected_gold": pd.Series(gb).where(a_wins, ga).astype(float),
        "chosen_ids": pairs["a_ids"].where(a_wins, pairs["b_ids"]),
        "rejected_ids": pairs["b_ids"].where(a_wins, pairs["a_ids"]),
    })
    keep = (out["chosen_gold"] - out["rejected_gold"]) > min_margin
    return out[keep].reset_index(drop=True)


def _pair_scores(model, tokenizer, df: pd.DataFrame, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward of chosen and rejected for a batch of pairs. Shapes (n,), (n,)."""
    prompt_ids, prompt_mask = pad_left(tokenizer(list(df["prompt"]))["input_ids"] * 2, tokenizer.pad_token_id)
    responses = list(df["chosen_ids"]) + list(df["rejected_ids"])
    width = max(1, max(len(r) for r in responses))
    resp = torch.full((len(responses), width), tokenizer.pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros_like(resp, dtype=torch.bool)
    for i, r in enumerate(responses):
        resp[i, : len(r)], resp_mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), True
    attn, positions = attention_and_positions(prompt_mask, resp_mask)
    seq = torch.cat([prompt_ids, resp], 1)
    last = (resp_mask.sum(1) - 1).clamp(min=0)
    scores = sequence_scores(model, seq.to(device), attn.to(device), positions.to(device), prompt_ids.shape[1], last.to(device))
    return scores[: len(df)], scores[len(df) :]


@torch.no_grad()
def agreement(model, tokenizer, df: pd.DataFrame, batch_size: int) -> float:
    model.eval()
    wins = []
    for i in range(0, len(df), batch_size):
        chosen, rejected = _pair_scores(model, tokenizer, df.iloc[i : i + batch_size], "cpu")
        wins.append((chosen > rejected).float())
    return float(torch.cat(wins).mean()) if wins else float("nan")


def train_reward_model(cfg: Config, model, tokenizer, train_df: pd.DataFrame) -> float:
    """Bradley-Terry: minimise -log sigmoid(r_chosen - r_rejected). Returns the last epoch's mean loss."""
    rc = cfg.reward
    steps_per_epoch = math.ceil(len(train_df) / rc.batch_size)
    total = max(1, int(steps_per_epoch * rc.epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=rc.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / total)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(total), desc="reward: training")
    for step in bar:
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(train_df), generator=gen).tolist()
        idx = order[(step % steps_per_epoch) * rc.batch_size : (step % steps_per_epoch + 1) * rc.batch_size]
        chosen, rejected = _pair_scores(model, tokenizer, train_df.iloc[idx], "cpu")
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


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import PreferencePairs, Prompts, validate
    from rlhf.data.splits import load_split, save_splits
    from rlhf.models.loading import load_causal_lm, load_tokenizer, reward_model_from_causal, save_pretrained
    from rlhf.rewards.gold import GoldJudge

    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    judge = GoldJudge.load(cfg.path("gold"))
    tokenizer = load_tokenizer(cfg.path("sft"))
    prompts = list(load_split(cfg.path("prepared"), "reward_prompts", Prompts)["prompt"])
    pairs = label_with_gold(sample_pairs(cfg, load_causal_lm(cfg.path("sft")), tokenizer, prompts), judge, cfg.reward.min_gold_margin)
    if len(pairs) < 4:
        raise ValueError(f"reward: only {len(pairs)} pairs with a gold preference; raise data.n_reward_prompts")
    n_test = max(2, int(len(pairs) * cfg.reward.eval_fraction))
    test_df, train_df = pairs.iloc[:n_test], pairs.iloc[n_test:]
    model = reward_model_from_causal(cfg.path("sft"))
    final_loss = train_reward_model(cfg, model, tokenizer, train_df)
    metrics = {
        "n_pairs": len(pairs),
        "n_test": n_test,
        "train_loss": final_loss,
        "agreement_train": agreement(model, tokenizer, train_df.iloc[:512], cfg.reward.batch_size),
        "agreement_heldout": agreement(model, tokenizer, test_df, cfg.reward.batch_size),
        "gold_margin_mean": float((pairs["chosen_gold"] - pairs["rejected_gold"]).mean()),
        "seconds": time.perf_counter() - start,
    }
    columns = ["prompt", "chosen", "rejected", "chosen_gold", "rejected_gold"]
    splits = {"train": train_df[columns].reset_index(drop=True), "test": test_df[columns].reset_index(drop=True)}
    for name, df in splits.items():
        validate(df, PreferencePairs, f"reward pairs ({name})")
    with atomic_dir(cfg.path("reward")) as tmp:
        save_pretrained(model, tokenizer, tmp / "model")
        save_splits(splits, tmp / "pairs")
    write_json(cfg.path("metrics", "reward.json"), metrics)
    print(f"reward: {len(pairs)} gold-labelled pairs; held-out agreement with gold {metrics['agreement_heldout']:.3f}")
    return metrics
