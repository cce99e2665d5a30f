"""Experiment configs, one get_config() file each: common fields in base.py, recurrent.py, sweeps/."""
