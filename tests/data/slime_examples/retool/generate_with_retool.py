# Mirrors slime's examples/retool/generate_with_retool.py (THUDM/slime, Apache-2.0), written anew
# with the same slime API surface: `assert not args.partial_rollout`, the sample's rollout state
# cleared, `GenerateState(args).tokenizer`, a Jinja2 prompt with the sandbox's tool specs,
# `args.rollout_max_context_len` (else `args.context_parallel_size * args.max_tokens_per_gpu`) as the
# budget that clamps each turn's max_new_tokens, `post` of input_ids, `Sample.append_response_tokens`
# for model tokens and (trimmed to the budget) interpreter output, extra attributes set on the sample
# (`tool_call_count`, `payload_text`), and `reward_func` returning math_dapo's dict with a tool bonus.
# Only the import block differs from a slime port; the code sandbox is a stub.
import json
import re

from jinja2 import Template
from tool_sandbox import SEMAPHORE, TOOL_CONFIGS, tool_registry

from slime_async.data.slime_compat import GenerateState, Sample, post
from slime_async.data.slime_compat.rm_hub import compute_score as math_dapo_compute_score

TOOL_TEMPLATE = """<|im_start|>system
{{ system }}
{%- if tools %}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, or put code in <code></code>.
{%- endif %}<|im_end|>
<|im_start|>user
{{ prompt }}<|im_end|>
<|im_start|>assistant
"""

SYSTEM = "You solve math problems, running Python with the code_interpreter tool when it helps."


def format_conversation_with_tools(prompt: str, tools=None) -> str:
    return Template(TOOL_TEMPLATE).render(system=SYSTEM, prompt=prompt, tools=tools or [])


def postprocess_predictions(prediction: str):
    answer = re.search(r"Answer:\s*\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", prediction, re.DOTALL)
    if answer:
        return "answer", answer.group(1).strip()
    call = re.search(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", prediction, re.DOTALL)
    if call:
        try:
            data = json.loads(call.group(1).replace("\n", "\\n"))
            if data.get("name") == "code_interpreter" and data.get("arguments", {}).get("code", "").strip():
                return "code", data["arguments"]["code"]
        except (json.JSONDecodeError, AttributeError):
            pass
    code = re.search(r"<code>(.*?)</code>", prediction, re.DOTALL)
    if code:
        return "code", code.group(1).strip()
    return None, ""


async def execute_predictions(prediction: str):
    action, content = postprocess_predictions(prediction)
    if action == "code":
        async with SEMAPHORE:
            result = await tool_registry.execute_tool("code_interpreter", {"code": content})
        return f"\n\n<interpreter>\n{result}\n</interpreter>\n\n", False
    if action == "answer":
        return "", True
    return "\nMy previous action is invalid: put code in <code></code> or answer as 'Answer: \\boxed{...}'.\n", False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert not args.partial_rollout, "Partial rollout is not supported for this function at the moment."

    sample.rollout_log_probs = None
    sample.rollout_top_p_token_ids = None
    sample.rollout_top_p_token_offsets = None
    sample.response = ""
    sample.response_length = 0
    sample.loss_mask = []

    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    tool_specs = tool_registry.get_tool_specs()
    prompt = format_conversation_with_tools(prompt=sample.prompt, tools=tool_specs)
    prompt_ids = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    response, response_ids = "", []
    loss_masks = sample.loss_mask
    tool_call_count = 0

    if args.rollout_max_context_len is not None:
        max_context_length = args.rollout_max_context_len
    else:
        max_context_length = args.context_parallel_size * args.max_tokens_per_gpu

    output = None
    for turn in range(TOOL_CONFIGS["max_turns"]):
        total = len(prompt_ids) + len(response_ids)
        if total >= max_context_length:
            sample.status = Sample.Status.TRUNCATED
            break
        turn_params = dict(sampling_params)
        turn_params["max_new_tokens"] = min(
            sampling_params.get("max_new_tokens", max_context_length - total), max_context_length - total
        )
        payload = {"input_ids": prompt_ids + response_ids, "sampling_params": turn_params, "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        if "output_token_logprobs" not in output["meta_info"]:
            sample.status = Sample.Status.ABORTED
            return sample
        new_ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        new_log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        text = state.tokenizer.decode(new_ids)
        response += text
        response_ids += new_ids
        sample.append_response_tokens(
            args, tokens=new_ids, log_probs=new_log_probs, trainable=True, meta_info=output["meta_info"]
        )
        if output["meta_info"]["finish_reason"]["type"] == "length":
            break

        observation, done = await execute_predictions(text)
        if done:
            break
        if "<interpreter>" in observation:
            tool_call_count += 1
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        overflow = len(prompt_ids) + len(response_ids) + len(obs_ids) - max_context_length
        if overflow > 0:
            obs_ids = obs_ids[: max(0, len(obs_ids) - overflow)]
        response_ids += obs_ids
        sample.append_response_tokens(args, tokens=obs_ids, trainable=False)
        assert len(response_ids) == len(sample.rollout_log_probs), f"token/logprob mismatch at turn {turn}"
        if overflow > 0:
            response = state.tokenizer.decode(response_ids)
            sample.status = Sample.Status.TRUNCATED
            break
        response += observation
        if tool_call_count >= TOOL_CONFIGS["max_tool_calls"]:
            break

    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = response
    sample.loss_mask = loss_masks
    sample.payload_text = prompt + response
    sample.tool_call_count = tool_call_count
    if sample.status is Sample.Status.PENDING and output is not None:
        match output["meta_info"]["finish_reason"]["type"]:
            case "length":
                sample.status = Sample.Status.TRUNCATED
            case "abort":
                sample.status = Sample.Status.ABORTED
            case "stop":
                sample.status = Sample.Status.COMPLETED
    return sample


async def reward_func(args, sample, **kwargs):
    if not isinstance(sample, Sample):
        raise TypeError("Sample must be an instance of Sample class.")
    solution = sample.prompt + sample.response
    result = math_dapo_compute_score(solution, sample.label if sample.label is not None else "", strict_box_verify=True)
    if result["score"] < 0:
        bonus = (getattr(sample, "tool_call_count", 0) - 2) / 2 * 0.1
        result["score"] = min(-0.6, result["score"] + bonus)
    if result["pred"] is None:
        result["pred"] = ""
    return result
