"""Stage `sft`: the SFT policy every later stage starts from.

model.source = tiny: train a word-level tokenizer on the SFT texts and a small causal LM from scratch.
Otherwise: load the checkpoint (local folder, hub id, packaged SmolLM2) and fine-tune it if sft.train.
The sft split is plain texts (reviews, tldr: every token learnt) or prompt/completion pairs (math: the prompt
encoded as every stage encodes prompts, in the model's chat template under data.chat_template, and only the
completion's tokens learnt). Each sequence is truncated to sft.max_length tokens including an appended EOS, so the
policy learns to stop (RL penalises samples without EOS). Output: cfg.path("sft") (model + tokenizer, atomic) and
cfg.path("metrics", "sft.json").
"""

from __future__ import annotations

import math
import time

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from rlhf import runtime
from rlhf.config import Config, ConfigError, SFTConfig
from rlhf.data.splits import load_task_split
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample
from rlhf.io import atomic_dir, write_json
from rlhf.models import loading, tiny

IGNORE = -100  # label of padding and prompt positions: F.cross_entropy's ignore_index
ADAM_BETAS = (0.9, 0.95)  # the usual LM-pretraining betas: 0.95 adapts faster to the shifting gradient scale
MAX_GRAD_NORM = 1.0
SAMPLE_PROMPT_WORDS = 8
PACKED_ROW_TOKENS = 144  # pack's rows: ~3 sequences of the tiny SFT's 48 tokens (measured vs 96, 192 and padding)
PLAIN_SEPARATOR = " "  # between a pair's prompt and completion when they are plain text (no chat template)


def run(cfg: Config) -> dict:
    """Build/load the policy, train it on the prepared SFT split, save it and its metrics. Returns the metrics."""
    start = time.perf_counter()
    examples = load_task_split(cfg.path("prepared"), "sft", cfg.data.source)
    train_rows, heldout_rows = (examples.iloc[i] for i in split_heldout(examples, cfg.sft.heldout_texts, cfg.seed))
    model, tokenizer = _starting_point(cfg, plain_texts(train_rows))
    _check_format(cfg, tokenizer, examples)
    _check_length(cfg, model)
    device = runtime.device()
    model.to(device)
    train_seqs, train_prompts = encode_examples(tokenizer, train_rows, cfg.sft.max_length, cfg.data.chat_template)
    heldout_seqs, heldout_prompts = encode_examples(tokenizer, heldout_rows, cfg.sft.max_length, cfg.data.chat_template)

    metrics: dict = {
        "n_params": tiny.count_parameters(model),
        "n_train_texts": len(train_seqs),
        "n_heldout_texts": len(heldout_seqs),
    }
    if cfg.sft.train:
        torch.set_num_threads(runtime.threads_alone())  # the stage runs alone: every core it has
        losses = train_causal_lm(model, train_seqs, cfg.sft, cfg.seed, tokenizer.pad_token_id, device, train_prompts)
        tail = losses[-max(1, len(losses) // 10) :]  # last 10% of steps: one step's loss is noisy
        metrics.update(steps=len(losses), train_loss_initial=losses[0], train_loss=sum(tail) / len(tail))
        metrics["train_tokens"] = round(cfg.sft.epochs * sum(len(s) - n for s, n in zip(train_seqs, train_prompts)))
    if heldout_seqs:
        loss = mean_token_loss(model, heldout_seqs, cfg.sft.batch_size, tokenizer.pad_token_id, device, heldout_prompts)
        metrics.update(heldout_loss=loss, heldout_perplexity=math.exp(min(loss, 50.0)))

    with atomic_dir(cfg.path("sft")) as tmp:  # outputs go together: the metrics are written before the model moves in
        loading.save_pretrained(model, tokenizer, tmp)
        write_json(cfg.path("metrics", "sft.json"), metrics)
    # the time is printed, not kept in sft.json: a tracked file changing with every run hides whether results did
    loss = f"held-out loss {metrics['heldout_loss']:.3f}, " if "heldout_loss" in metrics else ""
    print(f"sft: {loss}{time.perf_counter() - start:.1f} s -> {cfg.path('sft')}")
    _show_samples(cfg, model, tokenizer, heldout_rows if len(heldout_rows) else train_rows, device)
    return metrics


def _show_samples(cfg: Config, model, tokenizer, rows: pd.DataFrame, device) -> None:
    """Print the saved policy's answers to three prompts (pairs: the prompts; texts: their first words)."""
    if "prompt" in rows:
        shown = rows["prompt"].head(3).tolist()
        prompts = loading.encode_prompts(tokenizer, shown, cfg.data.chat_template)
    else:
        prompts = shown = [" ".join(t.split()[:SAMPLE_PROMPT_WORDS]) for t in rows["text"].head(3)]
    with torch.random.fork_rng(devices=[]):  # a look at the policy that leaves the RNG as it was
        torch.manual_seed(cfg.seed)
        [looked] = sample(model, tokenizer, prompts, SamplingParams(1, 24, 0.7), len(prompts), device)
    for prompt, text in zip(shown, looked.texts):
        print(f"sft sample: {prompt} || {text}")


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


def _check_format(cfg: Config, tokenizer, examples: pd.DataFrame) -> None:
    if cfg.sft.train and "text" in examples and loading.uses_chat_template(tokenizer, cfg.data.chat_template):
        raise ConfigError(
            "sft.train: the SFT split is plain text (no prompt/completion), but data.chat_template puts RL and eval "
            "prompts in the model's chat template; set sft.train: false (an instruction-tuned model is its own SFT "
            "policy) or data.chat_template: none"
        )


def _check_length(cfg: Config, model) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.sft.max_length > limit:
        raise ConfigError(
            f"sft.max_length ({cfg.sft.max_length}) exceeds the model's max_position_embeddings ({limit})"
        )


# --- data ------------------------------------------------------------------------------------------------


def split_heldout(items, n_heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle of the items' positions, then (train, heldout) positions, heldout = min(n_heldout, len // 5)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    n = min(n_heldout, len(items) // 5)
    return order[n:], order[:n]


def plain_texts(examples: pd.DataFrame) -> list[str]:
    """The split's rows as plain text (a pair as prompt + " " + completion): what a from-scratch tokenizer learns."""
    if "text" in examples:
        return examples["text"].tolist()
    return (examples["prompt"] + PLAIN_SEPARATOR + examples["completion"]).tolist()


def encode_examples(tokenizer, examples: pd.DataFrame, max_length: int, chat_template: str):
    """(sequences, prompt lengths) of an sft split: plain texts are learnt whole (prompt length 0); a pair is its
    prompt as the loop encodes prompts (loading.encode_prompts) followed by the completion, and only the completion
    (and the EOS) is learnt. Every sequence ends in EOS, len <= max_length."""
    if "text" in examples:
        seqs = encode_texts(tokenizer, examples["text"].tolist(), max_length)
        return seqs, [0] * len(seqs)
    prompts = loading.encode_prompts(tokenizer, examples["prompt"].tolist(), chat_template)
    # in a chat template the assistant turn is already open; as plain text the completion follows the separator
    sep = "" if loading.uses_chat_template(tokenizer, chat_template) else PLAIN_SEPARATOR
    completions = tokenizer([sep + c for c in examples["completion"]], add_special_tokens=False)["input_ids"]
    longest = max((len(p) for p in prompts), default=0)
    if longest >= max_length - 1:
        raise ConfigError(
            f"sft.max_length ({max_length}) leaves no completion token after a prompt of {longest} tokens; "
            f"raise it above {longest + 1}"
        )
    seqs = [(p + c)[: max_length - 1] + [tokenizer.eos_token_id] for p, c in zip(prompts, completions)]
    return seqs, [len(p) for p in prompts]


def encode_texts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Token ids of each text, truncated to max_length - 1, then EOS: every sequence ends in EOS, len <= max_length."""
    if max_length < 2:
        raise ConfigError(f"sft.max_length must be >= 2 (one token + EOS), got {max_length}")
    ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length - 1)["input_ids"]
    return [seq + [tokenizer.eos_token_id] for seq in ids if seq]


def collate(
    seqs: list[list[int]], pad_id: int, prompt_lengths: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask, labels), each (B, T_max).

    Right padding keeps position ids 0..len-1 without passing them; labels are IGNORE on padding and on each
    sequence's first prompt_lengths[row] tokens, so the loss covers exactly the tokens to learn (including the EOS).
    """
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE)
    for row, n in enumerate(prompt_lengths or []):
        labels[row, :n] = IGNORE
    return input_ids, mask, labels


def pack(
    seqs: list[list[int]], pad_id: int, prompt_lengths: list[int] | None = None, row_tokens: int = 0
) -> dict[str, torch.Tensor]:
    """The model's inputs for a batch, several sequences per row: (input_ids, position_ids, labels) (R, T) and an
    attention_mask (R, 1, T, T), True where a token may attend (earlier tokens of its own sequence).

    Rows hold up to max(row_tokens, longest) tokens, filled longest first (first fit). Right-padding each sequence to
    the batch's longest spent ~40% of the tiny SFT's compute on padding; packed, the same sequences give the same
    loss (position ids restart at 0 in each sequence, the mask keeps sequences apart). Labels as collate's: IGNORE on
    padding, on each sequence's first prompt_lengths[i] tokens, and on its first token (the model's shift would
    otherwise have it predicted by the previous sequence's last token).
    """
    capacity = max(row_tokens, max(len(s) for s in seqs))
    rows: list[list[int]] = []  # sequence positions per row
    free: list[int] = []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        row = next((r for r, left in enumerate(free) if left >= len(seqs[i])), len(rows))
        if row == len(rows):
            rows.append([])
            free.append(capacity)
        rows[row].append(i)
        free[row] -= len(seqs[i])
    width = capacity - min(free)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    sequence = torch.full((len(rows), width), -1, dtype=torch.long)  # which sequence a token is of; -1: padding
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for row, members in enumerate(rows):
        start = 0
        for i in members:
            seq, end = torch.tensor(seqs[i]), start + len(seqs[i])
            input_ids[row, start:end], sequence[row, start:end] = seq, i
            position_ids[row, start:end] = torch.arange(len(seq))
            learnt_from = start + max(1, prompt_lengths[i] if prompt_lengths else 0)
            labels[row, learnt_from:end] = seq[learnt_from - start :]
            start = end
    same = (sequence[:, :, None] == sequence[:, None, :]) & (sequence[:, :, None] >= 0)
    # a padding position attends to itself: a row of the softmax with nothing to attend to would be NaN
    mask = (same | torch.eye(width, dtype=torch.bool)) & torch.ones(width, width, dtype=torch.bool).tril()
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask[:, None], "labels": labels}


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


def train_causal_lm(
    model,
    seqs: list[list[int]],
    sft: SFTConfig,
    seed: int,
    pad_id: int,
    device,
    prompt_lengths: list[int] | None = None,
) -> list[float]:
    """Causal-LM training in place (AdamW, warmup + cosine, grad clip 1.0), the first prompt_lengths[i] tokens of
    sequence i not learnt. Returns the loss of every step.

    Raises FloatingPointError as soon as a loss is not finite (the caller then saves nothing).
    """
    if not seqs:
        raise ValueError("no SFT texts to train on (all empty after tokenisation)")
    batches = batch_order(len(seqs), sft.batch_size, sft.epochs, seed)
    warmup = round(sft.warmup_ratio * len(batches))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = runtime.adamw(params, device, lr=sft.learning_rate, betas=ADAM_BETAS, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, len(batches), warmup))
    losses: list[float] = []
    model.train()
    with torch.random.fork_rng(devices=[]), tqdm(total=len(batches), desc="sft", unit="step", mininterval=2.0) as bar:
        torch.manual_seed(seed)
        for step, batch in enumerate(batches):
            lengths = [prompt_lengths[i] for i in batch] if prompt_lengths else None
            inputs = pack([seqs[i] for i in batch], pad_id, lengths, PACKED_ROW_TOKENS)
            loss = model(**{name: t.to(device) for name, t in inputs.items()}).loss
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
def mean_token_loss(
    model, seqs: list[list[int]], batch_size: int, pad_id: int, device, prompt_lengths: list[int] | None = None
) -> float:
    """Mean next-token cross-entropy over the learnt tokens of `seqs` (token-weighted, not batch-weighted)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        lengths = prompt_lengths[i : i + batch_size] if prompt_lengths else None
        input_ids, mask, labels = (t.to(device) for t in collate(seqs[i : i + batch_size], pad_id, lengths))
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
