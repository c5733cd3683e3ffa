"""Flops and memory bytes of a compiled module, where `compiled.cost_analysis()` gives None (a
compile-only GPU target) or counts each loop once (every backend)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax

from fleetjax import hlo


class Cost(NamedTuple):
    """What one call of a compiled module does on one device.

    Attributes:
      flops: floating-point operations (a multiply-add is two).
      bytes_accessed: bytes its kernels read and write in device memory.
    """

    flops: float = 0.0
    bytes_accessed: float = 0.0

    def __add__(self, other: tuple) -> Cost:  # type: ignore[override]
        return Cost(*(a + b for a, b in zip(self, other, strict=True)))

    def __sub__(self, other: tuple) -> Cost:
        return Cost(*(a - b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> Cost:
        return Cost(*(n * a for a in self))


def cost_analysis(compiled: jax.stages.Compiled | str) -> Cost:
    """XLA's HloCostAnalysis of a compiled module (or its `as_text()`), every loop trip counted.

    XLA's analysis runs over the optimized per-device module, as `compiled.cost_analysis()`
    does where a backend offers it, with two corrections: a while loop counts its body its
    known trip count times (XLA's ``known_trip_count``; XLA's own analysis counts it once,
    which undercounts a scanned model by its layer count), and a matmul left to a library call
    (cuBLAS, which XLA's generic analysis counts as 0 flops) counts 2 x its multiply-adds. A
    loop inside a conditional branch or a called computation counts once; cuDNN calls
    (attention) count no flops.

    Raises:
      NotImplementedError: where jaxlib lacks the internals this reads (see `_xla_analysis`).
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    computations, entry = hlo.computations(text)
    analyse = _xla_analysis(text)

    @functools.cache
    def looped(name: str) -> Cost:
        total = analyse(name)
        for line in computations[name][1:]:
            if loop := hlo.while_loop(line):
                body, trips = loop
                total += looped(body).times(trips) - analyse(body)
        return total

    return looped(entry) + _library_matmuls(text)


def _library_matmuls(text: str) -> Cost:
    """The flops of library matmul calls (cuBLAS custom calls), every loop trip counted."""

    def measure(line: str, shapes: Mapping[str, tuple[int, ...]]) -> Cost:
        return Cost(hlo.matmul_flops(line, shapes) if " custom-call(" in line else 0.0)

    return hlo.per_call(text, measure, Cost(), max)


def _xla_analysis(text: str) -> Callable[[str], Cost]:
    """A function of a computation's name: XLA's HloCostAnalysis of that computation of the
    module `text`, each loop in it counted once.

    jax exposes no public way to run it on a module; this uses jaxlib's `hlo_module_from_text`
    and `hlo_module_cost_analysis` (what `jax.stages.Lowered.cost_analysis` uses) with the CPU
    client: the analysis reads the module only, whatever backend compiled it.
    """
    try:
        from jaxlib import _hlo as jaxlib_hlo
        from jaxlib import _jax

        parse, analyse = jaxlib_hlo.hlo_module_from_text, _jax.hlo_module_cost_analysis
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            "fleetjax.cost.cost_analysis reads XLA's HloCostAnalysis through jaxlib's "
            "_hlo.hlo_module_from_text and _jax.hlo_module_cost_analysis, which jaxlib "
            f"{jax.__version__} does not have"
        ) from e
    client = jax.local_devices(backend="cpu")[0].client
    lines = text.splitlines()

    @functools.cache
    def analysed(name: str) -> Cost:
        # The module with `name` as its entry; the header's aliasing and layout refer to the
        # old entry, so it goes.
        module = ["HloModule cost_analysis"]
        for line in lines[1:]:
            if header := hlo.HEADER.match(line):
                line = ("ENTRY " if header["name"] == name else "") + line.removeprefix("ENTRY ")
            module.append(line)
        result = analyse(client, parse("\n".join(module)))
        return Cost(result.get("flops", 0.0), result.get("bytes accessed", 0.0))

    return analysed
