"""fp4moe.launch: one process per GPU, torchrun-style environment.

    python -m fp4moe.launch --nproc 2 script.py [script args...]
    python -m fp4moe.launch --nproc 2 -m package.module [args...]

Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1) and MASTER_PORT (a
free port unless --master-port), so torch.distributed.init_process_group() works unchanged; rank r should use
GPU LOCAL_RANK. NCCL_NVLS_ENABLE is set to 0 in every process: NVLink SHARP (multicast) must stay off on our
GPU hosts, which are shared (a value other than 0 in the caller's environment is overridden, with a warning).
When a process fails, the others are terminated (then killed) and the launcher exits with its status; with
--timeout, all are killed after that many seconds (exit 124). Single-node only.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m fp4moe.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, required=True,
                   help="processes (GPUs) to start")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0, help="0: a free port")
    p.add_argument("--timeout", type=float, default=0, help="seconds before every process is killed (0: none)")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if not 0 <= a.master_port < 65536:
        p.error(f"--master-port must be in [0, 65535], got {a.master_port}")
    if a.timeout < 0:
        p.error("--timeout must be >= 0")
    if not a.module and not os.path.exists(a.target):
        p.error(f"script not found: {a.target}")
    return a


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def rank_env(base: dict, rank: int, nproc: int, addr: str, port: int) -> dict:
    """The environment of process `rank`."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "NCCL_NVLS_ENABLE": "0",  # must stay 0: the GPUs' host is shared
        "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
    })
    return env


def command(a) -> list:
    return [sys.executable] + (["-m", a.target] if a.module else [a.target]) + list(a.args)


def _stop(procs, grace: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    for p in procs:
        while p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()


def run(a) -> int:
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    if nvls not in (None, "0"):
        print(f"fp4moe.launch: NCCL_NVLS_ENABLE={nvls} overridden to 0 (NVLS must stay off on shared hosts)",
              file=sys.stderr)
    port = a.master_port or free_port(a.master_addr)
    cmd = command(a)
    procs = [subprocess.Popen(cmd, env=rank_env(os.environ, r, a.nproc, a.master_addr, port))
             for r in range(a.nproc)]
    deadline = time.monotonic() + a.timeout if a.timeout else None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                r, c = bad[0]
                print(f"fp4moe.launch: rank {r} exited with {c}; stopping the others", file=sys.stderr)
                _stop(procs)
                return c if c > 0 else 128 - c
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"fp4moe.launch: timeout after {a.timeout:g} s; killing every rank", file=sys.stderr)
                _stop(procs, grace=1.0)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def main(argv=None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
