"""One node's agent: torch's elastic agent plus elastic-rm's monitor, drain, rounds in place, warm spares
and checkpoint server (docs/agent.md). ``ermrun`` starts it through :mod:`elastic_rm.agent.entry`."""
