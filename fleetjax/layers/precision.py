"""The precision AMP gives an operation, as seen from a layer while AMP traces the model.

AMP (`fleetjax.transforms.amp`) traces the model in float32 and re-runs it operation by
operation at the policy's precision, but a `jax.custom_vjp` function it runs as traced (its
backward is its own). A custom-gradient layer written for mixed precision (fleetjax's
attention, as Paddle's fused kernels) asks `traced_dtype` while it is traced and casts its
inputs itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["traced_dtype", "tracing"]

Rule = Callable[[str], Any]  # a JAX primitive's name -> the dtype it runs at, or None
_RULE: contextvars.ContextVar[Rule | None] = contextvars.ContextVar("precision", default=None)


def traced_dtype(primitive: str) -> Any | None:
    """The dtype the AMP policy tracing the model runs `primitive` (a JAX primitive's name) at
    on float32 inputs; None where the operation keeps its inputs' dtypes (no AMP, float32
    operations, O1's gray operations, which follow their inputs)."""
    rule = _RULE.get()
    return None if rule is None else rule(primitive)


@contextlib.contextmanager
def tracing(rule: Rule) -> Iterator[None]:
    """Within the block `traced_dtype` answers by `rule` (AMP enters it while it traces)."""
    token = _RULE.set(rule)
    try:
        yield
    finally:
        _RULE.reset(token)
