"""Decoding (greedy, beam and sampling searches) and scoring its output: the math of the metrics and the registry of every score."""
