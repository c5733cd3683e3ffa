"""The fleet's saving and loading (`fleet.save_persistables`, `save_inference_model`, `save`,
`load_model`, ...): fleetjax's forms, a path first, save what they are given; Paddle's save
the fleet's trained model (its Trainer's state, or the model exported for inference)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from fleetjax import checkpoint, export
from fleetjax._warnings import warn_once
from fleetjax.fleet._loop import DygraphLoop
from fleetjax.fleet._ps import non_distributed
from fleetjax.fleet._roles import RoleQueries
from fleetjax.fleet._trainer import Trainer

__all__ = ["Saving"]

_WHOLE_STATE = (
    "fleet.{}(mode={}): Paddle's modes choose among its parameter-server table formats; "
    "fleetjax's tables are arrays in the training state, which is saved and loaded whole"
)
_NO_EXECUTOR = (
    "{}= has no meaning in JAX: there is no executor or program; fleet.{} works on the fleet's "
    "Trainer (the model of distributed_model, trained by minimize / backward)"
)


class Saving(RoleQueries):
    """Paddle's saving and loading calls on the fleet (a part of `Fleet`)."""

    _loop: DygraphLoop

    def save_persistables(
        self,
        executor: Any = None,
        dirname: str | os.PathLike[str] | None = None,
        main_program: Any = None,
        *,
        state: Any = None,
    ) -> None:
        """Save a training state to `dirname`, atomically replacing the last save (orbax; see
        `fleetjax.checkpoint`). Two call forms:

        * Paddle's `save_persistables(executor, dirname, main_program=None)` saves the state of
          the fleet's Trainer (parameters, optimizer state, step). JAX has no executor or
          program: `executor` and `main_program` are accepted and warn once.
        * fleetjax's `save_persistables(dirname, state)` (a path first) saves `state`, e.g.
          the `TrainState` of `make_train_step`.

        Raises:
          RuntimeError: in Paddle's form, if the fleet has not trained yet.
        """
        if isinstance(executor, (str, os.PathLike)):  # fleetjax's form: (dirname, state)
            if dirname is not None and state is not None:
                raise TypeError("save_persistables(dirname, state) got the state twice")
            executor, dirname, state = None, executor, state if dirname is None else dirname
        _no_meaning("save_persistables", executor=executor, main_program=main_program)
        if dirname is None:
            raise TypeError("save_persistables needs dirname")
        if state is None:
            state = self._trained("save_persistables(executor, dirname)").state
        checkpoint.save_persistables(dirname, state)

    def load_persistables(self, dirname: str | os.PathLike[str], target: object) -> object:
        """The state last saved in `dirname`, placed like `target` (any mesh)."""
        return checkpoint.load_persistables(dirname, target)

    def save_inference_model(self, *args: Any, **kwargs: Any) -> None:
        """Export an inference model into `dirname` with `jax.export` (see
        `fleetjax.export.save_inference_model`). Two call forms:

        * fleetjax's `save_inference_model(dirname, fn, params, example_inputs, *,
          dynamic_batch=True, platforms=None)` (a path first) exports `fn(params, *inputs)`.
        * Paddle's `save_inference_model(executor, dirname, feeded_var_names, target_vars,
          main_program=None, export_for_deployment=True)` exports the fleet's trained model.
          `feeded_var_names` name entries of the batch dict the fleet trained on: they are the
          inputs, in that order, with the last batch's shapes (any number of rows).
          `target_vars` are functions `target(model, feeds)`, like the loss functions, of the
          model (in eval mode: BatchNorm's running statistics, no dropout, as Paddle's
          inference program) and the dict of the named inputs; the exported model returns
          their list. `executor` and `main_program` are accepted and warn once.
        """
        if (args and isinstance(args[0], (str, os.PathLike))) or "fn" in kwargs:
            export.save_inference_model(*args, **kwargs)
        else:
            self._save_trained_model(*args, **kwargs)

    def _save_trained_model(
        self,
        executor: Any,
        dirname: str | os.PathLike[str],
        feeded_var_names: Sequence[str],
        target_vars: Sequence[Callable[..., Any]],
        main_program: Any = None,
        export_for_deployment: bool = True,
    ) -> None:
        """Paddle's form of `save_inference_model`, on the fleet's Trainer."""
        _no_meaning("save_inference_model", executor=executor, main_program=main_program)
        if export_for_deployment is not True:
            raise ValueError(
                "save_inference_model: export_for_deployment must be True (Paddle supports "
                f"only True), got {export_for_deployment!r}"
            )
        trainer = self._trained("save_inference_model(executor, dirname, ...)")
        example_inputs = _feeds(self._loop.batch_spec, feeded_var_names)
        if isinstance(target_vars, (str, bytes)) or not all(map(callable, target_vars)):
            raise TypeError(
                "target_vars must be a list of functions target(model, feeds) that compute the "
                f"outputs (JAX has no output variables to name), got {target_vars!r}"
            )
        names, targets = list(feeded_var_names), list(target_vars)
        model_of, params = _pure_model(trainer.model)

        def outputs(params: Any, *inputs: Any) -> list[Any]:
            model, feeds = model_of(params), dict(zip(names, inputs, strict=True))
            return [target(model, feeds) for target in targets]

        export.save_inference_model(dirname, outputs, params, example_inputs)

    def save(
        self,
        dirname: str | os.PathLike[str],
        feed: Sequence[str] = (),
        fetch: Sequence[Callable[..., Any]] = (),
        **configs: Any,
    ) -> None:
        """Paddle's `fleet.save`: with `feed` or `fetch`, the fleet's trained model as an
        inference model (`save_inference_model(None, dirname, feed, fetch)`: `feed` names
        batch entries, `fetch` are functions `target(model, feeds)`); without, its training
        state (`save_persistables(None, dirname)`). In a process alone it warns and saves
        nothing, as Paddle's does. `mode` (Paddle's configs: 0 the whole tables, 1 their
        changed rows, 2 a base model) warns unless 0: the whole state is saved.
        """
        if non_distributed(self._checked_role(), "save"):
            return
        unknown = set(configs) - {"mode"}
        if unknown:
            raise TypeError(f"fleet.save got unknown configs {sorted(unknown)}; Paddle's is mode")
        if configs.get("mode", 0) != 0:
            warn_once(_WHOLE_STATE.format("save", configs["mode"]))
        if feed or fetch:
            self._save_trained_model(None, dirname, feed, fetch)
        else:
            self.save_persistables(None, dirname)

    def load_model(self, path: str | os.PathLike[str], mode: int) -> None:
        """Paddle's `fleet.load_model`: the fleet's Trainer goes on from the training state that
        `fleet.save(path)` (or `save_persistables`) saved. In a process alone it warns and loads
        nothing, as Paddle's does. `mode` (Paddle's 0 checkpoint, 3 batch model, 1 and 2 its
        inference formats) warns unless 0: the whole state loads.
        """
        if non_distributed(self._checked_role(), "load_model"):
            return
        if mode != 0:
            warn_once(_WHOLE_STATE.format("load_model", mode))
        trainer = self._trained("load_model(path, mode)")
        trainer.state = checkpoint.load_persistables(path, trainer.state)

    def _trained(self, call: str) -> Trainer:
        if self._loop.trainer is None:
            raise RuntimeError(
                f"{call} saves the fleet's trained model, and the fleet has not trained yet: "
                "train with fleet.minimize(loss_fn, batch) (or the optimizer's minimize / "
                "backward + step) first, or use fleetjax's form with a path first"
            )
        return self._loop.trainer

    def load_inference_model(self, dirname: str | os.PathLike[str]) -> export.InferenceModel:
        """The exported model in `dirname`, callable with plain JAX."""
        return export.load_inference_model(dirname)


def _no_meaning(call: str, **arguments: Any) -> None:
    """Warn once for each Paddle argument given that JAX has no counterpart of."""
    for name, value in arguments.items():
        if value is not None:
            warn_once(_NO_EXECUTOR.format(name, call))


def _feeds(batch_spec: Any, names: Sequence[str]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of the batch entries `names` (Paddle's `feeded_var_names`)."""
    if isinstance(names, (str, bytes)) or not names:
        raise TypeError(f"feeded_var_names must be a non-empty list of names, got {names!r}")
    if not isinstance(batch_spec, Mapping):
        raise ValueError(
            "feeded_var_names name entries of the batch dict the fleet trains on, but its "
            f"batch is a {type(batch_spec).__name__}; export with "
            "fleet.save_inference_model(dirname, fn, params, example_inputs) instead"
        )
    missing = [name for name in names if name not in batch_spec]
    if missing:
        raise ValueError(
            f"feeded_var_names {missing} are not in the batch the fleet trained on, whose "
            f"entries are {sorted(batch_spec)}"
        )
    return tuple(batch_spec[name] for name in names)


def _pure_model(model: Any) -> tuple[Callable[[Any], Any], Any]:
    """(a function from parameters to the model, its parameters): for an nnx Module, its
    variables but the random-number state as a dict, and the module rebuilt from them in eval
    mode; for a pytree of parameters, itself."""
    if not isinstance(model, nnx.Module):
        return (lambda params: params), model
    graphdef, arrays, rngs = nnx.split(model, nnx.Not(nnx.RngState), ...)

    def model_of(params: Any) -> nnx.Module:
        state = jax.tree.map(lambda x: x, arrays)
        nnx.replace_by_pure_dict(state, params)
        module = nnx.merge(graphdef, state, rngs)
        module.eval()
        return module

    return model_of, nnx.to_pure_dict(arrays)
