"""The etcd v3 facade (client.py) and the embedded etcd server (server.py).

gRPC core's own fork handlers, on by default in grpcio's wheels, made a process forked while a client was
open die of SIGSEGV within milliseconds, before it ran any code of ours (11 of 30 forked children that only
slept; none of 40 with them off). gRPC reads the setting once, when it is first imported: so it is turned
off here, before anything imports grpc, unless the user set it. A forked child uses etcd's JSON gateway
instead of gRPC (fork.py).
"""

import os
import sys

if "grpc" not in sys.modules:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
