"""`slime-async`: the command line. Each command parses its arguments and calls one part."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from slime_async.cli.app import app, clear_errors, config_app, console, err_console, fail
from slime_async.config import load_config, to_yaml

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file (see configs/).", show_default=False)]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Overrides as key.sub=value, e.g. rollout.group_size=4.", show_default=False),
]


def _load(config: Path, overrides: list[str] | None, model: bool = True):  # -> Config
    """The validated config: its envs built once here (`launch.preflight`: module, class, arguments,
    tools, rewards), before any process starts, and its model directory checked (made first if it is
    `tiny`)."""
    cfg = load_config(config, overrides or [])
    from slime_async.launch.preflight import check_envs

    check_envs(cfg)
    if model:
        from slime_async.config.model_dir import check_teacher, resolve_model_path

        student = resolve_model_path(cfg.model.path)
        if cfg.train.distill.model is not None:  # refused here, before any part starts
            check_teacher(student, cfg.train.distill.model)
    return cfg


@app.command()
@clear_errors
def train(
    config: ConfigArg,
    overrides: OverridesArg = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in <run.dir>/<run.name>.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Delete that run directory first.")] = False,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="[ADDRESS]",
        help="Run every part as a Ray actor: on the cluster at ADDRESS (auto, ray://HOST:10001), or without "
             "one on launch.ray.address, a cluster this node belongs to, or a new local instance.",
    )] = None,
) -> None:
    """Train: buffer, engines, trainer and rollout workers as processes (or Ray actors), fully asynchronous."""
    from slime_async.launch.local import PartFailed
    from slime_async.launch.train_run import train as run_training

    cfg = _load(config, overrides)
    try:
        summary = run_training(cfg, resume=resume, overwrite=overwrite, console=console, ray=ray)
    except (PartFailed, RuntimeError) as exc:
        fail(str(exc))
    from slime_async.launch.train_run import summary_table

    console.print()
    console.print(summary_table(summary))
    run_dir = Path(summary["run_dir"])
    # only what this run wrote: samples.md needs log.sample_every, tensorboard/ log.tensorboard, and
    # metrics.jsonl a trainer step
    written = [name for name in ("summary.json", "metrics.jsonl", "eval.jsonl", "samples.md", "tensorboard/",
                                 "logs/") if (run_dir / name).exists()]
    console.print(f"run directory {run_dir} ({', '.join(written)})", soft_wrap=True)
    _report_guard(summary.get("guard") or [])


@app.command()
@clear_errors
def rollout(
    config: ConfigArg,
    overrides: OverridesArg = None,
    out: Annotated[Path, typer.Option(help="JSONL file the trajectories are appended to.")] = Path(
        "trajectories.jsonl"),
    groups: Annotated[int, typer.Option(help="Groups (tasks x rollout.group_size samples) to run.")] = 8,
    split: Annotated[str, typer.Option(help="Task split: train or eval.")] = "eval",
) -> None:
    """Generate trajectories only (no training): against engine.urls, or embedded engines it starts."""
    from slime_async.env import EnvLoadError
    from slime_async.launch.rollout_run import rollout_to_file

    cfg = _load(config, overrides)
    if split not in ("train", "eval"):
        fail(f"--split: got {split!r}; expected 'train' or 'eval'")
    if cfg.train.distilling:  # the teacher scores what the trainer is sent; nothing here trains
        console.print("note: train.distill is a training setting: `slime-async rollout` asks no teacher, and "
                      "its trajectories carry no teacher logprobs", highlight=False)
    if groups < 1:
        fail(f"--groups: got {groups}; expected at least 1")
    from slime_async.config.model_dir import resolve_model_path

    try:
        stats = rollout_to_file(cfg, resolve_model_path(cfg.model.path), out, groups, split, console)
    except EnvLoadError as exc:
        fail(str(exc))
    console.print(f"wrote {stats.sent} trajectories to {out}; dropped {dict(stats.dropped) or 'none'}")
    _report_guard([v.as_dict() for v in stats.verdicts])


def _report_guard(verdicts: list[dict[str, str]]) -> None:
    """The guard's verdicts, one line each; exit code 1 when one stopped the run."""
    from rich.markup import escape

    for v in verdicts:
        first = f"; first error: {v['first_error']}" if v["first_error"] else ""
        colour = "red" if v["action"] == "stop" else "yellow"
        label = "stopped" if v["action"] == "stop" else "warning"
        err_console.print(f"[bold {colour}]{label}:[/] {escape(v['reason'] + first)}", highlight=False, soft_wrap=True)
    if any(v["action"] == "stop" for v in verdicts):
        raise typer.Exit(1)


@app.command()
@clear_errors
def serve(
    model: Annotated[str, typer.Option(help="HF model directory, or `tiny`.")] = "tiny",
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (printed).")] = 30000,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    max_batch_size: Annotated[int, typer.Option(help="Most sequences decoded together.")] = 32,
    context_length: Annotated[int | None, typer.Option(help="Longest sequence; default the model's.")] = None,
    seed: int = 0,
    admin_token: Annotated[str | None, typer.Option(
        help="Required off loopback for weight/pause endpoints. Other users see it in the process list: "
             "prefer --admin-token-file or $SLIME_ASYNC_ADMIN_TOKEN.")] = None,
    admin_token_file: Annotated[Path | None, typer.Option(help="A file holding the admin token.")] = None,
    weight_version: Annotated[str, typer.Option(
        help="Version reported until the first weight update (a non-number: clients refuse its tokens).")] = "0",
    cuda_graphs: Annotated[bool, typer.Option(
        help="On a CUDA device, replay the decode step as CUDA graphs (one per batch-size bucket).")] = True,
) -> None:
    """Start the embedded inference engine (SGLang's HTTP API) on one model."""
    from slime_async.config.model_dir import resolve_model_path
    from slime_async.config.schema import ADMIN_TOKEN_ENV
    from slime_async.config.schema import is_loopback_host as is_loopback
    from slime_async.engine.launch import load_engine
    from slime_async.engine.launch import serve as serve_engine

    if admin_token_file is not None:
        try:
            admin_token = admin_token_file.read_text().strip()
        except OSError as exc:
            fail(f"--admin-token-file: {exc}")
        if not admin_token:
            fail(f"--admin-token-file: {admin_token_file} is empty")
    admin_token = admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if not is_loopback(host) and not admin_token:
        fail(f"--host {host} is not loopback: give --admin-token so that the weight and pause endpoints are guarded")
    path = resolve_model_path(model, field="--model")
    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device: got {device!r}; expected one of 'auto', 'cpu', 'cuda'")
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype: got {dtype!r}; expected one of 'float32', 'bfloat16'")
    try:
        engine = load_engine(path, device=device, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
                             context_length=context_length, weight_version=weight_version, cuda_graphs=cuda_graphs)
        serve_engine(engine, str(path), host=host, port=port, admin_token=admin_token)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    except Exception as exc:
        from slime_async.types.oom import OUT_OF_MEMORY_EXIT, is_out_of_memory

        if not is_out_of_memory(exc):
            raise
        # at start-up: the weights, the first cache, the CUDA graphs (one per batch-size bucket)
        import torch

        where = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        context = f", --context-length {context_length}" if context_length else ""
        print(f"error: engine: out of memory while starting on {where} ({path}, --max-batch-size {max_batch_size}, "
              f"--dtype {dtype}{context}): lower engine.max_batch_size, use bfloat16, or leave the engine more of the "
              f"device; {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr,
              flush=True)
        raise SystemExit(OUT_OF_MEMORY_EXIT) from None


@app.command("init-model")
@clear_errors
def init_model(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.", show_default=False)],
    preset: Annotated[str, typer.Option(
        help="Model size: tiny (~3.4M), tiny-moe (Qwen3-MoE, 8 experts, top-2), small, 100m, 0.5b, 1.5b "
             "(the last two Qwen2.5's shapes).")] = "tiny",
    seed: int = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT_DIR if it exists.")] = False,
) -> None:
    """Make a tiny local model (BPE tokenizer, chat template with tools, random Qwen2 or Qwen3-MoE). No download."""
    from slime_async.models.tiny_model import PRESETS, make_model

    if preset not in PRESETS:
        fail(f"--preset: got {preset!r}; expected one of {', '.join(map(repr, PRESETS))}")
    start = time.perf_counter()
    with console.status(f"making the {preset} model in {out_dir} ..."):
        make_model(out_dir, PRESETS[preset], seed=seed, overwrite=force)
    made_s = time.perf_counter() - start
    summary = _describe_model(out_dir)
    table = Table(title=f"{out_dir} ({made_s:.1f} s)", show_header=False)
    for key, value in summary.items():
        table.add_row(key, str(value))
    console.print(table)


def _describe_model(path: Path) -> dict[str, Any]:
    """Load the directory back the way users will, and check that its chat template works."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from slime_async.config.model_dir import check_model_dir, load_tokenizer

    check_model_dir(path)
    tokenizer = load_tokenizer(path)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path))
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 + 3"}}}
            ],
        },
        {"role": "tool", "content": "5"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {
        "architecture": type(model).__name__,
        "parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "vocabulary": f"{len(tokenizer):,} tokens (embedding rows {model.config.vocab_size:,})",
        "size on disk": f"{size / 2**20:.1f} MiB",
        "tool-call prompt": f"{len(tokenizer(rendered, add_special_tokens=False)['input_ids'])} tokens",
        "loads with": "AutoTokenizer, AutoModelForCausalLM",
    }


@app.command()
@clear_errors
def bench(
    name: Annotated[str | None, typer.Argument(help="Benchmark to run.", show_default=False)] = None,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="key.sub=value overrides of the config a training benchmark runs (learning: configs/local.yaml).",
        show_default=False)] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the benchmarks.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="A shorter run (fewer repeats), for smoke tests.")] = False,
) -> None:
    """Run a benchmark: prints a table, writes benchmarks/results/NAME.json, ends with its headline.
    Overrides (`slime-async bench learning train.loss=sapo`) write NAME+key=value.json instead."""
    from benchmarks import REPO_DIR, available, config_of, run_benchmark

    names = available()
    if list_ or name is None:
        table = Table("benchmark", "what it measures")
        for bench_name, description in names.items():
            table.add_row(bench_name, description)
        console.print(table)
        return
    if name not in names:
        fail(f"unknown benchmark {name!r}; available: {', '.join(names)} (see `slime-async bench --list`)")
    if overrides:
        config = config_of(name)
        if config is None:
            fail(f"benchmark {name} takes no config overrides (those that do: "
                 f"{', '.join(n for n in names if config_of(n))})")
        load_config(REPO_DIR / config, overrides)  # a bad key fails here, in one line, before any run
    run_benchmark(name, quick=quick, console=console, overrides=overrides)


@app.command()
@clear_errors
def simulate(
    config: ConfigArg,
    overrides: OverridesArg = None,
    gpus_inference: Annotated[int | None, typer.Option(help="Engines (one GPU each; CPU: engines).")] = None,
    gpus_train: Annotated[int | None, typer.Option(help="Trainer GPUs (h200 only).")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default train.steps).")] = None,
    hardware: Annotated[str, typer.Option(help="cpu: this machine's measured costs; h200: scaled H200 costs.")] = "cpu",
    run: Annotated[Path | None, typer.Option(help="A runs/NAME directory whose episodes to replay.")] = None,
    tool_latency_s: Annotated[float, typer.Option(help="Median tool latency (lognormal), seconds.")] = 0.0,
    tool_p99: Annotated[float, typer.Option(help="Tool latency p99 / median.")] = 10.0,
) -> None:
    """Simulate a whole run on paper (docs/scaling.md): throughput, staleness, the first bottleneck."""
    from slime_async.sim.command import run_simulate

    cfg = load_config(config, overrides or [])
    try:
        run_simulate(cfg, console, hardware=hardware, gpus_inference=gpus_inference, gpus_train=gpus_train,
                     steps=steps, run_dir=run, tool_latency_s=tool_latency_s, tool_p99=tool_p99)
    except (ValueError, FileNotFoundError) as exc:
        fail(f"simulate: {exc}")


@config_app.command("show")
@clear_errors
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the resolved config (file + overrides + defaults) as YAML, once its envs are checked."""
    cfg = _load(config, overrides, model=False)
    sys.stdout.write(to_yaml(cfg))


@config_app.command("memory")
@clear_errors
def config_memory(
    config: ConfigArg,
    overrides: OverridesArg = None,
    gpu_gb: Annotated[float | None, typer.Option(
        "--gpu-gb", help="The GPU's memory in GB (1e9 bytes); default this machine's first GPU's, else 80.")] = None,
) -> None:
    """What each part holds in GPU memory with this config on one GPU, and whether it fits (exit 1 if not)."""
    from slime_async.launch.memory_plan import gpu_total_bytes, plan_for, rows

    cfg = _load(config, overrides)
    gpu = gpu_gb * 1e9 if gpu_gb is not None else gpu_total_bytes() or 80e9
    p = plan_for(cfg, gpu)
    table = Table("part", "item", "memory", title=f"{config} on one GPU of {gpu / 1e9:.1f} GB")
    for part, item, amount in rows(p):
        table.add_row(part, item, amount)
    console.print(table)
    console.print(p.verdict(), highlight=False, soft_wrap=True)
    if not p.fits:
        raise typer.Exit(1)


def main() -> None:
    sys.argv = optional_value(sys.argv, "--ray")
    # As `python -m` does (and so every part the launcher starts): modules in the current directory
    # import. A console script's own path is its bin directory instead.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    app()


def optional_value(argv: list[str], flag: str) -> list[str]:
    """Let `flag` stand alone (`train CONFIG --ray`) or take a value (`--ray ADDRESS`): alone means the
    next word is absent, another option, an override (`key=value`) or a YAML file."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == flag:
            following = out[i + 1] if i + 1 < len(out) else None
            if following is None or following.startswith("-") or "=" in following or following.endswith(
                    (".yaml", ".yml")):
                out[i] = f"{flag}="
    return out


@app.command()
@clear_errors
def keys(
    out_dir: Annotated[Path, typer.Argument(help="Directory for the key files.", show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace OUT_DIR's contents.")] = False,
) -> None:
    """Make CURVE keys for a non-loopback buffer endpoint (set buffer.curve_dir=OUT_DIR on every side)."""
    from slime_async.transport.security import generate_keys

    made = generate_keys(out_dir, overwrite=force)
    console.print(
        f"wrote CURVE keys to {made.dir}: server.key + server.key_secret (the buffer), "
        "clients/client.key + clients/client.key_secret (senders and the trainer)"
    )


# `dashboard` and `replay` live in their own module; importing it registers them on `app`
from slime_async.cli import dashboard_commands  # noqa: E402, F401
