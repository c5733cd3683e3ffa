"""Writes paddle<version>_local_slices.json here: for a grid of meshes (up to 3 dimensions and 8
processes, process ids in any order), tensor shapes (uneven ones too) and placements (co-shard
with `shard_order`, `split_factor`, `Partial`), what each process holds, as Paddle says twice:

* `slices`: `paddle.distributed.auto_parallel.moe_utils.get_local_slices`, the [start, stop) of
  each tensor dimension on each rank (it reads neither `shard_order` nor `split_factor`);
* `local`: the local value `dist.shard_tensor` gives that rank: the tensor is `arange(n) + 1`, so
  each local element names its global position; stored as, per tensor dimension, the runs
  [start, stop) of the indices it holds (a `split_factor` part holds several runs), or `zeros`
  where the rank holds a Partial's zeros, or `error` where Paddle raises.

One process cannot be every rank, so this script runs itself once per rank with
`PADDLE_TRAINER_ID` set (each rank's `shard_tensor` slices its own part, without
communication) and merges what they found.

pip install paddlepaddle==3.3.1 "numpy<2.4"
python tests/data/write_placements_with_paddle.py tests/data
"""

import json
import os
import random
import subprocess
import sys

MESHES = [[1], [2], [4], [8], [2, 2], [2, 4], [4, 2], [1, 4], [2, 1], [1, 8], [8, 1]]
MESHES += [[2, 2, 2], [2, 1, 4], [1, 2, 4], [4, 1, 2], [2, 2, 1]]
SIZES = [8, 16, 24, 12, 4, 2, 48, 6]
UNEVEN = [5, 3, 7, 10]


def process_ids(rng: random.Random, shape: list[int]) -> list:
    """The mesh's ids, in mesh order: in order, reversed, shuffled, or a subset of 0..7."""
    size = 1
    for n in shape:
        size *= n
    ids = list(range(8))
    choice = rng.choice(["sorted", "reversed", "shuffled", "subset"])
    if choice == "subset":
        ids = rng.sample(ids, size)
    else:
        ids = ids[:size]
        if choice == "reversed":
            ids.reverse()
        elif choice == "shuffled":
            rng.shuffle(ids)
    nested = ids
    for n in reversed(shape[1:]):
        nested = [nested[i : i + n] for i in range(0, len(nested), n)]
    return nested


def placements(rng: random.Random, mesh: list[int], rank: int) -> list:
    """One placement per mesh dimension: ["R"], ["P", reduce] or ["S", dim, split, order]."""
    found = []
    for _ in mesh:
        roll = rng.random()
        if roll < 0.25:
            found.append(["R"])
        elif roll < 0.37:
            found.append(["P", rng.choice(["kRedSum", "kRedSum", "kRedAvg"])])
        else:
            found.append(["S", rng.randrange(rank), 1, None])
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(found):
        if p[0] == "S":
            by_dim.setdefault(p[1], []).append(mesh_dim)
    for mesh_dims in by_dim.values():  # co-shard: an explicit order, half of the time
        if len(mesh_dims) > 1 and rng.random() < 0.5:
            orders = list(range(len(mesh_dims)))
            rng.shuffle(orders)
            for mesh_dim, order in zip(mesh_dims, orders, strict=True):
                found[mesh_dim][3] = order
    return found


def shape_for(rng: random.Random, mesh: list[int], places: list, rank: int, uneven: bool) -> list:
    """A tensor shape: each dimension a multiple of what splits it, or (uneven) not."""
    split = [1] * rank
    for n, p in zip(mesh, places, strict=True):
        if p[0] == "S":
            split[p[1]] *= n * p[2]
    shape = [rng.choice(SIZES) * s if s > 1 else rng.choice(SIZES) for s in split]
    shape = [max(s // rng.choice([1, 2]), split[d]) if s > 16 else s for d, s in enumerate(shape)]
    shape = [s - s % split[d] for d, s in enumerate(shape)]
    if uneven:
        candidates = [d for d in range(rank) if split[d] > 1]
        if candidates:
            d = rng.choice(candidates)
            shape[d] = rng.choice([u for u in UNEVEN if u % split[d]])
    return shape


def split_factor_cases(rng: random.Random) -> list[dict]:
    """Fused weights: `Shard(d, split_factor=k)` (a qkv weight: k = 3) on one mesh dimension."""
    cases = []
    for mesh in ([2], [4], [2, 2], [2, 4], [4, 2], [2, 2, 2]):
        for k in (2, 3):
            mesh_dim = rng.randrange(len(mesh))
            places = [["R"] for _ in mesh]
            places[mesh_dim] = ["S", 1, k, None]
            others = [d for d in range(len(mesh)) if d != mesh_dim]
            if others and rng.random() < 0.5:
                places[rng.choice(others)] = ["S", 0, 1, None]
            split0 = 1
            for n, p in zip(mesh, places, strict=True):
                if p[0] == "S" and p[1] == 0:
                    split0 *= n
            shape = [4 * split0, k * mesh[mesh_dim] * rng.choice([1, 2, 4])]
            ids = process_ids(rng, mesh)
            cases.append({"mesh": ids, "shape": shape, "placements": places})
    return cases


def grid() -> list[dict]:
    rng = random.Random(31)
    cases = []
    for repeat in range(24):
        for mesh in MESHES:
            rank = rng.choice([1, 2, 2, 3])
            places = placements(rng, mesh, rank)
            uneven = repeat % 5 == 4
            shape = shape_for(rng, mesh, places, rank, uneven)
            cases.append({"mesh": process_ids(rng, mesh), "shape": shape, "placements": places})
    return cases + split_factor_cases(rng)


def runs(indices: list[int]) -> list[list[int]]:
    """Sorted distinct indices as [start, stop) runs."""
    found: list[list[int]] = []
    for i in sorted(set(indices)):
        if found and found[-1][1] == i:
            found[-1][1] = i + 1
        else:
            found.append([i, i + 1])
    return found


def on_this_rank(cases: list[dict]) -> dict:
    """{case number: what this rank holds}, for the cases whose mesh holds this rank."""
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel.moe_utils import get_local_slices

    rank = dist.get_rank()

    def placement(p: list):
        if p[0] == "R":
            return dist.Replicate()
        if p[0] == "P":
            return dist.Partial(getattr(dist.ReduceType, p[1]))
        if p[2] != 1:
            return dist.Shard(p[1], split_factor=p[2])
        return dist.Shard(p[1]) if p[3] is None else dist.Shard(p[1], shard_order=p[3])

    found = {}
    for number, case in enumerate(cases):
        ids = np.array(case["mesh"])
        if rank not in ids.flatten().tolist():
            continue
        names = [f"d{i}" for i in range(ids.ndim)]
        mesh = dist.ProcessMesh(case["mesh"], dim_names=names)
        places = [placement(p) for p in case["placements"]]
        shape = case["shape"]
        tensor = paddle.arange(1, int(np.prod(shape)) + 1, dtype="int64").reshape(shape)
        slices = get_local_slices(tensor, mesh, list(places))[rank]["slice"]
        entry = {"slices": [list(s) for s in slices]}
        try:
            local = dist.shard_tensor(tensor, mesh, places)._local_value().numpy()
        except Exception as e:  # Paddle's own failures are part of the record
            entry["error"] = str(e).strip().splitlines()[0][:200]
        else:
            entry["local_shape"] = list(local.shape)
            values = local.flatten()
            if values.size and not values.any():
                entry["zeros"] = True
            elif values.size:
                where = np.unravel_index(values - 1, shape)
                held = [runs(w.tolist()) for w in where]
                count = int(np.prod([sum(b - a for a, b in r) for r in held]))
                assert count == values.size, f"case {number}: not a product of index sets"
                entry["local"] = held
        found[number] = entry
    return found


if __name__ == "__main__":
    cases = grid()
    if os.environ.get("PADDLE_TRAINER_ID") is not None:
        json.dump(on_this_rank(cases), sys.stdout)
        sys.exit(0)
    out = sys.argv[1]
    for rank in range(8):
        env = {**os.environ, "PADDLE_TRAINER_ID": str(rank), "GLOG_minloglevel": "3"}
        result = subprocess.run(
            [sys.executable, __file__], env=env, capture_output=True, text=True, check=True
        )
        for number, entry in json.loads(result.stdout.strip().splitlines()[-1]).items():
            cases[int(number)].setdefault("ranks", {})[str(rank)] = entry
    import paddle

    path = f"{out}/paddle{paddle.__version__}_local_slices.json"
    with open(path, "w") as f:
        f.write(f'{{"paddle": "{paddle.__version__}", "cases": [\n')
        f.write(",\n".join(json.dumps(case, sort_keys=True) for case in cases))
        f.write("\n]}\n")
    print(path, len(cases), "cases")
