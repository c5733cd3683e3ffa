"""Paddle's forward hooks on flax nnx modules: `register_forward_pre_hook` and
`register_forward_post_hook`, which `shard_layer`'s `input_fn` / `output_fn` and
`parallelize`'s plans use.

An nnx module has no hooks, and the train step calls copies of it (`nnx.merge`), so a hook
cannot live beside the module: it becomes part of its class. `add_hooks` gives the module a
subclass of its class whose call runs the pre-hooks on the inputs, the module's own call,
then the post-hooks on the output, in the order they were added (Paddle's order). The
subclass is made once per (class, hooks), keeps the class's name, and merged copies are of it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

from flax import nnx

__all__ = ["Hooks", "add_hooks"]

PreHook = Callable[[nnx.Module, tuple], Any]  # (layer, inputs) -> new inputs or None
PostHook = Callable[[nnx.Module, tuple, Any], Any]  # (layer, inputs, outputs) -> new or None


@dataclasses.dataclass(frozen=True)
class Hooks:
    """A module's pre-hooks and post-hooks, in the order they run."""

    before: tuple[PreHook, ...] = ()
    after: tuple[PostHook, ...] = ()

    def __add__(self, other: Hooks) -> Hooks:
        return Hooks(self.before + other.before, self.after + other.after)


def add_hooks(
    module: nnx.Module, before: tuple[PreHook, ...] = (), after: tuple[PostHook, ...] = ()
) -> None:
    """Run `before` on `module`'s inputs and `after` on its output, after the hooks it has."""
    cls = type(module)
    base = cls.__dict__.get("_hooked_class", cls)
    hooks = getattr(cls, "_hooks", Hooks()) if base is not cls else Hooks()
    module.__class__ = _hooked(base, hooks + Hooks(before, after))


@functools.cache
def _hooked(base: type, hooks: Hooks) -> type:
    def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        for hook in hooks.before:
            changed = hook(self, args)
            if changed is not None:
                args = changed if isinstance(changed, tuple) else (changed,)
        out = base.__call__(self, *args, **kwargs)
        for hook in hooks.after:
            changed = hook(self, args, out)
            out = out if changed is None else changed
        return out

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(
            __call__=__call__,
            __module__=base.__module__,
            __qualname__=base.__qualname__,
            _hooked_class=base,
            _hooks=hooks,
            _calls_forward=True,  # fleetjax.nn.Layer: the base's call runs forward
        )

    return types.new_class(base.__name__, (base,), exec_body=body)
