"""pipeline_schedule: the tables' dependencies, bubbles and in-flight counts; Paddle's errors."""

import itertools

import numpy as np
import pytest

from fleetjax.transforms.pipeline.schedules import pipeline_schedule

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33)]


def ops(schedule, backward=False):
    """{(stage, virtual stage, micro-batch): tick} of every forward (or backward)."""
    micro = schedule.backward if backward else schedule.forward
    chunk = schedule.backward_chunk if backward else schedule.forward_chunk
    found = {}
    for t, s in zip(*np.nonzero(micro >= 0), strict=True):
        key = (int(s), int(chunk[t, s]) * schedule.stages + int(s), int(micro[t, s]))
        assert key not in found, f"{key} runs twice"
        found[key] = int(t)
    return found


def check_dependencies(schedule):
    """Every chunk runs each micro-batch forward and backward once, after its inputs arrive."""
    p, m, v = schedule.stages, schedule.micro_batches, schedule.virtual_stages
    last = p * v - 1
    f, b = ops(schedule), ops(schedule, backward=True)
    expected = {(k % p, k, i) for k in range(p * v) for i in range(m)}
    assert set(f) == expected and set(b) == expected
    for (_, k, i), t in f.items():
        if k > 0:  # the activation from the previous virtual stage arrived a tick earlier
            assert f[(k - 1) % p, k - 1, i] < t
    for (s, k, i), t in b.items():
        if k == last:  # the head's cotangent: the same tick as the forward, or later
            assert f[s, k, i] <= t
        else:
            assert b[(k + 1) % p, k + 1, i] < t


@pytest.mark.parametrize("mode", ["FThenB", "1F1B"])
def test_idle_fraction_is_the_classic_bubble(mode):
    for p, m in GRID:
        schedule = pipeline_schedule(mode, p, m)
        check_dependencies(schedule)
        for costs in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
            assert schedule.idle_fraction(*costs) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("v", [2, 3, 4])
def test_vpp_bubble_is_smaller(v):
    for p, m in GRID:
        if m < p:
            continue
        schedule = pipeline_schedule("VPP", p, m, v)
        check_dependencies(schedule)
        # The interleaved bubble of the literature: (P - 1) / (V m + P - 1).
        assert schedule.idle_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
        if p > 1:
            assert schedule.idle_fraction() < pipeline_schedule("1F1B", p, m).idle_fraction()


def test_fthenb_runs_every_forward_before_any_backward():
    schedule = pipeline_schedule("F-then-B", 4, 6)
    assert schedule.mode == "FThenB"
    last_forward = np.nonzero((schedule.forward >= 0).any(axis=1))[0].max()
    first_backward = np.nonzero((schedule.backward >= 0).any(axis=1))[0].min()
    assert first_backward == last_forward  # the last stage starts back in its last forward tick
    for s in range(4):
        f_ticks = np.nonzero(schedule.forward[:, s] >= 0)[0]
        b_ticks = np.nonzero(schedule.backward[:, s] >= 0)[0]
        assert f_ticks.max() <= b_ticks.min()
    np.testing.assert_array_equal(schedule.in_flight, [6, 6, 6, 6])


def test_one_f_one_b_table():
    schedule = pipeline_schedule("1F1B", 4, 6)
    # Stage s: forward of micro-batch t - s, backward of t - (2P - 2 - s), in lockstep.
    for t, s in itertools.product(range(schedule.ticks), range(4)):
        f, b = t - s, t - (2 * 4 - 2 - s)
        assert schedule.forward[t, s] == (f if 0 <= f < 6 else -1)
        assert schedule.backward[t, s] == (b if 0 <= b < 6 else -1)
    assert schedule.ticks == 6 + 2 * 4 - 2
    # At most 2 (P - s) - 1 micro-batches in flight, whatever the number of micro-batches.
    np.testing.assert_array_equal(schedule.in_flight, [6, 5, 3, 1])
    np.testing.assert_array_equal(pipeline_schedule("1F1B", 4, 64).in_flight, [7, 5, 3, 1])
    np.testing.assert_array_equal(pipeline_schedule("1F1B", 4, 2).in_flight, [2, 2, 2, 1])


def test_vpp_table_follows_paddle_rounds():
    p, m, v = 4, 9, 2
    schedule = pipeline_schedule("VPP", p, m, v)
    # Paddle's order on every stage: a first round of P + m % P micro-batches through each
    # chunk in turn, then rounds of P; backwards take the chunks in reverse.
    first = p + m % p
    rounds = [range(first), range(first, m)]
    forwards = [(c, i) for r in rounds for c in range(v) for i in r]
    backwards = [(c, i) for r in rounds for c in reversed(range(v)) for i in r]
    for s in range(p):
        ran = [
            (schedule.forward_chunk[t, s], schedule.forward[t, s]) for t in range(schedule.ticks)
        ]
        assert [op for op in ran if op[1] >= 0] == forwards
        ran = [
            (schedule.backward_chunk[t, s], schedule.backward[t, s]) for t in range(schedule.ticks)
        ]
        assert [op for op in ran if op[1] >= 0] == backwards
    # Paddle's warm-up: stage s holds at most 2 (P - 1 - s) + (V - 1)(P + m % P) + 1 chunks.
    np.testing.assert_array_equal(
        schedule.in_flight, [2 * (p - 1 - s) + (v - 1) * first + 1 for s in range(p)]
    )
    # With P <= m < 2P it is Paddle's interleaved F-then-B: all forwards first.
    fthenb = pipeline_schedule("VPP", p, p + 1, v)
    for s in range(p):
        assert (
            np.nonzero(fthenb.forward[:, s] >= 0)[0].max()
            <= np.nonzero(fthenb.backward[:, s] >= 0)[0].min()
        )


def test_unknown_schedule_lists_the_allowed_ones():
    with pytest.raises(ValueError) as error:
        pipeline_schedule("DualPipeV", 4, 8)
    assert str(error.value) == (
        "schedule_mode must be one of 'FThenB', 'F-then-B', '1F1B', 'Eager1F1B', 'VPP', 'ZBH1', "
        "'ZBVPP', got 'DualPipeV'"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("VPP", 4, 3, 2),
            "The accumulate_steps(3) should be greater than or equal to pp_degree(4) for the "
            "interleaved (VPP) schedule",
        ),
        (
            ("VPP", 4, 8, 1),
            "schedule_mode 'VPP' needs vpp_degree >= 2 virtual stages per device, got 1",
        ),
        (
            ("1F1B", 4, 8, 2),
            "vpp_degree=2 needs schedule_mode 'VPP' (interleaved 1F1B), got '1F1B'",
        ),
        (("1F1B", 0, 8, 1), "stages (pp_degree) must be a positive int, got 0"),
        (("1F1B", 4, 2.0, 1), "micro_batches (accumulate_steps) must be a positive int, got 2.0"),
        (("1F1B", 4, True, 1), "micro_batches (accumulate_steps) must be a positive int, got True"),
    ],
)
def test_paddle_constraints(args, message):
    with pytest.raises(ValueError) as error:
        pipeline_schedule(*args)
    assert str(error.value) == message


def test_gantt_chart():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    schedule = pipeline_schedule("VPP", 4, 8, 2)
    ax = schedule.plot()
    # One box per chunk forward and backward: P stages x V chunks x m micro-batches x 2.
    assert len(ax.collections) == 4 * 2 * 8 * 2
    assert ax.get_title() == f"VPP: P=4, m=8, V=2, idle {schedule.idle_fraction():.1%}"
    # The chart spans the schedule's time: idle + busy = P x total.
    right = max(c.get_paths()[0].get_extents().x1 for c in ax.collections)
    busy = 8 * (1.0 + 2.0)
    assert right == pytest.approx(busy / (1 - schedule.idle_fraction()))
    matplotlib.pyplot.close(ax.figure)


def test_printed_table():
    assert str(pipeline_schedule("F-then-B", 2, 2)) == (
        "FThenB: P=2, m=2, idle 33.3%\n"
        "tick     0      1      2      3      4\n"
        "stage 0  F0     F1     .      B0     B1\n"
        "stage 1  .      F0     F1 B0  B1     .\n"
        "Fi / Bi: forward / backward of micro-batch i"
    )
    assert str(pipeline_schedule("VPP", 2, 2, 2)).splitlines()[1:4] == [
        "tick     0          1          2          3          4          5          6          7"
        "          8",
        "stage 0  F0.0       F1.0       F0.1       F1.1       .          B0.1       B1.1       "
        "B0.0       B1.0",
        "stage 1  .          F0.0       F1.0       F0.1       F1.1 B0.1  B1.1       B0.0       "
        "B1.0       .",
    ]


def test_jupyter_shows_the_printed_table():
    pretty = pytest.importorskip("IPython.lib.pretty")
    schedule = pipeline_schedule("1F1B", 4, 8)
    assert pretty.pretty(schedule) == str(schedule)
