"""ermrun's options as `erm launch` reads them: each option's spellings and whether it takes a value.

`erm launch` passes every ermrun flag on to the nodes as typed. Reading which words are flags needs only
this table; ermrun's own parser (torchrun's, which imports torch: seconds on a busy login node) checks the
flags' values in launcher.commands.launch. tests/e2e/test_flag_parity.py compares this table with ermrun's
parser, so a torch upgrade that changes torchrun's options fails there until the table follows it.
"""

from __future__ import annotations

# (spellings, takes a value)
ERMRUN_OPTIONS: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("--nnodes",), True),
    (("--nproc-per-node", "--nproc_per_node"), True),
    (("--rdzv-backend", "--rdzv_backend"), True),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True),
    (("--rdzv-id", "--rdzv_id"), True),
    (("--rdzv-conf", "--rdzv_conf"), True),
    (("--standalone",), False),
    (("--max-restarts", "--max_restarts"), True),
    (("--monitor-interval", "--monitor_interval"), True),
    (("--start-method", "--start_method"), True),
    (("--event-log-handler", "--event_log_handler"), True),
    (("--role",), True),
    (("-m", "--module"), False),
    (("--no-python", "--no_python"), False),
    (("--run-path", "--run_path"), False),
    (("--log-dir", "--log_dir"), True),
    (("-r", "--redirects"), True),
    (("-t", "--tee"), True),
    (("--local-ranks-filter", "--local_ranks_filter"), True),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True),
    (("--node-rank", "--node_rank"), True),
    (("--master-addr", "--master_addr"), True),
    (("--master-port", "--master_port"), True),
    (("--local-addr", "--local_addr"), True),
    (("--logs-specs", "--logs_specs"), True),
    (("--numa-binding", "--numa_binding"), True),
    (("--signals-to-handle", "--signals_to_handle"), True),
    (("--shutdown-timeout", "--shutdown_timeout"), True),
    (("--virtual-local-rank", "--virtual_local_rank"), False),
    (("--node-id",), True),
    (("--slurm-release",), False),
    (("--etcd-binary",), True),
    (("--etcd-cacert",), True),
    (("--etcd-cert",), True),
    (("--etcd-key",), True),
    (("--ckpt-tls",), True),
    (("--membership-grace",), True),
    (("--job",), True),
    (("--sample-interval",), True),
    (("--drain-grace",), True),
    (("--metrics-port",), True),
    (("--metrics-host",), True),
    (("--event-log",), True),
    (("--event-sample-interval",), True),
    (("--log-format",), True),
    (("--quiet",), False),
    (("--etcd-user",), True),
    (("--cpu-limit",), True),
    (("--memory-limit",), True),
    (("--spares",), True),
    (("--spare-preload",), True),
    (("--malloc-arenas",), True),
)
