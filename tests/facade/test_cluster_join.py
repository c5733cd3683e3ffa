"""fleet.init() without PADDLE_* variables: it joins a job that JAX's cluster detection finds
(two tasks started as SLURM's srun starts them, on this machine), refuses a scheduler's
promise of several tasks that it cannot join, and leaves a one-task job alone."""

import os
import subprocess
import sys
import time

import jax
import pytest
from launching import alive, free_port

from fleetjax import fleet

TASK = """
import time
import jax
from fleetjax import fleet

fleet.init(is_collective=True)
fleet.barrier_worker()
print(f"process_count {jax.process_count()} worker_num {fleet.worker_num()} "
      f"worker_index {fleet.worker_index()} devices {jax.device_count()}", flush=True)
if fleet.worker_index() == 1:
    print(f"raising at {time.time()}", flush=True)
    raise RuntimeError("task 1 fails on purpose")
time.sleep(120)
"""


def _without_launcher_variables(environ) -> dict[str, str]:
    prefixes = ("PADDLE_", "SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR")
    return {k: v for k, v in environ.items() if not k.startswith(prefixes)}


def test_two_slurm_tasks_join_and_a_raising_one_exits_at_once():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost"}
    base = {
        **_without_launcher_variables(os.environ),
        **slurm,
        "JAX_COORDINATOR_PORT": str(free_port()),  # JAX's own override of SLURM's port
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "2",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "XLA_FLAGS": "",
    }
    tasks = [
        subprocess.Popen(
            [sys.executable, "-c", TASK],
            env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out1, _ = tasks[1].communicate(timeout=120)
        ended = time.time()
        assert tasks[0].poll() is None  # still sleeping: task 1 did not wait for it
    finally:
        for task in tasks:
            task.kill()
        out0, _ = tasks[0].communicate()
    assert "process_count 2 worker_num 2 worker_index 0 devices 4" in out0
    assert "process_count 2 worker_num 2 worker_index 1 devices 4" in out1
    # Not held in JAX's shutdown barrier until task 0 ends: out at once, with the traceback.
    assert tasks[1].returncode == 1
    # The traceback is the last word: no shutdown-barrier errors after it (Gloo may still log).
    after = out1.split("RuntimeError: task 1 fails on purpose", 1)[1]
    assert all(line.startswith("[Gloo]") for line in after.split("\n") if line.strip()), out1
    raised = float(out1.split("raising at ")[1].split()[0])
    assert ended - raised < 5
    assert not any(alive(task.pid) for task in tasks)


@pytest.mark.parametrize(
    "variables, message",
    [
        (
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
            "SLURM_NTASKS=2 says this process is one of 2 SLURM tasks, but JAX's cluster "
            "detection finds no SLURM job to join (srun gives each task SLURM_JOB_ID, "
            "SLURM_STEP_NODELIST, SLURM_PROCID and SLURM_LOCALID, which JAX reads). Start the "
            "tasks with the scheduler (srun, mpirun) or fleetjax-run, or unset SLURM_NTASKS to "
            "run a single process.",
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"},
            "OMPI_COMM_WORLD_SIZE=4 says this process is one of 4 Open MPI tasks, but JAX's "
            "cluster detection finds no Open MPI job to join (JAX reads OMPI_MCA_orte_hnp_uri",
        ),
        (
            {"PMI_SIZE": "2", "PMI_RANK": "1"},
            "PMI_SIZE=2 says this process is one of 2 MPI (PMI) tasks",
        ),
    ],
)
def test_tasks_that_cannot_be_joined_are_an_error(monkeypatch, variables, message):
    monkeypatch.setattr(os, "environ", _without_launcher_variables(os.environ) | variables)
    with pytest.raises(RuntimeError) as error:
        fleet.init(is_collective=True)
    assert str(error.value).startswith(message)
    assert not jax.distributed.is_initialized()


def test_a_one_task_slurm_job_runs_alone(monkeypatch):
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost",
    }
    monkeypatch.setattr(os, "environ", _without_launcher_variables(os.environ) | slurm)
    fleet.init(is_collective=True)
    assert fleet.worker_num() == 1
    assert not jax.distributed.is_initialized()  # nor limited to one device, as JAX would
    assert len(fleet.mesh.devices.flat) == jax.device_count() == 8
