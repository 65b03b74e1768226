"""The local web dashboard and trajectory viewer: `slime-async dashboard RUN_DIR ...`, live during a run.

What it owns:
- the run's record for it, written by the trainer (`recorder`): every trained trajectory, with its
  tokens, logprobs, versions, loss mask and advantage, in an indexed SQLite store (`store`), and the
  buffer's books after each step (`buffer.jsonl`); the launcher's `parts.json` (`run_files.write_parts`);
- reading a run directory, live or finished long ago, from its files alone (`run_files`, `run_view`);
- the HTTP server (aiohttp, loopback unless told otherwise, then a token; `server`, `serve`) and the
  page (`static/`: plain JavaScript and the vendored uPlot for the charts);
- exporting a trajectory and replaying it through its env without an engine (`trajectory_view`, `replay`).

What it does not own: the numbers themselves (the trainer, buffer, rollout and eval workers write
them), nor any control of the run: it only reads.
"""
