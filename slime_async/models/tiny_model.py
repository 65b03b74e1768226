"""A small local model made from nothing: BPE tokenizer, chat template with tools, random Qwen2.

Nothing is downloaded. The tokenizer is trained with `tokenizers` on text generated here from a
seed (arithmetic, tool calls in the chat format, plain words), splits digits one by one (so
arithmetic is learnable by a tiny model) and falls back to bytes (so any text encodes). The model
is a randomly initialised `Qwen2ForCausalLM`. The directory loads with `AutoTokenizer` and
`AutoModelForCausalLM` alone, and the same seed gives the same files byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import msgspec

# Tokens the chat format needs as single ids. The first three are special (never produced by
# decoding plain text); the tool and think markers are ordinary added tokens, as in Qwen2.5, so
# that they survive `decode(..., skip_special_tokens=True)`.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (Path(__file__).with_name("chat_template.jinja")).read_text()


class ModelSpec(msgspec.Struct, kw_only=True, frozen=True):
    """Shape of the model and tokenizer that `make_model` writes."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    bpe_vocab_size: int = 1024
    """Size of the trained BPE vocabulary (bytes, merges and the chat tokens)."""
    vocab_size: int | None = None
    """Rows of the embedding matrix; None uses the tokenizer's size. Larger pads like real
    checkpoints do (Qwen2 pads to 151,936), for benchmarks that need the real shapes."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    num_experts: int = 0
    """Experts per layer; more than 0 makes a Qwen3-MoE model (every layer sparse, no shared expert)."""
    experts_per_token: int = 2
    """Top-k of the router (`num_experts_per_tok`)."""
    expert_intermediate_size: int = 0
    """Rows of each expert's gate/up projection (`moe_intermediate_size`)."""


PRESETS: dict[str, ModelSpec] = {
    # ~3.4M parameters: learns the calculator task in minutes on 2 CPU cores.
    "tiny": ModelSpec(),
    # ~7.5M parameters, Qwen3-MoE-shaped: 8 experts of 256, top-2 (the same active MLP width as tiny's
    # 768 would be 3 experts; 2 x 256 keeps a token's compute near tiny's): the MoE paths end to end.
    "tiny-moe": ModelSpec(num_experts=8, experts_per_token=2, expert_intermediate_size=256),
    "small": ModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    # ~100M parameters, Qwen2-like shapes: weight-update and throughput benchmarks on CPU.
    "100m": ModelSpec(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=2, intermediate_size=2816, vocab_size=32768
    ),
    # Qwen2-0.5B's shapes (random weights): GPU benchmarks.
    "0.5b": ModelSpec(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, vocab_size=151936
    ),
    # Qwen2.5-1.5B's shapes (random weights, tied embeddings as there): the larger shape of `bench e2e_gpu`.
    "1.5b": ModelSpec(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab_size=151936
    ),
}


def default_cache_dir() -> Path:
    """Where made models are kept: `$XDG_CACHE_HOME/slime_async` (default `~/.cache/slime_async`)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slime_async"


def cached_model_dir(preset: str = "tiny", seed: int = 0) -> Path:
    """The cache directory of a preset model, made on first use (safe with concurrent callers)."""
    out = default_cache_dir() / "models" / f"{preset}-seed{seed}"
    if not (out / "config.json").is_file():
        make_model(out, PRESETS[preset], seed=seed)
    return out


def make_model(out_dir: str | Path, spec: ModelSpec = PRESETS["tiny"], seed: int = 0, overwrite: bool = False,
               device: str = "cpu") -> Path:
    """Write tokenizer, chat template and random model to `out_dir`; return it. `device`: where the
    weights are initialised (`cuda` makes a 1.5B model in seconds rather than minutes; its random
    weights then differ from the CPU's of the same seed).

    Written to a temporary directory and renamed into place, so a reader never sees half a model
    and two processes making the same model do not collide (the second keeps the first's).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another directory or overwrite it")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one shard of a few MB: its progress bar is only noise
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = build_tokenizer(spec.bpe_vocab_size, seed)
        tokenizer.save_pretrained(tmp)
        _build_model(spec, tokenizer, seed, device).save_pretrained(tmp)
        if overwrite and out.exists():
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process made it meanwhile; same seed, same files
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build_tokenizer(bpe_vocab_size: int, seed: int):  # -> transformers.PreTrainedTokenizerFast
    """Train the byte-level BPE tokenizer on generated text and wrap it for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Qwen2's own pipeline (NFC, its split pattern, byte level), so that transformers' Qwen2
    # tokenizer class, the raw tokenizer.json (sglang-router reads it) and SGLang all agree.
    # Its pattern splits numbers into single digits, which a tiny model needs for arithmetic.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=PRESETS["tiny"].max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    return wrapped


def _build_model(spec: ModelSpec, tokenizer, seed: int, device: str = "cpu"):  # -> Qwen2 or Qwen3-MoE CausalLM
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    config_class, model_class, extra = Qwen2Config, Qwen2ForCausalLM, {}
    if spec.num_experts:
        config_class, model_class = Qwen3MoeConfig, Qwen3MoeForCausalLM
        extra = dict(
            num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.expert_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], head_dim=spec.hidden_size // spec.num_heads, rms_norm_eps=1e-6,
        )
    config = config_class(
        **extra,
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)  # every device's generator
        model = model_class(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
        bos_token_id=ids("<|endoftext|>"),
    )
    return model


# --- the generated training text of the tokenizer -------------------------------------------

_WORDS = (
    "the a an of to in is it that what how many much total each per and or if then result answer "
    "number numbers compute calculate expression value sum product difference tool call use please "
    "step first second next finally you we i have has had buy buys bought sell sold apple apples book "
    "books box boxes coin coins price cost costs pay paid gets got left more less than times plus "
    "minus divided by multiplied equals guess higher lower correct wrong search query document python "
    "function return def code test pass fail error true false none def print list dict question user "
    "assistant system think final is are was were with for on at from as be this"
).split()
_TOOL_NAMES = ("calculate", "search", "run_python", "guess", "lookup")


def corpus(seed: int, n: int = 6000) -> list[str]:
    """Deterministic text resembling what the tiny model will see: problems, tool calls, chat."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        kind = rng.random()
        a, b, c = (rng.randint(0, 999) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"{a} {op1} {b} {op2} {c}"
        if kind < 0.3:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
            lines.append(f"{words.capitalize()}? What is {expr}?")
        elif kind < 0.6:
            name = rng.choice(_TOOL_NAMES)
            args = json.dumps({"expression": expr} if name == "calculate" else {"query": rng.choice(_WORDS)})
            call = f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
            lines.append(f"<|im_start|>assistant\n{call}<|im_end|>\n")
        elif kind < 0.8:
            lines.append(f"<|im_start|>user\n<tool_response>{a * b - c}</tool_response><|im_end|>\n")
        else:
            schema = {
                "name": rng.choice(_TOOL_NAMES),
                "description": " ".join(rng.choice(_WORDS) for _ in range(6)),
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "the expression"}},
                    "required": ["expression"],
                },
            }
            lines.append(f"<|im_start|>system\n# Tools\n<tools>\n{json.dumps(schema)}\n</tools>\n<|im_end|>\n")
    return lines
