"""The study behind sweep.py: the sweep file and its Optuna study, running trials, the results."""
