"""One of two processes of test_trainer.test_two_processes_train_and_checkpoint.

    python tests/two_process_worker.py PROCESS_ID COORDINATOR WORKDIR DATA_DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import trainer  # noqa: E402
from run_setup import setup_distributed  # noqa: E402
from tiny import tiny_config  # noqa: E402

process_id, coordinator, workdir, data_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config = tiny_config(
    data_dir, coordinator_address=coordinator, num_processes=2, process_id=process_id,
    num_train_steps=8, log_every_steps=4, checkpoint_every_steps=4, eval_every_steps=8,
)  # fmt: skip
setup_distributed(config)
assert jax.process_count() == 2 and jax.process_index() == process_id, "the two processes did not join"
print(f"process {jax.process_index()} of {jax.process_count()} on {jax.device_count()} devices", flush=True)
trainer.train_and_evaluate(config, workdir)
