"""Paddle's `paddle.nn.Layer` as a flax nnx Module: subclasses write `forward`, as in Paddle.

    class MLP(nn.Layer):
        def __init__(self):
            self.fc1 = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        def forward(self, x):
            return self.fc1(x)

Called, a layer runs `forward`. A layer that Paddle's auto-parallel dygraph loop trains (an
optimizer made with `parameters=layer.parameters()` and given to
`fleetjax.distributed.shard_optimizer`) gives a deferred output instead, when called with
arrays outside a traced function: the loop's compiled step computes it, as
`fleet.distributed_model`'s outputs are (`fleetjax.fleet.ModelOutput`). A copy of the layer
(`nnx.merge`, inside the step) runs `forward`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

__all__ = ["Layer", "Parameters", "bind_runner", "named_sublayers", "runner_of"]


class Runner(Protocol):
    """What computes a bound layer's calls (the auto-parallel dygraph loop)."""

    def call(self, layer: Layer, args: tuple, kwargs: dict[str, Any]) -> Any: ...


_RUNNERS: weakref.WeakKeyDictionary[nnx.Module, Runner] = weakref.WeakKeyDictionary()


def bind_runner(layer: nnx.Module, runner: Runner | None) -> None:
    """Make `runner` compute `layer`'s calls from now on (None: `forward` again)."""
    if runner is None:
        _RUNNERS.pop(layer, None)
    else:
        _RUNNERS[layer] = runner


def runner_of(layer: nnx.Module) -> Runner | None:
    """The runner bound to `layer` (None: its calls run `forward`)."""
    return _RUNNERS.get(layer)


class Parameters(list):
    """Paddle's `layer.parameters()`: the layer's `nnx.Param`s, in the order of `nnx.state`,
    and the layer they are of (`layer`), which an optimizer made with them trains."""

    def __init__(self, layer: nnx.Module, params: list[nnx.Param]) -> None:
        super().__init__(params)
        self.layer = layer


class Layer(nnx.Module):
    """Paddle's `paddle.nn.Layer` on flax nnx: write `forward(*inputs)`; `layer(*inputs)` runs
    it, or, for a layer an auto-parallel loop trains, defers it (see the module).

    Paddle's calls: `parameters()`, `named_parameters()`, `named_sublayers()`, `state_dict()`,
    `set_state_dict()`; `train()` and `eval()` are nnx's (they set `deterministic` and
    `use_running_average` on the sublayers that have them).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__call__" in vars(cls) and not getattr(cls, "_calls_forward", False):
            raise TypeError(
                f"{cls.__name__} defines __call__: a fleetjax.nn.Layer defines forward(), as "
                "Paddle's Layer does, and Layer.__call__ runs it (or defers it, in Paddle's "
                "auto-parallel dygraph loop); rename __call__ to forward, or subclass nnx.Module"
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runner = _RUNNERS.get(self)
        if runner is not None and not _traced((args, kwargs)):
            return runner.call(self, args, kwargs)
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Paddle's `forward`: the layer's computation (subclasses define it)."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def parameters(self, include_sublayers: bool = True) -> Parameters:
        """Paddle's `parameters()`: the `nnx.Param`s (with `include_sublayers=False`, this
        layer's own only), for an optimizer's `parameters=`."""
        return Parameters(self, [p for _, p in self.named_parameters("", include_sublayers)])

    def named_parameters(
        self, prefix: str = "", include_sublayers: bool = True
    ) -> Iterator[tuple[str, nnx.Param]]:
        """Paddle's `named_parameters()`: (dotted path, `nnx.Param`) pairs."""
        for path, param in nnx.to_flat_state(nnx.state(self, nnx.Param)):
            if include_sublayers or len(path) == 1:
                yield ".".join(map(str, (*([prefix] if prefix else []), *path))), param

    def named_sublayers(
        self, prefix: str = "", include_self: bool = False
    ) -> list[tuple[str, nnx.Module]]:
        """Paddle's `named_sublayers()`: (dotted path, module) of every module under this one,
        parents first."""
        return named_sublayers(self, prefix, include_self)

    def state_dict(self) -> dict[str, jax.Array]:
        """Paddle's `state_dict()`: the parameters and statistics (not random-number state)
        by dotted path, e.g. `"fc1.kernel"`."""
        state = nnx.state(self, nnx.Not(nnx.RngState))
        return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Paddle's `set_state_dict()`: load `state_dict()`'s entries in place, each cast and
        placed as the variable it replaces.

        Raises:
          ValueError: naming each entry that is missing, extra or of another shape.
        """
        state = nnx.state(self, nnx.Not(nnx.RngState))
        variables = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
        problems = [f"{k!r} is missing" for k in variables if k not in state_dict]
        problems += [
            f"{k!r} is not a variable of the layer" for k in state_dict if k not in variables
        ]
        problems += [
            f"{k!r} has shape {np.shape(v)}, the layer's {variables[k].shape}"
            for k, v in state_dict.items()
            if k in variables and np.shape(v) != tuple(variables[k].shape)
        ]
        if problems:
            raise ValueError(
                f"state_dict does not fit {type(self).__name__}: " + "; ".join(problems)
            )
        for name, variable in variables.items():
            old = variable[...]
            value = np.asarray(state_dict[name], old.dtype)
            variable.set_value(jax.device_put(value, getattr(old, "sharding", None)))


def named_sublayers(
    module: nnx.Module, prefix: str = "", include_self: bool = False
) -> list[tuple[str, nnx.Module]]:
    """(dotted path, module) of every module under `module` (and itself, named `prefix`, with
    `include_self`), parents first: Paddle's `named_sublayers` for any nnx Module."""
    # nnx walks children in the order of their names, each after its own children.
    found = sorted(
        nnx.iter_modules(module), key=lambda item: [(type(k).__name__, k) for k in item[0]]
    )
    named = [(".".join(map(str, (*([prefix] if prefix else []), *p))), m) for p, m in found]
    return [(n, m) for n, m in named if include_self or m is not module]


def _traced(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
