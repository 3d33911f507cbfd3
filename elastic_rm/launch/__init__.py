"""Multi-node launching: `erm launch` starts and releases ``ermrun`` agents on hosts, over ssh or as Slurm
jobs (docs/launch.md). The command line is ``launcher/``; one node's agent start is
:mod:`elastic_rm.agent.entry`."""
