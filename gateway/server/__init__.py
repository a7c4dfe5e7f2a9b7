"""The live gateway process: client API, worker control plane and data path, checkpoint manager,
recovery coordinator, admin API, and their assembly (app.py).

gRPC's fork handlers are switched off before gRPC loads: this process forks only to exec worker
processes (local clusters), never a child that uses gRPC, and with them on every fork printed
"fork_posix.cc … skipping fork() handlers". A value set by the operator wins.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
