"""Run a script under `torchrun` on this machine (gloo, CPU) for the multi-process tests."""

import os
import socket
import subprocess
import sys
from pathlib import Path


def run_torchrun(script: Path, *args, log: Path, nproc: int = 2, env: dict[str, str] | None = None) -> None:
    """`torchrun --nproc_per_node nproc script *args`, one thread per process; fails with the log's tail."""
    with socket.socket() as sock:  # torchrun needs a concrete free port (port 0 hangs its rendezvous)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_port", str(port), str(script), *map(str, args)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    # Output to a file, not a pipe: a grandchild that outlives torchrun would keep a pipe open forever.
    with log.open("w") as handle:
        result = subprocess.run(command, env=environment, stdout=handle, stderr=subprocess.STDOUT, timeout=600)
    assert result.returncode == 0, log.read_text()[-4000:]


def exit_without_teardown() -> None:
    """End a rank that finished its work (outputs written, process group destroyed) without the interpreter's
    teardown: gloo's worker threads destroyed during it sometimes abort the process (SIGABRT, "terminate called
    without an active exception") after a run that passed, now and then in CI."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
