"""Launch: starting and supervising the parts of a run.

Owns: child processes with log files and ready lines (`process`), local mode (`local`: buffer,
engines, trainer and rollout workers as processes on this machine, restarted per policy, shut
down in order), cluster mode behind the same interface (`ray_launcher`: each part's process owned
by a Ray actor, `ray_actor`, in its role's placement group, `placement`), SGLang servers and
sglang-router command lines (`sglang_command`, from the config's `sglang:` section), vLLM's
(`vllm_command`), health waits (`health`), the dashboard process beside a run (`dashboard`), the
`slime-async rollout` command's engines and episodes (`rollout_run`), the warm-start and success
check around a run, and the run's summary and books (`train_run`).
Does not own: what the parts do (algorithms, protocols).
"""
