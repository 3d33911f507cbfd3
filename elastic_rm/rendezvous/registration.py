"""How torch finds the handler: the ``torchrun.handlers`` entry point ``elastic-rm``.

torch calls ``handler_factory()`` (zero arguments) and registers what it returns as the creator
``RendezvousParameters -> RendezvousHandler``. The agent gets its node services from the handler here
too, in one place (:func:`node_services`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import BACKEND

# torch imports this module while its rendezvous package is first imported (it loads its plugins
# then): nothing here imports torch, or a module importing torch, before this module is complete
if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from .services import NodeServices


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Wiring: settings, the round policy, and the parser of the agents' metrics records."""
    from ..wire.metrics import parse_record, to_node_metrics
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


def node_services(handler: RendezvousHandler) -> NodeServices | None:
    """The node services of an elastic-rm handler; None for torch's own backends (c10d, static, etcd-v2),
    which have none: the agent then runs without what they provide (see ElasticRMAgent)."""
    from .handler import ElasticRMRendezvousHandler

    return handler.services if isinstance(handler, ElasticRMRendezvousHandler) else None


def handler_factory():
    return create_handler


def register() -> None:
    """Register in this process (for when the package's entry points are not installed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if BACKEND not in rendezvous_handler_registry._registry:
        rendezvous_handler_registry.register(BACKEND, create_handler)
