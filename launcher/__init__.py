"""The command-line entry points: ``ermrun`` (a drop-in for torchrun: one node's agent) and ``erm`` (launch,
status, stop, report, simulate, demo...). Thin by design: each command parses its flags and calls the
library, ``elastic_rm``. Multi-node launching itself lives in :mod:`elastic_rm.launch`."""
