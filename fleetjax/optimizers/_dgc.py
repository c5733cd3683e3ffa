"""DGC: Paddle's deep gradient compression (`strategy.dgc`, `dgc_configs`; ops `dgc`,
`dgc_clip_by_norm`, `dgc_momentum`, and the sparse all-reduce).

Interface. `dgc_reducer(...)` is an optax transformation that runs INSIDE `jax.shard_map` over
the data axes (`axis_names`, e.g. `("dp", "sharding")`): `update(grads, state, params)` takes
this replica's LOCAL gradient (the mean over its own batch rows; no all-reduce before),
this replica's `DGCState` and the parameters, does all the communication itself, and returns
the direction to step along and the new local state. `dgc(...)` chains it with the learning
rate (`p -= lr * direction`), so it is Paddle's whole `DGCMomentumOptimizer`. The state's
`u` and `v` differ per replica: keep it stacked on a leading axis sharded over the data axes
and hand each device its slice. The parameters stay equal on every replica. In shard_map's
type system (`check_vma`) the gradients and the state vary over the data axes, and so does
everything `update` returns.

Per parameter, with N replicas, local gradient `G`, L2 coefficient `r` (the user Momentum's
`weight_decay`) and `current_step` = steps taken before this one (0 on the first):

* Eligible (float32, >= 16384 elements), from `rampup_begin_step` on:
  `g = N * clip(G / N, clip_norm / sqrt(N)) + r * p` (Paddle clips its 1/N-scaled gradient;
  no clip without `clip_norm`); `u = m * u + g; v = v + u` (Nesterov: `u = m * (u + g);
  v = v + u + g`); the `k` largest `|v|` of each replica, `k = int(numel * (1 - sparsity))`
  with the sparsity of this step's ramp-up stage, are all-gathered as (index, value) pairs and
  scatter-added; `u` and `v` are zeroed where sent; the direction is that sum / N (SGD).
* Eligible, before `rampup_begin_step`: dense momentum on `pmean(G) + r * p` with velocity
  `u`, no clipping (as in Paddle).
* Others: dense momentum on `clip(pmean(G), clip_norm) + r * p` with velocity `u`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fleetjax.optimizers._basic import (
    LearningRate,
    PaddleOptimizer,
    check_clip_norm,
    check_learning_rate,
    check_number,
    clip_norm_per_tensor,
    paddle_optimizer,
)
from fleetjax.optimizers._names import param_names
from fleetjax.vocabulary import DATA_AXES

MIN_NUMEL = 16384  # Paddle's `_is_use_dgc`: smaller tensors are sent dense


class DGCState(NamedTuple):
    """One replica's DGC state.

    Attributes:
      step: steps taken (int32): Paddle's `current_step` for the next update.
      u: per parameter, the momentum (Paddle's `_dgc_u_`, also the dense momentum's velocity).
      v: per eligible parameter, the accumulated gradient not sent yet (`_dgc_v_`); an empty
        array for the others.
    """

    step: jax.Array
    u: Any
    v: Any


def is_eligible(param: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """Whether DGC compresses this parameter's gradient (float32, >= 16384 elements)."""
    return param.dtype == jnp.float32 and math.prod(param.shape) >= MIN_NUMEL


def _stage(step: Any, rampup_begin_step: int, rampup_step: int, stages: int) -> Any:
    """Paddle's `get_period_sparcity` index, in float32 as there."""
    elapsed = jnp.asarray(step - rampup_begin_step, jnp.float32)
    index = (elapsed * np.float32(stages) / np.float32(rampup_step)).astype(jnp.int32)
    return jnp.minimum(index, stages - 1)


def sparsity_at(
    step: int, rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float]
) -> float | None:
    """The sparsity DGC uses at `step` (0 for the first step); None before
    `rampup_begin_step`, where gradients go dense. E.g. with `sparsity=[0.75, 0.9375,
    0.984375, 0.996, 0.999]` and `rampup_step=10`, steps 0-1 use 0.75, 2-3 0.9375, ..."""
    if step < rampup_begin_step:
        return None
    return sparsity[int(_stage(step, rampup_begin_step, rampup_step, len(sparsity)))]


def top_k_count(numel: int, sparsity: float) -> int:
    """How many entries a replica sends: Paddle's `int(numel * (1 - sparsity))` in float32."""
    return int(np.float32(numel) * (np.float32(1) - np.float32(sparsity)))


def sparse_allreduce(
    values: jax.Array, k: int, axis_names: Sequence[str]
) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map: the sum over replicas of each one's `k` largest-magnitude entries of
    the flat float32 `values`, and this replica's indices of them.

    Like Paddle, each replica packs its k indices (int32 bits) and k values into one float32
    buffer of 2k, all-gathers those buffers, and scatter-adds them into a dense result: N * 2k
    numbers are gathered instead of an all-reduce of `values.size`.
    """
    if values.ndim != 1 or values.dtype != jnp.float32:
        raise ValueError(
            f"sparse_allreduce needs a flat float32 array, got {values.dtype}{list(values.shape)}"
        )
    _, indices = lax.top_k(jnp.abs(values), k)
    packed = jnp.concatenate([lax.bitcast_convert_type(indices, values.dtype), values[indices]])
    gathered = lax.all_gather(packed, tuple(axis_names))
    all_indices = lax.bitcast_convert_type(gathered[:, :k], jnp.int32)
    total = jnp.zeros_like(values).at[all_indices.ravel()].add(gathered[:, k:].ravel())
    return total, indices


Leaf = tuple[jax.Array, jax.Array, jax.Array]  # a parameter's (direction, u, v)


def _momentum(u: jax.Array, grad: jax.Array, mu: float, nesterov: bool) -> tuple[Any, Any]:
    """Paddle's `momentum` op without the learning rate: (velocity, direction)."""
    u = mu * u + grad
    return u, (grad + mu * u if nesterov else u)


def _check_config(
    rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float]
) -> tuple[float, ...]:
    """`dgc_configs` as Paddle's kernels accept them; the sparsities as a tuple."""
    for name, value, low in (
        ("rampup_begin_step", rampup_begin_step, 0),
        ("rampup_step", rampup_step, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    allowed = "a non-empty list of floats in (0, 1)"
    if isinstance(sparsity, str) or not len(sparsity):
        raise ValueError(f"sparsity must be {allowed}, got {sparsity!r}")
    if not all(isinstance(s, (int, float)) and 0 < s < 1 for s in sparsity):
        raise ValueError(f"sparsity must be {allowed}, got {list(sparsity)!r}")
    return tuple(float(s) for s in sparsity)


def _top_k_counts(params: Any, stages: tuple[float, ...]) -> list[tuple[int, ...]]:
    """k per ramp-up stage, for each eligible parameter in leaf order.

    Raises:
      ValueError: where a sparsity leaves an eligible tensor nothing to send (k = 0).
    """
    found = []
    named = zip(jax.tree.leaves(params), jax.tree.leaves(param_names(params)), strict=True)
    for p, name in named:
        if not is_eligible(p):
            continue
        ks = tuple(top_k_count(p.size, s) for s in stages)
        if 0 in ks:
            s = stages[ks.index(0)]
            raise ValueError(
                f"DGC sparsity {s} leaves nothing to send of the {p.size} elements of "
                f"parameter {name!r}: int({p.size} * (1 - {s})) = 0; use a lower sparsity"
            )
        found.append(ks)
    return found


@dataclasses.dataclass(frozen=True)
class _Rule:
    """DGC's momentum and exchange for one tensor, by Paddle's kernels."""

    mu: float
    nesterov: bool
    weight_decay: float
    clip_norm: float | None
    axes: tuple[str, ...]

    def dense(self, grad: jax.Array, u: jax.Array, v: jax.Array, p: jax.Array) -> Leaf:
        """Momentum on an all-reduced gradient, velocity `u`."""
        u, direction = _momentum(u, grad + self.weight_decay * p, self.mu, self.nesterov)
        return direction, u, v

    def sparse(self, g: jax.Array, u: jax.Array, v: jax.Array, p: jax.Array, k: int) -> Leaf:
        """Paddle's `dgc_clip_by_norm`, `dgc` and sparse all-reduce for one tensor."""
        n = lax.axis_size(self.axes)
        if self.clip_norm is not None:
            g = n * clip_norm_per_tensor(g / n, self.clip_norm / math.sqrt(n))
        g = g + self.weight_decay * p
        if self.nesterov:
            u = self.mu * (u + g)
            v = v + u + g
        else:
            u = self.mu * u + g
            v = v + u
        total, sent = sparse_allreduce(v.ravel(), k, self.axes)
        masked = lambda x: x.ravel().at[sent].set(0).reshape(x.shape)  # noqa: E731
        return total.reshape(g.shape) / n, masked(u), masked(v)

    def reduced(self, g: jax.Array) -> jax.Array:
        """The replicas' mean gradient, clipped per tensor as Paddle's Momentum does."""
        g = lax.pmean(g, self.axes)
        return g if self.clip_norm is None else clip_norm_per_tensor(g, self.clip_norm)


def dgc_reducer(
    momentum: float,
    *,
    use_nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    rampup_begin_step: int = 0,
    rampup_step: int = 1,
    sparsity: Sequence[float] = (0.999,),
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformation:
    """DGC's gradient exchange with its momentum, to run inside `jax.shard_map` over
    `axis_names` (see the module docstring): local gradients in, the direction
    `p -= lr * direction` wants out. Needs `params` in `update`.

    Raises (from `init` or the first `update`):
      ValueError: where a sparsity leaves an eligible tensor nothing to send (k = 0).
    """
    rule = _Rule(
        check_number("momentum", momentum),
        use_nesterov,
        check_number("weight_decay", weight_decay),
        check_clip_norm(clip_norm),
        tuple(axis_names),
    )
    stages = _check_config(rampup_begin_step, rampup_step, sparsity)

    def init(params: Any) -> DGCState:
        _top_k_counts(params, stages)
        empty = lambda p: jnp.zeros(p.shape if is_eligible(p) else (0,), p.dtype)  # noqa: E731
        return DGCState(
            jnp.zeros([], jnp.int32),
            jax.tree.map(jnp.zeros_like, params),
            jax.tree.map(empty, params),
        )

    def update(grads: Any, state: DGCState, params: Any = None) -> tuple[Any, DGCState]:
        if params is None:
            raise ValueError("DGC needs the parameters: call update(grads, state, params)")
        treedef = jax.tree.structure(params)
        leaves = list(
            zip(*(treedef.flatten_up_to(t) for t in (grads, state.u, state.v, params)), strict=True)
        )
        out: dict[int, Leaf] = {
            i: rule.dense(rule.reduced(g), u, v, p)
            for i, (g, u, v, p) in enumerate(leaves)
            if not is_eligible(p)
        }
        large = [i for i, leaf in enumerate(leaves) if is_eligible(leaf[3])]
        if large:
            ks = _top_k_counts(params, stages)

            def at_stage(s: int) -> Any:
                return lambda xs: [rule.sparse(*x, k[s]) for x, k in zip(xs, ks, strict=True)]

            branches = [at_stage(s) for s in range(len(stages))]
            index = _stage(state.step, rampup_begin_step, rampup_step, len(stages))
            if rampup_begin_step > 0:  # else this dense branch could never run: leave it out
                dense = lambda xs: [rule.dense(lax.pmean(g, rule.axes), *x) for g, *x in xs]  # noqa: E731
                branches.insert(0, dense)
                index = jnp.where(state.step < rampup_begin_step, 0, index + 1)
            xs = [leaves[i] for i in large]
            found = branches[0](xs) if len(branches) == 1 else lax.switch(index, branches, xs)
            out.update(zip(large, found, strict=True))

        directions, us, vs = zip(*(out[i] for i in range(len(leaves))), strict=True)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
        return unflat(directions), DGCState(state.step + 1, unflat(us), unflat(vs))

    return optax.GradientTransformation(init, update)


def dgc(
    learning_rate: LearningRate = 0.001,
    momentum: float = 0.9,
    *,
    use_nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    rampup_begin_step: int = 0,
    rampup_step: int = 1,
    sparsity: Sequence[float] = (0.999,),
    axis_names: Sequence[str] = DATA_AXES,
) -> PaddleOptimizer:
    """Paddle's `DGCMomentumOptimizer`, as `strategy.dgc` builds it from the user's Momentum:
    `dgc_reducer` then `p -= lr * direction`. Runs inside `jax.shard_map` over `axis_names`
    on each replica's local gradient and state (see the module docstring).

    Args:
      learning_rate, momentum, use_nesterov, weight_decay, clip_norm: the user's Momentum
        (a learning-rate schedule is allowed; `weight_decay` is L2, `clip_norm` per tensor).
      rampup_begin_step, rampup_step, sparsity: `dgc_configs`.
      axis_names: the data axes the shard_map runs over.
    """
    learning_rate = check_learning_rate(learning_rate)
    reducer = dgc_reducer(
        momentum,
        use_nesterov=use_nesterov,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
        rampup_begin_step=rampup_begin_step,
        rampup_step=rampup_step,
        sparsity=sparsity,
        axis_names=axis_names,
    )
    tx = optax.chain(
        reducer, optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=learning_rate)
    )
    hyperparams = {
        "learning_rate": learning_rate,
        "momentum": float(momentum),
        "use_nesterov": bool(use_nesterov),
        "weight_decay": float(weight_decay),
        "clip_norm": clip_norm,
        "rampup_begin_step": rampup_begin_step,
        "rampup_step": rampup_step,
        "sparsity": tuple(float(s) for s in sparsity),
        "axis_names": tuple(axis_names),
    }
    return paddle_optimizer(tx, "DGCMomentum", hyperparams)
