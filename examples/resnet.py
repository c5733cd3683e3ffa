"""A small ResNet of flax nnx modules with `fleetjax.layers.BatchNorm`, for seed 003's ResNet50
practice scaled to a CPU.

He et al.'s CIFAR ResNet: a 3x3 convolution stem, three stages of basic blocks (two 3x3
convolutions, each followed by batch normalization, around a shortcut) with 1, 2 and 4 times
`width` channels, the second and third stage halving the resolution, then global average
pooling and a linear classifier: ``depth = 6 n + 2`` layers for n blocks per stage. Images are
channels last, ``[batch, height, width, channels]``.

Batch normalization follows `DistributedStrategy.sync_batch_norm`: statistics over the whole
global batch (``sync_batch_norm=True``, Paddle's ``SyncBatchNorm``) or over each data-parallel
replica's rows (Paddle's default). The running statistics are the train step's model state
(`make_train_step(..., has_state=True)`): the loss normalizes with the batch's statistics and
returns the running ones updated with Paddle's momentum; evaluation uses them:

    resnet, params = make_resnet(8, 10, sync_batch_norm=True)
    stats = resnet.initial_stats()
    batch = {"image": x, "label": y}                                # x: float32 [B, H, W, C]
    loss, aux, stats = resnet.loss_fn(params, stats, batch)         # aux: {"accuracy": ...}
    logits = resnet.logits(params, stats, x)                        # running statistics
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from fleetjax.layers import BatchNorm, partition_specs

Params = dict[str, Any]
Stats = dict[str, Any]
Batch = dict[str, jax.Array]

__all__ = ["ResNet", "ResNetFunctions", "make_resnet"]


class ConvBN(nnx.Module):
    """A bias-free convolution followed by batch normalization (Paddle's ``ConvBNLayer``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        bn: dict[str, Any],
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.conv = nnx.Conv(
            in_channels,
            out_channels,
            (kernel_size, kernel_size),
            strides=stride,
            padding="SAME",
            use_bias=False,
            kernel_init=nnx.initializers.he_normal(),
            rngs=rngs,
        )
        self.bn = BatchNorm(out_channels, **bn)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.bn(self.conv(x))


class BasicBlock(nnx.Module):
    """Two 3x3 ConvBNs around a shortcut (a strided 1x1 ConvBN where the shape changes)."""

    def __init__(
        self, in_channels: int, channels: int, stride: int, bn: dict[str, Any], *, rngs: nnx.Rngs
    ) -> None:
        self.conv1 = ConvBN(in_channels, channels, 3, stride, bn, rngs=rngs)
        self.conv2 = ConvBN(channels, channels, 3, 1, bn, rngs=rngs)
        reshaped = stride != 1 or in_channels != channels
        self.shortcut = (
            ConvBN(in_channels, channels, 1, stride, bn, rngs=rngs) if reshaped else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))) + shortcut)


class ResNet(nnx.Module):
    """The network; run it with the pure functions of `ResNetFunctions` (see `make_resnet`)."""

    def __init__(
        self,
        depth: int,
        num_classes: int,
        *,
        width: int,
        in_channels: int,
        bn: dict[str, Any],
        rngs: nnx.Rngs,
    ) -> None:
        blocks_per_stage = (depth - 2) // 6
        self.stem = ConvBN(in_channels, width, 3, 1, bn, rngs=rngs)
        blocks, channels = [], width
        for stage in range(3):
            out = width * 2**stage
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out, stride, bn, rngs=rngs))
                channels = out
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(channels, num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.stem(images))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(axis=(1, 2)))


class ResNetFunctions:
    """The ResNet as pure functions of plain pytrees (nested dicts of arrays): parameters, and
    running statistics (each `BatchNorm`'s ``mean`` and ``var``, ``[groups, channels]``)."""

    def __init__(self, model: ResNet) -> None:
        self._graphdef, _, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        self._initial_stats = nnx.to_pure_dict(stats)
        self._state = nnx.eval_shape(lambda: nnx.state(model))  # shapes and logical names

    def _merge(self, params: Params, stats: Stats, training: bool) -> ResNet:
        model = nnx.merge(self._graphdef, params, stats)
        return nnx.view(model, use_running_average=not training)

    def loss_fn(
        self, params: Params, stats: Stats, batch: Batch
    ) -> tuple[jax.Array, dict[str, Any], Stats]:
        """The mean cross entropy of ``batch["image"]`` (float [B, H, W, C]) against
        ``batch["label"]`` (int [B]), normalizing with batch statistics, for
        `make_train_step(..., has_aux=True, has_state=True)`.

        Returns ``(loss, {"accuracy": ...}, stats)``: the running statistics after this batch
        (``momentum * stats + (1 - momentum) * batch``, Paddle's update)."""
        model = self._merge(params, stats, training=True)
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return loss, {"accuracy": accuracy}, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

    def logits(self, params: Params, stats: Stats, images: jax.Array) -> jax.Array:
        """Evaluation: the logits of `images`, normalized with the running statistics `stats`
        (under local statistics, replica r's rows of the batch with replica r's)."""
        return self._merge(params, stats, training=False)(images)

    def initial_stats(self) -> Stats:
        """Fresh running statistics: means 0, variances 1 (Paddle's initial ``_mean`` and
        ``_variance``)."""
        return jax.tree.map(jnp.copy, self._initial_stats)

    def stats_specs(self, *, mesh: Mesh | None = None) -> Stats:
        """A PartitionSpec for every running statistic: local statistics are split over the
        data axes (each replica holds its own row), sync ones replicated."""
        stats = nnx.state(self._state, nnx.BatchStat)
        return nnx.to_pure_dict(partition_specs(stats, mesh=mesh))


def make_resnet(
    depth: int = 8,
    num_classes: int = 10,
    *,
    width: int = 16,
    in_channels: int = 1,
    sync_batch_norm: bool = False,
    replicas: int = 1,
    momentum: float = 0.9,
    seed: int = 0,
) -> tuple[ResNetFunctions, Params]:
    """The ResNet's functions and its freshly initialised parameters.

    Args:
      depth: layers with weights, ``6 n + 2`` (8, 14, 20, ...: n basic blocks per stage).
      num_classes: outputs of the classifier.
      width: channels of the first stage (the others have 2 and 4 times as many).
      in_channels: channels of the input images.
      sync_batch_norm: `DistributedStrategy.sync_batch_norm`: statistics over all replicas.
      replicas: the data-parallel size of the mesh (`fleetjax.mesh.data_parallel_size`);
        local statistics keep one row per replica.
      momentum: the running statistics' momentum (Paddle's 0.9).
      seed: the initialisation's PRNG seed.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(
            f"depth must be 6 n + 2 for n >= 1 blocks per stage (8, 14, 20, ...), got {depth!r}"
        )
    for name, value in (
        ("num_classes", num_classes),
        ("width", width),
        ("in_channels", in_channels),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
    bn = {"sync": sync_batch_norm, "replicas": replicas, "momentum": momentum}
    model = ResNet(
        depth, num_classes, width=width, in_channels=in_channels, bn=bn, rngs=nnx.Rngs(seed)
    )
    return ResNetFunctions(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
