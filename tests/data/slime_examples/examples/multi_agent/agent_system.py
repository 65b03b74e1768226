# Mirrors slime's examples/multi_agent/agent_system.py (THUDM/slime, Apache-2.0), written anew with the
# same slime API surface: each agent call deep-copies `args.sample`, tokenizes with `args.tokenizer`,
# clamps max_new_tokens to `args.rollout_max_context_len`, posts input_ids, appends the reply with
# `Sample.append_response_tokens` (and meta_info), sets `sample.response`, the status and extra
# attributes; solver, rewriter and selector samples are scored with `rm_hub.batched_async_rm`,
# reweighted by the selector's verdict, stamped with one `rollout_id`, and returned as one list.
# Only the import block differs from a slime port.
import asyncio
import re
from copy import deepcopy

from slime_async.data.slime_compat import Sample, post
from slime_async.data.slime_compat.rm_hub import batched_async_rm

from .prompts import SOLVER_PROMPT_TEMPLATE, generate_rewriter_template, generate_select_template


async def generate_response(args, prompt, key):
    try:
        sample = deepcopy(args.sample)
        url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
        sample.prompt = prompt
        prompt_ids = args.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        sample.tokens = prompt_ids
        params = deepcopy(args.sampling_params)
        params["max_new_tokens"] = min(
            args.sampling_params["max_new_tokens"], args.rollout_max_context_len - len(prompt_ids)
        )
        if params["max_new_tokens"] <= 0:
            return None
        output = await post(url, {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True})
        pairs = output["meta_info"].get("output_token_logprobs", [])
        sample.append_response_tokens(
            args,
            tokens=[p[1] for p in pairs],
            log_probs=[p[0] for p in pairs],
            trainable=True,
            meta_info=output["meta_info"],
        )
        assert len(sample.rollout_log_probs) == sample.response_length
        sample.response = output["text"]
        match output["meta_info"]["finish_reason"]["type"]:
            case "length":
                sample.status = Sample.Status.TRUNCATED
            case "stop":
                sample.status = Sample.Status.COMPLETED
        args.results_dict[key].append(sample)

        head, sep, tail = output["text"].partition("</think>")
        if sep and tail.strip():
            sample.reason_content, sample.response_content = head.strip(), tail.strip()
            return sample.response_content
        sample.reason_content = sample.response_content = None
        return None
    except Exception as e:
        print(f"Error generating response: {e}")
        return None


async def run_agent_system(args, sample):
    args = deepcopy(args)
    args.sample = sample
    args.results_dict = {"solver": [], "rewriter": [], "selector": []}
    rollout_id = sample.index

    def emit(samples):
        for s in samples:
            s.rollout_id = rollout_id
        return samples

    def reweight(samples, weight):
        for s in samples:
            s.reward = s.reward * weight

    async def score(key):
        for s, r in zip(args.results_dict[key], await batched_async_rm(args, args.results_dict[key]), strict=False):
            s.reward = r

    problem = sample.prompt
    solutions = await asyncio.gather(
        *(
            generate_response(args, SOLVER_PROMPT_TEMPLATE.format(problem_statement=problem), "solver")
            for _ in range(args.num_parallel)
        )
    )
    await score("solver")
    solutions = [s for s in solutions if isinstance(s, str)]
    if not solutions:
        reweight(args.results_dict["solver"], args.incorrect_reward_weight)
        return emit(args.results_dict["solver"])

    fill = {"problem_statement": problem, **{f"solution{i + 1}": s for i, s in enumerate(solutions)}}
    rewrites = await asyncio.gather(
        *(
            generate_response(args, generate_rewriter_template(len(solutions)).format(**fill), "rewriter")
            for _ in range(args.num_parallel)
        )
    )
    await score("rewriter")
    rewrites = [s for s in rewrites if isinstance(s, str)]
    if not rewrites:
        for key in ("solver", "rewriter"):
            reweight(args.results_dict[key], args.incorrect_reward_weight)
        return emit(args.results_dict["solver"] + args.results_dict["rewriter"])

    fill = {"problem_statement": problem, **{f"solution{i + 1}": s for i, s in enumerate(rewrites)}}
    verdict = await generate_response(args, generate_select_template(len(rewrites)).format(**fill), "selector")
    if not args.results_dict["selector"]:
        for key in ("solver", "rewriter"):
            reweight(args.results_dict[key], args.incorrect_reward_weight)
        return emit(args.results_dict["solver"] + args.results_dict["rewriter"])
    selector = args.results_dict["selector"][0]
    selector.reward = 0
    found = re.findall(r"Judgment:\s*(\d+)", verdict or "")
    if found and 1 <= int(found[0]) <= len(rewrites):
        chosen = rewrites[int(found[0]) - 1]
        for s in args.results_dict["rewriter"]:
            if s.response_content is not None and chosen in s.response_content:
                selector.reward = s.reward
                break
    weight = args.correct_reward_weight if selector.reward == 1 else args.incorrect_reward_weight
    for key in ("solver", "rewriter", "selector"):
        reweight(args.results_dict[key], weight)
    return emit(args.results_dict["solver"] + args.results_dict["rewriter"] + args.results_dict["selector"])
