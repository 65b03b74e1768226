"""The local web dashboard and trajectory viewer: `slime-async dashboard RUN_DIR ...`, live during a run.

What it owns:
- the trajectory store (`store`): every trained trajectory, with its tokens, logprobs, versions,
  loss mask and advantage, in an indexed SQLite file that the trainer writes (`train.recorder`);
- a run directory as the dashboard shows it, live or finished long ago, from its files alone
  (`run_view`, over `rundir.run_files`);
- the HTTP server (aiohttp, loopback unless told otherwise, then a token; `server`, `serve`) and the
  page (`static/`: plain JavaScript and the vendored uPlot for the charts);
- exporting a trajectory and replaying it through its env without an engine (`trajectory_view`, `replay`).

What it does not own: the numbers themselves (the trainer, buffer, rollout and eval workers write
them), the run directory's format (`rundir`), starting the dashboard beside a run
(`launch.dashboard`), nor any control of the run: it only reads.
"""
