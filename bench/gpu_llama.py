"""`make gpu-check`'s d. (bench/gpu_check.py runs each in a child process): a random-initialised ~1B Llama's
bf16-autocast AdamW steps, and the async engine's host-memory weight sync of its state dict against pinned buffers
and a device-to-device copy; for the profile group, the same step compiled against the card's measured matmul peak.
Each takes the child's device and returns its figures."""

from __future__ import annotations

import shutil
import time

# ~1.0B parameters (TinyLlama's shape with a 32k vocabulary) / a 2-layer 64-wide one for the dry run
LLAMA_1B = dict(hidden=2048, layers=16, heads=32, vocab=32000, intermediate=5632, batch=8, seq=512, steps=8)
LLAMA_TINY = dict(hidden=64, layers=2, heads=2, vocab=512, intermediate=128, batch=2, seq=32, steps=2)


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


def llama_step(device, ckpt: bool, batch: int, seq: int, steps: int, backend: str | None = None, **shape) -> dict:
    """AdamW steps of a bf16-autocast forward and backward over batch x seq random tokens (fp32 master weights).
    backend: torch.compile each decoder layer with it (one graph, which the 16 identical layers share: compiles in
    a layer's time, not the model's); the warm-up's first step, which compiles, is `compile_s`."""
    import torch

    from rlhf.runtime import adamw

    model = _llama(device, seq=seq, **shape)
    if ckpt:
        model.gradient_checkpointing_enable()
    for layer in model.model.layers if backend else ():
        layer.compile(backend=backend)
    model.train()
    opt = adamw(model.parameters(), device, lr=1e-5)
    ids = torch.randint(shape["vocab"], (batch, seq), device=device)
    losses = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # a training step keeps no KV cache
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    compile_s = _timed(step, device, 1)  # warm-up: the allocator, cuBLAS's plans, AdamW's state, the compile
    _timed(step, device, 1)
    seconds = _timed(step, device, steps)
    params = sum(p.numel() for p in model.parameters())
    flops = 6 * params * batch * seq  # forward + backward, recomputation not counted
    return {
        "params_m": round(params / 1e6, 1),
        "batch_x_seq": f"{batch}x{seq}",
        "step_s": round(seconds, 4),
        "tokens_per_s": round(batch * seq / seconds),
        "tflops": float(f"{flops / seconds / 1e12:.4g}"),  # 4 digits: a CPU's are thousandths
        "loss": round(float(losses[-1]), 3),
        **(_compiled(compile_s) if backend else {}),
    }


def _compiled(compile_s: float) -> dict:
    """The compile's seconds and the graphs dynamo made: 1 when every layer reuses the first one's (a layer that
    recompiled, e.g. over a KV cache's layer index, counts one more, and past 8 the rest run uncompiled)."""
    from torch._dynamo.utils import counters

    return {"compile_s": round(compile_s, 1), "graphs": int(counters["stats"]["unique_graphs"])}


def matmul_tflops(device, n: int, repeats: int = 20) -> float:
    """TFLOP/s of an n x n x n bf16 matmul (2 n^3 FLOPs), back to back into one output: what this card's cuBLAS
    sustains, the yardstick a training step's TFLOP/s is read against (a datasheet's peak is rarely reached)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    _timed(lambda: torch.mm(a, b, out=out), device, 3)
    return 2 * n**3 / _timed(lambda: torch.mm(a, b, out=out), device, repeats) / 1e12


def llama_compiled(device, matmul_n: int, backend: str, **shape) -> dict:
    """The profile group's: the card's matmul TFLOP/s, then the Llama's step (fused AdamW on a GPU, each layer
    compiled with `backend`, no checkpointing) in the same process, its TFLOP/s as a share of the matmul's."""
    peak = matmul_tflops(device, matmul_n)
    figures = llama_step(device, ckpt=False, backend=backend, **shape)
    return {**figures, "matmul_tflops": float(f"{peak:.4g}"), "peak_share": float(f"{figures['tflops'] / peak:.3g}")}


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
