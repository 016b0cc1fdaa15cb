"""`make gpu-check`'s d. (bench/gpu_check.py runs each in a child process): a random-initialised ~1B Llama's
bf16-autocast AdamW steps, and the async engine's host-memory weight sync of its state dict against pinned buffers
and a device-to-device copy. Each takes the child's device and returns its figures."""

from __future__ import annotations

import shutil
import time


def _llama(device, hidden, layers, heads, vocab, intermediate, seq, **_):
    """A random-initialised Llama in float32 (the master weights) on `device`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def _timed(fn, device, repeats: int) -> float:
    """Mean seconds of fn() over `repeats` calls, the device synchronised around them."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def llama_step(device, ckpt: bool, batch: int, seq: int, steps: int, **shape) -> dict:
    """AdamW steps of a bf16-autocast forward and backward over batch x seq random tokens (fp32 master weights)."""
    import torch

    from rlhf.runtime import adamw

    model = _llama(device, seq=seq, **shape)
    if ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    opt = adamw(model.parameters(), device, lr=1e-5)
    ids = torch.randint(shape["vocab"], (batch, seq), device=device)
    losses = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    _timed(step, device, 2)  # warm-up: the allocator, cuBLAS's plans, AdamW's state
    seconds = _timed(step, device, steps)
    params = sum(p.numel() for p in model.parameters())
    flops = 6 * params * batch * seq  # forward + backward, recomputation not counted
    return {
        "params_m": round(params / 1e6, 1),
        "batch_x_seq": f"{batch}x{seq}",
        "step_s": round(seconds, 4),
        "tokens_per_s": round(batch * seq / seconds),
        "tflops": round(flops / seconds / 1e12, 2),
        "loss": round(float(losses[-1]), 3),
    }


def weight_sync(device, repeats: int, **shape) -> dict:
    """The async engine's host-memory weight sync of the Llama's state dict (shared_snapshot: GPU -> SharedWeights,
    page-locked on a GPU, then the engine's copy back to a GPU), the same copy into never-locked shared buffers, a
    pinned-buffer round trip, and a device-to-device copy; GB/s each."""
    import torch

    from rlhf.generation.weights import SharedWeights, shared_snapshot, weight_stream

    model = _llama(device, **shape)
    state = {n: t.detach() for n, t in model.state_dict().items()}
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    engine = {n: torch.empty_like(t) for n, t in state.items()}  # the engine's weights, on the same GPU here
    figures = {"state_gb": round(gb, 3)}
    d2d = _timed(lambda: [engine[n].copy_(t) for n, t in state.items()], device, repeats)
    figures["d2d_gbps"] = round(gb / d2d, 1)
    if device.type == "cuda":  # page-locked host buffers: what pinning SharedWeights' buffers would give
        pinned = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in state.items()}
        down = _timed(lambda: [pinned[n].copy_(t, non_blocking=True) for n, t in state.items()], device, repeats)
        up = _timed(lambda: [engine[n].copy_(t, non_blocking=True) for n, t in pinned.items()], device, repeats)
        figures.update(pinned_d2h_gbps=round(gb / down, 1), pinned_h2d_gbps=round(gb / up, 1))
    shm_free = shutil.disk_usage("/dev/shm").free / 1e9
    figures["shm_free_gb"] = round(shm_free, 1)
    if shm_free < 1.2 * gb:  # SharedWeights lives in /dev/shm: a fuller one ends the process with SIGBUS
        return {**figures, "error": f"/dev/shm has {shm_free:.1f} GB free, SharedWeights needs {gb:.1f} GB"}
    start = time.perf_counter()
    spare = shared_snapshot(model)  # a run's first sync: allocates the shared buffers, page-locks them on a GPU
    figures["shared_first_s"] = round(time.perf_counter() - start, 3)
    down = _timed(lambda: shared_snapshot(model, spare), device, repeats)
    # in this process the buffers are page-locked; the engine process maps the same memory without locking it
    up = _timed(lambda: [engine[n].copy_(t) for n, t in spare.tensors()], device, repeats)
    figures.update(shared_d2h_gbps=round(gb / down, 1), shared_h2d_gbps=round(gb / up, 1))
    figures["shared_sync_s"] = round(down + up, 3)
    figures["d2d_s"] = round(d2d, 4)
    if shm_free >= 2.4 * gb:  # the same copy into shared buffers never page-locked: the sync before page_lock
        with weight_stream(model) as (entries, _):
            pageable = SharedWeights.allocate(entries)
        figures["pageable_d2h_gbps"] = round(gb / _timed(lambda: pageable.fill(state.items()), device, repeats), 1)
    return figures
