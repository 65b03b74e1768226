# Mirrors slime's examples/search-r1/generate_with_search.py (THUDM/slime, Apache-2.0), written anew
# with the same slime API surface: `assert not args.partial_rollout`, `GenerateState(args).tokenizer`
# called on text, `post` of a text payload with stop strings and return_logprob, tokens and logprobs
# read from `meta_info.output_token_logprobs`, `Sample.append_response_tokens` for model tokens
# (trainable, with meta_info) and observations (not trainable), the sample's fields rebuilt at the
# end, status from the finish reason, and `reward_func(args, sample)` on `sample.label["ground_truth"]`.
# Only the import block differs from a slime port; the retrieval server is a stub.
import asyncio
import re

from qa_em_format import compute_score_em

from slime_async.data.slime_compat import GenerateState, Sample, post

SEARCH_R1_CONFIGS = {
    "max_turns": 2,
    "topk": 3,
    "search_concurrency": 256,
    "search_url": "http://127.0.0.1:8000/retrieve",
    "return_logprob": True,
    "format_score": 0.2,
}

SEMAPHORE = asyncio.Semaphore(SEARCH_R1_CONFIGS["search_concurrency"])

INVALID = (
    "\nMy previous action is invalid. To search, put the query between <search> and </search>; to answer, "
    "put the answer between <answer> and </answer>. Let me try again.\n"
)


async def search(query: str) -> str:
    from local_search_server import local_search

    docs = await local_search(SEARCH_R1_CONFIGS["search_url"], query, SEARCH_R1_CONFIGS["topk"], proxy=None)
    lines = []
    for i, doc in enumerate(docs):
        title, _, text = doc["document"]["contents"].partition("\n")
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    return "\n".join(lines)


def parse_action(text: str) -> tuple[str | None, str]:
    found = re.search(r"<(search|answer)>(.*?)</\1>", text, re.DOTALL)
    return (found.group(1), found.group(2).strip()) if found else (None, "")


async def execute_predictions(prediction: str) -> tuple[str, bool]:
    action, content = parse_action(prediction)
    if action == "search":
        async with SEMAPHORE:
            results = await search(content)
        return f"\n\n<information>{results.strip()}</information>\n\n", False
    if action == "answer":
        return "", True
    return INVALID, False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    assert not args.partial_rollout, "Partial rollout is not supported for this function at the moment."

    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"

    prompt_text = sample.prompt
    prompt_ids = state.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    sample.loss_mask = []
    sample.rollout_top_p_token_ids = None
    sample.rollout_top_p_token_offsets = None
    response, response_ids, loss_mask, log_probs = "", [], [], []

    stops = sampling_params.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    sampling_params = {**sampling_params, "stop": list(dict.fromkeys([*stops, "</search>", "</answer>"]))}

    for _turn in range(SEARCH_R1_CONFIGS["max_turns"]):
        payload = {"text": prompt_text + response, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample

        text = output["text"]
        new_ids = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        new_log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
        response += text
        response_ids += new_ids
        loss_mask += [1] * len(new_ids)
        log_probs += new_log_probs
        sample.append_response_tokens(
            args, tokens=new_ids, log_probs=new_log_probs, trainable=True, meta_info=output["meta_info"]
        )
        if output["meta_info"]["finish_reason"]["type"] == "length":
            break

        observation, done = await execute_predictions(text)
        if done:
            break
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += obs_ids
        loss_mask += [0] * len(obs_ids)
        log_probs += [0.0] * len(obs_ids)
        sample.append_response_tokens(args, tokens=obs_ids, trainable=False)

    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.response = response
    sample.loss_mask = loss_mask
    sample.prompt = prompt_text
    sample.rollout_log_probs = log_probs or None
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
    return compute_score_em(
        solution_str=sample.prompt + sample.response,
        ground_truth=sample.label["ground_truth"],
        format_score=SEARCH_R1_CONFIGS["format_score"],
    )
