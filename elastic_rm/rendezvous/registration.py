"""How torch finds the handler: the ``torchrun.handlers`` entry point ``elastic-rm``.

torch calls ``handler_factory()`` (zero arguments) and registers what it returns as the creator
``RendezvousParameters -> RendezvousHandler`` (reference/feasibility.md, section 5).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from .settings import BACKEND


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .handler import ElasticRMRendezvousHandler
    from .settings import RendezvousSettings

    return ElasticRMRendezvousHandler(RendezvousSettings.from_parameters(params))


def handler_factory():
    return create_handler


def register() -> None:
    """Register in this process (for when the package's entry points are not installed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if BACKEND not in rendezvous_handler_registry._registry:
        rendezvous_handler_registry.register(BACKEND, create_handler)
