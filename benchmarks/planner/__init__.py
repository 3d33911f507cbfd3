"""Planner benchmark: static vs Optimus-style vs our planner on a generated 1,000-job trace."""
