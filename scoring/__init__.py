"""Decoding (greedy, beam, sampling) and scoring its output: the metrics' math and the score registry."""
