"""What `/generate` answers for one sample, as SGLang 0.5.23's tokenizer manager and detokenizer build it.

`reply` follows `TokenizerManager._handle_batch_output` (a running or finished sample) and
`_handle_abort_req` (a sample aborted before it started: a shorter `meta_info`); `text_of` follows the
detokenizer's `trim_matched_stop`; `held_back` the output streamer's rule that a streamed chunk waits
while its text ends in a partial character or could be the start of a stop string. JSON is written by
msgspec, which writes a NaN (a logprob from non-finite logits) as null, as SGLang's orjson does.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from slime_async.engine import protocol as p
from slime_async.engine.core import Sequence, version_spans
from slime_async.moe.routing import encode_sglang

_ENCODER = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message, "code": status}}, status=status)


def reply(req: p.GenerateReqInput, seq: Sequence, tokenizer: Any, version: str, finished: bool) -> dict[str, Any]:
    """The reply for `seq` as it is now; `finished` adds what SGLang adds only at the end."""
    prompt = seq.request
    meta: dict[str, Any] = {"id": seq.rid, "finish_reason": seq.finish_reason}
    if not seq.aborted_waiting:  # SGLang's reply for a request aborted in its queue has none of these
        meta.update(prompt_tokens=len(seq.prompt), cached_tokens=0, reasoning_tokens=0,
                    num_retractions=seq.retractions)
    meta["completion_tokens"] = len(seq.output)
    if prompt is not None and prompt.return_logprob:
        words = req.return_text_in_logprobs
        meta["input_token_logprobs"] = [[lp, t, tokenizer.decode([t]) if words else None]
                                        for lp, t in seq.input_logprobs or []]
        meta["output_token_logprobs"] = [[lp, t, tokenizer.decode([t]) if words else None]
                                         for lp, t in zip(seq.logprobs, seq.output, strict=True)]
        meta["output_token_logprobs_length"] = len(seq.output)
    spans = version_spans(seq.versions) or [{"version": version, "start": 0, "end": 0}]
    meta["weight_versions"] = spans
    meta["weight_version"] = spans[-1]["version"]
    if finished and seq.routed_experts is not None:  # SGLang collects them when the request finishes
        meta["routed_experts"] = encode_sglang(seq.routed_experts)
    if finished:
        meta["e2e_latency"] = time.monotonic() - seq.created
        meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {"text": text_of(tokenizer, seq), "output_ids": list(seq.output), "meta_info": meta}
    if prompt is not None and req.return_prompt_token_ids:
        out["prompt_token_ids"] = list(seq.prompt)
    return out


def text_of(tokenizer: Any, seq: Sequence) -> str:
    """SGLang's detokenizer (`trim_matched_stop`): a matched stop token is left out of the text, and
    the text is cut before the first occurrence of a matched stop string, unless `no_stop_trim`."""
    sp = seq.params
    matched = (seq.finish_reason or {}).get("matched")
    ids = seq.output
    if isinstance(matched, int) and not sp.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens,
                            spaces_between_special_tokens=sp.spaces_between_special_tokens)
    if isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[: pos + len(matched)] if sp.no_stop_trim else text[:pos]
    return text


def held_back(text: str, stops: list[str]) -> bool:
    """Whether a streamed chunk with this text waits for more tokens: it ends in a partial UTF-8
    character (the replacement character), or its end could be the start of a stop string (SGLang's
    `check_match_stop_str_prefix`: the stop string may complete with the next token)."""
    if text.endswith("\ufffd"):
        return True
    return any(stop in text or any(text.endswith(stop[:i]) for i in range(1, len(stop))) for stop in stops if stop)
