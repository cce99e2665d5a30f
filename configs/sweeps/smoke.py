"""A 2x2 grid over configs/default.py, a few dozen steps a trial: for tests and for trying sweeps.

    python sweep.py --config=configs/default.py --sweep=configs/sweeps/smoke.py --workdir=runs/smoke --parallel=2

A sweep file's get_sweep() returns:

- method: "grid" (every combination of categorical spaces), "random", or "tpe".
- space: config field -> ("categorical", [choices]) | ("uniform", low, high)
  | ("log_uniform", low, high) | ("int", low, high).
- objective: "<split>/<metric>" of metrics.jsonl, e.g. "dev/exact_match", "dev/bleu",
  "dev/loss"; its value at the last step is the trial's result, and its values at
  the evaluations before feed the median pruner; it must be a score of scoring/score_registry.py that the
  config's task writes. direction: "maximize" or "minimize", the score's own (scoring/score_registry.py) when
  left out; one that contradicts the score is refused.
- num_trials: trials in all (a grid: its size). budget: config overrides every
  trial gets (steps, eval interval...). pruning: on unless False. seed: of the samplers.
"""


def get_sweep():
    return dict(
        method="grid",
        space={
            "learning_rate": ("categorical", [1e-3, 3e-3]),
            "model.d_model": ("categorical", [32, 64]),
        },
        # exact match is still 0 after 40 steps
        objective="dev/token_accuracy",
        direction="maximize",
        budget={
            "num_train_steps": 40,
            "warmup_steps": 10,
            "eval_every_steps": 20,
            "checkpoint_every_steps": 40,
            "log_every_steps": 10,
            "eval_decode_examples": 100,
            "visualize_examples": 0,
            "task.train_size": 2_000,
            "task.dev_size": 200,
            "task.test_size": 200,
        },
    )
