"""The sweep behind sweep.py: the sweep file and its study (study.py), running trials (trial.py), the results (results.py)."""
