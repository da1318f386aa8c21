"""Property-based: whatever the bytes or the structure, reading a table returns a Table or raises
TableError naming the file; a table that loads is usable (finite positive step times, a planner
that plans, gains a table can mean) and round-trips through write_table without partial files.

Examples: 1,500 byte-level mutations of a YAML table + 3,000 structural mutations of its mapping
(docs/RELIABILITY.md counts them).
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from spectune.errors import TableError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.table import (
    CapturePoint,
    Point,
    Row,
    Table,
    read_table,
    table_from_dict,
    table_to_yaml,
    write_table,
)
from tests.fuzz import fuzz
from tests.tables import make_params, make_policy, make_profile, make_workload


def small_table() -> Table:
    points = [Point("target", b, b * q, 5.0 + 0.1 * b * q, q=q) for b in (1, 4) for q in (1, 2, 4)]
    points += [Point("drafter", 4, 8, 0.8, k=2), Point("tier", 2, 16, 6.0), Point("overhead", 4, 8, 0.05)]
    return make_profile(
        make_params((5.0, 0.02, 64.0, 0.05, 30.0), (0.05, 0.4, 0.002), (0.02, 0.0001), power=(100.0, 500.0, 64.0)),
        make_workload(3, 8),
        capture=[CapturePoint(16, 0.2, 10.0)],
        points=points,
        acceptance={"source": "curve:0.8,0.6", "max_k": 3,
                    "components": [{"weight": 0.5, "accept": [0.9, 0.8, 0.7]},
                                   {"weight": 0.5, "accept": [0.6, 0.5, 0.4]}]},
        policy=make_policy([8, 16, 32], [Row((1, 4), 3, 12, tier=16, gain=1.9), Row((5, 8), 2, 16, tier=32, gain=1.3)],
                           window=256.0, margin=0.01, max_k=3, prior=[0.8, 0.7, 0.6]),
    )


BASE = yaml.safe_load(table_to_yaml(small_table()))
BASE_TEXT = table_to_yaml(small_table()).encode()
WORK = Path(tempfile.mkdtemp(prefix="spectune-fuzz-"))


def check_usable(table: Table) -> None:
    """What a loaded table promises its readers (spectune.runtime.table doc)."""
    cost = CostModel.of(table)
    wl = table.workload
    for b in sorted({1, wl.max_batch}):
        for n in (b, b * (wl.max_k + 1)):
            ms = cost.step_ms(b, wl.max_k, n)
            assert math.isfinite(ms) and ms > 0
    if table.policy is None:
        return
    planner = Planner(table)
    for b in sorted({1, planner.max_batch // 2 or 1, planner.max_batch}):
        plan = planner.plan(b)
        assert plan.tier is None or plan.tier >= b
    for row in table.policy.rows:
        assert row.gain is None or 0 < row.gain <= (row.k + 1) * 1.001


def round_trips(table: Table) -> None:
    # in memory: write_table's fsync would cost ~80 ms an example; the file path is tested below
    text = table_to_yaml(table)
    assert table_from_dict(yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))) == table


# -- byte-level ----------------------------------------------------------------------------------

edits = st.lists(st.tuples(st.sampled_from(["replace", "insert", "delete", "truncate"]),
                           st.integers(0, len(BASE_TEXT) - 1), st.binary(min_size=1, max_size=8)),
                 min_size=1, max_size=6)


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, at, chunk in ops:
        at = min(at, len(buf))
        if op == "replace":
            buf[at:at + len(chunk)] = chunk
        elif op == "insert":
            buf[at:at] = chunk
        elif op == "delete":
            del buf[at:at + len(chunk)]
        else:
            del buf[at:]
    return bytes(buf)


@fuzz(1500)
@given(ops=edits)
def test_mutated_bytes_load_or_fail_with_one_line(ops):
    path = WORK / "bytes.yaml"
    path.write_bytes(mutate(BASE_TEXT, ops))
    try:
        table = read_table(path)
    except TableError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
        return
    check_usable(table)


# -- structural ------------------------------------------------------------------------------------

leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2, 4096, 4097, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1e300, 0.5, 1.0001]),
    st.text(max_size=12), st.sampled_from(["goodput", "gjodput", "fill-tier", "target", "bfloat16", "cpu"]),
)
junk = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=3)), max_leaves=12)


def paths(node, prefix=()):
    """Every (path) into the mapping: keys of mappings and indexes of lists."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


PATHS = [p for p in paths(BASE) if p]


@st.composite
def structural(draw):
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for key in where[:-1]:
                parent = parent[key]
            last = where[-1]
            action = draw(st.sampled_from(["set", "set", "set", "delete", "extra", "scale"]))
            if action == "set":
                parent[last] = draw(junk)
            elif action == "delete":
                del parent[last]
            elif action == "extra" and isinstance(parent, dict):
                parent[draw(st.one_of(st.text(max_size=6), st.integers()))] = draw(junk)
            elif action == "scale" and isinstance(parent[last], int | float) and not isinstance(parent[last], bool):
                parent[last] = parent[last] * draw(st.sampled_from([-1, 0, 2, 1000, 1e6, float("inf")]))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path
    return data


@fuzz(3000)
@given(data=structural())
def test_mutated_structure_loads_or_names_the_field(data):
    try:
        table = table_from_dict(data, "t.yaml")
    except TableError as exc:
        assert str(exc).startswith("t.yaml: ") and "\n" not in str(exc)
        return
    check_usable(table)
    round_trips(table)


def test_the_unmutated_table_loads_and_round_trips():
    table = table_from_dict(copy.deepcopy(BASE))
    check_usable(table)
    round_trips(table)
    out = WORK / "round.yaml"
    write_table(table, out)
    assert read_table(out) == table
    assert not list(WORK.glob(".*.tmp"))
