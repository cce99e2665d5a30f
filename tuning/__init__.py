"""The study behind sweep.py: the sweep file and its Optuna study (study.py), running trials (trial.py), the results (results.py)."""
