"""Checking that `model.path` names a usable model directory, before any part starts on it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slime_async.config.loader import ConfigError
from slime_async.moe.shape import is_moe, moe_shape

TINY = "tiny"
PRESET_PATHS = ("tiny", "tiny-moe")
"""`model.path` values that name a made-on-first-use preset model instead of a directory."""


def resolve_model_path(path: str, field: str = "model.path") -> Path:
    """The directory that `model.path` means: `tiny` (or `tiny-moe`) is the cached preset model (made on
    first use)."""
    if path in PRESET_PATHS:
        from slime_async.models.tiny_model import cached_model_dir

        return cached_model_dir(path, seed=0)
    return check_model_dir(path, field)


def check_model_dir(path: str | Path, field: str = "model.path") -> Path:
    """Return `path` if it holds a HF causal LM config and a tokenizer with a chat template.

    Raises ConfigError naming `field`, the directory and the fix otherwise.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(
            f"{field}: {p} does not exist; make a tiny model there with `slime-async init-model {p}` "
            f"or set {field} to a Hugging Face model directory"
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"{field}: {p} has no config.json, so it is not a Hugging Face model directory")
    check_experts(p, field)
    tokenizer = load_tokenizer(p, field)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{field}: the tokenizer in {p} has no chat template; add a chat_template.jinja that "
            "renders tools (Qwen/Hermes <tool_call> style), or use a chat model's directory"
        )
    return p


def check_experts(path: Path, field: str = "model.path") -> None:
    """A mixture-of-experts config every part can run (`slime_async.moe.shape`), or a ConfigError naming
    the config field that asks for more, before any part starts on it."""
    config = json.loads((path / "config.json").read_text())
    if not is_moe(SimpleNamespace(**config)):
        return
    from transformers import AutoConfig

    try:
        moe_shape(AutoConfig.from_pretrained(str(path)), field)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_tokenizer(path: str | Path, field: str = "model.path") -> Any:
    """Load the HF tokenizer of a model directory, turning failures into a ConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise ConfigError(f"{field}: cannot load a tokenizer from {path}: {reason}") from None


def check_teacher(student: str | Path, teacher: str | Path, field: str = "train.distill.model") -> Path:
    """The teacher's model directory, if its tokenizer is the student's: distillation compares the two
    models' logprobs of the same token ids, which mean the same text only under one tokenizer. A
    ConfigError (one line naming `field`) otherwise. `tiny` (a preset) means its cached directory, as
    for `model.path` and `slime-async serve`."""
    path = resolve_model_path(str(teacher), field)
    ours, theirs = load_tokenizer(student), load_tokenizer(path, field)
    a, b = ours.get_vocab(), theirs.get_vocab()
    if a != b or ours.all_special_tokens != theirs.all_special_tokens:
        differ = sum(1 for token, i in a.items() if b.get(token) != i) + sum(1 for token in b if token not in a)
        raise ConfigError(f"{field}: the teacher's tokenizer ({path}, {len(b)} tokens) is not the student's "
                          f"(model.path {student}, {len(a)} tokens; {differ} tokens differ): distillation "
                          "compares logprobs of the same token ids, so the teacher must share the student's tokenizer")
    return path
