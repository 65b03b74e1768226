"""Running slime's custom generate functions inside the scheduler, unchanged but for their imports.

slime lets users replace rollout with `async def generate(args, sample, sampling_params)`
(`--custom-generate-function-path`), which posts to SGLang's `/generate` with
`slime.utils.http_utils.post`, often through `GenerateState(args).tokenizer`, and returns the Sample
(or a new one, or a list of them) with `tokens`, `response_length`, `loss_mask`, `rollout_log_probs`,
`reward` and `status` filled. To port one, swap the imports (docs/from_slime.md lists them):

    slime.utils.types.Sample                     -> slime_async.data.slime_compat.Sample
    slime.utils.http_utils.post                  -> slime_async.data.slime_compat.post
    slime.rollout.sglang_rollout.GenerateState   -> slime_async.data.slime_compat.GenerateState
    slime.rollout.rm_hub.{async_rm, batched_async_rm}, slime.utils.misc.load_function,
    slime.rollout.rm_hub.math_dapo_utils.compute_score -> slime_async.data.slime_compat.rm_hub / .load_function

and name it in the config (`env.name: slime_async.data.slime_compat:SlimeGenerate`, SlimeGenerateArgs)
or pass `SlimeGenerateFactory(...)` where an EnvFactory goes.

Owns: slime's `Sample` (`sample`), the per-episode `post` and `GenerateState` (`episode`), Sample →
Turns with clear errors (`turns`), the `rm_hub` stand-ins, loading functions by path (`loading`),
and the factory (`factory`). Does not own: scheduling, HTTP to the engines (`rollout`), training.
"""

from slime_async.data.slime_compat.episode import GenerateState, _Call, post
from slime_async.data.slime_compat.factory import SLIME_ENV_NAME, SlimeGenerateArgs, SlimeGenerateFactory
from slime_async.data.slime_compat.loading import load_function
from slime_async.data.slime_compat.rm_hub import async_rm, batched_async_rm
from slime_async.data.slime_compat.sample import Sample
from slime_async.data.slime_compat.turns import check_sample, to_turns

SlimeGenerate = SlimeGenerateFactory
"""What SLIME_ENV_NAME names (the data builder recognises the name; this keeps it importable)."""

__all__ = [
    "SLIME_ENV_NAME",
    "GenerateState",
    "Sample",
    "SlimeGenerate",
    "SlimeGenerateArgs",
    "SlimeGenerateFactory",
    "_Call",
    "async_rm",
    "batched_async_rm",
    "check_sample",
    "load_function",
    "post",
    "to_turns",
]
