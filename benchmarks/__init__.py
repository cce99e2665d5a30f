"""Scripts that measure speed, memory and quality and print a table; docs/ holds the tables with their commands."""
