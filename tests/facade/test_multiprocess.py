"""Two worker processes joined by fleet.init() (gloo on CPU): from PADDLE_* variables, or
after the script called jax.distributed.initialize() itself (as under srun or mpirun)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).parents[1] / "multiprocess_worker.py"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.parametrize(
    "joined_by",
    # jax's own variables under -m slow: the launcher tests start workers that way too
    ["paddle_variables", pytest.param("jax_itself", marks=pytest.mark.slow)],
)
def test_two_processes_train_data_parallel(joined_by):
    endpoints = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    procs = []
    base = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    for rank, endpoint in enumerate(endpoints):
        env = {**base, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "WORKER_CPU_DEVICES": "4"}
        if joined_by == "paddle_variables":
            env |= {
                "PADDLE_TRAINER_ID": str(rank),
                "PADDLE_TRAINERS_NUM": "2",
                "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
                "PADDLE_CURRENT_ENDPOINT": endpoint,
            }
        else:
            env |= {"JAX_COORDINATOR_ADDRESS": endpoints[0], "WORKER_SELF_INIT_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"worker {rank} failed:\n{out}"
        assert f"roles ok: worker {rank} of 2, 8 global devices" in out
        assert "train ok" in out
    assert "files ['part-0', 'part-1', 'part-2']" in outputs[0]
    assert "files ['part-3', 'part-4']" in outputs[1]
