"""fleetjax.launch (fleetjax-run): the processes it plans and starts, their variables and logs,
Paddle's options, usage errors, and where the coordinator listens. Faults (a worker that fails,
hangs or is killed; a launcher that is stopped or killed) are in test_launch_faults.py."""

import ipaddress
import json
import logging
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from launching import ENV, WORKER, free_port, listening, wait_for

from fleetjax import launch

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_digits.py"


def plan(*argv: str, environ=None):
    """The workers for `argv`; the CPU unless `environ` says otherwise (GPUs here or not)."""
    environ = {"JAX_PLATFORMS": "cpu"} if environ is None else environ
    return launch.plan_workers(launch.parse_args([*argv, "train.py"]), environ)


# -- what is started -----------------------------------------------------------------------
def test_plan_on_cpu():
    workers = plan("--nproc_per_node", "2", "--cpu_devices_per_proc", "4", "--start_port", "7000")
    endpoints = "127.0.0.1:7000,127.0.0.1:7001"
    assert [w.env for w in workers] == [
        {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": "2",
            "PADDLE_TRAINER_ENDPOINTS": endpoints,
            "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{7000 + rank}",
            "PADDLE_RANK_IN_NODE": str(rank),
            "PADDLE_NNODES": "1",
            "JAX_COORDINATOR_ADDRESS": "127.0.0.1:7000",
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "4",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            # fleet.init()'s join: JAX's wait for the others, its heartbeat timeout (s)
            "FLEETJAX_JOIN_TIMEOUT": "300",
            "FLEETJAX_JAX_HEARTBEAT_TIMEOUT": "8",
        }
        for rank in range(2)
    ]


def test_plan_on_gpus_of_the_second_node():
    workers = plan(
        "--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.2", "--gpus", "0,1,2,3",
        "--nproc_per_node", "2", environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
    )  # fmt: skip
    assert [(w.rank, w.local_rank) for w in workers] == [(2, 0), (3, 1)]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]
    assert [w.env["FLAGS_selected_gpus"] for w in workers] == ["0,1", "2,3"]
    assert workers[1].env["PADDLE_TRAINER_ENDPOINTS"] == (
        "10.0.0.1:6070,10.0.0.1:6071,10.0.0.2:6070,10.0.0.2:6071"
    )
    assert workers[1].env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:6071"
    assert workers[1].env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:6070"
    # A GPU JAX cannot use fails the worker; it never trains on the CPU instead.
    assert workers[0].env["JAX_PLATFORMS"] == "cuda"
    assert "JAX_NUM_CPU_DEVICES" not in workers[0].env


def test_plan_finds_gpus_and_this_node():
    # One process per visible GPU by default; this node is the --ips entry it can bind.
    workers = plan("--ips", "198.51.100.1,127.0.0.1", environ={"CUDA_VISIBLE_DEVICES": "5,7"})
    assert [(w.rank, w.env["CUDA_VISIBLE_DEVICES"]) for w in workers] == [(2, "5"), (3, "7")]
    assert (
        plan(environ={"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"})[0].env["JAX_PLATFORMS"]
        == "cpu"
    )


def test_fleetruns_other_spellings():
    # fleetrun's --worker_num and --trainers (parameter-server trainers), --selected_gpus.
    a = launch.parse_args(
        ["--worker_num", "2", "--trainers", "1.2.3.4:5", "--selected_gpus", "0", "t.py"]
    )
    b = launch.parse_args(["--trainer_num", "2", "--workers", "1.2.3.4:5", "--gpus", "0", "t.py"])
    assert vars(a) == vars(b)
    planned = plan("--server_num", "1", "--worker_num", "2", "--start_port", "6100")
    assert [(w.role, w.rank) for w in planned] == [("worker", 0), ("worker", 1), ("server", 0)]


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("--cpu_device_per_proc", "--cpu_devices_per_proc"),
        ("--nporc_per_node=2", "--nproc_per_node"),
        ("--nproc_per_nod", "--nproc_per_node"),  # no prefixes: an option is named in full
        ("--max-restarts", "--max-restart"),
    ],
)
def test_an_unknown_option_names_the_closest(given, meant):
    unknown = given.partition("=")[0]
    message = f"unknown option {unknown} (did you mean {meant}?); fleetjax-run --help lists them"
    with pytest.raises(launch.LaunchError, match=f"^{re.escape(message)}$"):
        launch.parse_args([given, "2", "train.py"])


def test_paddle_launchs_options_and_dashed_spellings():
    """`python -m paddle.distributed.launch`'s --run_mode and --log_level, and every option
    with dashes as well as underscores (torchrun's spelling)."""
    paddle = ["--run_mode", "collective", "--log_level", "warning", "--nproc_per_node", "2"]
    a = launch.parse_args([*paddle, "--max_restart", "1", "t.py", "--nproc-per-node", "9"])
    dashed = ["--run-mode", "collective", "--log-level", "WARNING", "--nproc-per-node", "2"]
    b = launch.parse_args([*dashed, "--max-restart", "1", "t.py", "--nproc-per-node", "9"])
    assert vars(a) == vars(b)
    assert (a.run_mode, a.log_level, a.nproc_per_node, a.max_restart) == ("collective", 30, 2, 1)
    assert a.training_script_args == ["--nproc-per-node", "9"]  # the script's own
    assert launch.parse_args(["t.py"]).log_level == logging.INFO  # Paddle's default
    ps = plan("--run_mode", "ps", "--server_num", "1", "--trainer_num", "1")
    assert [w.role for w in ps] == ["worker", "server"]


def test_the_defaults_for_faults():
    args = launch.parse_args(["train.py"])
    # Paddle's --max_restart 3 applies with --elastic_level >= 1 (Paddle's default -1: none).
    assert (args.max_restart, args.elastic_level, args.elastic_timeout) == (None, -1, 30)
    assert (args.heartbeat_timeout, args.peer_timeout, args.join_timeout) == (1800, 4, 300)


def test_plan_with_paddles_node_options():
    # --rank is the node's place in --ips (as --host), --nnodes their number.
    workers = plan("--ips", "10.0.0.1,10.0.0.2", "--rank", "1", "--nnodes", "2")
    assert [w.rank for w in workers] == [1]
    assert workers[0].env["PADDLE_NNODES"] == "2"
    # A single node needs no rendezvous at --master (as in Paddle); it listens on loopback.
    (worker,) = plan("--master", "10.0.0.1:8090", "--nnodes", "1", "--start_port", "7000")
    assert worker.env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:7000"


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (
            ["--gpus", "0,1,2", "--nproc_per_node", "2"],
            {"CUDA_VISIBLE_DEVICES": "0,1,2"},
            "3 GPUs (0,1,2) do not split evenly over --nproc_per_node 2 processes",
        ),
        (
            ["--gpus", "0,1", "--cpu_devices_per_proc", "4"],
            {"CUDA_VISIBLE_DEVICES": "0,1"},
            "--cpu_devices_per_proc applies without GPUs, but this node uses GPUs ['0', '1']; "
            "set JAX_PLATFORMS=cpu to train on the CPU",
        ),
        (
            ["--gpus", "0,1"],
            None,
            "--devices (--gpus) 0,1 names GPUs, but this machine has none (JAX_PLATFORMS=cpu); "
            "without GPUs, give the processes with --nproc_per_node and each one's simulated "
            "CPU devices with --cpu_devices_per_proc",
        ),
        (
            ["--devices", "0"],
            {"CUDA_VISIBLE_DEVICES": ""},
            "--devices (--gpus) 0 names GPUs, but this machine has none (CUDA_VISIBLE_DEVICES='')",
        ),
        (
            ["--gpus", "1,4"],
            {"CUDA_VISIBLE_DEVICES": "0,1"},
            "--devices (--gpus) 1,4: GPU 4 is not among this machine's GPUs 0,1",
        ),
        (
            ["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.3"],
            None,
            "--host 10.0.0.3 is not one of",
        ),
        (
            ["--ips", "198.51.100.1,198.51.100.2"],
            None,
            "cannot tell which of --ips 198.51.100.1,198.51.100.2 is this node (local addresses "
            "among them: none); pass --host",
        ),
        (
            ["--ips", "10.0.0.1,10.0.0.2", "--rank", "2"],
            None,
            "--rank 2 is outside --ips 10.0.0.1,10.0.0.2 (0..1)",
        ),
        (
            ["--ips", "10.0.0.1,10.0.0.2", "--rank", "1", "--host", "10.0.0.1"],
            None,
            "--rank 1 is not --host 10.0.0.1's place in --ips 10.0.0.1,10.0.0.2",
        ),
        (["--rank", "-2"], None, "--rank must be a node's rank (0, 1, ...) or -1 (any), got -2"),
        (["--ips", "10.0.0.1,,10.0.0.2"], None, "--ips='10.0.0.1,,10.0.0.2' has an empty entry"),
        (
            ["--nnodes", "2"],
            None,
            "--nnodes 2 but --ips lists 1 node(s); list every node in --ips, or let the nodes "
            "meet at --master",
        ),
        (
            ["--nnodes", "1:2", "--ips", "10.0.0.1,10.0.0.2"],
            None,
            "--nnodes 1:2 (an elastic range) needs --master, where nodes can come and go; --ips "
            "lists a fixed set of nodes",
        ),
        (
            ["--nnodes", "3:2", "--master", "10.0.0.1:8090"],
            None,
            "--nnodes must be a number of nodes (at least 1) or a range min:max, got '3:2'",
        ),
        (
            ["--nnodes", "\u00b2", "--master", "10.0.0.1:8090"],  # a digit to str.isdigit
            None,
            "--nnodes must be a number of nodes (at least 1) or a range min:max, got '\u00b2'",
        ),
        (
            ["--master", "10.0.0.1:\u00b2"],
            None,
            "--master '10.0.0.1:\u00b2' is not an address of the form host:port (or "
            "http://host:port)",
        ),
        (
            ["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.2", "--start_port", "1"],
            None,
            "--start_port 1: the launchers of --ips nodes meet at the first node's port "
            "start_port - 1, so it must be at least 2",
        ),
        (
            ["--master", "10.0.0.1:8090", "--ips", "10.0.0.1"],
            None,
            "give --master (the nodes meet there) or --ips, not both",
        ),
        (
            ["--master", "etcd://10.0.0.1:2379"],
            None,
            "--master 'etcd://10.0.0.1:2379' is not an address of the form host:port (or "
            "http://host:port)",
        ),
        (["--nproc_per_node", "0"], None, "--nproc_per_node must be at least 1, got 0"),
        (["--start_port", "70000"], None, "--start_port must be a port number 1..65535, got 70000"),
    ],
)
def test_plan_errors(argv, environ, message):
    with pytest.raises(launch.LaunchError, match=re.escape(message)):
        plan(*argv, environ=environ)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--log_dir", "{file}", "{script}"], "--log_dir {file} is a file, not a directory"),
        (["--log_dir", "{file}/log", "{script}"], "--log_dir {file}/log cannot be made: "),
        (["{tmp}/missing.py"], "the training script {tmp}/missing.py is not a file"),
        ([], "no training script: fleetjax-run [options] train.py [its arguments]"),
        (
            ["--nproc_per_node", "two", "{script}"],
            "argument --nproc_per_node/--nproc-per-node: invalid int value",
        ),
        (
            ["--heartbeat_timeout", "-1", "{script}"],
            "argument --heartbeat_timeout/--heartbeat-timeout: must be a number of seconds (0 or "
            "more), got '-1'",
        ),
        (
            ["--peer_timeout", "0.5", "{script}"],
            "--peer_timeout must be at least 1 second, got 0.5",
        ),
        (["--max_restart", "-1", "{script}"], "--max_restart must be 0 or more, got -1"),
        (["--no_such_option", "{script}"], "unknown option --no_such_option; fleetjax-run --help"),
        (
            ["--run_mode", "rpc", "{script}"],
            "argument --run_mode/--run-mode: invalid choice: 'rpc' (choose from 'collective', "
            "'ps')",
        ),
        (
            ["--worker_num", "2", "{script}"],
            "--trainer_num (--worker_num) 2 without servers: a parameter-server job (Paddle's "
            "--run_mode ps) also needs its servers, --server_num N on this node or --servers "
            "ip:port,...; for a collective job of 2 processes on this node, give "
            "--nproc_per_node 2 instead",
        ),
        (
            ["--run_mode", "ps", "{script}"],
            "--run_mode ps needs the job's servers and trainers: --server_num N and "
            "--trainer_num M on this node (or --servers and --workers, lists of ip:port)",
        ),
        (
            ["--run_mode", "collective", "--server_num", "1", "{script}"],
            "--run_mode collective, but --server_num is an option of a parameter-server job",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    names = {"file": tmp_path / "a_file", "script": tmp_path / "train.py", "tmp": tmp_path}
    names["file"].write_text("")
    names["script"].write_text("")
    code = launch.main([arg.format(**names) for arg in argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith(f"fleetjax-run: error: {message.format(**names)}")
    assert err.count("\n") == 1, err


def test_workers_get_their_variables_and_a_new_log_each_run(launcher, tmp_path):
    port = free_port()
    for args in (["--first"], ["--flag", "value"]):
        proc = launcher(
            "--nproc_per_node", "2", "--cpu_devices_per_proc", "3", "--start_port", str(port),
            str(WORKER), "env", *args,
        )  # fmt: skip
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    logs = [(tmp_path / "log" / f"workerlog.{r}").read_text().splitlines() for r in (0, 1)]
    assert [len(lines) for lines in logs] == [2, 2]  # pid=..., the record: the last run only
    records = [json.loads(lines[1]) for lines in logs]
    for rank, record in enumerate(records):
        assert record["rank"] == rank
        assert record["args"] == ["--flag", "value"]
        assert record["env"]["PADDLE_CURRENT_ENDPOINT"] == f"127.0.0.1:{port + rank}"
        assert record["env"]["JAX_NUM_CPU_DEVICES"] == "3"
        log = tmp_path / "log" / f"workerlog.{rank}"
        assert record["env"]["FLEETJAX_HEARTBEAT_FILE"] == str(log.absolute())
    assert len({record["env"]["FLEETJAX_RUN_ID"] for record in records}) == 1
    # The script runs as `python launch_worker.py ...` would run it (under the worker entry).
    assert records[0]["script"] == {
        "argv": [str(WORKER), "env", "--flag", "value"],
        "path0": str(WORKER.parent),
        "name": "__main__",
        "file": str(WORKER),
    }
    # Worker 0 is also on the console, worker 1 only in its log.
    assert '"rank": 0' in out and '"rank": 1' not in out
    assert "fleetjax-run: starting workers 0..1 of 2" in err


def test_a_busy_port_is_reported(launcher):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launcher("--nproc_per_node", "2", "--start_port", str(port), str(WORKER), "env")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == (
        f"fleetjax-run: error: the coordinator port {port} is already in use on this machine "
        "(another job?); choose a free one with --start_port"
    )


# -- the same training on 2 processes as on 1 ------------------------------------------------
def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([\d.]+)$", output, re.M)}


# two processes training: tests/facade/test_multiprocess.py does it in the default run
@pytest.mark.slow
def test_two_processes_train_like_one(launcher, tmp_path):
    args = ["--steps", "12", "--log-every", "3", "--hidden", "64"]
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "4", "--start_port", str(free_port()),
        str(EXAMPLE), *args,
    )  # fmt: skip
    single = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--cpu-devices", "8"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert single.returncode == 0, single.stderr
    assert "8 cpu devices, mesh {'dp': 8" in out
    two, one = _losses(out), _losses(single.stdout)
    assert list(two) == list(one) == [3, 6, 9, 12]
    np.testing.assert_allclose(list(two.values()), list(one.values()), rtol=1e-5)
    # Worker 1 trained the same steps; its log has the same losses.
    assert _losses((tmp_path / "log" / "workerlog.1").read_text()) == two


# -- Paddle's --master: nodes that find each other -------------------------------------------
def _env_record(log: pathlib.Path) -> dict:
    return json.loads(log.read_text().splitlines()[1])["env"]


def test_nodes_meet_at_master(launcher, tmp_path):
    master, ports = f"127.0.0.1:{free_port()}", [free_port(), free_port()]
    nodes = []
    for rank in (1, 0):  # the serving node may come second
        options = ["--master", master, "--nnodes", "2", "--rank", str(rank), "--job_id", "meet"]
        options += ["--start_port", str(ports[rank]), "--nproc_per_node", "1"]
        nodes.append(launcher(*options, str(WORKER), "env", log_dir=tmp_path / f"node{rank}"))
    for node in nodes:
        _, err = node.communicate(timeout=120)
        assert node.returncode == 0, err
    endpoints = f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    for rank in (0, 1):
        env = _env_record(tmp_path / f"node{rank}" / f"workerlog.{rank}")
        assert env["PADDLE_TRAINER_ID"] == str(rank)
        assert env["PADDLE_TRAINER_ENDPOINTS"] == endpoints
        assert env["PADDLE_NNODES"] == "2"
        assert env["JAX_COORDINATOR_ADDRESS"] == f"127.0.0.1:{ports[0]}"


def test_a_node_of_another_job_is_refused(launcher, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    common = ["--master", master, "--nnodes", "2", "--nproc_per_node", "1"]
    serving = launcher(*common, "--job_id", "a", str(WORKER), "env", log_dir=tmp_path / "a")
    wait_for(lambda: serving.poll() is not None or listening(int(master.split(":")[1])), 60, "a")
    other = launcher(*common, "--job_id", "b", str(WORKER), "env", log_dir=tmp_path / "b")
    _, err = other.communicate(timeout=60)
    assert other.returncode == 2
    assert err == (
        f"fleetjax-run: error: the rendezvous at {master} refused: this is the rendezvous of "
        "job 'a'\n"
    )
    assert serving.poll() is None  # still waiting for a node of its own job


def test_nodes_asking_for_one_rank_are_refused(launcher, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    options = ["--master", master, "--nnodes", "2", "--rank", "0"]
    nodes = [
        launcher(
            *options,
            "--start_port",
            str(free_port()),
            str(WORKER),
            "env",
            log_dir=tmp_path / f"n{i}",
        )
        for i in (0, 1)
    ]
    errors = [node.communicate(timeout=60)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [2, 2]
    problem = "the nodes ask for ranks [0, 0], which are not distinct ranks 0..1 of --nnodes 2"
    assert sorted(errors) == sorted(
        [
            f"fleetjax-run: error: {problem}\n",
            f"fleetjax-run: error: the rendezvous at {master} refused: {problem}\n",
        ]
    )


# -- the coordinator ---------------------------------------------------------------------------
def test_the_coordinator_listens_on_the_named_address_only(launcher, tmp_path):
    port = free_port()
    launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "1", "--start_port", str(port),
        str(WORKER), "train",
    )  # fmt: skip
    logs = [tmp_path / "log" / f"workerlog.{rank}" for rank in (0, 1)]
    wait_for(lambda: all(log.exists() and "ready" in log.read_text() for log in logs), 120, "ready")
    # Loopback only (maybe as IPv6's ::ffff:127.0.0.1), not every interface (0.0.0.0, [::]).
    assert listening(port) == {ipaddress.ip_address("127.0.0.1")}


def test_the_console_leaves_out_gloos_lines_and_the_log_keeps_them(launcher, tmp_path):
    """Gloo prints a line for each communicator it connects; the console (worker 0's echo)
    shows the script's output only, a progress bar's unfinished line at once."""
    proc = launcher(str(WORKER), "gloo", text=False)  # bytes: a bar's \r as written
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.partition(b"\n")[2] == b"before\n50%\r100%\ndone\n"  # after the worker's pid=
    log = (tmp_path / "log" / "workerlog.0").read_bytes()
    assert b"before\n[Gloo] Rank 0 is connected to 1 peer ranks\n50%\r" in log
    assert (
        err.decode()
        == f"fleetjax-run: starting workers 0..0 of 1; logs in {tmp_path}/log/workerlog.N\n"
    )
    # --log_level WARNING (Paddle's levels): the launcher's progress is left out, errors not.
    proc = launcher("--log_level", "WARNING", str(WORKER), "gloo")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "", err
    proc = launcher("--log_level", "WARNING", str(WORKER), "fail0")
    out, err = proc.communicate(timeout=60)
    assert "fleetjax-run: worker 0 exited with code 1; stopping all workers" in err
