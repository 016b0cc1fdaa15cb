"""Stage `sft`: the SFT policy every later stage starts from.

model.source = tiny: train a word-level tokenizer on the SFT texts and a small causal LM from scratch.
Otherwise: load the checkpoint (local folder, hub id, packaged SmolLM2) and fine-tune it if sft.train.
Each text is truncated to sft.max_length tokens including an appended EOS, so the policy learns to stop (RL
penalises samples without EOS). Output: cfg.path("sft") (model + tokenizer, atomic) and
cfg.path("metrics", "sft.json").
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rlhf import runtime
from rlhf.config import Config, ConfigError, SFTConfig
from rlhf.data.schemas import SFTExamples
from rlhf.data.splits import load_split
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample
from rlhf.io import atomic_dir, write_json
from rlhf.models import loading, tiny

IGNORE = -100  # label of padding positions: F.cross_entropy's ignore_index
ADAM_BETAS = (0.9, 0.95)  # the usual LM-pretraining betas: 0.95 adapts faster to the shifting gradient scale
MAX_GRAD_NORM = 1.0
SAMPLE_PROMPT_WORDS = 8


def run(cfg: Config) -> dict:
    """Build/load the policy, train it on the prepared SFT texts, save it and its metrics. Returns the metrics."""
    start = time.perf_counter()
    texts = load_split(cfg.path("prepared"), "sft", SFTExamples)["text"].tolist()
    train_texts, heldout_texts = split_heldout(texts, cfg.sft.heldout_texts, cfg.seed)
    model, tokenizer = _starting_point(cfg, train_texts)
    if cfg.sft.train and loading.uses_chat_template(tokenizer, cfg.data.chat_template):
        raise ConfigError(
            "sft.train: the SFT texts are plain text, but data.chat_template puts RL and eval prompts in the model's "
            "chat template; set sft.train: false (an instruction-tuned model is its own SFT policy) or "
            "data.chat_template: none"
        )
    _check_length(cfg, model)
    device = runtime.device()
    model.to(device)
    train_seqs = encode_texts(tokenizer, train_texts, cfg.sft.max_length)
    heldout_seqs = encode_texts(tokenizer, heldout_texts, cfg.sft.max_length)

    metrics: dict = {
        "n_params": tiny.count_parameters(model),
        "n_train_texts": len(train_seqs),
        "n_heldout_texts": len(heldout_seqs),
    }
    if cfg.sft.train:
        losses = train_causal_lm(model, train_seqs, cfg.sft, cfg.seed, tokenizer.pad_token_id, device)
        tail = losses[-max(1, len(losses) // 10) :]  # last 10% of steps: one step's loss is noisy
        metrics.update(steps=len(losses), train_loss_initial=losses[0], train_loss=sum(tail) / len(tail))
        metrics["train_tokens"] = round(cfg.sft.epochs * sum(len(s) for s in train_seqs))
    if heldout_seqs:
        loss = mean_token_loss(model, heldout_seqs, cfg.sft.batch_size, tokenizer.pad_token_id, device)
        metrics.update(heldout_loss=loss, heldout_perplexity=math.exp(min(loss, 50.0)))

    metrics["seconds"] = round(time.perf_counter() - start, 1)
    with atomic_dir(cfg.path("sft")) as tmp:  # outputs go together: the metrics are written before the model moves in
        loading.save_pretrained(model, tokenizer, tmp)
        write_json(cfg.path("metrics", "sft.json"), metrics)
    prompts = [" ".join(t.split()[:SAMPLE_PROMPT_WORDS]) for t in (heldout_texts or train_texts)[:3]]
    with torch.random.fork_rng(devices=[]):  # a look at the policy that leaves the RNG as it was
        torch.manual_seed(cfg.seed)
        [looked] = sample(model, tokenizer, prompts, SamplingParams(1, 24, 0.7), len(prompts), device)
    for prompt, text in zip(prompts, looked.texts):
        print(f"sft sample: {prompt} || {text}")
    return metrics


def _starting_point(cfg: Config, train_texts: list[str]):
    if cfg.model.source == "tiny":
        if not cfg.sft.train:
            raise ConfigError(
                "sft.train=false with model.source=tiny would save an untrained random model; set sft.train=true"
            )
        tokenizer = tiny.train_word_tokenizer(train_texts, cfg.model.vocab_size)
        return tiny.build_tiny_model(cfg.model, tokenizer, cfg.seed), tokenizer
    model, tokenizer = loading.load_policy(cfg.model)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"model {cfg.model.source} {cfg.model.path or ''}: tokenizer has no EOS token; the policy could not "
            f"learn to stop"
        )
    return model, tokenizer


def _check_length(cfg: Config, model) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.sft.max_length > limit:
        raise ConfigError(
            f"sft.max_length ({cfg.sft.max_length}) exceeds the model's max_position_embeddings ({limit})"
        )


# --- data ------------------------------------------------------------------------------------------------


def split_heldout(texts: list[str], n_heldout: int, seed: int) -> tuple[list[str], list[str]]:
    """Seeded shuffle, then (train, heldout) with heldout = min(n_heldout, len // 5) texts."""
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    n = min(n_heldout, len(texts) // 5)
    return [texts[i] for i in order[n:]], [texts[i] for i in order[:n]]


def encode_texts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids of each text, truncated to max_length - 1, then EOS: every sequence ends in EOS, len <= max_length."""
    if max_length < 2:
        raise ConfigError(f"sft.max_length must be >= 2 (one token + EOS), got {max_length}")
    ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length - 1)["input_ids"]
    return [seq + [tokenizer.eos_token_id] for seq in ids if seq]


def collate(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask, labels), each (B, T_max).

    Right padding keeps position ids 0..len-1 without passing them; labels are IGNORE on padding so the loss
    covers exactly the real tokens (including the final EOS).
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE)
    return input_ids, mask, labels


def batch_order(n: int, batch_size: int, epochs: float, seed: int) -> list[list[int]]:
    """Index batches covering round(epochs * n) samples: a fresh seeded permutation per epoch, chained.

    A fractional epoch takes the start of the next permutation; the last batch may be smaller.
    """
    total = max(1, round(epochs * n))
    generator = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    while len(stream) < total:
        stream += torch.randperm(n, generator=generator).tolist()
    stream = stream[:total]
    return [stream[i : i + batch_size] for i in range(0, total, batch_size)]


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Learning-rate multiplier: linear warmup 0 -> 1 over warmup_steps, then cosine 1 -> 0 at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# --- training --------------------------------------------------------------------------------------------


def train_causal_lm(model, seqs: list[list[int]], sft: SFTConfig, seed: int, pad_id: int, device) -> list[float]:
    """Causal-LM training in place (AdamW, warmup + cosine, grad clip 1.0). Returns the loss of every step.

    Raises FloatingPointError as soon as a loss is not finite (the caller then saves nothing).
    """
    if not seqs:
        raise ValueError("no SFT texts to train on (all empty after tokenisation)")
    batches = batch_order(len(seqs), sft.batch_size, sft.epochs, seed)
    warmup = round(sft.warmup_ratio * len(batches))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=sft.learning_rate, betas=ADAM_BETAS, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, len(batches), warmup))
    losses: list[float] = []
    model.train()
    with torch.random.fork_rng(devices=[]), tqdm(total=len(batches), desc="sft", unit="step", mininterval=2.0) as bar:
        torch.manual_seed(seed)
        for step, batch in enumerate(batches):
            input_ids, mask, labels = (t.to(device) for t in collate([seqs[i] for i in batch], pad_id))
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"sft: loss became {loss.item()} at step {step + 1}/{len(batches)}; nothing was saved. "
                    f"Lower sft.learning_rate (now {sft.learning_rate}) or raise sft.warmup_ratio"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.update(1)
            if step % 10 == 0 or step == len(batches) - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def mean_token_loss(model, seqs: list[list[int]], batch_size: int, pad_id: int, device) -> float:
    """Mean next-token cross-entropy over all predicted tokens of `seqs` (token-weighted, not batch-weighted)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        input_ids, mask, labels = (t.to(device) for t in collate(seqs[i : i + batch_size], pad_id))
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
        ).item()
        count += int((targets != IGNORE).sum())
    loss = total / max(1, count)
    if not math.isfinite(loss):
        raise FloatingPointError(f"sft: held-out loss is {loss}; the trained model is unusable, nothing was saved")
    return loss
