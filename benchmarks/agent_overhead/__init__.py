"""Agent overhead benchmark. Run: ``.venv/bin/python -m benchmarks.agent_overhead``."""
