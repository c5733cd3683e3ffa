"""Inference export on `jax.export`: Paddle's `fleet.save_inference_model`, and its loader.

`save_inference_model(dirname, fn, params, example_inputs)` writes two files:

* `inference.jaxexport`: the serialized `jax.export.Exported` of
  `model(param_leaves, *inputs) = fn(params, *inputs)`, StableHLO that any JAX of a compatible
  version runs without the Python code of `fn` (`Exported.serialize` needs the `flatbuffers`
  package);
* `inference_params.npz`: the parameter leaves, keyed `<index>:<path>` (zero-padded index, so
  sorted keys are in `jax.tree.leaves(params)` order). Leaves of dtypes numpy cannot store
  (bfloat16, float8) are kept as unsigned ints of the same width and bit-cast back inside the
  exported function.

By default the leading dimension of every input is symbolic, so the model takes any batch size.
`load_inference_model(dirname)` returns a callable; with plain JAX and numpy it is:

    exported = jax.export.deserialize(open(f"{dirname}/inference.jaxexport", "rb").read())
    with np.load(f"{dirname}/inference_params.npz") as f:
        params = [f[key] for key in sorted(f.files)]
    outputs = exported.call(params, *inputs)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

MODEL_FILE = "inference.jaxexport"
PARAMS_FILE = "inference_params.npz"


def _host_value(x: Any) -> np.ndarray:
    """`x` as one numpy array on this host (gathered if other processes hold parts of it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _storable(x: np.ndarray) -> np.ndarray:
    """`x`, viewed as unsigned ints if numpy's file format has no such dtype (ml_dtypes)."""
    return x if x.dtype.kind in "biufc" else x.view(f"u{x.dtype.itemsize}")


def save_inference_model(
    dirname: str | os.PathLike[str],
    fn: Callable[..., Any],
    params: Any,
    example_inputs: Sequence[Any],
    *,
    dynamic_batch: bool = True,
    platforms: Sequence[str] | None = None,
) -> None:
    """Export `fn(params, *inputs)` for inference into `dirname` (Paddle's
    `fleet.save_inference_model`, with a JAX function in place of a pruned program).

    Args:
      dirname: the directory to write (created if missing; its two files are replaced).
      fn: `fn(params, *inputs) -> outputs`, a JAX-traceable function.
      params: a pytree of arrays (sharded over any mesh, or host arrays).
      example_inputs: a tuple or list of example positional inputs (arrays or pytrees of
        arrays); only their shapes and dtypes are used.
      dynamic_batch: make the leading dimension of every input symbolic (any batch size,
        the same for all inputs), like Paddle's -1 batch dimension of feed variables.
      platforms: the platforms to export for, e.g. ("cpu", "cuda"); default the current one.

    With several processes, all of them call this (sharded parameters are gathered); the
    first writes the files.
    """
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs must be a tuple or list of fn's positional inputs after params, "
            f"got {type(example_inputs).__name__}"
        )
    if dynamic_batch:
        for path, x in jax.tree_util.tree_flatten_with_path(tuple(example_inputs))[0]:
            if np.ndim(x) == 0:
                raise ValueError(
                    f"example_inputs{jax.tree_util.keystr(path)} is a scalar, which has no "
                    "batch dimension; pass dynamic_batch=False to export fixed shapes"
                )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    values = [_host_value(x) for _, x in flat]
    dtypes = [x.dtype for x in values]
    stored = [_storable(x) for x in values]

    def model(param_leaves: list[jax.Array], *inputs: Any) -> Any:
        restored = [
            x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)
            for x, dtype in zip(param_leaves, dtypes, strict=True)
        ]
        return fn(jax.tree.unflatten(treedef, restored), *inputs)

    input_specs = jax.export.symbolic_args_specs(
        tuple(example_inputs), "batch, ..." if dynamic_batch else None
    )
    param_specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in stored]
    exported = jax.export.export(jax.jit(model), platforms=platforms)(param_specs, *input_specs)
    serialized = exported.serialize()

    if jax.process_index() == 0:
        os.makedirs(dirname, exist_ok=True)
        with open(os.path.join(dirname, MODEL_FILE), "wb") as f:
            f.write(serialized)
        width = len(str(max(len(stored) - 1, 0)))
        keys = [f"{i:0{width}d}:{jax.tree_util.keystr(path)}" for i, (path, _) in enumerate(flat)]
        np.savez(os.path.join(dirname, PARAMS_FILE), **dict(zip(keys, stored, strict=True)))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("fleetjax.save_inference_model")


class InferenceModel:
    """An exported model and its parameters: `model(*inputs)` runs `fn(params, *inputs)`.

    Attributes:
      exported: the `jax.export.Exported` (its `in_avals`, `out_avals`, `platforms`).
      params: the parameter leaves, on the default device.
    """

    def __init__(self, exported: jax.export.Exported, params: list[jax.Array]) -> None:
        self.exported = exported
        self.params = params
        self._call = jax.jit(exported.call)

    def __call__(self, *inputs: Any) -> Any:
        return self._call(self.params, *inputs)


def _read_model(path: str) -> jax.export.Exported:
    with open(path, "rb") as f:
        data = f.read()
    try:
        exported = jax.export.deserialize(bytearray(data))
        exported.mlir_module()  # the StableHLO is otherwise only read at the first call
        return exported
    except Exception as e:  # flatbuffers and XLA raise many kinds (struct.error, ...)
        raise ValueError(
            f"{path} is not a model written by save_inference_model, or is damaged "
            f"({type(e).__name__}: {e})"
        ) from e


def _read_params(path: str, exported: jax.export.Exported) -> list[np.ndarray]:
    """The parameter leaves in `path`, checked against what `exported` takes."""
    try:
        with np.load(path) as f:
            keys = sorted(f.files)
            params = [f[key] for key in keys]
    except FileNotFoundError:
        raise
    except Exception as e:  # numpy and zipfile raise many kinds (BadZipFile, EOFError, ...)
        raise ValueError(
            f"{path} is not a parameter file written by save_inference_model, or is damaged "
            f"({type(e).__name__}: {e})"
        ) from e
    wanted = exported.in_avals[: exported.in_tree.children()[0].children()[0].num_leaves]
    if len(params) != len(wanted):
        raise ValueError(
            f"{path} holds {len(params)} arrays but its model takes {len(wanted)} parameters"
        )
    for key, x, aval in zip(keys, params, wanted, strict=True):
        if x.shape != aval.shape or x.dtype != aval.dtype:
            raise ValueError(
                f"{path}: {key} is {x.dtype}{list(x.shape)} but its model takes "
                f"{aval.dtype}{list(aval.shape)}"
            )
    return params


def load_inference_model(dirname: str | os.PathLike[str]) -> InferenceModel:
    """The model that `save_inference_model` wrote to `dirname`, ready to call.

    Raises:
      FileNotFoundError: if a file is missing.
      ValueError: if a file is damaged, not written by `save_inference_model`, or the
        parameters do not fit the model (naming the file).
    """
    exported = _read_model(os.path.join(dirname, MODEL_FILE))
    params = _read_params(os.path.join(dirname, PARAMS_FILE), exported)
    return InferenceModel(exported, jax.device_put(params))
