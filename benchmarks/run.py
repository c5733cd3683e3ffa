"""Run every benchmark and write `results/*.json`, `results/*.png` and `RESULTS.md`.

    python benchmarks/run.py                  # all of them (h100 alone: ~25 min on 2 cores)
    python benchmarks/run.py --quick          # fewer cases and repeats
    python benchmarks/run.py --only comm_bytes --only zero_staircase --out /tmp/bench

On CPU, JAX simulates 8 devices. `RESULTS.md` gets a section for every benchmark with a JSON in
`<out>/results/`, so running some of them keeps the others' last results.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the benchmark modules, by name
from _report import BENCHMARKS, environment, publish, results_markdown  # noqa: E402

NAMES = (
    "overhead",
    "zero_staircase",
    "comm_bytes",
    "memory_transforms",
    "pipeline_memory",
    "sparse_tables",
    "moe",
    "input_pipeline",
    "gpu",
    "h100",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=NAMES,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(NAMES)}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=BENCHMARKS,
        help="where RESULTS.md and results/ go (default: benchmarks/)",
    )
    args = parser.parse_args(argv)
    # Imported up front: each sets JAX's CPU device count, which must precede any computation.
    modules = {name: importlib.import_module(name) for name in args.only or NAMES}
    start = time.perf_counter()
    for name, module in modules.items():
        began = time.perf_counter()
        print(f"{name} ...", flush=True)
        result = module.run(args.quick)
        publish(name, result, args.out, time.perf_counter() - began, args.quick)
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
    env = environment()
    header = f"""
# fleetjax benchmarks

Written by `python benchmarks/run.py` (`--only NAME` runs one, `--quick` fewer cases); the
numbers are in `results/*.json`. This run: jax {env["jax"]}, {env["devices"]} {env["platform"]}
devices ({env["device_kind"]}), {time.perf_counter() - start:.0f} s for
{", ".join(modules)}{" (--quick)" if args.quick else ""}.
"""
    (args.out / "RESULTS.md").write_text(results_markdown(args.out, NAMES, header))
    print(f"wrote {args.out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
