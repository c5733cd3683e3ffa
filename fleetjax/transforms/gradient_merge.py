"""Gradient merge (Paddle's `gradient_merge`, `gradient_merge_configs` k_steps/avg), two ways.

* Across calls (`DistributedStrategy.gradient_merge`, Paddle's `GradientMergeOptimizer`): every
  call adds its gradient to an accumulator; the optimizer runs on calls k, 2k, ... only, on the
  mean (avg) or sum of the k gradients, so its state and learning-rate schedule count real
  updates. This is `optax.MultiSteps`; `across_calls` returns it.
* In one call (`Strategy.gradient_merge`, Paddle auto-parallel's batch split): the batch is split
  into k micro-batches and a `lax.scan` accumulates their gradients, so peak activation memory
  is one micro-batch's; `microbatched` wraps a gradient function.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fleetjax.transforms.grad_fn import GradFn, Outputs


def _check_k(k_steps: int) -> None:
    if not isinstance(k_steps, int) or isinstance(k_steps, bool) or k_steps < 1:
        raise ValueError(f"k_steps must be a positive int, got {k_steps!r}")


def across_calls(
    optimizer: optax.GradientTransformation, k_steps: int, avg: bool = True
) -> optax.GradientTransformation:
    """`optimizer` applied on every `k_steps`-th call to the merged gradient (mean if `avg`,
    else sum); the other calls only accumulate and leave parameters unchanged."""
    _check_k(k_steps)
    return optax.MultiSteps(optimizer, every_k_schedule=k_steps, use_grad_mean=avg)


def split_batch(batch: Any, k_steps: int) -> Any:
    """`batch` with a new leading micro-batch axis of size `k_steps`.

    Micro-batch i takes rows i, i + k, i + 2k, ...: with the batch split over data-parallel
    devices in contiguous blocks, every device then holds an equal part of every micro-batch.
    """

    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % k_steps:
            raise ValueError(
                f"gradient merge splits the batch into k_steps={k_steps} micro-batches, but a "
                f"batch leaf has {x.shape[0]} rows"
            )
        return jnp.swapaxes(x.reshape(x.shape[0] // k_steps, k_steps, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def microbatched(grad_fn: GradFn, k_steps: int, avg: bool = True) -> GradFn:
    """`grad_fn(params, model_state, batch, *rest) -> ((loss, aux, model_state), grads)` over
    `k_steps` micro-batches.

    Gradients are the mean of the micro-batch gradients (the large-batch gradient) if `avg`,
    else their sum; the loss and aux values are means. Every micro-batch sees the same
    `model_state`; of the new model states, floating values are averaged (the large batch's
    statistics) and the others are the last micro-batch's. A PRNG key in `rest` is folded
    with the micro-batch index. Under data parallelism run it on each
    device's own rows, inside `shard_map` (`grad_allreduce.data_parallel`, as
    `make_train_step` does), so that gradients accumulate locally and are reduced once.
    """
    _check_k(k_steps)

    def merged(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple[Outputs, Any]:
        parts = split_batch(batch, k_steps)

        def one(index: jax.Array, micro: Any) -> tuple[Outputs, Any]:
            extra = (jax.random.fold_in(rest[0], index), *rest[1:]) if rest else ()
            return grad_fn(params, model_state, micro, *extra)

        def summed(index: jax.Array, micro: Any) -> tuple[tuple, Any]:
            """What is summed over the micro-batches, and the new model state."""
            (loss, aux, new_state), grads = one(index, micro)
            return ((loss, aux), grads), new_state

        first = jax.tree.map(lambda x: x[0], parts)
        shapes = jax.eval_shape(summed, jnp.zeros((), jnp.int32), first)[0]
        # Inside shard_map the sums are per device; a zero typed like the batch makes the
        # starting zeros per device too (zeros alone would be replicated).
        anchor = jnp.sum(jnp.zeros_like(jax.tree.leaves(parts)[0], dtype=jnp.float32))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype) + anchor.astype(s.dtype), shapes)

        def body(total: Any, indexed: tuple[jax.Array, Any]) -> tuple[Any, Any]:
            add, new_state = summed(*indexed)
            return jax.tree.map(jnp.add, total, add), new_state

        ((loss, aux), grads), states = jax.lax.scan(body, zeros, (jnp.arange(k_steps), parts))
        mean = lambda tree: jax.tree.map(lambda x: x / k_steps, tree)  # noqa: E731
        # The model states come out stacked (as scan outputs, each typed as the loss made it).
        model_state = jax.tree.map(
            lambda x: x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[-1],
            states,
        )
        return Outputs(loss / k_steps, mean(aux), model_state), mean(grads) if avg else grads

    return merged
