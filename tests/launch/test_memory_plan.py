"""The GPU memory plan (`launch.memory_plan`): its fixed parts against what the real backends and the
embedded engine allocate, its verdicts, `slime-async config memory`, and `train`'s refusal before anything
starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime_async.config import ConfigError, load_config
from slime_async.config.schema import LoraConfig
from slime_async.launch.memory_plan import check_fits, engine_share, model_shape_of, plan, trainer_share

REPO = Path(__file__).resolve().parents[2]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view of one counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def trainer_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's per-parameter tensors (its step counts are scalars
    and left out: they are not a parameter's bytes)."""
    out = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        out += [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
    return out


def step_on_zero_gradients(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step, so that AdamW makes its state (it does so lazily, at the first step)."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_the_shape_counts_every_parameter_the_model_has(preset: str, tiny_model_dir: Path,
                                                        tiny_moe_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir if preset == "tiny" else tiny_moe_dir
    shape = model_shape_of(path)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.vocab) == (model.config.num_hidden_layers, model.config.hidden_size,
                                                         model.get_input_embeddings().weight.shape[0])
    experts = getattr(model.config, "num_experts", 0)
    assert shape.mlp_width == (model.config.num_experts_per_tok * model.config.moe_intermediate_size if experts
                               else model.config.intermediate_size)


@pytest.mark.parametrize("variant", ["full", "lora", "kl"])
def test_the_torch_trainers_fixed_memory_is_what_its_backend_allocates(variant: str, tiny_model_dir: Path) -> None:
    from slime_async.train.torch_backend import TorchBackend

    lora = LoraConfig(rank=4) if variant == "lora" else None
    backend = TorchBackend(tiny_model_dir, device="cpu", lora=lora, reference=variant == "kl")
    step_on_zero_gradients(backend.model, backend.optimizer)
    tensors = trainer_tensors(backend.model, backend.optimizer)
    if backend.reference is not None:
        tensors += list(backend.reference.parameters())
    cfg = load_config(None, ["train.backend=torch", *(["train.lora={rank: 4}"] if lora else []),
                             *(["train.kl_coef=0.1"] if variant == "kl" else [])])
    share = trainer_share(cfg, model_shape_of(tiny_model_dir))
    assert sum(share.fixed.values()) == held_bytes(tensors)
    assert ("LoRA adapters" in share.fixed) == (variant == "lora")


def test_the_megatron_trainers_fixed_memory_is_what_its_backend_allocates(tiny_model_dir: Path) -> None:
    """float32 on CPU (bfloat16 needs a GPU): weights, gradients and AdamW's moments of the Megatron
    model, whose vocabulary is padded to `train.megatron.vocab_multiple`."""
    from slime_async.train.megatron.backend import MegatronBackend

    backend = MegatronBackend(tiny_model_dir, device="cpu")
    (inner,) = backend.optimizer._inner_optimizers() if hasattr(backend.optimizer, "_inner_optimizers") \
        else (backend.optimizer.optimizer,)
    step_on_zero_gradients(backend.model, inner)
    shape = model_shape_of(tiny_model_dir)
    assert backend.shape.padded_vocab_size > shape.vocab  # the padding is counted, not assumed away
    share = trainer_share(load_config(None, ["train.backend=megatron"]), shape)
    assert sum(share.fixed.values()) == held_bytes(trainer_tensors(backend.model, inner))


def test_the_engines_fixed_memory_is_what_the_embedded_engine_allocates(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from slime_async.engine.model import SlotModel

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    slots = SlotModel(model, 6, 96, initial_len=96)  # its cache at the ceiling: 6 slots x 96 positions
    cfg = load_config(None, ["engine.max_batch_size=6", "train.max_seq_len=96"])
    share = engine_share(cfg, model_shape_of(tiny_model_dir))
    (cache,) = share.up_to.values()
    assert cache == held_bytes(slots.k + slots.v)
    assert share.fixed["weights"] == held_bytes(list(model.parameters()))


def test_the_verdict_says_whether_the_run_fits_and_what_to_change(tiny_model_dir: Path) -> None:
    cfg_args = ["train.micro_batch_size=4", "train.max_seq_len=256", "engine.max_batch_size=8"]
    cfg = load_config(None, cfg_args)
    shape = model_shape_of(tiny_model_dir)
    fixed = plan(cfg, shape, 1e12).fixed
    per_token = plan(cfg, shape, 1e12).per_token

    roomy = plan(cfg, shape, fixed + per_token * 4 * 256 * 2)
    assert roomy.verdict().startswith("fits: ") and roomy.tokens_that_fit >= 4 * 256
    check_fits(roomy)
    tight = plan(cfg, shape, fixed + per_token * 100.5)
    assert tight.tokens_that_fit == 100
    assert "fits while a micro-batch stays under about 100 tokens" in tight.verdict()
    assert "lower train.micro_batch_size" in tight.verdict()
    check_fits(tight)  # it may fit: only a certain failure is refused
    full = plan(cfg, shape, fixed * 0.9)
    assert full.verdict().startswith("does not fit") and full.tokens_that_fit == 0
    with pytest.raises(ConfigError, match=r"GPU memory: does not fit.*engine.max_batch_size.*\(trainer .* GB, engine"):
        check_fits(full)
    # engines that give their memory back while the trainer computes leave it the room they held
    released = plan(load_config(None, [*cfg_args, "sync.release_memory=true"]), shape, fixed + per_token * 100.5)
    assert released.fixed == tight.fixed and released.tokens_that_fit > tight.tokens_that_fit
    assert released.tokens_that_fit == int((fixed + per_token * 100.5 - released.shares[0].held) // per_token)
    # the warm-start runs before the parts and gives its memory back: shown, never added
    warm = plan(load_config(None, ["warmstart.enabled=true"]), shape, 1e12)
    assert any(s.alone for s in warm.shares) and warm.fixed == plan(load_config(None, []), shape, 1e12).fixed


def test_attached_and_launched_servers_count_as_their_config_says(tiny_model_dir: Path) -> None:
    shape = model_shape_of(tiny_model_dir)
    attached = plan(load_config(None, ["engine.urls=[http://x:1]"]), shape, 80e9)
    assert [s.part for s in attached.shares] == ["trainer"]  # someone else's servers, on their own GPUs
    vllm_cfg = load_config(None, ["engine.kind=vllm", "sync.mode=disk", "vllm.args={gpu_memory_utilization: 0.25}"])
    vllm = plan(vllm_cfg, shape, 80e9)
    assert vllm.shares[1].held == pytest.approx(20e9)
    two = plan(load_config(None, ["engine.num_engines=2"]), shape, 80e9)
    assert [s.part for s in two.shares] == ["trainer", "engine 0", "engine 1"]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slime_async.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_config_memory_prints_each_part_and_exits_1_when_the_run_cannot_fit(tiny_model_dir: Path) -> None:
    ok = cli("config", "memory", "configs/e2e_gpu.yaml", f"model.path={tiny_model_dir}", "--gpu-gb", "80")
    assert ok.returncode == 0, ok.stderr
    assert "KV cache (128 slots x 4,096 positions)" in ok.stdout and "gradients, master weights, AdamW" in ok.stdout
    assert "fits: " in ok.stdout
    small = cli("config", "memory", "configs/e2e_gpu.yaml", f"model.path={tiny_model_dir}", "--gpu-gb", "0.5")
    assert small.returncode == 1 and "does not fit" in small.stdout


def test_train_refuses_a_run_that_cannot_fit_before_anything_starts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The GPU as `nvidia-smi` reports it (a 1 GiB one: a stand-in script, this machine has no GPU): the
    run stops with one line naming the settings, before its warm-start or any part (`model.device: cuda`,
    which a machine without a GPU would refuse only later, when the parts start)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 1024\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    run = cli("train", "configs/local.yaml", f"model.path={tiny_model_dir}", "model.device=cuda",
              f"run.dir={tmp_path / 'runs'}", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert "GPU memory: does not fit" in run.stderr and "engine.max_batch_size" in run.stderr
    assert "warm-start" not in run.stdout and not (tmp_path / "runs").exists()
