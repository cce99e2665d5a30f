"""What a run shows: the run's and the sweep's HTML pages with their assets, curves.png and the attention pictures."""
