"""The `megatron` backend: a megatron-core GPT model converted exactly from a HF checkpoint.

Every process of the trainer makes one `MegatronBackend` and makes the same calls with the same batch
(SPMD); micro-batches are dealt round-robin to data-parallel ranks, and results (logprobs, loss,
metrics) come back whole on every rank. With one pipeline stage the micro-batch loop is ours (as in
the torch backend); with several, Megatron's pipeline schedule runs it (GPU only). Weights go out in
HF names (`named_weights`, collective), and checkpoints are a HF directory plus each rank's
optimizer state.

Precision: `float32` keeps everything in float32. `bfloat16` (GPU) is Megatron's mixed precision:
bf16 parameters and compute, float32 gradients, master weights and Adam moments in the optimizer;
weights are exported in bf16. Logprobs are float32 from the logits either way.

Mixture of experts (Qwen3-MoE): experts whole on every rank, split over `expert_parallel` of the tensor x
data-parallel ranks; with tensor parallelism, sequence parallelism (micro-batches padded at the end to a
multiple of the tensor-parallel size, which causal attention keeps from every real token); with
`train.moe.routing_replay` and a batch that carries `routed_experts`, every forward (logprobs, the
train step, recomputation) routes each token to the experts the engine chose, tokens without a
record by the model itself (`moe_router.py`). The router losses (`train.moe`) are added to the step's
loss, weighted by each micro-batch's share of the batch's real tokens, and logged as `moe/aux_loss`
and `moe/z_loss` (means over layers).

LoRA (`train.lora`, `megatron/lora.py`): adapters per HF module inside Megatron's fused layers, the
base frozen and out of the optimizer; the engines get the adapted modules' merged weights under HF
names, and checkpoints hold the adapters alone in peft's format (as the torch backend's).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from slime_async.config.schema import LoraConfig, MegatronConfig, MoeConfig
from slime_async.sync.megatron_names import Geometry
from slime_async.train import lora as peft
from slime_async.train.backend import DEFAULT_OPTIMIZER, Logprobs, LossFn, OptimizerSettings, StepResult, metric_floats
from slime_async.train.batch import Batch
from slime_async.train.fused_logprobs import fused_logprobs
from slime_async.train.megatron import lora as L
from slime_async.train.megatron import wgrad_fusion
from slime_async.train.megatron.cpu_compat import cpu_megatron
from slime_async.train.megatron.local_dispatch import use_local_dispatch
from slime_async.train.megatron.logprobs import vocab_parallel_logprobs
from slime_async.train.megatron.model import (
    AttentionKind,
    ModelShape,
    build_gpt_model,
    te_available,
    transformer_config,
)
from slime_async.train.megatron.moe_router import QwenRouter, RouteFeed
from slime_async.train.megatron.optimizer import MegatronOptimizer, StepOptimizer, TorchOptimizer
from slime_async.train.megatron.parallel import init_parallel
from slime_async.train.megatron.weights import (
    HFWeights,
    LocalExport,
    export_hf,
    load_hf,
    mark_tensor_parallel,
    save_hf_dir,
)
from slime_async.train.torch_backend import resolve_device

LAYOUT_FILE = "megatron.json"


class MegatronBackend:
    """The `TrainerBackend` over megatron-core. Not thread-safe: one call at a time, on every rank."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: Literal["float32", "bfloat16"] = "float32",
        optim: OptimizerSettings = DEFAULT_OPTIMIZER,
        micro_batch_size: int = 16,
        reference: bool = False,
        parallel: MegatronConfig | None = None,
        moe: MoeConfig | None = None,
        lora: LoraConfig | None = None,
        publish_adapters: bool = False,
    ) -> None:
        from transformers import AutoConfig

        cfg = parallel or MegatronConfig()
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        if dtype == "bfloat16" and not self.on_gpu:
            raise ValueError("model.dtype: the megatron backend runs bfloat16 on GPU only; use float32 on CPU")
        if cfg.recompute_activations and not self.on_gpu:
            raise ValueError("train.megatron.recompute_activations: Megatron's recomputation saves CUDA RNG "
                             "states; it needs a GPU")
        if cfg.pipeline_parallel > 1 and not self.on_gpu:
            raise ValueError("train.megatron.pipeline_parallel: pipeline parallelism needs a GPU "
                             "(Megatron's pipeline schedules run on CUDA)")
        try:
            hf_config = AutoConfig.from_pretrained(str(model_path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.path: cannot read a transformers config from {model_path}: {exc}") from None
        self.shape = ModelShape.from_hf(hf_config, cfg.tensor_parallel, cfg.vocab_multiple)
        self.shape.check_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel)
        self.lora = lora
        if lora is not None:
            self._check_lora(lora, cfg)
        self.publish_adapters = publish_adapters and lora is not None
        """The engines load adapters (vLLM): `named_weights` gives the adapters, not merged weights."""
        self.moe = moe or MoeConfig()
        self.vocab_size = self.shape.vocab_size
        self.micro_batch_size = micro_batch_size
        self.params_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.export_dtype = self.params_dtype
        self.attention = self._attention(cfg.attention, lora is not None)
        self.grouped_experts = cfg.moe_grouped_gemm
        self.local_dispatch = cfg.moe_local_dispatch and cfg.moe_grouped_gemm and cfg.expert_parallel == 1
        self.fused_logprobs = cfg.fused_logprobs and self.on_gpu  # Inductor's CPU path would need a compiler
        with self._compat():
            self.layout = init_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.data_parallel, self.device,
                                        expert_parallel=cfg.expert_parallel)
            self.geometry = Geometry(
                num_heads=self.shape.num_heads, num_kv_heads=self.shape.num_kv_heads, head_dim=self.shape.head_dim,
                vocab_size=self.shape.vocab_size, padded_vocab_size=self.shape.padded_vocab_size,
                tensor_parallel=self.layout.tp, tied_embeddings=self.shape.tied_embeddings,
                num_experts=self.shape.moe.num_experts if self.shape.moe is not None else 0)
            self.config = transformer_config(
                self.shape, tensor_parallel=self.layout.tp, pipeline_parallel=self.layout.pp,
                dtype=self.params_dtype, on_gpu=self.on_gpu, recompute=cfg.recompute_activations,
                expert_parallel=self.layout.ep,
                # (not under LoRA: the frozen base weights have no gradient to accumulate)
                wgrad_fusion=cfg.wgrad_fusion and self.on_gpu and lora is None
                and wgrad_fusion.enable(str(self.device)))
            self.routes: RouteFeed | None = None
            self._local_export: LocalExport | None = None  # built at the first export (`named_weights`)
            self.route_width = self.shape.moe.route_width if self.shape.moe and self.moe.routing_replay else None
            """Ids per token of a routed-experts record the batches should carry (None: no replay; the
            training loop reads it)."""
            if self.shape.moe is not None:
                aux = self.moe.aux_loss_coef
                sp = (self.layout.tp_rank, self.layout.tp_group) if self.config.sequence_parallel else None
                self.routes = RouteFeed(self.shape.num_layers,
                                        self.shape.moe.router_aux_loss_coef if aux is None else aux,
                                        self.moe.z_loss_coef, self.device, sequence_parallel=sp)
            weights = HFWeights(self.model_path)
            module = self._build(weights, self.routes)
            # the reference routes itself (no replay), as in the torch backend; under LoRA it is the base model
            # (the adapters start at B = 0)
            self.reference = self._build(weights, None).eval().requires_grad_(False) if reference else None
            self.lora_layers = L.apply_lora(
                module, lora.target_modules, lora.rank, lora.alpha, self.geometry, self.layout,
                self.shape.hidden_size, self.shape.ffn_hidden_size) if lora is not None else {}
            self.num_trainable = L.adapter_parameters(self.lora_layers) if lora is not None else None
            """Adapter parameters of the whole model under LoRA (None: every weight trains)."""
            opt_args: dict[str, Any] = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                            weight_decay=optim.weight_decay, grad_clip=optim.grad_clip)
            self.optimizer: StepOptimizer
            if self.on_gpu:
                from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

                ddp_config = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.distributed_optimizer)
                self.model = DistributedDataParallel(self.config, ddp_config, module)
                self.optimizer = MegatronOptimizer(self.model, self.layout, bf16=self.params_dtype == torch.bfloat16,
                                                   distributed=cfg.distributed_optimizer, **opt_args)
            else:
                self.model = module
                self.optimizer = TorchOptimizer(module, self.layout, **opt_args)

    # --- construction ---------------------------------------------------------------------

    def _compat(self):  # -> context manager
        return cpu_megatron(not self.on_gpu)

    def _attention(self, asked: str, lora: bool) -> AttentionKind:
        if asked == "auto":  # LoRA: Transformer Engine's layers fuse the norm into linear_qkv/linear_fc1
            return "te" if self.on_gpu and te_available() and not lora else "sdpa"
        if asked == "te" and lora:
            raise ValueError("train.megatron.attention: te fuses the layer norm into linear_qkv and linear_fc1, whose "
                             "LoRA adapters (train.lora) need the normalised input; use sdpa")
        if asked == "local" and not self.on_gpu:
            raise ValueError("train.megatron.attention: local (Megatron's unfused attention) needs a GPU; use sdpa")
        return asked  # type: ignore[return-value]

    def _check_lora(self, lora: LoraConfig, cfg: MegatronConfig) -> None:
        """ValueErrors naming `train.lora` for what the megatron backend's adapters do not cover."""
        L.check_targets(lora.target_modules)
        if cfg.pipeline_parallel > 1:
            raise ValueError("train.lora: the megatron backend's adapters run with one pipeline stage; set "
                             "train.megatron.pipeline_parallel: 1")
        if self.shape.moe is not None:
            raise ValueError(f"train.lora: the megatron backend adapts dense models, not {self.shape.model_type}'s "
                             "experts; use train.backend: torch")
        if self.shape.num_kv_heads % cfg.tensor_parallel:
            raise ValueError(f"train.lora: train.megatron.tensor_parallel {cfg.tensor_parallel} must divide the "
                             f"{self.shape.num_kv_heads} key/value heads (each rank's q/k/v adapters hold whole "
                             "query groups)")

    def _build(self, weights: HFWeights, routes: RouteFeed | None) -> torch.nn.Module:
        model = build_gpt_model(self.shape, self.config, self.attention, pre_process=self.layout.first_stage,
                                post_process=self.layout.last_stage, device=self.device,
                                grouped_experts=self.grouped_experts)
        if self.shape.moe is not None and self.local_dispatch:
            use_local_dispatch(model)
        mark_tensor_parallel(model, self.geometry)
        load_hf(model, weights, self.geometry, self.layout)
        for m in model.modules():
            if isinstance(m, QwenRouter):
                m.feed = routes
        return model

    @property
    def module(self) -> torch.nn.Module:
        """The GPTModel itself (inside DDP on GPU)."""
        return self.model.module if self.on_gpu else self.model

    # --- forward --------------------------------------------------------------------------

    def _my_micro_batches(self, batch: Batch) -> list[tuple[slice, Batch]]:
        """This data-parallel rank's micro-batches (every dp-th, round-robin), their per-token tensors
        already on their way to the device. With expert parallelism every rank must run as many
        forwards as the others (each MoE layer is an all-to-all among them): a rank short of one runs a
        filler, an empty slice of rows with no real token, whose outputs are dropped."""
        out = []
        count = math.ceil(len(batch) / self.micro_batch_size)
        for i, start in enumerate(range(0, len(batch), self.micro_batch_size)):
            if i % self.layout.dp == self.layout.dp_rank:
                stop = min(start + self.micro_batch_size, len(batch))
                out.append((slice(start, stop), self._on_device(batch.rows(start, stop))))
        if self.layout.ep > 1:
            filler = batch.rows(0, 1)
            filler = dataclasses.replace(filler, attention_mask=torch.zeros_like(filler.attention_mask),
                                         loss_mask=torch.zeros_like(filler.loss_mask))
            while len(out) < math.ceil(count / self.layout.dp):
                out.append((slice(0, 0), self._on_device(filler)))
        return out

    def _on_device(self, mb: Batch) -> Batch:
        """On a GPU: the micro-batch's per-token tensors copied from pinned memory without waiting. A
        copy from ordinary memory makes the host wait until the GPU has done everything queued before
        it, and then the GPU waits for the host's Python between kernels: 128 of a 711 ms step, measured."""
        if not self.on_gpu:
            return mb

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().pin_memory().to(self.device, non_blocking=True)

        routes = mb.routed_experts
        return dataclasses.replace(mb, input_ids=move(mb.input_ids), attention_mask=move(mb.attention_mask),
                                   loss_mask=move(mb.loss_mask), behaviour_logprobs=move(mb.behaviour_logprobs),
                                   routed_experts=None if routes is None else move(routes))

    def _run_model(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """The model's output for a micro-batch: logits [b, t, V / tp] on the last stage (hidden states
        for the next stage on the others)."""
        t = mb.input_ids.shape[1]
        # sequence parallelism splits the sequence into equal parts: pad the rows' ends
        pad = -t % self.layout.tp if self.config.sequence_parallel else 0
        if self.routes is not None:  # what this forward's routers read
            replay = mb.routed_experts if self.route_width else None
            if replay is not None and replay.shape[-1] != self.route_width:
                raise ValueError(f"batch.routed_experts: {replay.shape[-1]} ids per token, the model routes "
                                 f"{self.route_width} (layers x top-k)")
            # a tensor: reading it here would make the host wait for the GPU
            share = mb.attention_mask.sum() / self._batch_tokens if self._batch_tokens else 0.0
            mask = mb.attention_mask
            if pad:
                mask = torch.nn.functional.pad(mask, (0, pad))
                replay = None if replay is None else torch.nn.functional.pad(replay, (0, 0, 0, pad), value=-1)
            self.routes.feed(replay, mask, share)
        ids = mb.input_ids.to(self.device)
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
        pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        # no mask: attention is causal and rows are right-padded
        out = model(input_ids=ids, position_ids=pos, attention_mask=None)
        return out[:, :t] if pad and self.layout.last_stage else out

    def _logprobs_of(self, logits: torch.Tensor, mb: Batch, temperature: float, entropy: bool) -> Logprobs:
        """Logits [b, t, V / tp] -> Logprobs aligned with tokens (0 at t = 0 and on padding)."""
        ids = mb.input_ids.to(self.device)
        attn = mb.attention_mask.to(self.device)
        if self.fused_logprobs and self.layout.tp == 1 and not entropy and logits.is_contiguous():
            # the whole logits tensor (a view of it, not a copy): the last position predicts nothing
            targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
            logp, ent = fused_logprobs(logits, targets, temperature, self.vocab_size)[:, :-1], None
        else:
            logp, ent = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], temperature=temperature,
                                                vocab_size=self.vocab_size, entropy=entropy)
        zero = torch.zeros_like(logp[:, :1])
        return Logprobs(torch.cat([zero, logp], dim=1) * attn,
                        torch.cat([zero, ent], dim=1) * attn if ent is not None else None)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float, entropy: bool = False, reference: bool = False
                 ) -> Logprobs:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to compute logprobs, got {temperature}")
        model = self.model
        if reference:
            if self.reference is None:
                raise ValueError("reference logprobs asked for, but the backend was built without a reference")
            model = self.reference
        n, t = batch.input_ids.shape
        logp = torch.zeros(n, t, device=self.device)
        ent = torch.zeros(n, t, device=self.device) if entropy else None
        with self._compat():
            if self.layout.pp == 1:
                for rows, mb in self._my_micro_batches(batch):
                    out = self._logprobs_of(self._run_model(model, mb), mb, temperature, entropy)
                    if rows.start == rows.stop:  # a filler
                        continue
                    k = mb.input_ids.shape[1]
                    logp[rows, :k] = out.logprobs
                    if ent is not None and out.entropy is not None:
                        ent[rows, :k] = out.entropy
            else:
                from slime_async.train.megatron.pipeline import pipeline_logprobs

                pipeline_logprobs(self, model, batch, temperature, logp, ent)
            for tensor in (logp, ent):
                if tensor is not None:
                    self._share(tensor)
        return Logprobs(logp.cpu(), ent.cpu() if ent is not None else None)

    def _share(self, tensor: torch.Tensor) -> None:
        """Make a per-row result whole on every rank: rows are disjoint over data-parallel ranks, and
        only the last pipeline stage computed them."""
        if self.layout.dp > 1:
            dist.all_reduce(tensor, group=self.layout.dp_group)
        if self.layout.pp > 1:
            dist.broadcast(tensor, group_src=self.layout.pp - 1, group=self.layout.pp_group)

    # --- training -------------------------------------------------------------------------

    _batch_tokens = 0

    def train_step(self, batch: Batch, loss_fn: LossFn, temperature: float, entropy: bool = False) -> StepResult:
        with self._compat():
            self.optimizer.zero_grad()
            if self.routes is not None:
                self.routes.begin_step()
                self._batch_tokens = int(batch.attention_mask.sum())
            try:
                total = torch.zeros((), dtype=torch.float64, device=self.device)
                metrics: dict[str, Any] = {}
                if self.layout.pp == 1:
                    for rows, mb in self._my_micro_batches(batch):
                        out = self._logprobs_of(self._run_model(self.model, mb), mb, temperature, entropy)
                        if rows.start == rows.stop:  # a filler: its backward joins the others' all-to-alls
                            (out.logprobs.sum() * 0.0).backward()
                            continue
                        loss, mb_metrics = loss_fn(mb, rows, out)
                        loss.backward()
                        total += loss.detach()
                        for k, v in mb_metrics.items():
                            metrics[k] = metrics.get(k, 0.0) + v
                else:
                    from slime_async.train.megatron.pipeline import pipeline_train

                    total = pipeline_train(self, batch, loss_fn, temperature, entropy, metrics)
                if self.routes is not None:
                    replaying = self.route_width is not None and batch.routed_experts is not None
                    total = total + self._router_losses(metrics, replaying)
            finally:
                if self.routes is not None:
                    self.routes.end_step()
                    self._batch_tokens = 0
            loss_value, metrics = self._sum_over_ranks(total, metric_floats(metrics))
            if "moe/replayed_recorded" in metrics:  # share of replayed routes that changed experts
                differ, recorded = metrics.pop("moe/replayed_differ"), metrics.pop("moe/replayed_recorded")
                metrics["moe/route_mismatch"] = differ / recorded if recorded else 0.0
            applied, grad_norm = self.optimizer.step(math.isfinite(loss_value))
        if not applied:
            reason = "non-finite loss" if not math.isfinite(loss_value) else "non-finite grad norm"
            return StepResult(False, loss_value, grad_norm, metrics, reason=reason)
        return StepResult(True, loss_value, grad_norm, metrics)

    def _router_losses(self, metrics: dict[str, Any], replaying: bool) -> torch.Tensor:
        """This data-parallel rank's router loss term (added to the loss: its gradient is in already) and
        metrics, summed over pipeline stages (each holds some of the layers)."""
        assert self.routes is not None
        sums = self.routes.sums.clone()
        if self.layout.pp > 1:
            dist.all_reduce(sums, group=self.layout.pp_group)
        metrics["moe/aux_loss"] = sums[1]
        metrics["moe/z_loss"] = sums[2]
        if replaying:  # replayed routes: summed over ranks, divided at the end (`train_step`)
            if self.routes.sequence_parallel is not None:  # each tensor-parallel rank counted its own tokens
                dist.all_reduce(sums[3:], group=self.layout.tp_group)
            metrics["moe/replayed_differ"], metrics["moe/replayed_recorded"] = sums[3], sums[4]
        return sums[0]

    def _sum_over_ranks(self, total: torch.Tensor, metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
        """The batch's loss and metrics: summed over data-parallel ranks, from the last stage."""
        if self.layout.dp == 1 and self.layout.pp == 1:
            return float(total), metrics
        total = total.clone()
        self._share(total)
        gathered: list[Any] = [None] * self.layout.dp
        dist.all_gather_object(gathered, metrics, group=self.layout.dp_group)
        summed: dict[str, float] = {}
        for part in gathered:
            for k, v in part.items():
                summed[k] = summed.get(k, 0.0) + v
        if self.layout.pp > 1:
            box = [summed]
            dist.broadcast_object_list(box, group_src=self.layout.pp - 1, group=self.layout.pp_group)
            summed = box[0]
        return float(total), summed

    # --- weights and state ----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor once (a tied lm_head under the embedding's name), in the export dtype, on this
        rank's device. Collective: every rank of the trainer must iterate it to the end. Under LoRA: the
        adapted modules' merged weights (and their biases) only, as the torch backend's; nothing else changes
        (to engines that load adapters: the adapters, whole, under peft's names)."""
        if self.publish_adapters:
            return ((f"{peft.PEFT_PREFIX}{name}.lora_{x}.weight", t.to(self.export_dtype))
                    for name, a, b in L.adapters(self.lora_layers) for x, t in (("A", a), ("B", b)))
        if self.lora_layers:
            return L.merged_weights(self.module, self.lora_layers, self.geometry, self.layout, self.export_dtype)
        if self.layout.tp == self.layout.pp == self.layout.ep == 1:  # the whole model here: no collective
            if self._local_export is None:
                self._local_export = LocalExport(self.module, self.geometry)
            return self._local_export(self.export_dtype)
        return export_hf(self.module, self.geometry, self.layout, self.export_dtype)

    def adapters(self, grad: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) by HF module path, whole (`grad`: their gradients). Collective."""
        return {name: (a, b) for name, a, b in L.adapters(self.lora_layers, grad)}

    @property
    def adapter_names(self) -> list[str]:
        """The HF module paths of the adapters, in the torch backend's order."""
        return [L.hf_path(key, m) for key, lora in self.lora_layers.items() for m in lora.targets]

    def set_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Set every adapter from whole (A, B) by HF module path (a peft checkpoint's, `peft.read_peft`)."""
        for key, lora in self.lora_layers.items():
            for m in lora.targets:
                a, b = adapters[L.hf_path(key, m)]
                lora.set_whole(m, a.to(self.device), b.to(self.device))

    def _layout_record(self) -> dict[str, int]:
        record = {"tensor_parallel": self.layout.tp, "pipeline_parallel": self.layout.pp,
                  "data_parallel": self.layout.dp}
        if self.shape.moe is not None:  # each rank's optimizer state holds its own experts
            record["expert_parallel"] = self.layout.ep
            # grouped experts keep two stacked tensors a layer, SequentialMLP 2 x E: other optimizer state
            record["moe_grouped_gemm"] = int(self.grouped_experts)
        return record

    def save(self, path: Path) -> None:
        """A HF directory (written by rank 0; engines can load it), or under LoRA the adapters alone in
        peft's format; each rank's optimizer state, and the parallel sizes (the optimizer state loads back
        only into the same sizes)."""
        path.mkdir(parents=True, exist_ok=True)
        rank0 = self.layout.rank == 0
        if self.lora is not None:  # the adapters alone (peft's format); the base is `model.path`
            whole = self.adapters()
            if rank0:
                peft.write_peft(whole, path, str(self.model_path), self.lora.rank, self.lora.alpha,
                                self.lora.target_modules)
        else:
            save_hf_dir(self.named_weights(), self.model_path, path, write=rank0)
        if self.reference is not None and self.lora is None:  # under LoRA the reference is model.path
            save_hf_dir(export_hf(self.reference, self.geometry, self.layout, self.export_dtype), self.model_path,
                        path / "reference", write=rank0)
        with self._compat():
            self.optimizer.save(path, self.layout)
        if rank0:
            (path / LAYOUT_FILE).write_text(json.dumps(self._layout_record()))
        if dist.get_world_size() > 1:
            dist.barrier()

    def load(self, path: Path) -> None:
        record = json.loads((path / LAYOUT_FILE).read_text()) if (path / LAYOUT_FILE).is_file() else None
        if record != self._layout_record():
            raise ValueError(f"checkpoint {path}: saved with parallel sizes {record}, this trainer runs "
                             f"{self._layout_record()}; its optimizer state cannot be resharded")
        with self._compat():
            if self.lora is not None:
                self.set_adapters(peft.read_peft(path, list(self.adapter_names)))
            else:
                peft.refuse_adapters(path)
                load_hf(self.module, HFWeights(path), self.geometry, self.layout)
            self.optimizer.load(path, self.layout)
            if self.reference is not None and (path / "reference").is_dir():
                load_hf(self.reference, HFWeights(path / "reference"), self.geometry, self.layout)
