"""The TRL half of bench/vs_trl.py: its venv (ensure_trl_venv) and one TRL OnlineDPO or RLOO run inside it.

Not run by hand: bench/vs_trl.py creates .cache/bench/trl-venv, writes a spec (settings + the exact prompt list
our loop consumes) and calls
    .cache/bench/trl-venv/bin/python bench/trl_side.py --spec SPEC.json --out DIR
Imports only torch / transformers / datasets / trl (never `rlhf`: it is not installed in that venv). Writes
DIR/policy (safetensors, for the orchestrator's reward evaluation), DIR/result.json (timings, peak RSS, TRL's log
history) and DIR/reward_check.json (a few scored samples the orchestrator re-scores with rlhf's ProxyReward).

The reward TRL optimises is the proxy RM scored exactly as rlhf/rewards/proxy.py does (read at the last real
response token, the EOS when there is one, left-padded prompt + right-padded response, positions from the mask,
in the units its config's `reward_normalization` gives), then our missing-EOS rule (score := penalty_reward_value).
It is passed as a reward callable because TRL's built-in RM path re-tokenises decoded text and reads the last
non-pad token, after the EOS was stripped by decoding, and because TRL has no replace-the-score penalty (OnlineDPO
subtracts a constant, RLOO has none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
TRL_VENV = ROOT / ".cache" / "bench" / "trl-venv"
SHARED_PINS = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "accelerate",
    "datasets",
    "numpy",
    "pandas",
)


# --- the TRL venv (bench/vs_trl.py calls this from the project venv) -------------------------------------


def trl_requirements() -> list[str]:
    """trl==TRL_VERSION plus the project's exact pins of the libraries both sides share (torch as the CPU build)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    pins = [d for d in deps if d.split("==")[0].strip().lower() in SHARED_PINS and "==" in d]
    pins = [f"{d}+cpu" if d.startswith("torch==") and "+" not in d else d for d in pins]
    return [f"trl=={TRL_VERSION}", *sorted(pins)]


def ensure_trl_venv() -> Path:
    python, stamp = TRL_VENV / "bin" / "python", TRL_VENV / ".installed"
    reqs = trl_requirements()
    if stamp.is_file() and stamp.read_text(encoding="utf-8").split() == reqs and python.exists():
        return python
    print(f"creating {TRL_VENV} with {' '.join(reqs)} (once; pip cache in .cache/pip)", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    env = {**os.environ, "PIP_CACHE_DIR": str(ROOT / ".cache" / "pip"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [str(python), "-m", "pip", "install", "-q", *reqs]
    # The pip config's own indexes/wheel folders first (they may hold the CPU torch); else PyTorch's CPU index.
    if (
        subprocess.run(cmd, env=env).returncode
        and subprocess.run([*cmd, "--extra-index-url", "https://download.pytorch.org/whl/cpu"], env=env).returncode
    ):
        raise SystemExit(
            f"pip could not install the TRL venv ({' '.join(reqs)}) into {TRL_VENV}; see pip's output above"
        )
    check = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if check.returncode or check.stdout.strip() != TRL_VERSION:
        raise SystemExit(f"{TRL_VENV}: `import trl` failed or is not {TRL_VERSION}:\n{check.stderr[-2000:]}")
    stamp.write_text("\n".join(reqs) + "\n", encoding="utf-8")
    return python


# --- one TRL run (in the TRL venv) -----------------------------------------------------------------------


class ProxyRM:
    """The proxy reward model as a TRL reward callable (sync, picklable, named `proxy_rm` in TRL's logs)."""

    __name__ = "proxy_rm"

    def __init__(self, folder: str, tokenizer, eos_id: int, pad_id: int, penalty: float | None, keep: int = 8):
        from transformers import AutoModelForSequenceClassification

        self.model = (
            AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
            .eval()
            .requires_grad_(False)
        )
        self.tokenizer, self.eos, self.pad, self.penalty = tokenizer, eos_id, pad_id, penalty
        self.seconds, self.calls, self.samples, self.keep = 0.0, 0, [], keep

    def _response(self, ids: list[int]) -> tuple[list[int], bool]:
        """Tokens up to and including the first EOS (TRL pads after it), or all of them when there is none."""
        if self.eos in ids:
            return ids[: ids.index(self.eos) + 1], True
        return ids, False

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids, **_) -> list[float]:
        start = time.perf_counter()
        prompt_ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        responses, has_eos = zip(*(self._response(list(c)) for c in completion_ids))
        C, T = max(map(len, prompt_ids)), max(1, max(map(len, responses)))
        n = len(prompt_ids)
        ids = torch.full((n, C + T), self.pad, dtype=torch.long)
        attn = torch.zeros((n, C + T), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompt_ids, responses)):
            ids[i, C - len(p) : C] = torch.tensor(p)
            ids[i, C : C + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, C - len(p) : C + len(r)] = 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        last = torch.tensor([max(len(r), 1) - 1 for r in responses])
        scores = []
        for i in range(0, n, 64):  # ProxyReward's chunk
            s = slice(i, i + 64)
            hidden = self.model.base_model(
                input_ids=ids[s], attention_mask=attn[s], position_ids=positions[s], use_cache=False
            ).last_hidden_state
            values = self.model.score(hidden).squeeze(-1).float()
            scores.append(values[torch.arange(len(values)), C + last[s]])
        raw = torch.cat(scores)
        # the calibration the reward stage saved (rlhf.models.forward.reward_normalization: reward.normalize)
        if (norm := getattr(self.model.config, "reward_normalization", None)) is not None:
            raw = (raw - norm[0]) / norm[1]
        if len(self.samples) < self.keep:
            self.samples += [
                {"prompt_ids": p, "response_ids": list(c), "raw_score": float(x)}
                for p, c, x in zip(prompt_ids, completion_ids, raw)
            ][: self.keep - len(self.samples)]
        out = raw.clone()
        if self.penalty is not None:
            out[~torch.tensor(has_eos)] = self.penalty
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out.tolist()


def step_timer():
    """A TrainerCallback summing on_step_begin -> on_step_end (generation, scoring, forward, backward, optimizer
    step; not the logging between steps): the counterpart of our csv's timing/step."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        seconds, steps, _start = 0.0, 0, None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self._start
            self.steps += 1

    return StepTimer()


def timed_generate(model):
    """Wrap model.generate (TRL calls it on the unwrapped model: the same object on one CPU process)."""
    stats = {"seconds": 0.0, "calls": 0}
    inner = model.generate

    def generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            stats["seconds"] += time.perf_counter() - start
            stats["calls"] += 1

    model.generate = generate
    return stats


def common_args(s: dict, out: Path) -> dict:
    """TrainingArguments shared by both trainers: our optimiser, schedule and precision, no saving/reporting."""
    return dict(
        output_dir=str(out / "trainer"),
        seed=s["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        # TRL defaults to True (and then generates without a KV cache); ours never checkpoints
        gradient_checkpointing=False,
        learning_rate=s["learning_rate"],
        lr_scheduler_type=s["lr_scheduler"],
        warmup_steps=int(s["warmup_ratio"] * s["steps"]),  # our int(warmup_ratio * updates), as whole steps
        max_grad_norm=s["max_grad_norm"],
        weight_decay=0.0,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        gradient_accumulation_steps=s["gradient_accumulation_steps"],
        max_steps=s["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32", "device_map": None},  # RLOO's CPU default; OnlineDPO would use "auto"
    )


def trainer_classes(algo: str):
    """(config class, trainer class), imported before any timer starts (as ours imports its loop)."""
    if algo == "online_dpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        return OnlineDPOConfig, OnlineDPOTrainer
    if algo == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        return RLOOConfig, RLOOTrainer
    raise SystemExit(f"trl_side: unknown algorithm {algo!r} (online_dpo | rloo)")


def temper_logits(model, temperature: float) -> None:
    """Divide the model's LM-head logits by `temperature` in every forward (generate's included)."""
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, logits: logits / temperature)


def build_trainer(algo: str, s: dict, out: Path, tokenizer, reward, dataset, callbacks, tempered: bool = False):
    """TRL's trainer for `algo` on the spec's settings. tempered (online DPO): its log-probs from logits / T, as ours,
    instead of raw logits; it then samples at temperature 1 from those tempered logits (the same distribution)."""
    top = dict(temperature=1.0 if tempered else s["temperature"], top_k=0, top_p=1.0)
    config_cls, trainer_cls = trainer_classes(algo)
    if algo == "online_dpo":
        args = config_cls(
            **common_args(s, out),
            **top,
            per_device_train_batch_size=s["per_device_prompts"],
            max_new_tokens=s["response_length"],
            beta=s["beta"],
            loss_type=s["loss_type"],
            missing_eos_penalty=None,
            disable_dropout=True,
            train_sampling_strategy="sequential",  # our loop's prompt order, batch for batch
        )
    else:
        args = config_cls(
            **common_args(s, out),
            **top,
            per_device_train_batch_size=s["per_device_prompts"] * s["k"],  # TRL counts completions, we count prompts
            num_generations=s["k"],
            max_completion_length=s["response_length"],
            beta=s["kl_coef"],
            epsilon=s["cliprange"],
            num_iterations=1,
            normalize_advantages=False,
            shuffle_dataset=False,
            disable_dropout=True,
        )
    trainer = trainer_cls(
        model=s["sft"],
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    if tempered:
        if algo != "online_dpo" or trainer.ref_model is None:
            raise SystemExit("trl_side: --tempered-logprobs is for online_dpo with a reference model copy")
        for model in (trainer.model, trainer.ref_model):
            temper_logits(model, s["temperature"])
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="JSON written by bench/vs_trl.py")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--tempered-logprobs", action="store_true", help="online DPO: log-probs of logits / T, as ours")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("RLHF_TORCH_THREADS", "1")))  # bench/vs_trl.py's --threads
    process_start = time.perf_counter()
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer

    s = json.loads(Path(a.spec).read_text(encoding="utf-8"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(s["sft"], padding_side="left")
    # Both trainers tokenise the prompt text themselves: check it gives the token ids our loop used.
    got = tokenizer(s["prompts"], add_special_tokens=False)["input_ids"]
    bad = [i for i, (g, want) in enumerate(zip(got, s["prompt_ids"])) if g != want]
    if bad:
        raise SystemExit(
            f"trl_side: {len(bad)} prompts tokenise differently from our loop's ids (first: #{bad[0]}: "
            f"{s['prompts'][bad[0]]!r})"
        )
    dataset = datasets.Dataset.from_dict({"prompt": s["prompts"]})
    trainer_classes(s["algo"])  # module imports stay out of the timings, on both sides
    build_start = time.perf_counter()
    reward = ProxyRM(
        s["reward"],
        tokenizer,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        s["penalty_reward_value"] if s["non_eos_penalty"] else None,
    )
    timer = step_timer()
    trainer = build_trainer(s["algo"], s, out, tokenizer, reward, dataset, [timer], a.tempered_logprobs)
    setup_seconds = time.perf_counter() - build_start
    gen = timed_generate(trainer.model)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    if timer.steps != s["steps"]:
        raise SystemExit(f"trl_side: TRL ran {timer.steps} optimizer steps, expected {s['steps']}")
    if gen["calls"] == 0:
        raise SystemExit(
            "trl_side: model.generate was never called through the wrapped model; the generation timing would be wrong"
        )
    trainer.save_model(str(out / "policy"))
    if not any((out / "policy").glob("*.safetensors")):
        raise SystemExit(f"trl_side: {out / 'policy'} has no safetensors weights")
    wall_seconds = time.perf_counter() - build_start  # the counterpart of our train(cfg): load models, train, save
    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "steps": timer.steps,
        "episodes": s["episodes"],
        "setup_seconds": setup_seconds,
        "train_call_seconds": train_seconds,
        "train_seconds": wall_seconds,
        "loop_seconds": timer.seconds,
        "generation_seconds": gen["seconds"],
        "scoring_seconds": reward.seconds,
        "process_seconds": time.perf_counter() - process_start,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "log_history": trainer.state.log_history,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "reward_check.json").write_text(json.dumps(reward.samples), encoding="utf-8")


if __name__ == "__main__":
    main()
