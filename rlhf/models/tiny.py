"""The `tiny` profile's policy: a word-level tokenizer and a small Llama (or GPT-NeoX) trained from scratch.

Why word-level: on 2 CPU cores a ~1-3M-parameter model trained for a few minutes writes review-like text only
when each token is a whole word; a 2k-BPE model of the same size was still gibberish after 5 minutes
(shared/reference/platform.md).
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from rlhf.config import ModelConfig

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]  # ids 0..3 in this order
PYTHIA_ROTARY_PCT = 0.25  # Pythia's rotary_pct: rotary on the first quarter of each head's dims, the rest as is
# A word (contractions such as "didn't" and "it's" stay one word) or one punctuation character.
WORD_OR_PUNCT = r"\w+(?:['’]\w+)*|[^\w\s]"


def train_word_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a lower-cased word-level tokenizer on `texts`: the `vocab_size - 4` most frequent words + 4 specials.

    Specials: <pad>=0, <unk>=1, <bos>=2, <eos>=3. Nothing is added automatically when encoding (no BOS/EOS):
    the SFT stage appends EOS itself, and prompts are encoded bare. Decoding joins words with spaces and
    attaches punctuation (". , ! ?") and clitics ("'s", "n't") to the previous word. Deterministic: ties in
    word frequency are broken by the tokenizers trainer's stable ordering.
    padding_side is "left" (generation pads prompts on the left); transformers 5 may not keep it when saved, so
    load with rlhf.models.loading.load_tokenizer, which passes it again.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    if not texts:
        raise ValueError("train_word_tokenizer needs at least one text")
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(WORD_OR_PUNCT), behavior="isolated")]
    )
    # WordPiece's decoder joins tokens with spaces; cleanup glues punctuation back ("movie ." -> "movie.").
    # No token starts with "##" (the pre-tokenizer never produces one), so the prefix never fires.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    """A randomly initialised float32 causal LM with the dims of `model_cfg` and the tokenizer's vocabulary.

    Llama (default, tied input/output embeddings) or GPT-NeoX (model_cfg.architecture="gpt_neox") with Pythia's
    choices where they differ from Llama: untied embed_in / embed_out, parallel residual, rotary on a quarter of
    each head (rotary_pct 0.25), fused QKV and biases; every dropout 0, bos/eos/pad ids taken from the tokenizer.
    The same seed gives the same weights, and the global torch RNG is left as it was.
    For the vLLM engines, head_dim = hidden_size / num_heads must be one that vLLM's CPU attention supports
    (32, 64, 80, 96, 112, 128, ...; 16 fails at engine start): the defaults 128 / 4 = 32 do.
    """
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        attention_dropout=0.0,
        dtype="float32",
        **ids,
    )
    if model_cfg.architecture == "llama":
        config = LlamaConfig(num_key_value_heads=model_cfg.num_heads, tie_word_embeddings=True, **common)
        cls = LlamaForCausalLM
    elif model_cfg.architecture == "gpt_neox":
        config, cls = pythia_config(**common), GPTNeoXForCausalLM
    else:  # the config's Literal makes this unreachable; keep the error explicit for hand-built configs
        raise ValueError(f"model.architecture: unknown tiny architecture {model_cfg.architecture!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32).eval()


def pythia_config(**dims) -> GPTNeoXConfig:
    """A GPT-NeoX config with Pythia's choices where they differ from Llama: untied embed_in / embed_out, parallel
    residual, rotary on a quarter of each head, every dropout 0; `dims`: sizes, vocabulary and token ids."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PYTHIA_ROTARY_PCT}
    return GPTNeoXConfig(
        hidden_dropout=0.0,
        classifier_dropout=0.0,
        use_parallel_residual=True,
        rope_parameters=rope,
        tie_word_embeddings=False,
        **{"attention_dropout": 0.0, **dims},
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
