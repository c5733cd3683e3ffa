"""Batch normalization over all data-parallel replicas or over each replica's own rows:
`DistributedStrategy.sync_batch_norm` (Paddle's `SyncBatchNorm`) or Paddle's default local
`BatchNorm` under data parallelism, as a flax nnx module.

In SPMD the batch is one global array whose rows are split over the data axes (``dp`` x
``sharding``). The layer views it as ``[groups, rows per group, ...]`` and computes statistics
per group:

* sync: one group, so the statistics span every replica's rows, and XLA all-reduces them;
* local: one group per replica; group r is the block of rows replica r holds (the batch is split
  in contiguous blocks), so each device computes its own statistics with no communication.

Running statistics have one row per group, ``[groups, num_features]``: under local each
replica keeps its own, as each Paddle trainer does, and they are split over the data axes.

Inside a `shard_map` over the data axes (as the per-replica optimizers DGC and LocalSGD run the
loss), each device sees its own rows and its own row of statistics; sync then averages the
statistics over those axes with `lax.pmean`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from fleetjax.layers._params import check_sizes
from fleetjax.layers.partitioning import constrain, logical_to_spec

__all__ = ["BatchNorm", "convert_batch_norm"]

# The logical axis of the batch split; a local layer's statistics are split like it.
_BATCH = "activation_batch"


class BatchNorm(nnx.Module):
    """Paddle's ``BatchNorm`` (local statistics) or ``SyncBatchNorm`` (``sync=True``).

    In training (``use_running_average=False``) each group's rows are normalized with their own
    mean and biased variance over every axis but the feature axis, as Paddle's
    ``batch_norm``: ``y = (x - mean) / sqrt(var + epsilon) * scale + bias``, and the running
    statistics become ``momentum * running + (1 - momentum) * batch``. In evaluation the running
    statistics are used: under local, each replica's rows with that replica's.

    ``model.eval()`` / ``model.train()`` and ``nnx.view(model, use_running_average=...)`` switch
    modes, as for ``nnx.BatchNorm``. `convert_batch_norm` sets the mode of a whole model from
    the strategy.

    Attributes:
      scale, bias: ``[num_features]`` parameters (Paddle's ``weight`` and ``bias``); None
        without ``use_scale`` / ``use_bias``.
      mean, var: running statistics (Paddle's ``_mean`` and ``_variance``), ``[groups,
        num_features]``; under local, row r is replica r's.
      sync: statistics over all replicas (``DistributedStrategy.sync_batch_norm``).
      groups: 1 under sync, else the number of data-parallel replicas.
    """

    def __init__(
        self,
        num_features: int,
        *,
        sync: bool = False,
        replicas: int = 1,
        axis: int = -1,
        momentum: float = 0.9,
        epsilon: float = 1e-5,
        use_running_average: bool = False,
        use_scale: bool = True,
        use_bias: bool = True,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
    ) -> None:
        """Momentum and epsilon default to Paddle's.

        Args:
          num_features: the size of the feature axis (Paddle's ``num_features``).
          sync: statistics over all replicas (``DistributedStrategy.sync_batch_norm``).
          replicas: how many ways the batch is split over the data axes
            (`fleetjax.mesh.data_parallel_size(mesh)`); used unless ``sync``.
          axis: the feature axis (-1: channels last; 1 for Paddle's NCHW); not the batch axis.
          dtype: the output dtype (default: the input's); statistics are float32 or wider.
        """
        _check_mode(type(self).__name__, sync, replicas)
        check_sizes(type(self).__name__, num_features=num_features)
        if not 0 <= momentum <= 1:
            raise ValueError(f"BatchNorm: momentum must be in [0, 1], got {momentum!r}")
        if not epsilon > 0:
            raise ValueError(f"BatchNorm: epsilon must be > 0, got {epsilon!r}")
        self.num_features = num_features
        self.axis, self.momentum, self.epsilon = axis, momentum, epsilon
        self.use_running_average = use_running_average
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype)) if use_scale else None
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype)) if use_bias else None
        self._lay_out(sync, replicas, jnp.zeros(num_features), jnp.ones(num_features))

    def _lay_out(self, sync: bool, replicas: int, mean: jax.Array, var: jax.Array) -> None:
        """Running statistics for `sync` (one row) or `replicas` rows, each row `mean` and `var`
        ([features])."""
        self.sync = sync
        self.groups = groups = 1 if sync else replicas
        names = (_BATCH if groups > 1 else None, None)
        for name, value in (("mean", mean), ("var", var)):
            rows = jnp.broadcast_to(value.astype(jnp.float32), (groups, self.num_features))
            # Placed when the model is (`partition_specs`), so a model builds with no mesh.
            stat = nnx.BatchStat(rows, out_sharding=names, eager_sharding=False)
            setattr(self, name, stat)

    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        """Normalize `x` (``[batch, ...]``, the batch split over the data axes)."""
        if use_running_average is None:
            use_running_average = self.use_running_average
        feature = self._feature_axis(x)
        # The statistics rows this code sees: all of them, or inside a shard_map over the data
        # axes, this device's own.
        groups, batch = self.mean[...].shape[0], x.shape[0]
        if batch % groups:
            raise ValueError(
                f"BatchNorm with local statistics for {groups} replicas: a batch of {batch} "
                f"rows does not split into {groups} equal shares"
            )
        _check_replicas(x, groups)
        # Group r is rows [r * batch / groups, (r + 1) * batch / groups): replica r's block.
        xg = x.reshape(groups, batch // groups, *x.shape[1:])
        names = (_BATCH, None) if groups > 1 else (None, _BATCH)
        xg = constrain(xg, names + (None,) * (x.ndim - 1))
        wide = xg.astype(jnp.promote_types(x.dtype, jnp.float32))
        stats_shape = [groups] + [1] * x.ndim
        stats_shape[feature + 1] = self.num_features
        if use_running_average:
            mean, var = self.mean[...], self.var[...]
        else:
            reduced = tuple(d + 1 for d in range(x.ndim) if d != feature)
            # One pass (sum and sum of squares) so that sync all-reduces both at once, as
            # Paddle's SyncBatchNorm does.
            mean, mean_square = wide.mean(reduced), jnp.square(wide).mean(reduced)
            manual = _manual_data_axes()
            if self.sync and manual:  # inside a shard_map: the other replicas' rows too
                mean, mean_square = jax.lax.pmean((mean, mean_square), manual)
            var = jnp.maximum(mean_square - jnp.square(mean), 0.0)
            m = self.momentum
            self.mean[...] = jax.lax.stop_gradient(m * self.mean[...] + (1 - m) * mean)
            self.var[...] = jax.lax.stop_gradient(m * self.var[...] + (1 - m) * var)
        y = (wide - mean.reshape(stats_shape)) * jax.lax.rsqrt(
            var.reshape(stats_shape) + self.epsilon
        )
        feature_shape = [1] * x.ndim
        feature_shape[feature] = self.num_features
        if self.scale is not None:
            y = y * self.scale[...].reshape(feature_shape)
        if self.bias is not None:
            y = y + self.bias[...].reshape(feature_shape)
        return y.reshape(x.shape).astype(self.dtype or x.dtype)

    def _feature_axis(self, x: jax.Array) -> int:
        if not -x.ndim <= self.axis < x.ndim or self.axis % x.ndim == 0:
            raise ValueError(
                f"BatchNorm: axis={self.axis} must name a non-batch axis of the input, "
                f"which has shape {x.shape}"
            )
        feature = self.axis % x.ndim
        if x.shape[feature] != self.num_features:
            raise ValueError(
                f"BatchNorm: the input's axis {self.axis} has {x.shape[feature]} features, "
                f"expected num_features={self.num_features} (input shape {x.shape})"
            )
        return feature

    def set_view(self, use_running_average: bool | None = None) -> None:
        """For ``nnx.view``: the mode to use."""
        if use_running_average is not None:
            self.use_running_average = use_running_average


def _check_mode(where: str, sync: bool, replicas: int) -> None:
    if not isinstance(sync, bool):
        raise TypeError(f"{where}: sync must be bool, got {type(sync).__name__} {sync!r}")
    check_sizes(where, replicas=replicas)


def _batch_axes(mesh: AbstractMesh | None = None) -> tuple[str, ...]:
    """The mesh axes the batch is split over (of `mesh`, if given, and not manual there)."""
    axes = logical_to_spec((_BATCH,), mesh=mesh)[0] or ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _check_replicas(x: jax.Array, groups: int) -> None:
    """With a mesh in scope, local statistics need one group per replica of that mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(jax.typeof(x).sharding, "mesh", mesh)
    if groups == 1 or mesh.empty:
        return
    replicas = math.prod(mesh.shape[a] for a in _batch_axes(mesh))
    if replicas != groups:
        raise ValueError(
            f"BatchNorm keeps local statistics for {groups} replicas, but the mesh splits "
            f"the batch {replicas} ways; convert_batch_norm(model, sync=False, "
            f"replicas={replicas}) re-lays it out"
        )


def _manual_data_axes() -> tuple[str, ...]:
    """The data axes that are manual here (inside a `shard_map` over them)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return tuple(a for a in _batch_axes() if types.get(a) == AxisType.Manual)


def convert_batch_norm(model: nnx.Module, *, sync: bool, replicas: int = 1) -> nnx.Module:
    """Set every `BatchNorm` in `model` to sync or local statistics (in place); returns `model`.

    Paddle's ``SyncBatchNorm.convert_sync_batchnorm(model)``, both ways: ``sync`` is
    ``DistributedStrategy.sync_batch_norm``, ``replicas`` the data-parallel size of the mesh.
    The running statistics are re-laid out: every new row is the mean of the old rows.
    """
    _check_mode("convert_batch_norm", sync, replicas)
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, BatchNorm)]
    for layer in layers:
        layer._lay_out(sync, replicas, layer.mean[...].mean(0), layer.var[...].mean(0))
    return model
