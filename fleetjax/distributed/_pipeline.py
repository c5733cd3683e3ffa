"""`parallelize`'s `pp_config` on fleetjax's SPMD pipeline: a model's run of identical blocks
(`split_spec`'s layers) cut into the `pp` dimension's stages.

Paddle's pipeline cuts a model's layers into stages that run their own programs. fleetjax runs
one program on every stage (`fleetjax.transforms.pipeline`): the blocks are stacked on a layer
axis split over `pp`, what the forward computes before the first block runs in `embed` (on
the first stage), and what it computes after the last one, then the loss, in `head_loss` (on
the last). `PipelineModel` reads these parts off the model itself: the blocks' list is replaced
by stand-ins that stop the forward at the first block (`embed`), or that hand it the last
block's output (`head_loss`). Which parameters each part reads is read from the traced
`embed`, and the parameters are written back to the layer after each step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import re
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from fleetjax.auto_parallel import MeshView, ProcessMesh
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams

__all__ = ["PipelineModel", "SplitPoint", "SplitSpec", "set_split_spec", "split_spec_of"]


class SplitPoint(enum.IntEnum):
    """Paddle's `paddle.distributed.SplitPoint`: a stage boundary before (`BEGINNING`) or
    after (`END`) the named layer."""

    BEGINNING = 0
    END = 1


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """Where `pp_config` cuts a model: the blocks at `path` (a list of identical modules),
    evenly over the mesh dimension `dim` of `mesh`."""

    mesh: ProcessMesh
    dim: str
    path: tuple[str | int, ...]
    given: Any  # the split_spec as the user wrote it (for messages)


_SPECS: weakref.WeakKeyDictionary[nnx.Module, SplitSpec] = weakref.WeakKeyDictionary()


def split_spec_of(layer: Any) -> SplitSpec | None:
    """The `pp_config` cut of `layer` (None: none)."""
    return _SPECS.get(layer) if isinstance(layer, nnx.Module) else None


def set_split_spec(layer: nnx.Module, mesh: ProcessMesh, split_spec: Any) -> SplitSpec:
    """Read `split_spec` (a prefix naming the blocks, or {layer name: `SplitPoint`}) for
    `layer` on `mesh`'s `pp` dimension, and keep it for the layer's training.

    Raises:
      ValueError: naming `split_spec` where it names no list of identical blocks, cuts them
        into unequal stages, or the mesh has no `pp` dimension.
    """
    if "pp" not in mesh.dim_names:
        raise ValueError(
            f"pp_config's split_spec={split_spec!r} cuts the model over the mesh dim 'pp', "
            f"which {mesh} does not have (Paddle's parallelize names it so)"
        )
    stages = mesh.get_dim_size("pp")
    names = [name for name, _ in _blocks_lists(layer)]
    if isinstance(split_spec, str):
        path = _path(layer, split_spec, names, split_spec)
    elif isinstance(split_spec, Mapping):
        path = _path_of_points(layer, split_spec, names, stages)
    else:
        raise TypeError(
            f"pp_config's split_spec must be a layer-name prefix or a dict of layer names to "
            f"SplitPoint, got {split_spec!r}"
        )
    count = len(_get(layer, path))
    if count % stages:
        raise ValueError(
            f"pp_config's split_spec={split_spec!r} names {count} blocks, which do not split "
            f"evenly over the {stages} stages of mesh dim 'pp': fleetjax's stages run the same "
            "number of identical blocks"
        )
    spec = SplitSpec(mesh, "pp", path, split_spec)
    _SPECS[layer] = spec
    return spec


def _blocks_lists(layer: nnx.Module) -> list[tuple[str, tuple[str | int, ...]]]:
    """(dotted name, path) of each list of modules in `layer`."""
    return [
        (".".join(map(str, path)), path)
        for path, node in nnx.iter_graph(layer)
        if isinstance(node, nnx.List) and len(node) and isinstance(node[0], nnx.Module)
    ]


def _path(layer: nnx.Module, prefix: str, names: list[str], given: Any) -> tuple[str | int, ...]:
    for name, path in _blocks_lists(layer):
        if name == prefix:
            _check_identical(_get(layer, path), given)
            return path
    raise ValueError(
        f"pp_config's split_spec={given!r} names no list of blocks of "
        f"{type(layer).__name__}: its lists of layers are {names}"
    )


def _path_of_points(
    layer: nnx.Module, points: Mapping[str, Any], names: list[str], stages: int
) -> tuple[str | int, ...]:
    """The blocks' path of a {layer name: SplitPoint} split_spec, which must cut them into
    `stages` equal runs."""
    for name, path in _blocks_lists(layer):
        count = len(_get(layer, path))
        cuts = set()
        for key, point in points.items():
            hits = [i for i in range(count) if re.fullmatch(key, f"{name}.{i}")]
            if not hits or SplitPoint(point) not in SplitPoint:
                break
            cuts |= {i + (SplitPoint(point) == SplitPoint.END) for i in hits}
        else:
            even = {count // stages * k for k in range(1, stages)}
            if cuts - {0, count} == even:
                _check_identical(_get(layer, path), points)
                return path
            raise ValueError(
                f"pp_config's split_spec={dict(points)!r} cuts {name}'s {count} blocks at "
                f"{sorted(cuts)}; fleetjax's {stages} stages each run {count // stages} of "
                f"them, cut at {sorted(even)}"
            )
    raise ValueError(
        f"pp_config's split_spec={dict(points)!r} names no blocks of one list of "
        f"{type(layer).__name__}: its lists of layers are {names}"
    )


def _check_identical(blocks: Any, given: Any) -> None:
    shapes = [
        (nnx.graphdef(b), jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(b)))) for b in blocks
    ]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            f"pp_config's split_spec={given!r} names blocks that are not all alike (their "
            "structure or shapes differ): fleetjax stacks them on a layer axis"
        )


def _get(node: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


# -- the stand-ins: the forward stopped at the first block, or handed the last one's output ----

_MODE: contextvars.ContextVar[tuple[str, Any]] = contextvars.ContextVar(
    "stand_in", default=("", None)
)


class _Reached(Exception):
    def __init__(self, x: Any) -> None:
        super().__init__("the forward reached the first pipelined block")
        self.x = x


class _StandIn(nnx.Module):
    """Block `index` of the pipelined list, as the parts around the blocks see it."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise TypeError(
                "the pipelined blocks are called with more than their input: fleetjax's "
                "pipeline hands one array from stage to stage (block(x)); compute the other "
                "arguments inside the block"
            )
        mode, value = _MODE.get()
        if mode == "stop":
            raise _Reached(x)
        return value if self.index == 0 else x


@contextlib.contextmanager
def _mode(mode: str, value: Any = None) -> Iterator[None]:
    token = _MODE.set((mode, value))
    try:
        yield
    finally:
        _MODE.reset(token)


# -- the model as a PipelineLayer --------------------------------------------------------------


class PipelineModel:
    """A layer cut by its `SplitSpec`: its `PipelineLayer` for a loss, its parameters as
    `PipelineParams` and back.

    Raises (when made):
      ValueError: for a layer whose forward never calls the first block, a parameter read both
        before and after the blocks (tied weights), or variables other than parameters.
    """

    def __init__(self, split: SplitSpec, layer: nnx.Module, view: MeshView) -> None:
        self.split, self.view = split, view
        blocks = _get(layer, split.path)
        self.count = len(blocks)
        self.block_graph = nnx.graphdef(blocks[0])
        if jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param))):
            raise ValueError(
                f"{type(layer).__name__} keeps variables other than parameters (statistics, "
                "random-number streams): under pp_config's split_spec its stages keep "
                "parameters only"
            )
        if not isinstance(split.path[-1], str):
            raise ValueError(
                f"pp_config's split_spec={split.given!r}: the blocks must be a list attribute "
                "of a layer (self.layers = nnx.List([...]))"
            )
        shell = nnx.merge(*nnx.split(layer))  # a copy whose blocks are stand-ins
        parent = _get(shell, split.path[:-1])
        stand_ins = nnx.List([_StandIn(i, self.count) for i in range(self.count)])
        setattr(parent, str(split.path[-1]), stand_ins)
        self.shell_graph = nnx.graphdef(shell)
        self.embed_names: list[tuple] = []  # read by for_loss from the first batch
        self._shapes: dict[tuple, jax.ShapeDtypeStruct] = {}

    # parameters ----------------------------------------------------------------------------------

    def _rest(self, layer: nnx.Module) -> dict[tuple, Any]:
        """The layer's parameters outside the blocks, by path."""
        flat = _flat_names(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
        return {k: v for k, v in flat.items() if k[: len(self.split.path)] != self.split.path}

    def parts(self, layer: nnx.Module) -> PipelineParams:
        """The layer's parameters as `PipelineParams` (the blocks' stacked)."""
        rest = self._rest(layer)
        blocks = [nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in _get(layer, self.split.path)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
        embed = {k: v for k, v in rest.items() if k in self.embed_names}
        head = {k: v for k, v in rest.items() if k not in self.embed_names}
        return PipelineParams(_nest(embed), stacked, _nest(head))

    def specs(self, param_specs: Any) -> PipelineParams:
        """`param_specs` (like the layer's parameters) as the `PipelineParams`' specs: the
        blocks' with a leading layer axis (which the step splits over `pp`)."""
        flat = _flat_names(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        path, n = self.split.path, len(self.split.path)
        layers = {
            k[n + 1 :]: PartitionSpec(None, *s) for k, s in flat.items() if k[: n + 1] == (*path, 0)
        }
        rest = {k: s for k, s in flat.items() if k[:n] != path}
        embed = {k: s for k, s in rest.items() if k in self.embed_names}
        head = {k: s for k, s in rest.items() if k not in self.embed_names}
        return PipelineParams(_nest(embed), _nest(layers), _nest(head))

    def param_names(self, path: tuple[Any, ...]) -> list[tuple[str, int | None]]:
        """The layer's dotted names of the `PipelineParams` leaf at `path` (a stacked block
        leaf: one per block, with its index)."""
        part, rest = path[0], ".".join(map(str, path[1:]))
        if part != "layers":
            return [(rest, None)]
        blocks = ".".join(map(str, self.split.path))
        return [(f"{blocks}.{i}.{rest}", i) for i in range(self.count)]

    def write_back(self, layer: nnx.Module, params: PipelineParams) -> None:
        """The trained `params` into the layer's variables."""
        flat = {**_flat_names(params.embed), **_flat_names(params.head)}
        for i, block in enumerate(_get(layer, self.split.path)):
            state = nnx.state(block, nnx.Param)
            nnx.replace_by_pure_dict(state, jax.tree.map(lambda x, i=i: x[i], params.layers))
            nnx.update(block, state)
        for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
            if path in flat:
                variable.set_value(flat[path])

    # the parts' functions ------------------------------------------------------------------------

    def for_loss(
        self, loss_fn: Any, layer: nnx.Module, param_specs: Any, batch: Any
    ) -> tuple[PipelineLayer, PipelineParams, PipelineParams]:
        """(the `PipelineLayer` of the layer and `loss_fn`'s loss layer, the parameters, their
        specs), the parts read on `batch` (the deferred loss's).

        Raises:
          TypeError: for a loss that is not a loss layer of the model's output.
          ValueError: for a parameter read both before and after the blocks (tied weights).
        """
        loss_layer = getattr(loss_fn, "layer", None)
        if loss_layer is None:
            raise TypeError(
                "under pp_config's split_spec the loss is a loss layer of the model's output "
                "(loss = loss_fn(model(x), y)), which the pipeline's last stage computes; a "
                f"loss function of the model ({loss_fn!r}) cannot be cut into stages"
            )
        self._read_parts(layer, loss_layer, batch)
        model = PipelineLayer(self._embed, self._stage, functools.partial(self._head, loss_layer))
        return model, self.parts(layer), self.specs(param_specs)

    def _read_parts(self, layer: nnx.Module, loss_layer: Any, batch: Any) -> None:
        """Which parameters the forward reads before the first block (`embed_names`), after
        checking that what comes after the last block reads none of them."""
        rest = self._rest(layer)
        self._shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in rest.items()}
        keys, shapes = list(rest), [self._shapes[k] for k in rest]
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), batch)

        def embed(p: list[Any], b: Any) -> Any:
            return self._embed(_nest(dict(zip(keys, p, strict=True))), b)

        def head(p: list[Any], h: Any, b: Any) -> Any:
            return self._head(loss_layer, _nest(dict(zip(keys, p, strict=True))), h, b)

        read = _inputs_read(embed, shapes, batch)[: len(keys)]
        self.embed_names = [k for k, used in zip(keys, read, strict=True) if used]
        embedded = jax.eval_shape(embed, shapes, batch)
        after = _inputs_read(head, shapes, embedded, batch)[: len(keys)]
        tied = [k for k, used in zip(keys, after, strict=True) if used and k in self.embed_names]
        if tied:
            raise ValueError(
                f"parameters {['.'.join(map(str, k)) for k in tied]} are read both before and "
                f"after the blocks of split_spec={self.split.given!r} (tied weights): fleetjax's "
                "pipeline keeps the first and the last stages' parameters apart; untie them"
            )

    def _merged(self, params: Any) -> nnx.Module:
        """The shell with `params` (those absent zeros: a part that does not read them)."""
        given = _flat_names(params)
        full = {
            k: given[k] if k in given else jnp.zeros(s.shape, s.dtype)
            for k, s in self._shapes.items()
        }
        return nnx.merge(self.shell_graph, _nest(full))

    def _embed(self, params: Any, batch: Any) -> Any:
        model = self._merged(params)
        with _mode("stop"):
            try:
                model(*batch["inputs"], **batch["keywords"])
            except _Reached as reached:
                return reached.x
        raise ValueError(f"the forward never called the blocks of split_spec={self.split.given!r}")

    def _stage(self, params: Any, h: Any) -> Any:
        return nnx.merge(self.block_graph, params)(h)

    def _head(self, loss_layer: Any, params: Any, h: Any, batch: Any) -> Any:
        model = self._merged(params)
        with _mode("inject", h):
            out = model(*batch["inputs"], **batch["keywords"])
        return loss_layer(out, batch["label"])


def _inputs_read(fn: Any, *args: Any) -> list[bool]:
    """Whether `fn`'s output depends on each leaf of `args` (its jaxpr, dead code dropped)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    needed = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed |= {v for v in eqn.invars if isinstance(v, jex.Var)}
    return [v in needed for v in jaxpr.invars]


def _flat_names(tree: Any, is_leaf: Any = None) -> dict[tuple, Any]:
    """{path: leaf} of a nested dict."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p): v for p, v in leaves}


def _nest(flat: Mapping[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
