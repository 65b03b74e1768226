"""Launch: starting and supervising the parts of a run.

Owns: child processes with log files and ready lines (`process`), local mode (`local`: buffer,
engines, trainer and rollout workers as processes on this machine, restarted per policy, shut
down in order), cluster mode behind the same interface (`ray_launcher`: each part's process owned
by a Ray actor, `ray_actor`, in its role's placement group, `placement`), SGLang servers and
sglang-router command lines (`sglang_command`, from the config's `sglang:` section) and health
waits (`health`). Does not own: what the parts do (algorithms, protocols).
"""
