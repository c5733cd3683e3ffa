"""`DistributedStrategy.auto`: a planner that picks the parallel layout for a model, a batch and
a per-device memory budget, by compiling candidate train steps (nothing runs).

    found = fleetjax.auto.search(loss_fn, optax.adam(1e-3), params, batch, memory_budget=2**30)
    print(found)                     # every candidate, its compiled bytes and estimated time
    step = found.make_train_step()   # or make_train_step(loss_fn, opt, found.strategy, ...)

Its parts:

* `_layouts`: the candidate layouts (`Layout`: degrees, ZeRO stage, memory savers);
* `fleetjax.cost`: the cost model (`DeviceSpec`, `hlo_cost`: a compiled step's time on one
  device), shared with `fleetjax.explain` and `fleetjax.targets`;
* `_memory`: what a candidate holds, by formula from its placement, and the default budget;
* `_search`: compiling candidates, pruning those that cannot fit or cannot win, the choice;
* `_result`: each `Candidate`, the `SearchResult` and its report.

The chosen candidate is the fastest that fits; on a tie, the simplest (pure data parallelism
first: fewer collectives, nothing split). Override any of it: pass ``candidates=`` (strategies
or degree dicts) to compile exactly those, fix degrees in ``strategy.hybrid_configs``, pass
``device=DeviceSpec(...)`` for other constants, or edit ``found.strategy`` (a normal
`DistributedStrategy`). See docs/auto.md.
"""

from fleetjax.auto._layouts import Layout
from fleetjax.auto._memory import default_memory_budget
from fleetjax.auto._result import Candidate, SearchResult
from fleetjax.auto._search import SAVING_MARGIN, search
from fleetjax.cost import DEVICE_SPECS, DeviceSpec, HloCost, hlo_cost
from fleetjax.targets import device_spec

__all__ = [
    "DEVICE_SPECS",
    "SAVING_MARGIN",
    "Candidate",
    "DeviceSpec",
    "HloCost",
    "Layout",
    "default_memory_budget",
    "device_spec",
    "hlo_cost",
    "search",
    "SearchResult",
]
