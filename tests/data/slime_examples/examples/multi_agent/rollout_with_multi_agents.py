# Mirrors slime's examples/multi_agent/rollout_with_multi_agents.py (THUDM/slime, Apache-2.0), written
# anew with the same slime API surface: a generate function with an `evaluation` parameter, a tokenizer
# loaded from `args.hf_checkpoint`, `args.rollout_max_context_len` / `args.eval_max_context_len`,
# attributes set on `args`, the agent system loaded by `load_function` from a dotted path, and a
# shuffled list of samples returned. Only the import block differs from a slime port.
import random

from transformers import AutoTokenizer

from slime_async.data.slime_compat import Sample, load_function

MULTI_AGENT_CONFIGS = {
    "custom_multi_agent_function_path": "examples.multi_agent.agent_system.run_agent_system",
    "num_parallel": 3,
    "incorrect_reward_weight": 0.8,
    "correct_reward_weight": 1.2,
}


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    max_context_length = args.rollout_max_context_len if not evaluation else args.eval_max_context_len

    args.sampling_params = sampling_params
    args.rollout_max_context_len = max_context_length
    args.tokenizer = tokenizer
    for key, value in MULTI_AGENT_CONFIGS.items():
        setattr(args, key, value)

    run_agents = load_function(args.custom_multi_agent_function_path)
    samples = await run_agents(args, sample)
    random.shuffle(samples)
    return samples
