"""The etcd v3 facade (client.py) and the embedded etcd server (server.py).

gRPC core's own fork handlers, on by default in grpcio's wheels, can kill a process forked while a client
is open (SIGSEGV within milliseconds, before it runs any code of ours); with them off it lives. gRPC reads
the setting once, when it is first imported: so it is turned off here, before anything imports grpc,
unless the user set it. A forked child uses etcd's JSON gateway
instead of gRPC (fork.py).
"""

import os
import sys

if "grpc" not in sys.modules:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
