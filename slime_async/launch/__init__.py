"""Launch: starting and supervising the parts of a run.

Owns: child processes with log files and ready lines (`process`), local mode (`local`: buffer,
engines, trainer and rollout workers as processes on this machine, restarted per policy, shut
down in order). Ray mode arrives with its own issue behind the same interface. Does not own: what
the parts do (algorithms, protocols).
"""
