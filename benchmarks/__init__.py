"""Scripts that measure speed, memory and quality and print a table (timing.py: their shared timer)."""
