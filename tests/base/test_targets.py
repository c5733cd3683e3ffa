"""fleetjax.targets: compile-only GPU devices from jax's CUDA plugin, their roofline constants,
and the flops and bytes of what XLA:GPU compiled."""

import ctypes
import functools
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fleetjax import targets

needs_plugin = pytest.mark.skipif(
    not targets.plugin_installed(),
    reason="jax's CUDA plugin is not installed: pip install -e '.[aot]'",
)
ASYNC = re.compile(r"\b(all-gather|all-reduce|reduce-scatter)-start\(")


def _abstract(mesh, shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


def _tanh_layer_grad(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)


@needs_plugin
@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_every_shipped_config_compiles_a_sharded_step(name):
    mesh = targets.mesh(name, 8, per_host=4, mp=4)  # dp 2 across the hosts, mp 4 within
    w = _abstract(mesh, (1024, 4096), jnp.bfloat16, "dp", "mp")
    x = _abstract(mesh, (64, 1024), jnp.bfloat16, "dp")
    compiled = jax.jit(_tanh_layer_grad).lower(w, x).compile()

    device = mesh.devices.flat[0]
    assert device.device_kind == targets.get(name).device_kind
    assert targets.of(device) is targets.get(name)
    assert [d.process_index for d in mesh.devices.flat] == [0] * 4 + [1] * 4
    assert (
        compiled.memory_analysis().argument_size_in_bytes == (1024 * 4096 + 64 * 1024 * 4) * 2 // 8
    )
    assert {"all-gather", "all-reduce"} <= set(ASYNC.findall(compiled.as_text()))
    assert compiled.cost_analysis() is None  # what targets.cost_analysis is for


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_the_roofline_constants_agree_with_the_config(name):
    target = targets.get(name)
    config = dict(
        re.findall(r"^\s*(device_memory_size|memory_bandwidth): (\d+)", target.config, re.M)
    )
    assert target.spec.hbm_bytes == int(config["device_memory_size"])
    assert target.spec.hbm_bandwidth == pytest.approx(int(config["memory_bandwidth"]), rel=1e-3)
    assert f'name: "{target.device_kind}"' in target.config
    spec = target.spec
    assert (
        spec.peak_fp32_flops < spec.peak_tf32_flops < spec.peak_bf16_flops == spec.peak_fp16_flops
    )
    assert spec.network_bandwidth < spec.nvlink_bandwidth < spec.hbm_bandwidth


@needs_plugin
def test_the_compiler_follows_the_config():
    """The A100 (compute capability 8.0) has no fp8 tensor cores: XLA converts the operands
    and calls cuBLAS; the H100 (9.0) keeps an fp8 dot. The same call gives the same devices."""

    def fp8_matmul_text(name):
        mesh = targets.mesh(name, 8)
        a = _abstract(mesh, (1024, 4096), jnp.float8_e4m3fn, "dp")
        b = _abstract(mesh, (4096, 1024), jnp.float8_e4m3fn)
        dot = lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32)  # noqa: E731
        return jax.jit(dot).lower(a, b).compile().as_text()

    h100, a100 = fp8_matmul_text("h100"), fp8_matmul_text("a100-80g")
    assert re.search(r"f8e4m3fn\[[\d,]+\]\{[\d,]+\} parameter", h100) and " dot(" in h100
    assert "__cublas$lt$matmul" in a100 and " dot(" not in a100
    assert targets.devices("h100", 8) == targets.devices("h100", 8)


def test_an_unknown_target_lists_the_known_ones():
    with pytest.raises(ValueError, match="^unknown GPU target 'b200'; known targets: h100, h200, "):
        targets.devices("b200", 8)


def test_a_count_that_does_not_fill_the_hosts_says_why():
    with pytest.raises(
        ValueError,
        match=r"^12 h100 GPUs do not fill whole hosts of per_host=8: 12 / 8 = 1.5 hosts; use a "
        r"multiple of 8 \(8 or 16\), or set per_host to the GPUs each host has$",
    ):
        targets.devices("h100", 12)
    for bad in (0, -8, 8.0, True):
        with pytest.raises(ValueError, match=rf"^count must be a positive int, got {bad!r}$"):
            targets.devices("h100", bad)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | env
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


REPORT_ERROR = """
    from fleetjax import targets
    try:
        targets.devices("h100", 8)
        print("compiled")
    except RuntimeError as e:
        print(e)
"""


def test_a_missing_plugin_says_which_extra_to_install(tmp_path):
    # A regular package named jax_plugins ahead on the path hides the installed plugins.
    (tmp_path / "jax_plugins").mkdir()
    (tmp_path / "jax_plugins" / "__init__.py").write_text("")
    path = os.pathsep.join([str(tmp_path), *sys.path])
    done = _run(REPORT_ERROR, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "compiling for a GPU target needs jax's CUDA plugin, which is not installed: "
        "pip install -e '.[aot]' in fleetjax's clone, or pip install "
        f"'jax[cuda13-local]=={jax.__version__}' (jax-cuda13-plugin and jax-cuda13-pjrt at the "
        "installed jax version; no CUDA libraries are needed)"
    )


def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@needs_plugin
def test_without_a_driver_fleetjax_starts_jax_on_the_cpu_and_compiles_quietly():
    """JAX_PLATFORMS unset, the plugin installed and no NVIDIA driver (the test extra on a
    machine without GPUs): `import fleetjax` leaves CUDA out, so JAX logs no failed CUDA check
    and the compile-only devices register."""
    if _has_cuda_driver():
        pytest.skip("this machine has an NVIDIA driver: JAX starts CUDA as it would")
    done = _run(textwrap.dedent(REPORT_ERROR) + "import jax; print(jax.default_backend())")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "compiled\ncpu\n"
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@needs_plugin
def test_a_plugin_that_did_not_register_says_to_leave_cuda_out():
    """JAX started its backends before fleetjax was imported: the plugin's check ran and failed."""
    if _has_cuda_driver():
        pytest.skip("this machine has an NVIDIA driver: the plugin registers")
    done = _run("import jax; jax.devices()\n" + textwrap.dedent(REPORT_ERROR))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("jax's CUDA plugin is installed but did not register")
    assert "Import fleetjax before JAX starts its backends" in done.stdout
    assert "or set JAX_PLATFORMS=cpu before JAX starts (now None)" in done.stdout


@needs_plugin
def test_cost_analysis_counts_every_trip_of_a_scanned_model():
    """A scan of 12 matmul layers on 8 H100s: 12 x the per-layer flops (XLA counts the loop
    body once), and at least the layers' weights read."""
    layers, batch, width = 12, 4096, 2048
    mesh = targets.mesh("h100", 8)
    x = _abstract(mesh, (batch, width), jnp.bfloat16, "dp")
    ws = _abstract(mesh, (layers, width, width), jnp.bfloat16)

    def forward(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    cost = targets.cost_analysis(jax.jit(forward).lower(x, ws).compile())
    matmuls = layers * 2 * (batch // 8) * width * width
    assert matmuls <= cost.flops < 1.01 * matmuls
    assert cost.bytes_accessed > layers * width * width * 2


@needs_plugin
def test_cost_analysis_counts_library_matmuls():
    """XLA's generic analysis gives cuBLAS calls no flops (here the A100's fp8 matmul)."""
    mesh = targets.mesh("a100-80g", 8)
    a = _abstract(mesh, (8192, 4096), jnp.float8_e4m3fn, "dp")
    b = _abstract(mesh, (4096, 4096), jnp.float8_e4m3fn)
    dot = lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32)  # noqa: E731
    cost = targets.cost_analysis(jax.jit(dot).lower(a, b).compile())
    matmul = 2 * 1024 * 4096 * 4096
    assert matmul <= cost.flops < 1.01 * matmul


def _gpt_step(mesh, layers, width, heads, vocab, seq, batch):
    """A GPT-like step: pre-norm blocks (attention, GELU MLP) scanned and rematerialized, fp32
    master weights used in bf16, Adam, the FSDP x TP placement of `mesh`'s `sharding` and `mp`
    axes. Returns the jitted step's lowering and the parameter count."""

    def place(*spec):
        return NamedSharding(mesh, P(*spec))

    shapes = {
        "embed": ((vocab, width), place("mp", "sharding")),
        "qkv": ((layers, width, 3 * width), place(None, "sharding", "mp")),
        "out": ((layers, width, width), place(None, "mp", "sharding")),
        "up": ((layers, width, 4 * width), place(None, "sharding", "mp")),
        "down": ((layers, 4 * width, width), place(None, "mp", "sharding")),
        "norms": ((layers, 2, width), place(None, None, "sharding")),
    }
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=p) for k, (s, p) in shapes.items()}

    def norm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale

    def block(x, w):
        qkv, out, up, down, norms = (a.astype(jnp.bfloat16) for a in w)
        q, k, v = jnp.split(norm(x, norms[0]) @ qkv, 3, -1)
        q, k, v = (a.reshape(*a.shape[:2], heads, -1) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(width // heads)
        scores = jnp.where(jnp.tri(seq, dtype=bool), scores.astype(jnp.float32), -1e9)
        attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores).astype(x.dtype), v)
        x = x + attention.reshape(x.shape) @ out
        return x + jax.nn.gelu(norm(x, norms[1]) @ up) @ down, None

    def loss(p, tokens):
        x = jax.lax.with_sharding_constraint(p["embed"][tokens], place("sharding"))
        stack = (p["qkv"], p["out"], p["up"], p["down"], p["norms"])
        x, _ = jax.lax.scan(jax.checkpoint(block), x.astype(jnp.bfloat16), stack)
        logits = (x @ p["embed"].astype(jnp.bfloat16).T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    adam = optax.adam(1e-4)

    def step(p, state, tokens):
        updates, state = adam.update(jax.grad(loss)(p, tokens), state, p)
        return optax.apply_updates(p, updates), state

    state = (
        optax.ScaleByAdamState(
            jax.ShapeDtypeStruct((), jnp.int32, sharding=place()), params, params
        ),
        optax.EmptyState(),
    )
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=place("sharding"))
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, tokens)
    return lowered, sum(math.prod(s) for s, _ in shapes.values())


@needs_plugin
@pytest.mark.slow
def test_a_174b_gpt_step_compiles_for_1024_h100s():
    """Issue 18's headline: 96 layers, width 12288 (GPT-3 175B's shape), FSDP 128 x TP 8 on 128
    hosts of 8 H100s; each device holds 12 bytes per parameter / 1024 (fp32 weights, Adam's two
    moments), and XLA:GPU overlaps the FSDP all-gathers and reduce-scatters (-start forms)."""
    mesh = targets.mesh("h100", 1024, sharding=128, mp=8)
    layers, width, seq, batch = 96, 12288, 2048, 128
    lowered, n = _gpt_step(mesh, layers, width, heads=96, vocab=51200, seq=seq, batch=batch)
    compiled = lowered.compile()
    assert 174e9 < n < 175e9
    assert compiled.memory_analysis().argument_size_in_bytes == pytest.approx(12 * n / 1024, 1e-3)
    assert {"all-gather", "reduce-scatter"} <= set(ASYNC.findall(compiled.as_text()))
    # Forward and backward (6 flops per parameter and token), the blocks' forward again under
    # remat but for their last matmul (the backward pass needs only its input: 8 of 12 d^2 per
    # layer), and attention (4 b s^2 d per layer: forward, again, and twice backward).
    tokens = batch * seq
    remat = 2 * 8 * layers * width**2 * tokens
    attention = 4 * 4 * batch * seq**2 * width * layers
    formula = (6 * n * tokens + remat + attention) / 1024
    assert targets.cost_analysis(compiled).flops == pytest.approx(formula, rel=0.01)


def test_megatron_formula_is_gpt3_175b():
    """GPT-3 175B's shapes give 175B parameters (its untied output layer adds the 0.6B of its
    vocabulary); Megatron-LM's layout holds N_s (4 + 4 + 8/dp + 2) bytes per stage parameter,
    its 1F1B keeps pp micro-batches of layer inputs and its bubble is (pp - 1) / m."""
    f = targets.Megatron(96, 12288, 96, 2048, 51200, 1536, tp=8, pp=8, dp=16)
    assert f.parameters == pytest.approx(175.3e9, rel=1e-3)
    assert targets.Megatron(96, 12288, 96, 2048, 51200, 1536, tied=True).parameters == (
        pytest.approx(174.6e9, rel=1e-3)
    )
    assert (f.gpus, f.micro_batches, f.bubble) == (1024, 96, 7 / 96)
    hbm = f.hbm()
    n = f.stage_parameters
    assert n == pytest.approx((12 * 12288**2 * 12 + 51200 * 12288) / 8, rel=1e-2)
    assert hbm["Adam moments"] == 8 / 16 * n
    assert hbm["kept layer inputs"] == 8 * 12 * 2048 * 12288 * 2
    assert hbm["recompute working set"] == 2048 * 12288 * (10 + 24 / 8 + 5 * 96 * 2048 / 12288 / 8)
    axes = f.axis_bytes()
    assert axes["mp"] == 12 * 96 * 6 * 2048 * 12288 * 2
    assert axes["pp"] == 96 * 2 * 2048 * 12288 * 2
    assert axes["data"] == 2 * 4 * n
    assert 0.45 <= f.mfu(targets.get("h100").spec) <= 0.50
    interleaved = targets.Megatron(96, 12288, 96, 2048, 51200, 1536, tp=8, pp=8, dp=16, vpp=2)
    assert interleaved.kept_micro_batches == 2 * 7 + 8 + 1  # chunks of 6 layers
    assert interleaved.bubble == 7 / (96 * 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"global_batch": 100, "dp": 16}, "global_batch=100 does not split into dp=16"),
        ({"pp": 5}, "layers=96 do not split into pp x vpp = 5 x 1"),
        ({"tp": -1}, "Megatron.tp must be a non-negative int, got -1"),
    ],
)
def test_megatron_formula_checks_its_shapes(kwargs, message):
    shapes = {"layers": 96, "hidden": 12288, "heads": 96, "sequence": 2048, "vocab": 51200}
    with pytest.raises(ValueError, match=re.escape(message)):
        targets.Megatron(**{**shapes, "global_batch": 1536, **kwargs})


needs_cudnn = pytest.mark.skipif(
    targets.cudnn_version() is None,
    reason="no cuDNN for jax's CUDA plugin: pip install -e '.[aot-cudnn]'",
)
SEQ, ROWS_PER_DEVICE, HEADS = 2048, 2, 8  # GPT-3's sequence, heads of 128


@functools.cache
def _gpt_attention_step(implementation):
    """The example GPT (2 blocks of 8 heads of 128, sequences of 2048) trained with AMP bf16 and
    recompute over 8 data-parallel H100s, attention by `implementation`: its compiled module
    and temp bytes per device."""
    import tiny_gpt  # noqa: F401 (puts examples/ on the path)
    from flax import nnx
    from gpt import GPT, GPTConfig, GPTFunctions

    import fleetjax

    config = GPTConfig(1024, SEQ, 1024, HEADS, 2, 4096, attention_implementation=implementation)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    gpt, params = GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))
    mesh = targets.mesh("h100", 8)
    strategy = fleetjax.DistributedStrategy(amp=True, recompute=True)
    strategy.amp_configs = {"dtype": "bfloat16"}
    strategy.recompute_configs = {"policy": "nothing_saveable"}
    specs = gpt.partition_specs(mesh=mesh)
    step = fleetjax.make_train_step(
        gpt.loss_fn, optax.adam(1e-4), strategy, mesh, param_specs=specs
    )
    batch = {"tokens": jax.ShapeDtypeStruct((8 * ROWS_PER_DEVICE, SEQ + 1), jnp.int32)}
    compiled = step.lower(step.abstract_init(params), batch).compile()
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


SCORES = re.compile(rf"\b(\w+)\[[\d,]*{SEQ},{SEQ}\]")  # a [..., query, key] buffer
FUSED = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)"')
SCORES_BYTES = ROWS_PER_DEVICE * HEADS * SEQ * SEQ * 4  # f32 [rows, heads, s, s] per device


@needs_plugin
def test_xla_attention_keeps_the_scores_on_h100():
    """`jax.nn.dot_product_attention`'s XLA path (``implementation="xla"``) computes attention
    from the whole f32 [rows, heads, s, s] score matrix, which the step's temporaries hold."""
    text, temp = _gpt_attention_step("xla")
    assert "f32" in SCORES.findall(text)
    assert not FUSED.findall(text)
    assert temp > SCORES_BYTES


@needs_plugin
def test_fleetjax_attention_holds_no_score_matrix_on_h100():
    """fleetjax's attention (the default, ``implementation=None``) goes 512 queries at a time
    and keeps its bf16 probabilities alone: no [s, s] buffer (its tiles are [.., 512, s]), and
    fewer temporaries than XLA's (measured 630.2 MiB against 858.3 MiB)."""
    text, temp = _gpt_attention_step(None)
    assert not SCORES.findall(text)
    assert not FUSED.findall(text)
    assert temp < 0.8 * _gpt_attention_step("xla")[1]


@needs_plugin
@needs_cudnn
def test_cudnn_attention_compiles_to_the_fused_kernel_on_h100():
    """With cuDNN installed, `implementation="cudnn"` compiles deviceless to cuDNN's fused flash
    attention, forward and backward: no [s, s] buffer, and at least one score matrix less of
    temporaries than `jax.nn.dot_product_attention`'s XLA path."""
    text, temp = _gpt_attention_step("cudnn")
    assert set(FUSED.findall(text)) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert not SCORES.findall(text)
    assert temp <= _gpt_attention_step("xla")[1] - SCORES_BYTES


@needs_plugin
@pytest.mark.skipif(targets.cudnn_version() is not None, reason="cuDNN is installed")
def test_cudnn_attention_without_cudnn_says_so():
    """Without the cuDNN library jax refuses the cuDNN attention while tracing (the error
    docs/gpu_targets.md quotes)."""
    with pytest.raises(RuntimeError, match=r"^cuDNN not found\."):
        _gpt_attention_step("cudnn")
