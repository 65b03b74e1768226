"""slime's `Sample` (`slime/utils/types.py`): the fields and methods that generate and reward functions use.

Left out: multimodal processing, top-p replay and routed-expert replay (their fields exist so that a
function may set them to None; nothing reads them), and the speculative-decoding and prefix-cache
statistics objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One rollout sample, as slime's generate and reward functions see it."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    """Which group (prompt) of the run the sample belongs to: the same for the n samples of a task."""
    index: int | None = None
    """Unique within the run (a running count of episodes of this adapter)."""
    rollout_id: int | None = None
    """Samples split out of one rollout (a list returned by a generate function) share it."""
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    """Prompt tokens followed by response tokens."""
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    """One per response token: 1 for model tokens to train on, 0 for tool/observation tokens."""
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    """One per response token (0 for tokens the model did not generate)."""
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    """Keep the sample for its group's baseline, train none of its tokens."""
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["status"] = self.status.value if isinstance(self.status, Sample.Status) else self.status
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """The inverse of `to_dict`; keys that are not fields become attributes, as in slime."""
        data = dict(data)
        if "status" in data:
            data["status"] = Sample.Status(data["status"])
        fields = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in fields})
        for k, v in data.items():
            if k not in fields:
                setattr(sample, k, v)
        return sample

    def get_reward_value(self, args: Any) -> float:
        """The reward that trains: the whole reward, or its `args.reward_key` entry when it is a dict."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward  # type: ignore[index,return-value]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Any = None,
        log_probs: Any = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens, keeping `tokens`, `response_length`, `loss_mask` and
        `rollout_log_probs` aligned. Model tokens: `trainable=True` with their logprobs (and SGLang's
        `meta_info`, whose finish reason sets the status and whose weight version is recorded). Tool or
        observation tokens: `trainable=False`, no logprobs (they get mask 0 and logprob 0)."""
        new = [int(t) for t in (tokens if tokens is not None else [])]
        lps = None if log_probs is None else [float(x) for x in log_probs]
        if lps is not None and len(lps) != len(new):
            raise ValueError(f"log_probs length {len(lps)} != tokens length {len(new)}")
        if new and trainable and lps is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if new and not trainable:
            if lps is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            lps = [0.0] * len(new)
        if text is not None:
            self.response += text
        before = self.response_length
        if new:
            self.tokens += new
            self.response_length += len(new)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(new)
        if lps is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        "cannot append trainable log probabilities to a sample that has response "
                        "tokens but no rollout_log_probs"
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += lps
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            if "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])
            finish = meta_info["finish_reason"]["type"]
            status = {
                "length": Sample.Status.TRUNCATED,
                "abort": Sample.Status.ABORTED,
                "stop": Sample.Status.COMPLETED,
            }.get(finish)
            if status is not None:
                self.status = status
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length {self.response_length}"
            )
