"""The Fleet API in one process: role makers, roles, util, and refusals of PS mode."""

import optax
import pytest

import fleetjax
from fleetjax import StrategyWarning, fleet
from fleetjax.fleet import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker

ENDPOINTS = "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170"


class TestRoleMakers:
    def test_paddle_check_case_29_collective_env(self):
        role = PaddleCloudRoleMaker(
            True, environ={"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": ENDPOINTS}
        )
        assert (role.worker_index, role.worker_num, role.node_num) == (1, 3, 2)
        assert role.current_endpoint == "10.0.0.1:6171"
        assert role.is_distributed and role.role == Role.WORKER

    def test_no_environment_is_a_single_worker(self):
        role = PaddleCloudRoleMaker(True, environ={})
        assert (role.worker_index, role.worker_num, role.is_distributed) == (0, 1, False)
        assert role.worker_endpoints == ["127.0.0.1:6170"]

    def test_all_four_variables(self):
        env = {
            "PADDLE_TRAINER_ID": "2",
            "PADDLE_TRAINERS_NUM": "3",
            "PADDLE_TRAINER_ENDPOINTS": ENDPOINTS,
            "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6170",
        }
        assert PaddleCloudRoleMaker(True, environ=env).worker_index == 2

    def test_reads_os_environ(self, monkeypatch):
        monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:7000,127.0.0.1:7001")
        monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
        assert PaddleCloudRoleMaker(is_collective=True).worker_index == 1

    @pytest.mark.parametrize(
        ("env", "message"),
        [
            ({"PADDLE_TRAINER_ID": "3", "PADDLE_TRAINER_ENDPOINTS": ENDPOINTS},
             "worker index 3 is outside 0..2 for 3 worker endpoints"),
            ({"PADDLE_TRAINER_ID": "one"}, "PADDLE_TRAINER_ID must be an integer, got 'one'"),
            ({"PADDLE_TRAINER_ENDPOINTS": "10.0.0.1"}, "'10.0.0.1' is not an endpoint"),
            ({"PADDLE_TRAINER_ENDPOINTS": "a:1,a:1"}, "worker endpoints repeat"),
            ({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINER_ENDPOINTS": ENDPOINTS,
              "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6170"},
             "current endpoint '10.0.0.2:6170' is not worker 1's endpoint '10.0.0.1:6171'"),
        ],
    )  # fmt: skip
    def test_bad_environment(self, env, message):
        role = PaddleCloudRoleMaker(True, environ=env)  # as Paddle's: read on first use
        with pytest.raises(ValueError, match=message):
            role._generate_role()
        with pytest.raises(ValueError, match=message):
            role.worker_index  # noqa: B018  (every role query reads it)

    def test_trainers_num_differing_from_the_endpoints_warns_and_counts_endpoints(self):
        env = {"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:36000"}
        with pytest.warns(
            StrategyWarning,
            match=r"PADDLE_TRAINERS_NUM=2 but PADDLE_TRAINER_ENDPOINTS lists 1 endpoint\(s\) "
            r"\(127.0.0.1:36000\): the worker count is the endpoint count, 1, as in Paddle",
        ):
            role = PaddleCloudRoleMaker(True, environ=env)
            assert (role.worker_num, role._worker_num(), role.is_distributed) == (1, 1, False)

    def test_user_defined(self):
        role = UserDefinedRoleMaker(current_id=1, worker_endpoints=["h1:1", "h2:1"])
        assert (role.worker_index, role.worker_num, role.node_num) == (1, 2, 2)
        with pytest.raises(ValueError, match="worker_num=3 but worker_endpoints lists 2"):
            UserDefinedRoleMaker(worker_endpoints=["h1:1", "h2:1"], worker_num=3)
        with pytest.raises(TypeError, match="worker index must be int"):
            UserDefinedRoleMaker(current_id="0")

    def test_parameter_server_settings_need_parameter_server_mode(self):
        with pytest.raises(ValueError, match="server_endpoints and role=Role.SERVER are"):
            UserDefinedRoleMaker(role=Role.SERVER)
        with pytest.raises(ValueError, match="pass is_collective=False"):
            UserDefinedRoleMaker(server_endpoints=["h:1"])


@pytest.fixture
def fresh_fleet(monkeypatch):
    for name in ("PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(name, raising=False)
    return fleetjax.fleet.Fleet()


class TestFleet:
    def test_before_init(self, fresh_fleet):
        with pytest.raises(RuntimeError, match=r"call fleet.init\(\) first"):
            fresh_fleet.worker_index()
        with pytest.raises(RuntimeError, match=r"call fleet.init\(\) first"):
            _ = fresh_fleet.mesh

    def test_single_process_roles(self, fresh_fleet):
        assert fresh_fleet.init(is_collective=True) is fresh_fleet
        f = fresh_fleet
        assert (f.worker_index(), f.worker_num(), f.is_first_worker(), f.is_worker()) == (
            0, 1, True, True,
        )  # fmt: skip
        assert f.worker_endpoints() == ["127.0.0.1:6170"]
        assert f.worker_endpoints(to_string=True) == "127.0.0.1:6170"
        assert (f.server_num(), f.server_index(), f.is_server()) == (0, 0, False)
        assert f.server_endpoints() == [] and f.server_endpoints(to_string=True) == ""
        assert dict(f.mesh.shape) == {"dp": 8, "pp": 1, "sharding": 1, "mp": 1}
        f.barrier_worker()

    def test_init_with_role_maker_and_strategy(self, fresh_fleet):
        s = fleetjax.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 4, "mp_degree": 2}
        fresh_fleet.init(UserDefinedRoleMaker(worker_endpoints=["127.0.0.1:7000"]), strategy=s)
        assert dict(fresh_fleet.mesh.shape) == {"dp": 4, "pp": 1, "sharding": 1, "mp": 2}
        s.hybrid_configs = {"dp_degree": 8, "mp_degree": 1}  # the fleet kept a copy
        assert fresh_fleet.strategy.hybrid_configs["mp_degree"] == 2

    def test_init_errors(self, fresh_fleet):
        with pytest.raises(TypeError, match="is_collective must be bool"):
            fresh_fleet.init(is_collective="yes")
        with pytest.raises(TypeError, match="role_maker must be a fleetjax role maker"):
            fresh_fleet.init(role_maker=object())
        with pytest.raises(TypeError, match="strategy must be a fleetjax.DistributedStrategy"):
            fresh_fleet.init(strategy={"amp": True})
        s = fleetjax.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 3}
        with pytest.raises(ValueError, match="= 3, but there are 8 devices"):
            fresh_fleet.init(strategy=s)

    @pytest.mark.parametrize("call", ["init_worker", "init_server", "run_server", "stop_worker"])
    def test_parameter_server_calls(self, fresh_fleet, call, monkeypatch):
        monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170")  # not a lone process
        fresh_fleet.init()
        with pytest.raises(NotImplementedError, match=f"{call}.*parameter-server"):
            getattr(fresh_fleet, call)()

    def test_distributed_optimizer_binds_strategy_and_mesh(self, fresh_fleet):
        s = fleetjax.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 8}
        fresh_fleet.init(strategy=s)
        opt = fresh_fleet.distributed_optimizer(optax.sgd(0.1))
        assert isinstance(opt, fleetjax.DistributedOptimizer)
        assert opt.strategy == s and opt.mesh is fresh_fleet.mesh
        assert callable(opt.init) and callable(opt.update)

    def test_strategy_in_distributed_optimizer_replaces_inits(self, fresh_fleet, caplog):
        fresh_fleet.init()
        s = fleetjax.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 4, "mp_degree": 2}
        opt = fresh_fleet.distributed_optimizer(optax.sgd(0.1), strategy=s)
        assert "replaces the one from fleet.init()" in caplog.text
        assert opt.mesh.shape["mp"] == 2 and fresh_fleet.mesh.shape["mp"] == 2

    def test_distributed_optimizer_rejects_non_optax(self, fresh_fleet):
        fresh_fleet.init()
        with pytest.raises(TypeError, match="optimizer must be an optax GradientTransformation"):
            fresh_fleet.distributed_optimizer(object())

    def test_module_level_api(self, monkeypatch):
        monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
        fleet.init(is_collective=True)
        assert fleet.worker_num() == 1 and fleet.is_first_worker()
        assert fleet.mesh is fleet.fleet.mesh
        assert isinstance(fleet.DistributedStrategy(), fleetjax.DistributedStrategy)
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            _ = fleet.nope


def test_facade_saves_and_loads(fresh_fleet, tmp_path):
    import jax.numpy as jnp

    fresh_fleet.init()
    state = {"w": jnp.arange(4.0), "step": jnp.int32(3)}
    fresh_fleet.save_persistables(tmp_path / "ckpt", state)
    restored = fresh_fleet.load_persistables(tmp_path / "ckpt", state)
    assert restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and int(restored["step"]) == 3
    fresh_fleet.save_inference_model(
        tmp_path / "model", lambda p, x: x @ p["w"], {"w": jnp.ones((4, 2))}, [jnp.ones((3, 4))]
    )
    model = fresh_fleet.load_inference_model(tmp_path / "model")
    assert model(jnp.ones((5, 4))).tolist() == [[4.0, 4.0]] * 5


class TestUtil:
    def test_reductions_in_one_process(self, fresh_fleet):
        util = fresh_fleet.init().util
        assert util.all_reduce(3) == 3
        assert util.all_reduce([1, 2], mode="max") == [1, 2]
        assert util.all_gather(7) == [7]
        util.barrier()
        with pytest.raises(ValueError, match="mode must be one of sum, mean, max, min"):
            util.all_reduce(1, mode="prod")
        with pytest.raises(NotImplementedError, match="collective mode has only workers"):
            util.all_reduce(1, comm_world="server")

    @pytest.mark.parametrize(
        ("index", "count", "files", "expected"),
        [
            (0, 2, list("abcde"), list("abc")),
            (1, 2, list("abcde"), list("de")),
            (1, 2, ["a"], []),
            (2, 3, list("abcdefgh"), list("gh")),
        ],
    )
    def test_get_file_shard_paddle_semantics(self, fresh_fleet, index, count, files, expected):
        endpoints = [f"127.0.0.1:{7000 + i}" for i in range(count)]
        role = UserDefinedRoleMaker(current_id=index, worker_endpoints=endpoints)
        fresh_fleet.util._set_role_maker(role)
        assert fresh_fleet.util.get_file_shard(files) == expected

    def test_get_file_shard_needs_a_list(self, fresh_fleet):
        with pytest.raises(TypeError, match="files should be a list"):
            fresh_fleet.init().util.get_file_shard("a,b")

    def test_print_on_rank(self, fresh_fleet, capsys):
        util = fresh_fleet.init().util
        util.print_on_rank("hello", 0)
        util.print_on_rank("nobody", 1)
        assert capsys.readouterr().out == "hello\n"
