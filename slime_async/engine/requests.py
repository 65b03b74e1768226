"""A `/generate` body as the prompts it holds: SGLang's batch rules, checked before anything runs.

SGLang 0.5.23 (`GenerateReqInput.normalize_batch_and_arguments` in `io_struct.py`) takes one prompt
or a batch: `text` a list, `input_ids` a list of lists, and each of `rid`, `sampling_params`,
`return_logprob`, `logprob_start_len` one value for every prompt or a list with one per prompt.
A string `rid` becomes `{rid}_{i}` for prompt i; ids must be unique. The reply is one object for
one prompt sampled once, otherwise a list: prompt by prompt, each prompt's `n` samples together.
Each rule's violation here is a ValueError whose message names the field, as SGLang's do.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from slime_async.engine.protocol import GenerateReqInput, SamplingParams

MAX_SAMPLES = 4096
"""Most sequences one request may start (prompts x n): a small body cannot queue millions of them."""


@dataclass
class Prompt:
    """One prompt of a request, with the options that apply to it."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    where: str
    """How an error names this prompt: `input_ids`, or `input_ids[3]` in a batch."""
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    def sample_rids(self) -> list[str]:
        """The ids of its n samples: its own for one; `{rid}-{j}` for several, so that aborting the
        prompt's id (a prefix) aborts them all, as SGLang's abort matches ids by prefix."""
        n = self.params.n
        return [self.rid] if n == 1 else [f"{self.rid}-{j}" for j in range(n)]


def split(req: GenerateReqInput, max_n: int) -> tuple[list[Prompt], bool]:
    """The request's prompts, and whether its reply is a single object (one prompt, n == 1).
    `max_n`: the most samples of one prompt (the engine's batch: a group is decoded together)."""
    if (req.text is None) == (req.input_ids is None):
        raise ValueError("give exactly one of text and input_ids")
    if req.text is not None:
        key, single = "text", isinstance(req.text, str)
        texts: list[str | None] = [req.text] if isinstance(req.text, str) else list(req.text)
        ids: list[list[int] | None] = [None] * len(texts)
    else:
        key = "input_ids"
        single = isinstance((req.input_ids or [None])[0], int)
        ids = _token_batch(req.input_ids or [])
        texts = [None] * len(ids)
    size = len(texts)
    if size == 0:
        raise ValueError(f"{key}: an empty batch")
    params = _per_prompt(req.sampling_params, size, single, "sampling_params")
    params = [sp or SamplingParams() for sp in params]
    n = params[0].n
    if any(sp.n != n for sp in params):
        raise ValueError("sampling_params: n must be the same for every prompt of a batch")
    if n > max_n:
        raise ValueError(f"sampling_params.n: {n}; at most {max_n} (the engine's batch) per request")
    if size * n > MAX_SAMPLES:
        raise ValueError(f"{key}: {size} prompts x n={n} samples; at most {MAX_SAMPLES} per request")
    for name in ("return_logprob", "logprob_start_len"):
        if n > 1 and isinstance(getattr(req, name), list):
            raise ValueError(f"{name}: a list cannot go with sampling_params.n > 1 (SGLang's rule)")
    logprob = _per_prompt(req.return_logprob, size, single, "return_logprob")
    starts = _per_prompt(req.logprob_start_len, size, single, "logprob_start_len")
    rids = _rids(req.rid, size, single)
    prompts = [
        Prompt(rid=rids[i], text=texts[i], input_ids=ids[i], params=params[i], return_logprob=bool(logprob[i]),
               logprob_start_len=-1 if starts[i] is None else starts[i], where=key if single else f"{key}[{i}]",
               return_routed_experts=req.return_routed_experts, routed_experts_start_len=req.routed_experts_start_len)
        for i in range(size)
    ]
    return prompts, single and n == 1


def _token_batch(input_ids: list[int | list[int]]) -> list[list[int] | None]:
    if not input_ids:
        raise ValueError("input_ids cannot be empty")
    if isinstance(input_ids[0], int):
        if not all(isinstance(t, int) for t in input_ids):
            raise ValueError("input_ids: a list of token ids, or a list of such lists; not a mix")
        return [list(input_ids)]  # type: ignore[arg-type]
    if not all(isinstance(t, list) for t in input_ids):
        raise ValueError("input_ids: a list of token ids, or a list of such lists; not a mix")
    return list(input_ids)  # type: ignore[arg-type]


def _per_prompt(value: object, size: int, single: bool, name: str) -> list:
    """One value for each prompt: a scalar is shared, a list must have one per prompt."""
    if not isinstance(value, list):
        return [value] * size
    if single:
        raise ValueError(f"{name}: a list needs a batch of prompts (text or input_ids as a list)")
    if len(value) != size:
        raise ValueError(f"{name}: {len(value)} values for a batch of {size} prompts")
    return list(value)


def _rids(rid: str | list[str] | None, size: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(size)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(size)]
    rids = _per_prompt(rid, size, single, "rid")
    if len(set(rids)) != len(rids):
        duplicates = sorted({r for r in rids if rids.count(r) > 1})
        raise ValueError(f"rid: duplicate request ids in the batch: {duplicates}")
    return rids
