"""`python -m sglang.launch_server` for tests: takes SGLang's flags and serves the embedded engine.

What the launcher's SGLang path needs from a server is its command line (the flags the test checks
were passed), its HTTP API and its health check; the embedded engine speaks SGLang's API. Flags this
stand-in does not use are accepted and recorded in its log.
"""

import argparse

from slime_async.engine.launch import load_engine, serve

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=30000)
parser.add_argument("--weight-version", default="default")
parser.add_argument("--random-seed", type=int, default=0)
parser.add_argument("--admin-api-key", default=None)
parser.add_argument("--dtype", default="float32")
args, rest = parser.parse_known_args()
print(f"fake sglang: weight version {args.weight_version}, other flags {rest}", flush=True)
engine = load_engine(args.model_path, device="cpu", dtype=args.dtype, seed=args.random_seed,
                     weight_version=args.weight_version, max_batch_size=16)
serve(engine, args.model_path, host=args.host, port=args.port, admin_token=args.admin_api_key)
