"""Paddle's `paddle.amp` for the auto-parallel dygraph loop: `auto_cast`, `GradScaler`,
`decorate`.

    scaler = dist.shard_scaler(amp.GradScaler(init_loss_scaling=1024))
    for x, y in loader():
        with amp.auto_cast(level="O1", dtype="float16"):
            loss = F.mse_loss(model(x), y)          # deferred: its AMP is auto_cast's
        scaler.scale(loss).backward()
        scaler.step(opt)                            # the compiled step: cast, scale, unscale, skip
        scaler.update()
        opt.clear_grad()

JAX has no eager tape to cast as it runs, so `auto_cast` is read where the layer is called, and
the loop's compiled step applies it as `Strategy.amp` does (`fleetjax.transforms.amp`: each
operation at its list's precision; docs/amp.md), with the `GradScaler`'s loss scaling
(`fleetjax.transforms.loss_scale`): the step scales the loss, unscales the gradients, skips a
step with a non-finite gradient and updates the scale. `update()` has nothing left to do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from fleetjax._warnings import warn_once
from fleetjax.strategy import Strategy

__all__ = ["AutoCast", "GradScaler", "apply", "auto_cast", "current_autocast", "decorate"]

_LEVELS, _DTYPES = ("O0", "O1", "O2"), ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AutoCast:
    """An `auto_cast` block's settings (Paddle's arguments)."""

    level: str
    dtype: str
    custom_white_list: tuple[str, ...] = ()
    custom_black_list: tuple[str, ...] = ()
    use_promote: bool = True


_CURRENT: contextvars.ContextVar[AutoCast | None] = contextvars.ContextVar("autocast", default=None)


def current_autocast() -> AutoCast | None:
    """The `auto_cast` in effect (None: none, or `enable=False`, or level O0)."""
    return _CURRENT.get()


@contextlib.contextmanager
def auto_cast(
    enable: bool = True,
    custom_white_list: Sequence[str] | None = None,
    custom_black_list: Sequence[str] | None = None,
    level: str = "O1",
    dtype: str = "float16",
    use_promote: bool = True,
) -> Iterator[None]:
    """Paddle's `paddle.amp.auto_cast`: a layer called in the block is trained with AMP at
    `level` ("O1": the white list in `dtype`, the black list in float32, the rest as their
    inputs; "O2": the rest in `dtype` too) in `dtype` ("float16" or "bfloat16"). The lists
    take Paddle's operator names or JAX primitive names (docs/amp.md).

    Raises:
      ValueError: for a level or dtype Paddle does not have.
    """
    if level not in _LEVELS:
        raise ValueError(f"auto_cast level must be one of {_LEVELS}, got {level!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"auto_cast dtype must be one of {_DTYPES}, got {dtype!r}")
    on = enable and level != "O0"
    value = (
        AutoCast(
            level,
            dtype,
            tuple(custom_white_list or ()),
            tuple(custom_black_list or ()),
            use_promote,
        )
        if on
        else None
    )
    token = _CURRENT.set(value)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class GradScaler:
    """Paddle's `paddle.amp.GradScaler(enable=True, init_loss_scaling=65536.0, incr_ratio=2.0,
    decr_ratio=0.5, incr_every_n_steps=2000, decr_every_n_nan_or_inf=1,
    use_dynamic_loss_scaling=True)`: dynamic loss scaling, which the auto-parallel loop's
    compiled step does (see the module). `scale(loss)` returns the deferred loss itself (the
    step multiplies it by the scale and divides the gradients by it); on an array it returns
    the array times the initial scale."""

    def __init__(
        self,
        enable: bool = True,
        init_loss_scaling: float = 65536.0,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        incr_every_n_steps: int = 2000,
        decr_every_n_nan_or_inf: int = 1,
        use_dynamic_loss_scaling: bool = True,
    ) -> None:
        if not init_loss_scaling > 0:
            raise ValueError(f"GradScaler init_loss_scaling must be > 0, got {init_loss_scaling}")
        if not incr_ratio > 1 or not 0 < decr_ratio < 1:
            raise ValueError(
                f"GradScaler needs incr_ratio > 1 and 0 < decr_ratio < 1, got {incr_ratio}, "
                f"{decr_ratio}"
            )
        self._enable = enable
        self.init_loss_scaling = float(init_loss_scaling)
        self.incr_ratio, self.decr_ratio = float(incr_ratio), float(decr_ratio)
        self.incr_every_n_steps = int(incr_every_n_steps)
        self.decr_every_n_nan_or_inf = int(decr_every_n_nan_or_inf)
        self.use_dynamic_loss_scaling = bool(use_dynamic_loss_scaling)

    def scale(self, var: Any) -> Any:
        """Paddle's `scale(loss)`: a deferred loss of the auto-parallel loop is returned as it
        is, its step scaling it; an array is multiplied by the initial scale."""
        use = getattr(getattr(var, "runner", None), "use_scaler", None)
        if use is not None:
            if self._enable:
                use(self)
            return var
        if hasattr(var, "runner"):
            raise TypeError(
                "GradScaler scales the losses of Paddle's auto-parallel loop (a layer trained "
                "through dist.shard_optimizer or dist.to_static); under fleet, AMP's loss "
                "scaling is DistributedStrategy.amp's (amp_configs)"
            )
        return var * self.init_loss_scaling if self._enable else var

    def step(self, optimizer: Any) -> Any:
        """Paddle's `step(optimizer)`: the optimizer's step (the compiled step unscales the
        gradients, skips a non-finite one and updates the scale)."""
        return optimizer.step()

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Paddle's `minimize(optimizer, scaled_loss)`: `optimizer.minimize(scaled_loss)`."""
        return optimizer.minimize(*args, **kwargs)

    def unscale_(self, optimizer: Any) -> None:
        """Paddle's `unscale_(optimizer)`: the compiled step unscales the gradients itself."""

    def update(self) -> None:
        """Paddle's `update()`: the compiled step updated the scale already."""

    def is_enable(self) -> bool:
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        return self.use_dynamic_loss_scaling

    def get_init_loss_scaling(self) -> float:
        return self.init_loss_scaling

    def __repr__(self) -> str:
        return (
            f"GradScaler(enable={self._enable}, init_loss_scaling={self.init_loss_scaling}, "
            f"use_dynamic_loss_scaling={self.use_dynamic_loss_scaling})"
        )


def decorate(
    models: Any,
    optimizers: Any = None,
    level: str = "O1",
    dtype: str = "float16",
    master_weight: bool | None = None,
    save_dtype: str | None = None,
    master_grad: bool = False,
    excluded_layers: Any = None,
) -> Any:
    """Paddle's `paddle.amp.decorate`: the models and optimizers as they are. fleetjax keeps
    the parameters in float32 (the master weights) and casts them inside the step under
    `auto_cast(level="O2")`, so there is nothing to decorate; O2 warns once saying so."""
    if level == "O2":
        warn_once(
            "amp.decorate(level='O2') leaves the parameters in float32: fleetjax casts them "
            "inside the compiled step under auto_cast(level='O2') and keeps float32 master "
            "weights (Paddle's master_weight=True)"
        )
    return models if optimizers is None else (models, optimizers)


def apply(strategy: Strategy, autocast: AutoCast | None, scaler: GradScaler | None) -> None:
    """`strategy`'s amp section from an `auto_cast` and a `GradScaler` (float16 without a
    scaler: scaling by 1, non-finite steps still skipped)."""
    if autocast is None:
        if scaler is not None and scaler.is_enable():
            warn_once(
                "GradScaler without auto_cast: the step runs in float32, whose gradients need "
                "no loss scaling; the scaler is not used"
            )
        return
    section = strategy.amp
    section.enable, section.dtype, section.level = True, autocast.dtype, autocast.level.lower()
    section.custom_white_list = list(autocast.custom_white_list)
    section.custom_black_list = list(autocast.custom_black_list)
    section.use_promote = autocast.use_promote
    if scaler is None or not scaler.is_enable():
        if autocast.dtype == "float16":  # bfloat16 is not scaled unless a scaler asks
            section.init_loss_scaling, section.use_dynamic_loss_scaling = 1.0, False
        return
    section.init_loss_scaling = scaler.init_loss_scaling
    section.use_dynamic_loss_scaling = scaler.use_dynamic_loss_scaling
    section.incr_ratio, section.decr_ratio = scaler.incr_ratio, scaler.decr_ratio
    section.incr_every_n_steps = scaler.incr_every_n_steps
    section.decr_every_n_nan_or_inf = scaler.decr_every_n_nan_or_inf
