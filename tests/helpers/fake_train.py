"""Stands in for train.py in the sweep tests: the same flags, "training" in a blink.

`--config=FILE --workdir=DIR --config.NAME=VALUE...`. Every `eval_every_steps`
it appends `{"step", "split": "dev", "score"}` to DIR/metrics.jsonl, with
`score = quality * step / num_train_steps` (so a low `quality` lags from the
start), and records its step in DIR/checkpoint; a rerun resumes from there.
SIGTERM stops it after the current step (exit 0), like train.py. `crash=True`
fails at once with train.py's one-line error. Each start is logged in DIR/starts.
"""

import ast
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

flags = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
# What sweep.py must pass, as train.py requires it: the config file, the workdir, config.* overrides.
assert {"config", "workdir"} <= set(flags), f"no --config or --workdir in {sys.argv[1:]}"
assert all(k.startswith("config.") for k in flags if k not in ("config", "workdir")), sys.argv[1:]
spec = importlib.util.spec_from_file_location("fake_config", flags.pop("config"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config().to_dict()
workdir = Path(flags.pop("workdir"))
for name, value in flags.items():
    assert name.removeprefix("config.") in config, f"sweep.py passed an unknown field: --{name}"
    config[name.removeprefix("config.")] = ast.literal_eval(value)

workdir.mkdir(parents=True, exist_ok=True)
checkpoint = workdir / "checkpoint"
start = int(checkpoint.read_text()) if checkpoint.exists() else 0
with open(workdir / "starts", "a") as f:
    f.write(f"{start}\n")
if config["crash"]:
    print("error: crash asked for by config.crash", file=sys.stderr)
    sys.exit(2)
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
for step in range(start + 1, config["num_train_steps"] + 1):
    time.sleep(config["seconds_per_step"])
    if step % config["eval_every_steps"] == 0 or step == config["num_train_steps"]:
        row = {"step": step, "split": "dev", "score": config["quality"] * step / config["num_train_steps"]}
        with open(workdir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    checkpoint.write_text(str(step))
    if stop:
        break
