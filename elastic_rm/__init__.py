"""elastic-rm: elastic, right-sized TorchRec training on plain machines."""

__version__ = "0.1.0"
