"""`TrainState`: everything a train step updates, as one pytree."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fleetjax.transforms.loss_scale import DynamicLossScale


class TrainState(NamedTuple):
    """Everything a step updates, as one pytree (checkpointed as one unit).

    Attributes:
      step: the number of steps taken (int32).
      params: the parameters (float32 master weights under AMP). Under LocalSGD each
        data-parallel replica trains its own: they are stacked on a leading replica axis.
      opt_state: the optimizer state (stacked per replica under DGC and LocalSGD).
      rng: raw key data (uint32[2]); step `i` gives the loss `fold_in(rng, i)`.
      loss_scale: AMP's dynamic loss scale, if AMP scales the loss.
      model_state: the model's variables that are not trained by gradients (batch-norm
        running statistics and the like), with `make_train_step(..., has_state=True)`.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: DynamicLossScale | None = None
    model_state: Any = None
