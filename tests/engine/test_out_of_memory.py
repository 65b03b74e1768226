"""Running out of memory: the engine says which setting decides its memory and stops for good, its
server process exits with the code that tells the launcher not to restart it, and the launcher stops the
run at once. A CUDA allocation cannot fail here; the host's allocator can (a real failed allocation),
and a CUDA one is `torch.OutOfMemoryError`, raised where a step would raise it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from slime_async.engine.core import Sequence
from slime_async.engine.launch import load_engine
from slime_async.engine.protocol import SamplingParams
from slime_async.launch.local import LocalLauncher, PartFailed
from slime_async.launch.process import start_process
from slime_async.train.worker import out_of_memory_message
from slime_async.types.oom import OUT_OF_MEMORY_EXIT, is_out_of_memory

CLI = Path(sys.executable).with_name("slime-async")


def test_what_counts_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as host:  # a real allocation the host refuses (8 TiB)
        torch.empty(2**43, dtype=torch.uint8)
    assert is_out_of_memory(host.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("out of memory"))


def test_a_step_out_of_memory_aborts_what_is_held_and_stops_the_engine(tiny_model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    engine = load_engine(tiny_model_dir, device="cpu", max_batch_size=4)
    told: list[str] = []
    engine.on_fatal = told.append

    def decode(*args: object, **kw: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine.decoder, "decode", decode)
    done = threading.Event()
    seqs = [Sequence(rid=str(i), prompt=[5, 6, 7], params=SamplingParams(max_new_tokens=8),
                     on_finish=lambda _s: done.set()) for i in range(3)]
    for seq in seqs:
        engine.submit(seq)
    engine._thread.join(timeout=60)  # the loop ends by itself
    assert not engine.alive and done.is_set()
    assert engine.fatal is not None and told == [engine.fatal]
    assert "engine: out of memory in a generation step on cpu" in engine.fatal
    assert "engine.max_batch_size 4" in engine.fatal and "OutOfMemoryError: CUDA out of memory" in engine.fatal
    for seq in seqs:
        assert seq.finish_reason is not None and seq.finish_reason["type"] == "abort"
        assert "lower engine.max_batch_size" in seq.finish_reason["message"]
    assert not engine.running and not engine.waiting


def test_an_engine_out_of_memory_at_start_exits_with_its_code_and_one_line() -> None:
    # a context of 2**40 positions: its rotary table is an allocation the host refuses
    done = subprocess.run([str(CLI), "serve", "--model", "tiny", "--device", "cpu", "--context-length", str(2**40),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == OUT_OF_MEMORY_EXIT, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: engine: out of memory while starting on cpu")
    assert "--max-batch-size 32" in done.stderr and f"--context-length {2**40}" in done.stderr


def test_the_launcher_stops_a_run_whose_part_ran_out_of_memory_without_restarts(tmp_path: Path,
                                                                                  varied_model_dir: Path) -> None:
    from slime_async.config import load_config, to_yaml

    cfg = load_config(None, [f"model.path={varied_model_dir}", "model.device=cpu", f"run.dir={tmp_path}",
                             "launch.max_restarts=3", "rollout.sampling.max_new_tokens=8"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    launcher = LocalLauncher(cfg, path, tmp_path / "run", with_trainer=False)
    launcher.start(on_event=lambda _m: None)
    try:
        part = launcher.part("rollout-0")
        part.child.stop()
        # in its place, a process that says what a part out of memory says, and exits with its code
        part.child = start_process("rollout-0", [sys.executable, "-c", (
            "import sys; print('READY', flush=True); "
            f"print('error: trainer: out of memory (...)', file=sys.stderr); sys.exit({OUT_OF_MEMORY_EXIT})")],
            r"(READY)", 30, tmp_path / "oom.log")
        part.child.proc.wait()
        with pytest.raises(PartFailed, match="rollout-0 ran out of memory: not restarted") as failed:
            launcher.check()
        assert part.restarts == 0 and "error: trainer: out of memory" in str(failed.value)
    finally:
        launcher.shutdown()
    assert all(not p.child.alive() for p in launcher.parts)


def test_the_trainers_message_names_the_settings_of_its_memory() -> None:
    from slime_async.config import load_config

    cfg = load_config(None, ["train.backend=megatron", "train.micro_batch_size=64", "model.device=cuda"])
    line = out_of_memory_message(cfg, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB\nmore"))
    assert line.startswith("trainer: out of memory (megatron backend, model tiny in float32 on cuda): lower "
                           "train.micro_batch_size (now 64) or train.max_seq_len (now 4096), set "
                           "train.megatron.recompute_activations, train adapters alone (train.lora), or leave "
                           "the trainer more of the device")
    assert line.endswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 9.27 GiB") and "\n" not in line
