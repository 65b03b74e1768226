"""The tiny local model: loads with transformers alone, renders tools, round-trips, deterministic."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_async.models.tiny_model import ADDED_TOKENS, PRESETS, SPECIAL_TOKENS, ModelSpec, make_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 2 + 3"}},
                "required": ["expression"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You solve arithmetic with the calculator."},
    {"role": "user", "content": "What is 12 * 34 + 5?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12 * 34 + 5"}}}
        ],
    },
    {"role": "tool", "content": "413", "name": "calculate"},
    {"role": "assistant", "content": "The answer is 413."},
    {"role": "user", "content": "And twice that? Use two calls."},
    {
        "role": "assistant",
        "content": "Computing.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "413 * 2"}}},
            {"type": "function", "function": {"name": "calculate", "arguments": '{"expression": "826 + 0"}'}},
        ],
    },
    {"role": "tool", "content": "826"},
    {"role": "tool", "content": "826"},
    {"role": "assistant", "content": "826 ✓ — done"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_loads_with_transformers_alone(tiny_model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 6_000_000  # "a few million"
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id[0] == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=True)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_chat_tokens_are_single_ids(tokenizer) -> None:
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        assert tokenizer.convert_ids_to_tokens(ids) == [token]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345", add_special_tokens=False)) == list("12345")


def test_template_renders_tools_calls_and_responses(tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou solve arithmetic with the calculator.\n# Tools\n<tools>\n")
    assert '{"name": "calculate", "description": "Evaluate an arithmetic expression."' in text
    assert ('<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": '
            '{"expression": "12 * 34 + 5"}}</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>413</tool_response><|im_end|>\n" in text
    # two calls in one turn; arguments given as a JSON string are passed through
    assert ('Computing.\n<tool_call>{"name": "calculate", "arguments": {"expression": "413 * 2"}}</tool_call>\n'
            '<tool_call>{"name": "calculate", "arguments": {"expression": "826 + 0"}}</tool_call><|im_end|>') in text
    # consecutive tool messages share one user turn
    assert "<|im_start|>user\n<tool_response>826</tool_response>\n<tool_response>826</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n826 ✓ — done<|im_end|>\n")
    with_prompt = tokenizer.apply_chat_template(
        CONVERSATION[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert with_prompt.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_rendering_round_trips_through_the_tokenizer(tiny_model_dir: Path, tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # the raw tokenizer.json (what sglang-router and SGLang read) gives the same ids
    assert Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(text).ids == ids


def test_rendering_is_append_only(tokenizer) -> None:
    """Each message boundary: the rendering of a conversation prefixes the rendering of its continuation."""
    boundaries = [2, 3, 4, 5, 6, 9, 10]  # after each complete message group (tool runs stay whole)
    renders = [tokenizer.apply_chat_template(CONVERSATION[:k], tools=TOOLS, tokenize=False) for k in boundaries]
    for shorter, longer in itertools.pairwise(renders):
        assert longer.startswith(shorter)
        ids_short = tokenizer.encode(shorter, add_special_tokens=False)
        ids_long = tokenizer.encode(longer, add_special_tokens=False)
        assert ids_long[: len(ids_short)] == ids_short


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = make_model(tmp_path / "again", PRESETS["tiny"], seed=0)
    assert _digest(again) == _digest(tiny_model_dir)
    other = make_model(tmp_path / "other", PRESETS["tiny"], seed=1)
    digest, base = _digest(other), _digest(tiny_model_dir)
    assert digest["model.safetensors"] != base["model.safetensors"]


def test_refuses_to_overwrite_without_asking(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        make_model(tmp_path, ModelSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64))
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_padded_vocabulary_for_real_shapes(tmp_path: Path) -> None:
    spec = ModelSpec(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=4096)
    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "m", spec))
    assert model.get_input_embeddings().weight.shape == (4096, 64)
