"""Run directory: the files a run writes under `runs/NAME`, and reading them back.

Owns: which files a run has and who writes each (`run_files`: `config.yaml`, `metrics.jsonl`,
`eval.jsonl`, `buffer.jsonl`, `rollout-<i>.json`, `events.jsonl`, `parts.json`, `summary.json`,
`trajectories.sqlite`), reading them from the directory alone with errors that name the file and
line, the parts' health from `parts.json`; the run's story across restarts and `--resume`
(`run_log`: the events file, and the lines of steps a restarted trainer undoes).

Does not own: what goes into the files (the trainer, buffer, rollout and evaluation workers and the
launcher write them), the trajectory store's schema (`dashboard.store`), or showing them (`dashboard`).
"""
