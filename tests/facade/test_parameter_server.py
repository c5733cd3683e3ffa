"""Parameter-server roles: Paddle's PS environment and role makers, the fleet's role queries and
its runtime calls (`init_worker`, `init_server`, `run_server`, `stop_worker`)."""

import json
import logging
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from launching import alive, free_port, wait_for

import fleetjax
from fleetjax import launch
from fleetjax.fleet.base.role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker

SERVERS = "127.0.0.1:6001,127.0.0.1:6002"
PS_WORKER = pathlib.Path(__file__).parents[1] / "ps_worker.py"


class TableModel(nnx.Module):
    """A sparse table, summed over each example's ids, and a dense layer."""

    def __init__(self, rngs):
        self.emb = fleetjax.layers.SparseEmbedding(64, 4, table_name="emb", rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.emb(ids).sum(1))[:, 0]


def ps_env(role, **extra):
    env = {
        "PADDLE_PSERVERS_IP_PORT_LIST": SERVERS,
        "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7001,127.0.0.1:7002",
        "TRAINING_ROLE": role,
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": "6002" if role == "PSERVER" else "7002",
        "PADDLE_TRAINER_ID": "1",
    }
    return {**env, **extra}


class TestRoleMakers:
    def test_a_server_answers_paddles_queries(self):
        role = PaddleCloudRoleMaker(is_collective=False, environ=ps_env("PSERVER"))
        assert (role._is_server(), role._is_worker(), role._is_first_worker()) == (
            True, False, False,
        )  # fmt: skip
        assert (role._server_num(), role._server_index(), role._worker_num()) == (2, 1, 2)
        assert role._worker_index() == 1  # Paddle's current_id: the server's index
        assert role._get_pserver_endpoints() == SERVERS.split(",")
        assert not role.is_distributed  # a server joins no process

    def test_a_trainer_answers_paddles_queries(self):
        role = PaddleCloudRoleMaker(is_collective=False, environ=ps_env("TRAINER"))
        assert (role._is_server(), role._is_worker(), role._worker_index()) == (False, True, 1)
        assert (role._worker_num(), role._server_num(), role.is_distributed) == (2, 2, True)
        assert role.worker_endpoints == ["127.0.0.1:7001", "127.0.0.1:7002"]
        assert role._get_trainer_endpoint() == "127.0.0.1:7002"

    def test_paddles_default_is_parameter_server_mode(self, monkeypatch):
        """Paddle's test_fleet_base: `PaddleCloudRoleMaker()` under TRAINING_ROLE=PSERVER is a
        server (its `is_collective` defaults to False)."""
        for name, value in ps_env("PSERVER").items():
            monkeypatch.setenv(name, value)
        role = PaddleCloudRoleMaker()
        assert (role.is_collective, role._is_server(), role._server_index()) == (False, True, 1)

    def test_without_servers_a_lone_trainer_as_in_paddle(self):
        role = PaddleCloudRoleMaker(is_collective=False, environ={})
        assert (role._is_worker(), role._worker_num(), role._server_num()) == (True, 1, 0)
        assert role._is_non_distributed() and not role.is_collective

    def test_without_servers_the_trainer_variables_are_ignored_as_in_paddle(self):
        """Paddle's test_fleet_base_2 sets PADDLE_TRAINER_ID=1 beside PADDLE_TRAINERS_NUM=1."""
        env = {"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "1", "TRAINING_ROLE": "TRAINER",
               "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7001,127.0.0.1:7002"}  # fmt: skip
        with pytest.warns(
            fleetjax.StrategyWarning,
            match=r"^PADDLE_TRAINER_ID=1, PADDLE_TRAINER_ENDPOINTS=127.0.0.1:7001,127.0.0.1:7002 "
            "ignored: without PADDLE_PSERVERS_IP_PORT_LIST this process is one non-distributed "
            r"parameter-server trainer \(index 0\), as in Paddle$",
        ):
            role = PaddleCloudRoleMaker(is_collective=False, environ=env)
            assert (role._worker_index(), role._worker_num(), role.worker_endpoints) == (0, 1, [])
        assert role._is_non_distributed() and not role.is_distributed

    def test_repeated_server_endpoints_are_accepted_with_a_warning_as_in_paddle(self):
        """Paddle's test_fleet_rolemaker_new gives two servers one endpoint."""
        repeated = ["127.0.0.1:36001", "127.0.0.1:36001"]
        message = (
            r"^UserDefinedRoleMaker\(is_collective=False\): server_endpoints: server endpoints "
            r"repeat \(127.0.0.1:36001\); accepted, as in Paddle, where those servers would "
            "collide on the port. fleetjax's servers hold no tables and bind nothing, so here it "
            "is harmless$"
        )
        with pytest.warns(fleetjax.StrategyWarning, match=message) as record:
            for current_id in (0, 1):
                role = UserDefinedRoleMaker(
                    is_collective=False, server_endpoints=repeated, role=Role.SERVER,
                    current_id=current_id, worker_num=2,
                )  # fmt: skip
                assert (role._is_server(), role._server_index()) == (True, current_id)
                assert (role._server_num(), role._get_pserver_endpoints()) == (2, repeated)
        assert len(record) == 1  # once
        env = ps_env("PSERVER", PADDLE_PSERVERS_IP_PORT_LIST="127.0.0.1:6002,127.0.0.1:6002")
        with pytest.warns(fleetjax.StrategyWarning, match="^PADDLE_PSERVERS_IP_PORT_LIST: server"):
            role = PaddleCloudRoleMaker(is_collective=False, environ=env)
            assert (role._server_index(), role._server_num()) == (0, 2)  # the first, as Paddle's

    def test_worker_endpoints_stay_distinct(self):
        servers = SERVERS.split(",")
        with pytest.raises(ValueError, match="worker_endpoints: worker endpoints repeat"):
            UserDefinedRoleMaker(
                is_collective=False, server_endpoints=servers, current_id=0,
                worker_endpoints=["127.0.0.1:7001", "127.0.0.1:7001"],
            )  # fmt: skip
        env = ps_env("TRAINER", PADDLE_TRAINER_ENDPOINTS="127.0.0.1:7001,127.0.0.1:7001")
        with pytest.raises(ValueError, match="PADDLE_TRAINER_ENDPOINTS: worker endpoints repeat"):
            PaddleCloudRoleMaker(is_collective=False, environ=env)._generate_role()

    def test_trainers_without_endpoints_answer_and_fail_to_join(self, ps_fleet, monkeypatch):
        """Paddle's role maker needs no trainer endpoints (test_fleet_rolemaker); joining
        several trainers does, so fleet.init names them."""
        monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
        env = ps_env("TRAINER", PADDLE_TRAINER_ENDPOINTS="")
        role = PaddleCloudRoleMaker(is_collective=False, environ=env)
        assert (role._is_worker(), role._worker_index(), role._worker_num()) == (True, 1, 2)
        fleet = ps_fleet(env)
        with pytest.raises(
            ValueError,
            match=r"^2 parameter-server trainers join as one SPMD job .* set "
            "PADDLE_TRAINER_ENDPOINTS .* or JAX_COORDINATOR_ADDRESS$",
        ):
            fleet.init(is_collective=False)

    @pytest.mark.parametrize(
        "env, message",
        [
            ({"PADDLE_PSERVERS_IP_PORT_LIST": None}, "TRAINING_ROLE=PSERVER but "
             "PADDLE_PSERVERS_IP_PORT_LIST is not set"),
            ({"PADDLE_PSERVERS_IP_PORT_LIST": ""}, "PADDLE_PSERVERS_IP_PORT_LIST is empty"),
            ({"PADDLE_PORT": "6003"}, "this server's POD_IP:PADDLE_PORT, 127.0.0.1:6003, is not "
             "in PADDLE_PSERVERS_IP_PORT_LIST"),
            ({"POD_IP": None}, "Can not find POD_IP, please check your environment."),
            ({"POD_IP": None, "PADDLE_PORT": None}, "Can not find PADDLE_PORT"),  # Paddle's order
            ({"TRAINING_ROLE": "HETER_TRAINER"}, "TRAINING_ROLE must be PSERVER or TRAINER"),
            ({"TRAINING_ROLE": None}, "Can not find TRAINING_ROLE"),
            ({"PADDLE_TRAINERS_NUM": None}, "Can not find PADDLE_TRAINERS_NUM"),
            ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1"}, "is not an endpoint of the form"),
        ],
    )  # fmt: skip
    def test_a_server_environment_that_names_no_role(self, env, message):
        environ = {k: v for k, v in {**ps_env("PSERVER"), **env}.items() if v is not None}
        role = PaddleCloudRoleMaker(is_collective=False, environ=environ)  # Paddle's: no error
        with pytest.raises(ValueError, match=message):
            role._generate_role()  # Paddle reads the environment here, on first use

    @pytest.mark.parametrize(
        "env, message",
        [
            ({"PADDLE_TRAINER_ID": None, "POD_IP": None}, "Can not find PADDLE_TRAINER_ID"),
            ({"PADDLE_TRAINER_ID": "2"}, "trainer index 2 is outside 0..1 for 2 trainers"),
            ({"PADDLE_PORT": None, "POD_IP": None}, "Can not find PADDLE_PORT"),
            ({"PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7001"}, "lists 1 trainers, but there are 2"),
        ],
    )  # fmt: skip
    def test_a_trainer_environment_that_names_no_role(self, env, message, monkeypatch):
        monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
        environ = {k: v for k, v in {**ps_env("TRAINER"), **env}.items() if v is not None}
        role = PaddleCloudRoleMaker(is_collective=False, environ=environ)  # Paddle's: no error
        with pytest.raises(ValueError, match=message):
            role._is_worker()  # any role query reads it first

    def test_user_defined(self):
        servers = SERVERS.split(",")
        role = UserDefinedRoleMaker(
            is_collective=False, role=Role.SERVER, current_id=0, worker_num=4,
            server_endpoints=servers,
        )  # fmt: skip
        assert (role._is_server(), role._server_index(), role._worker_num()) == (True, 0, 4)
        trainer = UserDefinedRoleMaker(
            is_collective=False, current_id=0, worker_num=1, server_endpoints=servers
        )
        assert (trainer._is_worker(), trainer._is_first_worker()) == (True, True)
        with pytest.raises(ValueError, match="needs server_endpoints"):
            UserDefinedRoleMaker(is_collective=False, worker_num=1)
        with pytest.raises(ValueError, match="server index 2 is outside 0..1 for 2 servers"):
            UserDefinedRoleMaker(
                is_collective=False, role=Role.SERVER, current_id=2, worker_num=1,
                server_endpoints=servers,
            )  # fmt: skip


@pytest.fixture
def ps_fleet(monkeypatch):
    """A fresh fleet and a function that sets Paddle's PS variables for it."""
    for name in ("PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(name, raising=False)

    def with_env(env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return fleetjax.fleet.Fleet()

    return with_env


class TestFleet:
    def test_a_server_starts_serves_and_returns(self, ps_fleet, caplog):
        fleet = ps_fleet(ps_env("PSERVER"))
        fleet.init(is_collective=False)
        assert (fleet.is_server(), fleet.is_worker(), fleet.server_num()) == (True, False, 2)
        assert (fleet.server_index(), fleet.worker_num()) == (1, 2)
        assert fleet.server_endpoints(to_string=True) == SERVERS
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fleetjax"):
            fleet.init_server()
            fleet.run_server()
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            "fleet.init_server(): fleetjax's sparse tables live sharded over the trainers' "
            "devices, so this server holds none",
            "fleet.run_server(): fleetjax's sparse tables live sharded over the trainers' "
            "devices, so this server has nothing to serve and ends",
        ]
        with pytest.raises(RuntimeError, match="this process is parameter server 1: .* builds no"):
            _ = fleet.mesh
        with pytest.raises(ValueError, match=r"init_worker\(\) is a parameter-server trainer's"):
            fleet.init_worker()

    def test_init_server_with_a_model_directory_says_where_tables_load(self, ps_fleet):
        fleet = ps_fleet(ps_env("PSERVER"))
        fleet.init(is_collective=False)
        with pytest.warns(fleetjax.StrategyWarning, match="fleet.load_persistables"):
            fleet.init_server("/models/day1")

    def test_a_lone_trainer(self, ps_fleet, caplog):
        fleet = ps_fleet(ps_env("TRAINER", PADDLE_TRAINERS_NUM="1", PADDLE_TRAINER_ID="0",
                                PADDLE_TRAINER_ENDPOINTS="127.0.0.1:7001"))  # fmt: skip
        fleet.init(is_collective=False)
        assert (fleet.is_worker(), fleet.is_first_worker(), fleet.worker_num()) == (True, True, 1)
        assert dict(fleet.mesh.shape)["dp"] == 8
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fleetjax"):
            fleet.init_worker()
            fleet.stop_worker()
        assert len(caplog.records) == 2
        with pytest.raises(ValueError, match=r"run_server\(\) is a parameter-server server's"):
            fleet.run_server()

    def test_no_servers_named_warns_as_paddle(self, ps_fleet, monkeypatch):
        monkeypatch.delenv("PADDLE_PSERVERS_IP_PORT_LIST", raising=False)
        monkeypatch.delenv("TRAINING_ROLE", raising=False)
        fleet = ps_fleet({})
        fleet.init(is_collective=False)
        with pytest.warns(UserWarning, match="doesn't work when use non_distributed fleet"):
            fleet.init_worker()

    @pytest.mark.parametrize("call", ["init_worker", "init_server", "run_server", "stop_worker"])
    def test_collective_mode_has_no_parameter_server_runtime(self, ps_fleet, call):
        fleet = ps_fleet({"PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7001"})
        fleet.init()
        with pytest.raises(ValueError, match="Fleet can not find suitable runtime handler"):
            getattr(fleet, call)()

    @pytest.mark.parametrize(
        "call, args",
        [("init_worker", ()), ("init_server", ()), ("run_server", ()), ("stop_worker", ()),
         ("save", ("/nonexistent/x",)), ("load_model", ("/nonexistent/x", 0))],
    )  # fmt: skip
    def test_a_process_alone_warns_in_either_mode_as_paddle(self, ps_fleet, call, args):
        """Paddle checks `_is_non_distributed()` before the mode (its decorators' order)."""
        fleet = ps_fleet({})
        fleet.init()
        with pytest.warns(UserWarning, match=rf"^{call}\(\) function doesn't work when use "):
            assert getattr(fleet, call)(*args) is None


def test_the_fleets_trainer_trains_an_nnx_models_tables_by_their_rows(ps_fleet):
    """fleet.distributed_model + fleet.minimize on a model with a SparseEmbedding: the same
    states as the functional step on the model's parameters."""
    rng = np.random.RandomState(0)
    batches = [
        {"ids": rng.randint(0, 64, (32, 3)).astype(np.int32), "y": rng.randn(32).astype("f4")}
        for _ in range(3)
    ]
    fleet = ps_fleet({})
    fleet.init(is_collective=False)
    model = fleet.distributed_model(TableModel(nnx.Rngs(0)))
    fleet.distributed_optimizer(fleetjax.optimizers.adam(0.01))
    losses = [
        float(fleet.minimize(lambda m, b: jnp.mean((m(b["ids"]) - b["y"]) ** 2), b))
        for b in batches
    ]

    graphdef, params = nnx.split(TableModel(nnx.Rngs(0)))

    def loss(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b["ids"]) - b["y"]) ** 2)

    step = fleetjax.make_train_step(loss, fleetjax.optimizers.adam(0.01))
    state, expected = step.init(params), []
    for b in batches:
        state, metrics = step(state, b)
        expected.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    np.testing.assert_allclose(model.emb.weight[...], state.params["emb"]["weight"][...], rtol=1e-6)
    assert isinstance(model.emb.weight, fleetjax.layers.SparseTable)
    assert jax.tree.leaves(fleet.trainer.state.opt_state.slots)  # the tables' rule slots


def test_save_and_load_model_on_a_trainer(ps_fleet, tmp_path):
    """Paddle's `fleet.fleet.save(dirname)` and `fleet.load_model(path, mode)` (Paddle's
    test_fleet_base_2): the trainer goes on from the saved state, tables included; with
    `feed` and `fetch`, `save` exports the trained model."""

    def loss(m, b):
        return jnp.mean((m(b["ids"]) - b["y"]) ** 2)

    rng = np.random.RandomState(0)
    batch = {"ids": rng.randint(0, 64, (32, 3)).astype(np.int32), "y": rng.randn(32).astype("f4")}
    fleet = ps_fleet(ps_env("TRAINER", PADDLE_TRAINERS_NUM="1", PADDLE_TRAINER_ID="0",
                            PADDLE_TRAINER_ENDPOINTS="127.0.0.1:7001"))  # fmt: skip
    fleet.init(is_collective=False)
    model = fleet.distributed_model(TableModel(nnx.Rngs(0)))
    fleet.distributed_optimizer(fleetjax.optimizers.adam(0.01))
    fleet.minimize(loss, batch)
    fleet.save(str(tmp_path / "state"))
    saved = np.asarray(model.emb.weight[...])
    after = float(fleet.minimize(loss, batch)), np.asarray(model.emb.weight[...])
    assert not np.allclose(after[1], saved)
    with pytest.warns(fleetjax.StrategyWarning, match=r"fleet.load_model\(mode=1\): Paddle's"):
        fleet.load_model(str(tmp_path / "state"), mode=1)
    np.testing.assert_array_equal(model.emb.weight[...], saved)
    assert float(fleet.minimize(loss, batch)) == after[0]  # the step after the save, again
    np.testing.assert_array_equal(model.emb.weight[...], after[1])

    fleet.save(str(tmp_path / "model"), feed=["ids"], fetch=[lambda m, f: m(f["ids"])])
    exported = fleet.load_inference_model(str(tmp_path / "model"))
    expected = model(batch["ids"]).numpy()  # a DistributedModel's outputs, read
    np.testing.assert_allclose(exported(batch["ids"])[0], expected, rtol=1e-6)
    with pytest.raises(TypeError, match=r"unknown configs \['modes'\]; Paddle's is mode"):
        fleet.save(str(tmp_path / "state"), modes=1)


# -- a parameter-server job through fleetjax-run ------------------------------------------------


def _job(launcher, mode):
    return launcher(
        "--server_num", "1", "--trainer_num", "2", "--cpu_devices_per_proc", "2",
        "--start_port", str(free_port()), str(PS_WORKER), mode,
    )  # fmt: skip


def _answers(log):
    return next(json.loads(line) for line in log.read_text().splitlines() if line[:1] == "{")


def _pids(log_dir):
    return [
        int(p) for log in log_dir.glob("*log.*") for p in re.findall(r"pid=(\d+)", log.read_text())
    ]


def test_a_parameter_server_job_through_the_launcher(launcher, tmp_path):
    """One server and two trainers with Paddle's PS variables: each answers its role as
    Paddle's do, the server ends after init_server() and run_server(), the trainers join."""
    proc = _job(launcher, "roles")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "starting workers 0..1 of 2 and 1 parameter server(s)" in err
    logs = tmp_path / "log"
    server = _answers(logs / "serverlog.0")
    assert server == {
        "is_server": True, "is_worker": False, "server_num": 1, "server_index": 0,
        "worker_num": 2, "worker_index": 0, "server_endpoints": [server["server_endpoints"][0]],
    }  # fmt: skip
    assert "this server has nothing to serve and ends" in (logs / "serverlog.0").read_text()
    for rank in (0, 1):
        trainer = _answers(logs / f"workerlog.{rank}")
        assert (trainer["is_worker"], trainer["worker_index"], trainer["worker_num"]) == (
            True, rank, 2,
        )  # fmt: skip
        assert f"ready: trainer {rank} of 2" in (logs / f"workerlog.{rank}").read_text()
    assert len(_pids(logs)) == 3 and not any(alive(pid) for pid in _pids(logs))


def test_a_raising_trainer_stops_the_job(launcher, tmp_path):
    proc = _job(launcher, "raise")
    _, err = proc.communicate(timeout=120)
    ended = time.time()
    raised = float(re.search(r"raising at ([\d.]+)", err)[1])
    assert ended - raised < 10
    assert proc.returncode == 1
    assert "fleetjax-run: worker 1 exited with code 1; stopping all workers" in err
    assert "RuntimeError: trainer 1 fails on purpose" in err
    pids = _pids(tmp_path / "log")
    wait_for(lambda: not any(alive(pid) for pid in pids), 15, f"the end of {pids}")


def test_the_launchers_parameter_server_plan():
    args = launch.parse_args(
        ["--server_num", "2", "--trainer_num", "2", "--start_port", "6100", "train.py"]
    )
    planned = launch.plan_workers(args, {"JAX_PLATFORMS": "cpu"})
    assert [(w.role, w.rank, w.log_name) for w in planned] == [
        ("worker", 0, "workerlog.0"), ("worker", 1, "workerlog.1"),
        ("server", 0, "serverlog.0"), ("server", 1, "serverlog.1"),
    ]  # fmt: skip
    trainer, server = planned[1].env, planned[3].env
    assert trainer["PADDLE_PSERVERS_IP_PORT_LIST"] == "127.0.0.1:6100,127.0.0.1:6101"
    assert (trainer["TRAINING_ROLE"], trainer["PADDLE_TRAINER_ID"], trainer["PADDLE_PORT"]) == (
        "TRAINER", "1", "6103",
    )  # fmt: skip
    assert trainer["JAX_COORDINATOR_ADDRESS"] == trainer["PADDLE_TRAINER_ENDPOINTS"].split(",")[0]
    assert (server["TRAINING_ROLE"], server["POD_IP"], server["PADDLE_PORT"]) == (
        "PSERVER", "127.0.0.1", "6101",
    )  # fmt: skip
    assert server["JAX_PLATFORMS"] == "cpu" and "PADDLE_TRAINER_ID" not in server


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--server_num", "1"], "needs --trainer_num"),
        (["--server_num", "1", "--trainer_num", "1", "--ips", "10.0.0.1"], "--ips is for"),
        (["--servers", "127.0.0.1:7000", "--server_num", "2", "--trainer_num", "1"],
         "--server_num 2 but --servers lists 1"),
        (["--servers", "127.0.0.1", "--trainer_num", "1"], "is not an endpoint of the form"),
        (["--servers", "10.9.9.9:7000", "--workers", "10.9.9.9:7001"], "none of --servers"),
    ],
)  # fmt: skip
def test_the_launchers_parameter_server_errors(argv, message):
    args = launch.parse_args([*argv, "train.py"])
    with pytest.raises(launch.LaunchError, match=message):
        launch.plan_workers(args, {"JAX_PLATFORMS": "cpu"})
