"""Experiment configs: one get_config() file per experiment; every common field documented once in base.py."""
