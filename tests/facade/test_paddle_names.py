"""docs/paddle.md maps every public name on the seed pages to its fleetjax name, or to the reason
it has none: each name the seeds use appears in its table, and each fleetjax name it gives
exists."""

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
SEEDS = ROOT / "tests" / "data" / "seeds"  # copies of the seed documents
PAGE = ROOT / "docs" / "paddle.md"
TABLE_MARK = "<!-- seed-names: tests/facade/test_paddle_names.py checks this table -->"
SEED_FILES = {path.name[:3]: path for path in sorted(SEEDS.glob("[0-9][0-9][0-9]_*.txt"))}

# Strategy-like objects in the seeds' code, by the variable names the seeds give them.
STRATEGY_VARIABLES = {
    "strategy": "DistributedStrategy",
    "dist_strategy": "DistributedStrategy",
    "build_strategy": "BuildStrategy",
    "exe_strategy": "ExecutionStrategy",
    "execution_strategy": "ExecutionStrategy",
}


def _code_names(text: str, seed: str) -> set[str]:
    """Names the seed's code and prose use: `fleet.*`, `paddle.*`, `fluid.*`, `role_maker.*`,
    strategy fields set (`strategy.x = ...`, `strategy.section.key = ...`), config keys
    (`*_configs = {"key": ...}`), environment variables and the launcher."""
    text = re.sub(r"https?://\S+", "", text)  # fleet.bj.bcebos.com is a host
    names = {f"fleet.{m}" for m in re.findall(r"\bfleet\.(\w+)", text)}
    names |= {f"paddle.nn.{m}" for m in re.findall(r"(?<![\w.])nn\.(\w+)", text)}
    names |= set(re.findall(r"(?<![A-Za-z])[A-Za-z]*RoleMaker[A-Za-z]*", text))
    names |= {f"optimizer.{m}" for m in re.findall(r"(?<![\w.])(?:adam|optimizer)\.(\w+)\(", text)}
    names |= {f"{a}.{m}" for a, m in re.findall(r"\b(loss|exe)\.(\w+)\(", text)}
    names |= set(re.findall(r"\b(?:paddle|fluid|X)\.[\w.]*\w", text))
    names |= {f"role_maker.{m}" for m in re.findall(r"\brole_maker\.(\w+)", text)}
    names |= set(re.findall(r"\b(?:FLAGS|NCCL)_\w+", text))
    names |= {"fleetrun"} if "fleetrun" in text else set()
    for variable, owner in STRATEGY_VARIABLES.items():
        pattern = rf"(?<![\w.]){variable}\.(\w+)(?:\.(\w+))?\s*="
        for field, key in re.findall(pattern, text):
            section = "Strategy" if seed == "002" else owner
            names.add(f"{section}.{field}.{key}" if key else f"{section}.{field}")
    for field, body in re.findall(r"\b(\w+_configs)\s*=\s*\{(.*?)\}", text, re.DOTALL):
        names |= {
            f"DistributedStrategy.{field}.{key}" for key in re.findall(r"[\"'](\w+)[\"']\s*:", body)
        }
    return names


def _documented_names(text: str, seed: str) -> set[str]:
    """Names the seed documents: Fleet's methods and attributes (004), the strategy's
    attributes (000, 001) and config keys (`**key(type):**`), `Strategy`'s properties and
    configs (002), the field tables (003)."""
    names: set[str] = set()
    if seed == "004":
        names |= {f"fleet.{m}" for m in re.findall(r"\.\. py:(?:method|attribute):: (\w+)", text)}
    if seed in ("000", "001"):
        names |= {
            f"DistributedStrategy.{m}"
            for m in re.findall(r"\.\. py:attribute:: (\w+)", text)
            + re.findall(r"^(\w+)\n'{9}", text, re.MULTILINE)
        }
        for field, body in re.findall(r"^(\w+_configs)\n(.*?)(?=^\w+\n'{9}|\Z)", text, re.M | re.S):
            keys = re.findall(r"^\*\*(\w+)\s*\(", body, re.MULTILINE)
            names |= {f"DistributedStrategy.{field}.{key}" for key in keys}
        if seed == "000":  # its config sections are `.. py:attribute::` blocks
            for field, body in re.findall(
                r"py:attribute:: (\w+_configs)(.*?)(?=\.\. py:|\Z)", text, re.S
            ):
                keys = re.findall(r"^\*\*(\w+)\s*\(", body, re.MULTILINE)
                names |= {f"DistributedStrategy.{field}.{key}" for key in keys}
    if seed == "002":
        names |= {"Strategy"}
        for section, body in re.findall(
            r"property (\w+)(?: \[source\])?\n-\n(.*?)(?=- property|\Z)", text, re.S
        ):
            names.add(f"Strategy.{section}")
            keys = re.findall(r"(\w+)\n\((?:bool|int|str|float)\)", body)
            keys += re.findall(r"“(\w+)” \(bool\)", body)
            names |= {f"Strategy.{section}.{key}" for key in keys}
    if seed == "003":
        for title, table in re.findall(
            r"^(\w+)\n~+\n\n\n(.*?)\n\n\n", text + "\n\n\n", re.M | re.S
        ):
            for row in table.split("+=")[-1].split("\n+-")[1:]:
                first = "".join(
                    line.split("|")[1].strip() for line in row.splitlines()[1:] if "|" in line
                )
                if first:
                    names.add(f"{title}.{first}")
    return names


def seed_names() -> set[str]:
    """Every public name on the seed pages."""
    names: set[str] = set()
    for seed, path in SEED_FILES.items():
        text = path.read_text()
        names |= _code_names(text, seed) | _documented_names(text, seed)
    return names


def page_table() -> dict[str, str]:
    """{Paddle name: fleetjax cell} of the page's table."""
    text = PAGE.read_text()
    rows = text[text.index(TABLE_MARK) :].splitlines()[3:]
    table = {}
    for row in rows:
        if not row.startswith("|"):
            break
        paddle, fleetjax_cell = (cell.strip() for cell in row.strip("|").split("|", 1))
        for name in re.findall(r"`([^`]+)`", paddle):
            table[name] = fleetjax_cell
    return table


def resolve(dotted: str) -> object:
    """The object `fleetjax.a.b.c` names: modules imported, attributes read, a class made with no
    arguments to read an instance's field (a strategy's), a config's key read."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
            continue
        except ModuleNotFoundError:
            pass
        if isinstance(obj, type) and not hasattr(obj, part):
            obj = obj()
        obj = getattr(obj, part)
    return obj


def test_every_seed_name_is_on_the_page():
    assert sorted(SEED_FILES) == ["000", "001", "002", "003", "004"]
    missing = sorted(seed_names() - set(page_table()))
    assert not missing, f"docs/paddle.md does not map these seed names: {missing}"


def test_every_fleetjax_name_on_the_page_exists():
    table = page_table()
    assert len(table) > 150
    problems = []
    for paddle, cell in table.items():
        fleetjax_names = re.findall(r"`(fleetjax(?:\.\w+)+)`", cell)
        if not fleetjax_names and not cell.startswith("none:"):
            problems.append(f"{paddle}: neither a fleetjax name nor 'none: <reason>'")
        for name in fleetjax_names:
            try:
                resolve(name)
            except (AttributeError, ImportError, KeyError, TypeError, RuntimeError) as e:
                problems.append(f"{paddle}: {name} does not exist ({e})")
    assert not problems, problems
