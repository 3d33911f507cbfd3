"""The name torch knows this rendezvous by (``--rdzv-backend``; the ``torchrun.handlers`` entry point).

A module of its own, importing nothing: torch loads its rendezvous plugins while its rendezvous package is
first imported, so the registration must not import a module that is itself importing torch."""

BACKEND = "elastic-rm"
