"""The config tree: every setting of a run, its type, its default and what it means.

This is the only place defaults live. Each section belongs to one part (docs/architecture.md); the part
reads its section and nothing else. Unknown keys are errors, so a typo never silently falls back
to a default.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

import msgspec

from slime_async.config.engine_kinds import engine_kind
from slime_async.config.sglang import SGLangConfig


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Beta = Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: keyword-only, unknown keys rejected."""


class RunConfig(_Section):
    name: str = "run"
    """Name of the run; the run directory is `dir/name`."""
    dir: str = "runs"
    """Parent directory of run directories (resolved config, metrics, checkpoints)."""
    seed: int = 0
    """Seed for tasks, sampling and initialisation; the same seed gives the same run on CPU."""
    python_path: list[str] = msgspec.field(default_factory=lambda: ["."])
    """Directories added to the import path of every process of the run before an env, agent or other
    function the config names (`module:name`) is imported, so that `env.name: my_env:MyEnv` finds
    `my_env.py` there. Relative ones are relative to the config file's directory (the default: that
    directory itself); they come after installed packages, so a module of yours cannot hide one. The
    current directory and PYTHONPATH work too."""


class ModelConfig(_Section):
    path: str = "tiny"
    """A Hugging Face model directory, or `tiny` for the local tiny model (`slime-async init-model`),
    made on first use under the cache directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` picks cuda when a GPU is present, else cpu."""


class SamplingConfig(_Section):
    """SGLang's sampling parameters, with SGLang's names."""

    temperature: NonNegativeFloat = 1.0
    top_p: Probability = 1.0
    top_k: int = -1
    """-1 disables top-k, as in SGLang."""
    max_new_tokens: PositiveInt = 128
    """Per model call (per turn)."""


class RouterConfig(_Section):
    """`sglang-router launch` in front of the engines: rollout workers send every request to it, the
    trainer still pushes weights to each engine itself."""

    enabled: bool = False
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the router; 0 picks a free one."""
    args: dict[str, Any] = {}
    """Other `sglang-router launch` options by their long name without dashes, e.g.
    `{health_check_interval_secs: 2}`; `true` passes a bare switch."""


ADMIN_TOKEN_ENV = "SLIME_ASYNC_ADMIN_TOKEN"
"""How the launcher hands `engine.admin_token` to an embedded engine: the environment, which only
its own user can read (`/proc/PID/environ`), not the command line, which every user can."""


class EngineConfig(_Section):
    kind: Literal["embedded", "sglang", "vllm"] = "embedded"
    """`embedded`: slime_async's own server speaking SGLang's API (CPU or one GPU).
    `sglang`: real SGLang servers, launched or attached through `urls`.
    `vllm`: real vLLM servers (`vllm:` section; `make vllm` installs it), launched or attached."""
    urls: list[str] = []
    """Attach to servers already running at these URLs instead of launching any."""
    num_engines: PositiveInt = 1
    host: str = "127.0.0.1"
    """Bind address; anything but loopback requires `admin_token`."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the first engine; engine i listens on port + i. 0 (the default) picks free ports, so
    that runs side by side on one machine never collide."""
    max_batch_size: PositiveInt = 32
    """Most sequences decoded together (continuous batching)."""
    admin_token: str | None = None
    """Token required by weight-update, pause and flush endpoints off loopback."""
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    """sglang-router in front of the engines (either kind)."""


class VLLMConfig(_Section):
    """vLLM servers for `engine.kind: vllm` (vLLM >= 0.32, CPU or GPU build)."""

    python: str | None = None
    """The interpreter of vLLM's own virtualenv. None: `$SLIME_ASYNC_VLLM_PYTHON`, else
    `.venv-vllm/bin/python` of the current directory (what `make vllm` makes)."""
    args: dict[str, Any] = {}
    """vLLM's own server arguments by their long name without dashes (`max_model_len: 1024`,
    `gpu_memory_utilization: 0.05`; `true` passes a bare switch). The launcher checks them with the
    installed vLLM's own parser before starting it. It sets the model, host, port, seed, dtype,
    `max_num_seqs` (engine.max_batch_size), `enable_scale_out` and `logprobs_mode` itself."""


class EnvConfig(_Section):
    name: str = "envs.calculator:CalculatorEnv"
    """The environment class, as `module:Class`."""
    args: dict[str, Any] = {}
    """Keyword arguments for the environment (task generation, limits)."""


class DatasetConfig(_Section):
    """Where tasks come from and which keys of a row hold what (slime's row format:
    `{"prompt": text or chat messages, "label": ..., "metadata": {...}}`)."""

    source: Literal["env", "jsonl", "hf"] = "env"
    """`env`: the environment generates its own tasks (its `tasks(split)`); `jsonl`: a JSON-lines
    file at `path`; `hf`: a Hugging Face `datasets` dataset at `path` (a `save_to_disk` directory,
    a .jsonl/.json/.parquet/.csv file, or a hub name where the network allows)."""
    path: str | None = None
    """The file, directory or hub name; required unless `source` is `env`."""
    split: str = "train"
    """The split: of an HF dataset, or (`source: env`) the env's own `train`/`eval`."""
    input_key: str = "prompt"
    """Key of the prompt (slime's --input-key): text, or a list of `{role, content}` messages."""
    label_key: str | None = "label"
    """Key of the label (slime's --label-key), the verifier's reference; null: rows have none."""
    metadata_key: str | None = "metadata"
    """Key of a dict of extra fields for the env (slime's --metadata-key)."""
    id_key: str | None = None
    """Key of a stable task id; null: `NAME:ROW_INDEX`."""
    env_key: str | None = None
    """Key naming each row's environment, one of `data.envs` (one run mixing environments)."""

    def __post_init__(self) -> None:
        if self.source != "env" and not self.path:
            raise ValueError(f"path is required when source is {self.source!r}")


class EvalSuiteConfig(DatasetConfig, kw_only=True):
    """One named evaluation dataset with its own environment, sampling and metrics."""

    name: str
    """Name in metrics (`eval/NAME/pass@1`)."""
    env: EnvConfig | None = None
    """The environment that scores it; null: the run's `env`."""
    n_samples: PositiveInt = 1
    """Samples per task; pass@k needs n_samples >= k."""
    sampling: SamplingConfig | None = None
    """Sampling of the suite; null: greedy (temperature 0) with the rollout's max_new_tokens."""
    pass_k: list[PositiveInt] = msgspec.field(default_factory=lambda: [1])
    """The k of pass@k to report (unbiased estimator over the n samples)."""
    max_tasks: PositiveInt | None = None
    """Evaluate only the first this many tasks; null: all."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(k > self.n_samples for k in self.pass_k):
            raise ValueError(f"eval suite {self.name!r}: pass_k {self.pass_k} needs n_samples >= {max(self.pass_k)}")


class DataConfig(DatasetConfig, kw_only=True):
    """The training tasks (the fields of DatasetConfig), their order and the evaluation suites.
    The default, `source: env`, takes the tasks from the environment, as before this section existed."""

    shuffle: bool = True
    """Shuffle each epoch (rows from a file or dataset; an env's own tasks keep the env's order)."""
    seed: int | None = None
    """Seed of the shuffle; null: `run.seed`. Epoch e's order depends only on (seed, e)."""
    epochs: PositiveInt | None = None
    """Passes over the data; null: for ever (the run stops at `train.steps`)."""
    on_bad_row: Literal["skip", "raise"] = "skip"
    """A row that does not parse or lacks a key: skipped and counted (its file and line logged), or
    raised, stopping the run."""
    max_skipped: NonNegativeInt | None = None
    """Stop the run when more rows than this were skipped; null: no bound."""
    envs: dict[str, EnvConfig] = {}
    """Named environments that rows choose by `env_key`; rows naming another are bad rows."""
    default_env: str | None = None
    """The name in `envs` of rows without an env key value; null: such rows are bad."""
    eval: list[EvalSuiteConfig] = []
    """Evaluation suites."""
    eval_every: NonNegativeInt = 0
    """Run the suites every this many optimizer steps; 0: never during training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.env_key is not None and not self.envs:
            raise ValueError("env_key is set but envs is empty: name the environments rows may choose")
        if self.default_env is not None and self.default_env not in self.envs:
            raise ValueError(f"default_env {self.default_env!r} is not one of envs ({sorted(self.envs)})")
        names = [suite.name for suite in self.eval]
        if len(set(names)) != len(names):
            raise ValueError(f"eval suite names must be unique, got {names}")


GuardAction = Literal["stop", "warn", "off"]


class GuardConfig(_Section):
    """What the rollout watches for in a run that cannot learn, and what it does then: `stop` ends the
    run with the reason and the first error message (exit code 1, after the summary), `warn` says so in
    the live view and the summary and goes on, `off` does neither. Error counts per name (each reward,
    metric, tool, group reward; env and server errors) are shown either way."""

    on_failures: GuardAction = "stop"
    """When more than `max_failed_fraction` of the latest `window` episodes failed: ended in
    `env_error` (its setup, `on_reply` or agent raised) or had a reward or group reward raise (and
    score its `on_error`). Server errors are not counted: a dead engine is the launcher's to restart."""
    max_failed_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    """The share of failed episodes above which `on_failures` acts."""
    window: PositiveInt = 64
    """Episodes over which the failed share is measured (the rule waits until it has seen this many)."""
    on_no_signal: GuardAction = "warn"
    """When the groups of `no_signal_steps` steps in a row (`rollout.batch_size` trajectories each) all
    had equal rewards within each group: GRPO's advantages are then 0, so loss and gradient are 0
    (or, with `filter_equal_rewards`, every group is dropped and the trainer waits). Typical of a
    model that never succeeds (no warm-start) or always does. `warn` by default: a run may start
    there and get out (a sampled success now and then)."""
    no_signal_steps: PositiveInt = 10
    """Steps' worth of groups without a learning signal, in a row, before `on_no_signal` acts."""


class RolloutConfig(_Section):
    group_size: PositiveInt = 8
    """Samples per task (GRPO's n)."""
    batch_size: PositiveInt = 64
    """Trajectories per optimizer step (B in the staleness rule)."""
    max_staleness: NonNegativeInt = 2
    """Bound eta: a trajectory's tokens are at most this many versions older than the trainer.
    0 is synchronous on-policy."""
    max_concurrency: PositiveInt = 256
    """Most episodes in flight (split evenly over the rollout workers); with `adaptive_concurrency`,
    the ceiling of the adaptive limit."""
    adaptive_concurrency: bool = False
    """Size the episodes in flight from the engines' own load instead (SGLang's `/v1/loads`, vLLM's
    `/metrics`: requests running and waiting): grow while no request waits for a batch slot, shrink
    while a queue builds (`slime_async/rollout/concurrency.py` has the rule). The engines stay saturated
    without a hand-set number, and requests do not queue inside them (longer turns, staler tokens)."""
    num_workers: PositiveInt = 1
    """Rollout worker processes (one asyncio loop each)."""
    partial_mode: Literal["in_place", "abort"] | None = None
    """At a weight update, in-flight requests continue on the new weights (`in_place`) or are
    aborted and resumed with their partial output (`abort`: the engine's cached prefixes are then
    flushed before it resumes). None: `abort` with SGLang engines, whose radix cache would otherwise
    serve prefixes computed by earlier weights (see `config/engine_kinds.py`), `in_place` with the
    others."""
    filter_equal_rewards: bool = True
    """Drop groups whose rewards are all equal (no learning signal), counted (DAPO-style)."""
    group_filter: str | None = None
    """Your own group filter, `module:function` (slime's `--dynamic-sampling-filter-path`): called
    with each finished group's trajectories (rewards and group rewards set) before it is sent; True
    keeps the group, False or a reason (a string) drops it, counted as `filtered` (the first reason is
    logged). One that raises drops the group as `filter_error`, counted with its first message."""
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)
    """Stop (or warn about) a run whose episodes mostly fail or whose groups carry no learning signal."""


class BufferConfig(_Section):
    policy: Literal["fifo", "freshest"] = "fifo"
    """Which ready groups the trainer gets first (a custom function is passed in code, not named here)."""
    endpoint: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint of the buffer server; port 0 picks a free port. Off loopback needs CURVE."""
    group_timeout_s: PositiveFloat | None = None
    """Release an incomplete group after this long as a smaller group (counted); None waits."""
    curve_dir: str | None = None
    """Key directory made by `slime-async keys DIR`; required when `endpoint` is not loopback."""
    capacity: PositiveInt = 4096
    """Most trajectories held (pending + ready) before the buffer stops granting credits: senders
    then wait, they never drop."""
    sender_credits: PositiveInt = 64
    """Trajectories one sender may have in flight (sent, not yet acked) while there is room."""
    max_frame_bytes: PositiveInt = 64 * 2**20
    """Largest trajectory frame accepted; a larger one is rejected (counted, sender told)."""
    heartbeat_s: PositiveFloat = 1.0
    """Seconds between a sender's pings."""
    heartbeat_timeout_s: PositiveFloat = 5.0
    """Silence after which a peer counts as dead: the server forgets a sender, a sender reconnects
    and resends everything unacked."""
    wal_dir: str | None = "buffer-wal"
    """Directory of the write-ahead log; relative paths are under the run directory (`run.dir/run.name`).
    None keeps no log (a restarted buffer starts empty): for benchmarks, never for training."""
    wal_fsync: bool = False
    """fsync the log before each ack (one fsync per server step, covering every trajectory of the step:
    group commit). Without it, acked trajectories survive the death of the buffer
    process (the OS has them) but not a power cut or kernel crash; with it, both, at a cost in speed."""
    compact_every: PositiveInt = 4096
    """Rewrite the log without trained trajectories after this many have been trained, once at most
    a quarter of the log is still live (so a lagging trainer does not make it rewrite all it holds)."""


class MegatronConfig(_Section):
    """Parallelism and kernels of the `megatron` trainer backend (ignored by `torch`).

    Every process of the trainer runs the same calls (SPMD): world size = tensor_parallel x
    pipeline_parallel x data_parallel. The processes and their `torch.distributed` environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) come from the launcher; a lone process
    makes a world of one itself."""

    tensor_parallel: PositiveInt = 1
    """Tensor-parallel size: attention heads, MLP columns and the vocabulary are split this many ways.
    Must divide the attention heads and, unless smaller than it, the key/value heads."""
    pipeline_parallel: PositiveInt = 1
    """Pipeline-parallel size: layers are split into this many stages (needs a GPU; must divide the
    number of layers)."""
    data_parallel: PositiveInt | None = None
    """Data-parallel size; None: world size / (tensor_parallel x pipeline_parallel). Rows of a batch
    are spread over data-parallel ranks; gradients are summed across them."""
    expert_parallel: PositiveInt = 1
    """Expert-parallel size for MoE models: the experts of each layer are split over this many of the
    tensor x data-parallel ranks (tokens travel to their experts by all-to-all; experts are never split
    by tensor parallelism). Must divide the number of experts and tensor_parallel x data-parallel size."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer; GPU only)."""
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention: `sdpa` is torch's scaled_dot_product_attention (flash kernels on GPU); `local`
    Megatron's unfused attention (GPU only, for comparison); `te` Transformer Engine's layers (when
    installed); `auto` picks `te` when Transformer Engine is importable on a GPU, else `sdpa`."""
    vocab_multiple: PositiveInt = 128
    """The embedding and output rows are padded to a multiple of this x tensor_parallel; padded
    logits are masked out of every softmax, and padded rows never reach exported weights."""
    recompute_activations: bool = False
    """Recompute each layer's activations in the backward pass (less memory, ~1/3 more compute; GPU only)."""
    fused_logprobs: bool = True
    """On a GPU without tensor parallelism: the token logprobs from the logits as one compiled kernel
    each way (`torch.compile`), reading the bf16 logits instead of a float32 copy kept for the backward
    pass (the LM head's output over a 152k vocabulary is the largest tensor of a step)."""
    wgrad_fusion: bool = True
    """On a GPU: linear layers accumulate their weight gradients straight into the float32 gradient
    buffers (Megatron's gradient-accumulation fusion, one GEMM per weight; `megatron/wgrad_fusion.py`),
    instead of a bf16 gradient that is then added to them."""
    moe_grouped_gemm: bool = True
    """MoE models: each layer's experts as grouped matrix products over stacked weights (two
    `torch._grouped_mm` per layer, whatever the number of experts; `megatron/grouped_experts.py`), where
    False runs Megatron's `SequentialMLP`, a Python loop over the experts (for comparison). Same weights,
    names and values either way; the optimizer state is laid out differently, so a checkpoint resumes
    only with the setting it was saved with (the other is refused, naming this field)."""
    moe_local_dispatch: bool = True
    """MoE models with `expert_parallel: 1` and grouped experts: tokens reach their experts by one sort
    on the device and come back by its inverse (`megatron/local_dispatch.py`), where False runs Megatron's
    all-to-all dispatcher, which makes the host wait for the GPU in every MoE layer (for comparison).
    Same results up to summation order; no state, so checkpoints resume under either setting."""


class MoeConfig(_Section):
    """Mixture-of-experts training (ignored for dense models)."""

    routing_replay: bool = True
    """Record the experts the engine chose for each token and have the trainer's forward passes use
    them (its logprob recompute and its training step; the router still learns through the chosen
    experts' weights). Without it, experts that the engine and the trainer choose differently for the
    same token make importance ratios swing. Engines must report routing (the embedded engine does;
    SGLang needs `--enable-return-routed-experts`, set for you when it is launched here)."""
    aux_loss_coef: NonNegativeFloat | None = None
    """Weight of the load-balancing loss (Switch Transformer's, summed over the layers); None: the
    checkpoint's `router_aux_loss_coef`. Logged as `moe/aux_loss` (mean over layers; 1.0 is balanced)."""
    z_loss_coef: NonNegativeFloat = 0.0
    """Weight of the router z-loss (mean squared logsumexp of the router logits, summed over the
    layers). Logged as `moe/z_loss` (mean over layers)."""


class DistillConfig(_Section):
    """On-policy distillation: a teacher model scores every token the student sampled, and the loss
    pulls the student towards it with a per-token reverse KL (`slime_async.rollout.teacher` scores,
    `slime_async.train.objective` trains). Off while `model` is null."""

    model: str | None = None
    """The teacher's Hugging Face model directory (its own checkpoint, any size). Its tokenizer must be
    the student's (`model.path`): the run is refused before start otherwise. Without `urls` the launcher
    starts an embedded engine on it beside the student's engines."""
    urls: list[str] = []
    """Attach to teacher servers already running here (any SGLang-API server serving `model`) instead
    of starting one."""
    coef: NonNegativeFloat = 1.0
    """Weight of the reverse-KL term: each scored token's advantage gets `-coef * (log p_student -
    log p_teacher)` of the sampled token (the sampler's logprob; the per-token policy gradient of
    KL(student || teacher), as in on-policy distillation by Agarwal et al. 2024 and Thinking Machines)."""
    task_reward: bool = True
    """Whether the env's reward trains too (GRPO's advantages plus the KL term). False: pure
    distillation, the reward is only measured."""
    timeout_s: PositiveFloat = 10.0
    """Per scoring request. A teacher that is slower, or down, never stalls the rollout or the trainer:
    each of a group's requests waits at most `(retries + 1) x timeout_s` (plus backoff; and, before it
    is sent, for one of the worker's `max_in_flight` request slots), then the group goes to the buffer
    unscored (counted as `teacher_unavailable`) and trains without the KL term; a teacher marked down is
    not waited for at all. Needs `rollout.sampling` at temperature 1 without top_p or top_k: the
    teacher's logprobs are plain log-softmax."""
    retries: NonNegativeInt = 2
    """Extra attempts of a failed scoring request (with backoff, failing over between `urls`)."""
    max_batch: PositiveInt = 16
    """Most sequences in one scoring request (a group's trajectories go together)."""
    max_in_flight: PositiveInt = 4
    """Most scoring requests a rollout worker has outstanding at once."""


class LoraConfig(_Section):
    """LoRA (`slime_async.train.lora`): low-rank adapters on the named linear layers train, everything
    else is frozen; checkpoints hold only the adapters (peft's format). The engines get the merged
    weights of the adapted layers (`W + alpha / rank * B A`), or, where they load adapters themselves
    (vLLM), the adapters (`sync.adapters`). Torch and megatron backends (megatron: dense models, one
    pipeline stage; `slime_async.train.megatron.lora` says what else)."""

    rank: PositiveInt = 8
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: PositiveFloat = 16.0
    """Scale numerator: the update is alpha / rank * B A."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Attribute names of the `nn.Linear` layers to adapt (every attention and MLP projection of a
    Qwen2/Llama model by default)."""


class TrainConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    """`torch`: a transformers model on CPU or one GPU. `megatron`: Megatron-core's GPT model with
    tensor/pipeline/data parallelism (`train.megatron`), converted exactly from and to the HF model."""
    steps: PositiveInt = 200
    """Optimizer steps to run."""
    time_limit_s: PositiveFloat | None = None
    """Stop training after this many seconds (from the trainer's start), as if `steps` were reached
    (a final checkpoint, the run summary); null: no limit. For budgets such as "8 minutes of RL"."""
    lr: PositiveFloat = 1e-4
    lr_warmup_steps: NonNegativeInt = 0
    """Optimizer steps of linear learning-rate warm-up from lr/lr_warmup_steps to lr (0: none)."""
    loss: Literal["grpo", "dr_grpo", "gspo", "cispo", "sapo", "ppo", "decoupled_ppo"] = "decoupled_ppo"
    """The recipe: policy loss, advantage estimator and aggregation together (`train.objective`
    lists each recipe's defaults). `decoupled_ppo` clips against the proximal policy and weights each
    token by proximal/behaviour (capped); `ppo` has no behaviour correction. `sapo` (Qwen's Soft
    Adaptive Policy Optimization) replaces the clip by a smooth gate on the ratio (`sapo_tau_pos`,
    `sapo_tau_neg`), with the same behaviour correction as `decoupled_ppo`. A clip or a gate acts only
    where the ratio leaves 1: with one optimizer step per batch the ratio to the proximal policy is
    exactly 1, so they act with `steps_per_batch` > 1 or `proximal: behaviour` (the ratio to the
    sampler's logprobs, up to `rollout.max_staleness` versions old)."""
    advantage: Literal["grpo", "grpo_no_std", "dr_grpo", "reinforce_pp"] | None = None
    """Override the recipe's advantage estimator: group-normalised with std (`grpo`), without std
    (`grpo_no_std`, same as `dr_grpo`), or REINFORCE++ with a group-mean baseline and batch whitening."""
    advantage_fn: str | None = None
    """Your own advantage estimator, `module:function` (slime's `--custom-advantage-function-path`),
    replacing `advantage`: `fn(rewards [N], group_index [N], mask [N, T]) -> [N] or [N, T]` (float
    tensors; a value per sequence is spread over its trained tokens). Once per batch, on the CPU."""
    policy_loss_fn: str | None = None
    """Your own policy loss, `module:function` (slime's `--custom-loss-function-path`), replacing the
    recipe's PPO/GSPO/CISPO/SAPO term: `fn(logp, prox, advantages, mask, clip_low, clip_high) -> [N, T]`
    per-token loss (or an object with `.loss` and `.clipped`), on the trainer's device and differentiable
    in `logp`; the behaviour correction, aggregation, KL and entropy terms apply to it as to the recipe's."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "group_mean"] | None = None
    """Override the recipe's loss aggregation. `seq_mean_token_sum_norm` is Dr.GRPO's length-unbiased
    form (token sums divided by `aggregation_norm`)."""
    aggregation_norm: PositiveInt | None = None
    """Constant divisor of `seq_mean_token_sum_norm`; None uses `max_seq_len`."""
    clip_low: PositiveFloat | None = None
    """Ratio clip below 1: ratios under 1 - clip_low are clipped. None: the recipe's (0.2; GSPO 3e-4)."""
    clip_high: PositiveFloat | None = None
    """Ratio clip above 1 (clip-higher when larger than clip_low). None: the recipe's (0.2; GSPO 4e-4;
    CISPO 5.0, its only bound)."""
    dual_clip: Annotated[float, msgspec.Meta(gt=1.0)] | None = None
    """Dual-clip constant c > 1: the loss of a negative-advantage token is at most -c * A. None disables."""
    sapo_tau_pos: PositiveFloat = 1.0
    """`sapo`'s gate temperature on tokens with a positive advantage: the gate weighs a token's gradient
    1 at ratio 1 and 1/2 where the ratio is 1.76 / tau away from 1 (the paper's default 1.0: at 2.76).
    Larger: a narrower trust region. Only `sapo` reads it."""
    sapo_tau_neg: PositiveFloat = 1.05
    """`sapo`'s gate temperature on tokens with a zero or negative advantage; the paper keeps it above
    `sapo_tau_pos` (1.05), so that negative updates, which spread over the vocabulary, fade sooner.
    Only `sapo` reads it."""
    proximal: Literal["recompute", "behaviour"] = "recompute"
    """Proximal logprobs (the PPO anchor): the trainer's own before the step, or the engine's
    behaviour logprobs taken as they are (then the behaviour correction is 1). `recompute` with one
    step per batch takes them from the training forward (no extra pass); with `steps_per_batch` > 1,
    `outlier_mask` or `kl_in: reward` it runs a forward pass before the step."""
    behaviour_correction: Literal["none", "token", "sequence"] = "token"
    """Truncated importance weight proximal/behaviour per token, or per sequence (exp of the summed
    log-ratio), capped at `behaviour_cap`. Ignored by `ppo`."""
    behaviour_cap: PositiveFloat = 2.0
    """Cap of the proximal/behaviour weight."""
    outlier_mask: Literal["none", "token", "sequence"] = "none"
    """Mask tokens (or whole sequences) whose proximal/behaviour ratio leaves
    [outlier_low, outlier_high]."""
    outlier_low: PositiveFloat = 0.5
    outlier_high: PositiveFloat = 2.0
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the reference (initial) model; 0 loads no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators of KL(policy || reference) from sampled tokens."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Add the KL penalty to the loss, or subtract it from the rewards (per-token reward-to-go)."""
    positive_nll_coef: NonNegativeFloat = 0.0
    """Weight of a negative log-likelihood term on the sequences rewarded above their group's mean
    (VAPO's positive-example LM loss; token mean over those sequences). 0: none."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    steps_per_batch: PositiveInt = 1
    """Optimizer steps on each batch; each step after the first adds one version of staleness."""
    micro_batch_size: PositiveInt = 16
    """Sequences per forward/backward; gradients accumulate over the batch."""
    max_seq_len: PositiveInt = 4096
    """Longest sequence (all turns, prompt and completion tokens) the trainer takes."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """A longer trajectory is cut to `max_seq_len` or skipped; either is counted."""
    mask_truncated: bool = False
    """Train no token of an episode that ran out of tokens (stop reason `truncated` or `max_tokens`:
    its reply never ended); its reward still counts in its group's baseline. DAPO's overlong
    filtering (AReaL: `mask_no_eos_with_zero`): long cut-off replies then cannot dominate a
    token-mean loss with negative advantages, a path to collapse into ever longer replies. A batch
    in which every reply was cut off trains as without this (else nothing would train, the version
    would not move and the staleness bound would stall the rollout); counted as `unmasked_truncated`."""
    grad_clip: NonNegativeFloat = 1.0
    """Max gradient norm; 0 disables clipping."""
    weight_decay: NonNegativeFloat = 0.0
    adam_betas: tuple[Beta, Beta] = (0.9, 0.999)
    adam_eps: PositiveFloat = 1e-8
    world_size: PositiveInt = 1
    """Trainer ranks (processes joined by torch.distributed, one GPU each under Ray). The torch
    backend trains on one rank; the megatron backend splits the ranks into its parallel groups.
    Rank 0 alone reads the buffer and publishes weights; it hands each batch to the others
    (`slime_async.train.ranks`). More than one needs `slime-async train --ray`."""
    batch_timeout_s: PositiveFloat = 5.0
    """How long one `get_batch` call waits before the loop checks engines and asks again."""
    control_timeout_s: PositiveFloat | None = None
    """With several ranks: how long a follower rank waits for rank 0's next message (a batch, a weight
    export, a stop decision) before it gives up with an error (rank 0 hung; a rank 0 that died is
    noticed at once). Must cover rank 0's longest lone stretch: a `get_batch` wait or one publish with
    all its retries. None: 300 s, or that worst case plus a minute when longer
    (`slime_async.train.ranks.control_timeout`)."""
    checkpoint_every: NonNegativeInt = 5
    """Save a checkpoint every this many steps; 0 only at the end. A step is *trained* for the
    buffer's books once a checkpoint holds it: a trainer that dies comes back from its latest
    checkpoint and trains the steps after it again, on the same batches, so a crash costs at most
    this many steps of compute and no data. The tiny model's checkpoint takes 20-40 ms (every 5 steps:
    under 1% of the run); raise it where a save takes seconds (a multi-GB model). With 0 a step
    counts as trained once applied (a crash then loses its data too)."""
    keep_checkpoints: PositiveInt = 2
    """Most recent checkpoints kept; older ones are deleted."""
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    """Settings of the `megatron` backend."""
    moe: MoeConfig = msgspec.field(default_factory=MoeConfig)
    """Mixture-of-experts models: routing replay and the router's losses."""
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off unless `distill.model` is set)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (`{}` for the defaults); null: full fine-tuning.
    Torch and megatron backends (megatron: dense models, one pipeline stage, `attention` not te)."""

    def __post_init__(self) -> None:
        if self.loss == "sapo" and self.policy_loss_fn is None:
            for name in ("clip_low", "clip_high", "dual_clip"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: the sapo recipe has no clip (its gate's width is sapo_tau_pos and "
                                     f"sapo_tau_neg); leave {name} out")

    @property
    def distilling(self) -> bool:
        return self.distill.model is not None


class SyncConfig(_Section):
    mode: Literal["tensor", "disk", "nccl"] = "tensor"
    """How weights reach the engines: serialized tensors over HTTP, safetensors on disk, or NCCL."""
    tensor_format: Literal["auto", "shared", "safetensors"] = "auto"
    """Tensor mode's payload. `shared`: SGLang's own format, tensor handles (CUDA IPC; shared memory for
    CPU tensors) that an engine on the same GPU or host maps and copies, with no bytes in the request
    (what a real SGLang server takes). `safetensors`: the bytes, base64 in the request (the embedded
    engine only; any host). `auto`: `shared` when the trainer's weights are on a GPU, else
    `safetensors`; an engine that cannot open the handles (another host) gets safetensors."""
    bucket_mb: PositiveFloat = 512
    """Largest single safetensors weight-update request (MB); a larger tensor goes alone."""
    retries: NonNegativeInt = 3
    """Extra attempts of a failed push to one engine (the whole push again, never a partial one)."""
    retry_backoff_s: NonNegativeFloat = 0.5
    """First wait between attempts; doubles each time."""
    timeout_s: PositiveFloat = 120.0
    """Per HTTP request."""
    disk_dir: str | None = None
    """Where disk mode writes `v<version>/model.safetensors` (a filesystem the engines share).
    None: `<run dir>/weights`."""
    give_up_after: NonNegativeInt = 0
    """Stop the trainer with an error once this many publishes in a row (after their retries) left
    some engine behind; 0: never (a dead engine is counted in `publish_failures` and caught up by
    the next publish or an idle reconcile)."""
    keep_disk_versions: PositiveInt = 2
    """Disk mode keeps this many newest versions (an engine may still be reading the previous one)."""
    nccl_master_address: str = "127.0.0.1"
    """Address the engines reach the trainer's rank 0 at (nccl mode)."""
    nccl_master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of the NCCL rendezvous; 0 picks a free one."""
    release_memory: bool | None = None
    """Engines give their GPU memory (KV cache, weights) back while the trainer computes, and take it
    back before the new weights arrive (SGLang's `/release_memory_occupation`, `/resume_memory_occupation`):
    for trainer and engines sharing GPUs. Rollout pauses meanwhile. None: on when `launch.ray.layout`
    is `colocated` under `--ray`, else off."""


class WarmstartStage(_Section):
    """One stage of the warm-start: its own demonstrations, trained after the previous stage's."""

    examples: PositiveInt
    """Demonstration episodes of this stage (drawn from the env's train split)."""
    env_args: dict[str, Any] = {}
    """Overrides of `env.args` for this stage's demonstrations only (e.g. a different mix of them)."""


class WarmstartConfig(_Section):
    """A supervised warm-start on the env's demonstrations before RL (`slime_async.train.warmstart`),
    and a check that the model it starts RL from succeeds often enough to learn from."""

    enabled: bool = False
    """Train on `Env.demonstration` episodes first; the result is cached by everything that shapes it."""
    examples: PositiveInt | None = None
    """Demonstration episodes (drawn from the env's train split); null: 4096. Not with `stages`."""
    stages: list[WarmstartStage] = []
    """A curriculum: stages trained one after another (each shuffled within itself, each for `epochs`)
    under one learning-rate schedule, instead of one set of `examples`. E.g. first demonstrations that
    all use a tool, so that a skill is learnt, then a mix that shifts a choice."""
    epochs: PositiveInt = 1
    batch_size: PositiveInt = 32
    lr: PositiveFloat = 1e-3
    """Peak learning rate: linear warm-up over `warmup_steps`, then cosine decay to 10%."""
    warmup_steps: NonNegativeInt = 50
    """Steps of linear learning-rate warm-up (a tiny model's Adam diverges from copying without it)."""
    seed: int | None = None
    """Seed of the demonstrations' order and of training; null: `run.seed`."""
    env: EnvConfig | None = None
    """The env whose demonstrations train (`name`, `args`; stages' `env_args` apply to it); null: the
    run's `env`. For an env that poses the same tasks with the same tokens as another, such as a
    black-box agent of an env (`configs/calculator_agent.yaml`), whose warm-start is then shared."""
    min_success: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Stop before RL when the sampled success (reward >= 1, at `rollout.sampling`) of the model RL
    starts from, on `check_tasks` held-out problems, is below this (0: no floor). RL cannot learn
    from a model that never succeeds."""
    check_tasks: NonNegativeInt = 0
    """Held-out (eval split) problems on which success is measured before RL (the check) and after
    it (the run summary), one sample at `rollout.sampling` and one greedy each; 0: not measured."""


class LogConfig(_Section):
    tensorboard: bool = True
    """Mirror the trainer's and the evaluation's metrics to TensorBoard event files under
    `<run dir>/tensorboard/` (`tensorboard --logdir runs/NAME/tensorboard`)."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when set."""
    sample_every: NonNegativeInt = 10
    """Every this many trainer steps, a few trajectories of the batch, decoded, go to
    `<run dir>/samples.md` (0: none)."""
    trajectories: bool = True
    """Record every trained trajectory (tokens, logprobs, versions, masks, advantage) in
    `<run dir>/trajectories.sqlite`, for the dashboard's trajectory viewer and `slime-async replay`."""
    dashboard: bool = True
    """`slime-async train` serves the live dashboard (`slime_async/dashboard`) and prints its URL."""
    dashboard_host: str = "127.0.0.1"
    """Where the dashboard listens. Off loopback it needs a token: `$SLIME_ASYNC_DASHBOARD_TOKEN`, or a
    random one printed in its URL."""
    dashboard_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """The dashboard's port; 0 (the default) picks a free one (several runs on one machine never clash)."""


class RoleResources(_Section):
    """What one process of a role reserves in its Ray placement group bundle."""

    cpus: PositiveFloat = 1.0
    """CPUs Ray reserves (fractions are fine: a rollout worker mostly waits on the network)."""
    gpus: NonNegativeInt = 0
    """Whole GPUs (an SGLang engine needs tp_size * pp_size * dp_size of them)."""


class RayConfig(_Section):
    """Cluster mode (`slime-async train CONFIG --ray [ADDRESS]`): every part as a Ray actor that owns
    the part's process, placed by one placement group per role."""

    address: str | None = None
    """The cluster (`auto`, `ray://HOST:10001`, `HOST:6379`); `--ray ADDRESS` overrides it; None with
    `--ray` and no address: connect to a running cluster if there is one, else start one on this machine."""
    namespace: str = "slime_async"
    layout: Literal["disaggregated", "colocated"] = "disaggregated"
    """`disaggregated`: trainer ranks and engines on their own GPUs. `colocated`: engine i shares the GPUs
    of trainer ranks i*g .. (i+1)*g - 1 (g: GPUs per engine); their memory is released while the trainer
    steps (`sync.release_memory`)."""
    host: str | None = None
    """Address the parts bind to and announce: None for each node's IP as Ray knows it (reachable from the
    other nodes); 127.0.0.1 keeps a one-machine run on loopback."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement strategy of each role's placement group (the trainer's is STRICT_PACK with several ranks
    when this is PACK: ranks of one node talk fastest)."""
    engine: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0, gpus=1))
    """Per engine. An embedded engine on CPU: `gpus: 0`."""
    trainer: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0, gpus=1))
    """Per trainer rank (`train.world_size` ranks)."""
    rollout: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0))
    """Per rollout worker (one asyncio loop each)."""
    buffer: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0))
    router: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0))
    eval: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0))
    teacher: RoleResources = msgspec.field(default_factory=lambda: RoleResources(cpus=1.0, gpus=1))
    """On-policy distillation's teacher (an embedded engine on `train.distill.model`, unless
    `train.distill.urls` attaches to running ones): a bundle of its own in either layout (the trainer
    never pushes to it, so it has no reason to share the trainer's GPUs). On CPU: `gpus: 0`."""


class LaunchConfig(_Section):
    max_restarts: NonNegativeInt = 3
    """Times a part that died is restarted before the run stops (0: stop at the first death)."""
    ready_timeout_s: PositiveFloat = 300.0
    """How long a starting part may take to say it is ready (an SGLang server: to pass its health
    check; under Ray, placement groups: to get their resources)."""
    torch_threads: PositiveInt | None = None
    """Torch CPU threads (OMP_NUM_THREADS) of each process that computes on the CPU: the trainer and each
    embedded engine. None: this machine's cores divided among them, at least 1 each (torch's default
    gives every process all the cores: on 2 cores the trainer and the engine then fight over them).
    Other parts get 1. An OMP_NUM_THREADS already set in the environment wins. Under Ray, Ray sets it
    from each part's `cpus`."""
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    """Cluster mode on Ray (used with `slime-async train --ray`)."""


class Config(_Section):
    """The whole run: one section per part."""

    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    sync: SyncConfig = msgspec.field(default_factory=SyncConfig)
    warmstart: WarmstartConfig = msgspec.field(default_factory=WarmstartConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    launch: LaunchConfig = msgspec.field(default_factory=LaunchConfig)
    sglang: SGLangConfig = msgspec.field(default_factory=SGLangConfig)  # type: ignore[valid-type]
    """SGLang's ServerArgs fields for `engine.kind: sglang` (see `config.sglang`)."""
    vllm: VLLMConfig = msgspec.field(default_factory=VLLMConfig)
    """vLLM's server and its arguments for `engine.kind: vllm`."""

    def __post_init__(self) -> None:
        # vLLM loads the adapters themselves (sync.adapters), up to its largest --max-lora-rank
        if self.train.lora is not None and self.engine.kind == "vllm" and self.train.lora.rank > 512:
            raise ValueError(f"train.lora.rank: {self.train.lora.rank} is more than vLLM serves (--max-lora-rank "
                             "is at most 512)")
        if self.train.lora is not None and self.sync.release_memory:
            raise ValueError("train.lora: with sync.release_memory an engine gives its weights back and takes them "
                             "all from the next push, and a LoRA run pushes only the adapted layers; set "
                             "sync.release_memory: false")
        if self.train.distilling:
            s = self.rollout.sampling
            if s.temperature != 1.0 or s.top_p < 1.0 or s.top_k > 0:
                # the teacher scores plain log-softmax (SGLang's prompt scoring takes no sampling
                # settings) and the term compares it with the behaviour logprobs of the sampled policy
                raise ValueError(f"train.distill: rollout.sampling must be temperature 1 with no top_p or top_k "
                                 f"(got temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}): the "
                                 "teacher's logprobs are plain log-softmax, the student's are of what it sampled from")
        kind = engine_kind(self.engine.kind)  # what the kind can honour (`config.engine_kinds`)
        if self.rollout.partial_mode is None:
            self.rollout.partial_mode = kind.default_partial_mode
        elif (self.rollout.partial_mode == "in_place" and kind.stale_prefixes_in_place
              and not getattr(self.sglang, "disable_radix_cache", None)):
            raise ValueError(f"rollout.partial_mode: in_place with engine.kind {kind.name}: {kind.label}'s radix cache "
                             "keeps prefixes computed by earlier weights, and it cannot be flushed while requests "
                             "are paused in place, so new requests would reuse them under the new version; use "
                             "rollout.partial_mode: abort (requests in flight end, the cache is flushed, they "
                             "resume on the new weights) or set sglang.disable_radix_cache: true")
        if self.sync.mode not in kind.sync_modes:
            raise ValueError(f"sync.mode: {self.sync.mode} does not reach {kind.label} engines here "
                             f"({kind.sync_note}); engine.kind {kind.name} takes sync.mode: "
                             f"{' or '.join(kind.sync_modes)}")
        if self.sync.release_memory and not kind.release_memory:
            raise ValueError(f"sync.release_memory: not supported with engine.kind {kind.name}")
        if self.engine.router.enabled and not kind.sglang_router:
            raise ValueError(f"engine.router.enabled: sglang-router speaks SGLang's API, not {kind.label}'s; "
                             f"the rollout client balances {kind.label} engines itself (give several engines)")
        if not kind.remote_admin and not is_loopback_host(self.engine.host) and not self.engine.urls:
            raise ValueError(f"engine.host: {self.engine.host}: {kind.label}'s weight-update routes (dev mode) "
                             f"take no token (its --api-key does not guard them), so slime_async launches "
                             f"{kind.label} on loopback only (under --ray: one machine, launch.ray.host: 127.0.0.1)")
