"""Agent overhead benchmark (issue 3). Run: ``.venv/bin/python -m benchmarks.agent_overhead``."""
