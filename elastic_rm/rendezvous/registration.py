"""How torch finds the handler: the ``torchrun.handlers`` entry point ``elastic-rm``.

torch calls ``handler_factory()`` (zero arguments) and registers what it returns as the creator
``RendezvousParameters -> RendezvousHandler`` (reference/feasibility.md, section 5).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from .settings import BACKEND


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Wiring: settings, the round policy, and the parser of the agents' metrics records."""
    from ..agent.metrics_record import parse_record, to_node_metrics
    from .handler import ElasticRMRendezvousHandler
    from .settings import RendezvousSettings
    from .torchrun_exit import ExitsWhenClosed, created_by_torch_launch_agent

    settings = RendezvousSettings.from_parameters(params)
    policy = None
    if settings.policy == "planner":
        from ..planner.config import config_from_job
        from ..planner.policy import PlannerPolicy

        policy = PlannerPolicy(config_from_job(settings.job))

    def metrics_parser(key: str, raw: bytes):
        return to_node_metrics(parse_record(raw, key=key))

    # under stock torchrun a closed run must end the process cleanly (torchrun_exit.py says why)
    cls = ExitsWhenClosed if created_by_torch_launch_agent() else ElasticRMRendezvousHandler
    return cls(settings, policy=policy, job=settings.job, metrics_parser=metrics_parser)


def handler_factory():
    return create_handler


def register() -> None:
    """Register in this process (for when the package's entry points are not installed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if BACKEND not in rendezvous_handler_registry._registry:
        rendezvous_handler_registry.register(BACKEND, create_handler)
