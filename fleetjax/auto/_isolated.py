"""Compiling candidate steps in a worker process, so that XLA aborting on one does not end the
search.

XLA reports some of its own bugs by a failed ``CHECK``, which aborts the whole process (SIGABRT):
no Python exception is raised, so nothing in the process can catch it. `Compiler` hands each
lowered step to a worker process, which compiles it and sends back what the search reads of the
result (`Compiled`). When the worker dies, the candidate fails with XLA's last fatal log line
(`CompileFailed`) and the next candidate starts a new worker.

The worker gets the module and the compile options as jax hands them to XLA (StableHLO bytecode
and a serialized ``CompileOptions``), so it compiles the same program with the same options and
gives the same memory analysis and HLO text; it makes the same devices again: this process's
CPU devices, or the compile-only GPUs of `fleetjax.targets`. It starts once per process (a few
seconds: importing jax) and serves every search after. A forked process would start faster
but cannot compile: the fork keeps the locks and thread pools of XLA's other threads, and its
compile hangs (CPU) or aborts on a mutex check (GPU targets). Real GPUs and TPUs, which a second
process could not share, and steps that XLA calls back into this process for (host callbacks,
custom partitioning such as cuDNN's attention) compile in this process.

jax has no public way to hand a lowered module to another process: `_request` reads the compile
arguments of jax's lowering (`Lowered._lowering`) and builds the options with jax's own
`create_compile_options`, as `Lowered.compile` does (tests/tools/test_auto.py checks that both give
the same memory analysis and HLO text).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any, NamedTuple

import jax
import numpy as np

from fleetjax import targets

__all__ = ["CompileFailed", "Compiled", "Compiler", "MemoryStats"]

# glog's fatal line: "F1126 09:19:20.320164   20042 spmd_partitioner_util.cc:497] Check failed: ..."
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (?P<where>\S+:\d+)\] (?P<what>.*)$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """The sizes `jax.stages.Compiled.memory_analysis()` gives (jaxlib's ``CompiledMemoryStats``,
    which does not pickle), per device, in bytes."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int
    host_argument_size_in_bytes: int
    host_output_size_in_bytes: int
    host_alias_size_in_bytes: int
    host_temp_size_in_bytes: int
    host_generated_code_size_in_bytes: int
    peak_memory_in_bytes: int

    @classmethod
    def of(cls, stats: Any) -> MemoryStats:
        return cls(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled step's analyses, read as from `jax.stages.Compiled`: `memory_analysis()`,
    `as_text()` (the optimized per-device HLO) and `cost_analysis()` (None for compile-only
    GPUs)."""

    memory: MemoryStats
    text: str
    cost: Any

    def memory_analysis(self) -> MemoryStats:
        return self.memory

    def as_text(self) -> str:
        return self.text

    def cost_analysis(self) -> Any:
        return self.cost


class CompileFailed(Exception):
    """XLA refused or aborted compiling a step; the message says why, in XLA's words."""


class _Devices(NamedTuple):
    """What the worker needs to make the devices again: "cpu" or a target's name, how many,
    and how many to a host."""

    platform: str
    count: int
    per_host: int


class _Request(NamedTuple):
    module: bytes  # StableHLO bytecode
    options: bytes  # a serialized xla CompileOptions
    device_ids: tuple[int, ...]  # the device assignment


@dataclasses.dataclass
class Compiler:
    """Compiles lowered steps (`jax.stages.Lowered`) into `Compiled`; with `isolate`, in the
    worker process where it can (see the module docstring), else in this process.

    Raises `CompileFailed` with XLA's message when XLA refuses the module or aborts on it."""

    isolate: bool = True

    def __call__(self, lowered: jax.stages.Lowered) -> Compiled:
        found = _request(lowered) if self.isolate else None
        if found is not None:
            devices, request = found
            with _lock:  # one request at a time on the worker's pipes
                return _worker(devices).compile(request)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            raise CompileFailed(str(e)) from e
        memory = MemoryStats.of(compiled.memory_analysis())
        return Compiled(memory, compiled.as_text(), compiled.cost_analysis())


def _request(lowered: jax.stages.Lowered) -> tuple[_Devices, _Request] | None:
    """The devices and the request the worker needs to compile `lowered` as
    `lowered.compile()` would, or None if it cannot (devices it cannot make, callbacks into
    this process)."""
    from jax._src.interpreters import mlir, pxla  # no public API hands a module to XLA

    lowering = lowered._lowering
    args = lowering.compile_args
    device_list = lowering._device_list
    if device_list is None or args["host_callbacks"] or args["keepalive"]:
        return None
    devices = _devices_of(device_list[0])
    if devices is None:
        return None
    allow_in, allow_out = pxla.get_prop_to_input_output(
        args["in_shardings"], args["out_shardings"], len(args["ordered_effects"])
    )
    options = pxla.create_compile_options(
        lowering.stablehlo(),
        args["tuple_args"],
        allow_in,
        allow_out,
        args["backend"],
        np.array(list(device_list), dtype=object),
        dict(lowering._compiler_options_kvs),
    )
    return devices, _Request(
        mlir.module_to_bytecode(lowering.stablehlo()),
        options.SerializeAsString(),
        tuple(d.id for d in device_list),
    )


def _devices_of(device: jax.Device) -> _Devices | None:
    """How the worker makes `device` and its peers again, or None if it cannot."""
    from jax._src.lib import _jax

    peers = device.client.devices()
    per_host = sum(d.process_index == device.process_index for d in peers)
    if device.platform == "cpu":
        return _Devices("cpu", len(peers), per_host)
    target = targets.of(device)  # real GPUs have a target too: only compile-only ones qualify
    if target is None or not isinstance(device.client, _jax.CompileOnlyPyClient):
        return None
    made = _Devices(target.name, len(peers), per_host)
    if set(targets.devices(made.platform, made.count, per_host=made.per_host)) != set(peers):
        return None  # compile-only devices that fleetjax.targets did not make
    return made


class _Worker:
    """One worker process: requests and replies over two pipes, its output in a log file."""

    def __init__(self, devices: _Devices) -> None:
        self.devices = devices
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the worker lives)
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(request_read), str(reply_write)],
            pass_fds=(request_read, reply_write),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path},
        )
        os.close(request_read)
        os.close(reply_write)
        self.requests = os.fdopen(request_write, "wb")
        self.replies = os.fdopen(reply_read, "rb")

    def compile(self, request: _Request) -> Compiled:
        start = os.fstat(self.log.fileno()).st_size
        try:
            _write(self.requests, request)
            status, result = _read(self.replies)
        except (BrokenPipeError, EOFError):
            message = self._death(start)
            self.close()
            raise CompileFailed(message) from None
        if status != "ok":
            raise CompileFailed(result)
        return result

    def _death(self, start: int) -> str:
        """Why the worker died: XLA's fatal log line, else its last output, and how it ended."""
        code = self.process.wait()
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        size = os.fstat(self.log.fileno()).st_size - start
        output = os.pread(self.log.fileno(), size, start).decode(errors="replace")
        fatal = list(_FATAL.finditer(output))
        if fatal:
            return f"XLA aborted compiling it ({how}) at {fatal[-1]['where']}: {fatal[-1]['what']}"
        said = " | ".join(output.strip().splitlines()[-3:])
        return f"the compiling process ended ({how}): {said or 'no output'}"

    def close(self) -> None:
        for pipe in (self.requests, self.replies):
            with contextlib.suppress(BrokenPipeError):  # a dead worker's unread request
                pipe.close()
        self.process.wait()
        self.log.close()


_lock = threading.Lock()
_current: list[_Worker] = []  # the live worker, if any


def _worker(devices: _Devices) -> _Worker:
    """The live worker for `devices`, started (and its devices made) if there is none; the
    caller holds `_lock`."""
    if _current and (_current[0].devices != devices or _current[0].process.poll() is not None):
        _current.pop().close()
    if not _current:
        worker = _Worker(devices)
        _write(worker.requests, devices)
        _current.append(worker)
    return _current[0]


@atexit.register
def _stop() -> None:
    with _lock:
        while _current:
            _current.pop().close()


def _write(pipe: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def _read(pipe: IO[bytes]) -> Any:
    head = pipe.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The worker: make the devices, then compile each request until the pipe closes."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    devices: _Devices = _read(requests)
    if devices.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", devices.count)
        made = jax.devices("cpu")
    else:
        made = targets.devices(devices.platform, devices.count, per_host=devices.per_host)
    by_id = {d.id: d for d in made}
    while True:
        try:
            request: _Request = _read(requests)
        except EOFError:
            return
        assignment = _jax.DeviceList(tuple(by_id[i] for i in request.device_ids))
        client = assignment[0].client
        options = _jax.CompileOptions.ParseFromString(request.options)
        # As jax's backend_compile_and_load: compile-only clients compile, others also load.
        compile_ = (
            client.compile
            if isinstance(client, _jax.CompileOnlyPyClient)
            else (client.compile_and_load)
        )
        try:
            with mlir.make_ir_context():
                executable = compile_(ir.Module.parse(request.module), assignment, options)
            reply = ("ok", _analyses(executable))
        except jax.errors.JaxRuntimeError as e:
            reply = ("error", str(e))
        _write(replies, reply)


def _analyses(executable: Any) -> Compiled:
    """A jaxlib executable's analyses, as `jax.stages.Compiled` reads them."""
    if hasattr(executable, "get_hlo_text"):
        text = executable.get_hlo_text()
    else:
        text = "\n\n".join(m.to_string() for m in executable.hlo_modules())
    try:
        cost = executable.cost_analysis()
    except jax.errors.JaxRuntimeError:  # UNIMPLEMENTED for compile-only GPUs
        cost = None
    return Compiled(MemoryStats.of(executable.get_compiled_memory_stats()), text, cost)


if __name__ == "__main__":
    # Run as the module it is, so that what it pickles names fleetjax.auto._isolated.
    from fleetjax.auto import _isolated

    _isolated._serve(os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb"))
