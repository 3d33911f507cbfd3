"""What the parts share: the formats that cross a process or machine boundary, in one place.

- :mod:`.keyspace`: the etcd key names of a run (the one authority on them).
- :mod:`.records`: the JSON values under those keys, strictly parsed; the round phases.
- :mod:`.metrics`: the ``metrics/<node>`` record and the planner's view of it.
- :mod:`.channel`: the worker channel between a training process and its node's agent.

This package imports nothing of elastic-rm but the planner's plain types (``NodeState``, ``NodeMetrics``,
``StepStats``), so every other part may import it and no two parts need to import each other.
"""
