"""One of two processes training the tiny config together, for tests/test_crash_recovery.py.

    python tests/helpers/two_process_worker.py PROCESS_ID COORDINATOR WORKDIR DATA_DIR NUM_TRAIN_STEPS \
        SIGTERM_AT_STEP SHARDING

COORDINATOR is `host:port` (the config's coordinator fields), or `cluster` to leave the config's
empty and let the environment (a faked SLURM job) name the cluster. With SIGTERM_AT_STEP > 0 the
process sends itself SIGTERM while that train step runs (a scheduler's preemption notice).
SHARDING is the config's `sharding` (tiny.two_process_config).
"""

import logging
import signal
import sys
from pathlib import Path

# The project's root (its modules) and tests/ (the helpers package) on the path, as pytest has them.
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from utils import allocator  # noqa: E402

allocator.collect_less_while_importing()

import jax  # noqa: E402

from engine import training_loop  # noqa: E402
from helpers.fault_worker import signal_at_step  # noqa: E402
from helpers.tiny import two_process_config  # noqa: E402
from run_setup.cluster import setup_distributed  # noqa: E402
from run_setup.settings import parse  # noqa: E402
from utils import allocator, stop_signals  # noqa: E402

# the trainer's INFO lines (resuming, ...) in log.txt, as train.py logs them
logging.getLogger().setLevel(logging.INFO)
for library in ("absl", "jax", "orbax", "grain", "tensorflow_datasets"):
    logging.getLogger(library).setLevel(logging.WARNING)
# as train.py's set-up does
allocator.collect_garbage_less_often()
process_id, coordinator, workdir, data_dir, steps, sigterm_at, sharding = sys.argv[1:]
# JAX's thread looks for the notice once a second: the slowed steps bound how many pass first
if int(sigterm_at) > 0:
    signal_at_step(int(sigterm_at), signal.SIGTERM, pause_after=0.2)
joining = (
    {}
    if coordinator == "cluster"
    else {"coordinator_address": coordinator, "num_processes": 2, "process_id": int(process_id)}
)
settings = parse(two_process_config(data_dir, int(steps), sharding, **joining))
setup_distributed(settings.cluster)
assert jax.process_count() == 2 and jax.process_index() == int(process_id), "the two processes did not join"
print(f"process {jax.process_index()} of {jax.process_count()} on {jax.device_count()} devices", flush=True)
try:
    training_loop.train_and_evaluate(settings, workdir)
except stop_signals.Stopped as stopped:
    # as train.py ends (its line, 128 + the signal's number)
    print(stopped.line(), flush=True)
    sys.exit(stopped.exit_code)
