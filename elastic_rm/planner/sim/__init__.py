"""Trace-driven simulation of a shared cluster under round policies (``erm simulate``)."""
