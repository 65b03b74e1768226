"""From a finished slime `Sample` to `Turn`s: the prompt and each loss-mask-0 stretch (tool output,
observations) are environment tokens, each loss-mask-1 stretch a completion whose weight versions
come from the model calls the episode recorded."""

from __future__ import annotations

from slime_async.data.slime_compat.episode import _Call
from slime_async.data.slime_compat.sample import Sample
from slime_async.types import Turn


def check_sample(sample: Sample) -> None:
    """Raise ValueError saying what in `sample` does not fit together and which field to set."""
    if not isinstance(sample, Sample):
        raise TypeError(
            f"the generate function returned {type(sample).__name__}, not a Sample (or a list of them): "
            "return the sample it was given, a new Sample, or a list of Samples"
        )
    n, total = sample.response_length, len(sample.tokens)
    if total == 0:
        raise ValueError(
            "sample.tokens is empty: set it to the prompt tokens followed by the response tokens, "
            "and sample.response_length to the number of response tokens"
        )
    if n <= 0:
        raise ValueError(
            f"sample.response_length is {n} but sample.tokens has {total}: set response_length to the "
            "number of response tokens at the end of sample.tokens"
        )
    if n > total:
        raise ValueError(
            f"sample.response_length {n} is more than the {total} tokens of sample.tokens (prompt "
            "tokens followed by response tokens)"
        )
    if sample.loss_mask is not None and len(sample.loss_mask) != n:
        raise ValueError(
            f"sample.loss_mask has {len(sample.loss_mask)} entries, response_length is {n}: one per response token"
        )
    if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != n:
        raise ValueError(
            f"sample.rollout_log_probs has {len(sample.rollout_log_probs)} entries, response_length is "
            f"{n}: one per response token"
        )


def to_turns(sample: Sample, calls: list[_Call], new_branch: bool = False) -> list[Turn]:
    """Split a finished Sample into Turns. A loss-mask-1 stretch takes its logprobs and versions from
    the recorded model call whose output holds it; a stretch found in no call (the function re-tokenized
    text) takes them token by token in call order, and a token found nowhere gets logprob 0 and the
    oldest recorded version (staleness is then overestimated, never under). `new_branch`: the first
    turn starts a new sequence (a later sample of a list)."""
    check_sample(sample)
    n = sample.response_length
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if not any(mask):
        raise ValueError(
            "the sample has no loss-mask-1 token: nothing to train on (set remove_sample=True to "
            "keep a sample only for its group's baseline)"
        )
    generated = [(t, lp, v) for c in calls for t, lp, v in zip(c.output_ids, c.logprobs, c.versions, strict=True)]
    oldest = min((v for _, _, v in generated), default=min((int(v) for v in sample.weight_versions), default=0))
    used: set[int] = set()
    response = sample.tokens[-n:]
    turns: list[Turn] = []
    env_ids: list[int] = list(sample.tokens[:-n])
    i = 0
    while i < n:
        if not mask[i]:
            env_ids.append(response[i])
            i += 1
            continue
        start = i
        while i < n and mask[i]:
            i += 1
        ids = response[start:i]
        found = _find_call(ids, calls, used)
        if found is None:
            lps, vs = _token_by_token(ids, generated, oldest)
        else:
            call, offset = found
            lps = call.logprobs[offset : offset + len(ids)]
            vs = call.versions[offset : offset + len(ids)]
        if sample.rollout_log_probs is not None:
            lps = sample.rollout_log_probs[start:i]
        turns.append(
            Turn(
                prompt_ids=env_ids,
                completion_ids=ids,
                logprobs=lps,
                versions=vs,
                loss_mask=[0] * len(ids) if sample.remove_sample else None,
                new_branch=new_branch and not turns,
            )
        )
        env_ids = []
    return turns


def _find_call(ids: list[int], calls: list[_Call], used: set[int]) -> tuple[_Call, int] | None:
    """The first unused call whose output holds `ids` contiguously, and where."""
    k = len(ids)
    for j, call in enumerate(calls):
        if j in used or len(call.output_ids) < k:
            continue
        out = call.output_ids
        for offset in range(len(out) - k + 1):
            if out[offset] == ids[0] and out[offset : offset + k] == ids:
                used.add(j)
                return call, offset
    return None


def _token_by_token(
    ids: list[int], generated: list[tuple[int, float, int]], oldest: int
) -> tuple[list[float], list[int]]:
    lps: list[float] = []
    vs: list[int] = []
    pos = 0
    for tok in ids:
        j = pos
        while j < len(generated) and generated[j][0] != tok:
            j += 1
        if j < len(generated):
            lps.append(generated[j][1])
            vs.append(generated[j][2])
            pos = j + 1
        else:
            lps.append(0.0)
            vs.append(oldest)
    return lps, vs
