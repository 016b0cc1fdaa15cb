"""Weight sync's pure parts: the /dev/shm preflight, and ZeRO-3
gathering one parameter at a time (a real ZeRO-3 partition, in a process of its own). The syncs themselves run
through vLLM's API in tests/test_vllm_engines.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.generation.transfer import check_shm_room, free_bytes, shm_copies
from rlhf.generation.weights import weight_bytes

MiB, GiB = 2**20, 2**30


def test_the_async_engine_keeps_n_plus_2_copies():
    """Versions v-1-N .. v-1 kept (the engine has acknowledged v-1-N at least) and v being filled."""
    assert [shm_copies(n) for n in (1, 2, 4)] == [3, 4, 6]


@pytest.mark.parametrize("bytes_per_param, gib", [(2, 16), (4, 32)])
def test_a_2_8b_model_against_a_containers_default_shm_fails_in_one_line_naming_the_fix(bytes_per_param, gib):
    needed = 2_800_000_000 * bytes_per_param * shm_copies(1)  # bf16: 16.8 GB; fp32: 33.6 GB
    with pytest.raises(RuntimeError) as err:
        check_shm_room(needed, 64 * MiB)
    text = str(err.value)
    assert "\n" not in text and "64 MiB free" in text and f"{needed / GiB:.1f} GiB" in text
    assert f"--shm-size={gib}g" in text and "--ipc=host" in text
    check_shm_room(needed, needed)  # exactly enough passes


def test_the_real_dev_shm_holds_a_tiny_models_copies_and_not_an_exabyte(tmp_path):
    st = os.statvfs("/dev/shm")
    assert free_bytes() == st.f_bavail * st.f_frsize > 0
    from rlhf.config import ModelConfig
    from rlhf.models import tiny

    tok = tiny.train_word_tokenizer(["a b c d"], vocab_size=16)
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=16)
    check_shm_room(weight_bytes(tiny.build_tiny_model(cfg, tok, seed=0)) * shm_copies(1), free_bytes())
    with pytest.raises(RuntimeError, match="/dev/shm has .* free"):
        check_shm_room(2**60, free_bytes())


# slow: a DeepSpeed ZeRO-3 process group in a fresh interpreter, as the launcher tests (~7 s; 33-65 s while the
# script let DeepSpeed build its shared-memory comm op, which ZeRO never uses: it now skips it as launched runs do)
@pytest.mark.slow
def test_zero3_weights_are_gathered_one_parameter_at_a_time():
    """shared_snapshot of a ZeRO-3 model asks GatheredParameters for one weight at a time (was: all of them at
    once, the whole model on every rank), and the copy is the model's (merged) weights."""
    script = Path(__file__).with_name("zero3_stream.py")
    env = {**os.environ, "PYTHONPATH": str(script.parents[1]), "ZERO3_PORT": str(29500 + os.getpid() % 1000)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    plain, adapted = out.stdout.strip().splitlines()[-2:]
    assert plain.startswith("plain: largest gather 1 of ") and plain.endswith("equal True"), out.stdout
    # a LoRA layer's merged weight reads its base weight and its two adapters: three at a time, never the model
    assert adapted.startswith("lora: largest gather 3 of ") and adapted.endswith("equal True"), out.stdout
