"""The HLO reader the other tests rely on, on each replica-group syntax XLA prints."""

from hlo import Collective, collectives, stablehlo_dtypes

from fleetjax import hlo

MESH = (
    "  %all-reduce.4 = (f32[32]{0}, f32[]) all-reduce(%a, %b), channel_id=1, "
    "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}, use_global_device_ids=true"
)
LISTS = "  %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), replica_groups={{0,1,2,3},{4,5,6,7}}"
IOTA = "  %rs = bf16[2]{0} reduce-scatter-start(bf16[8]{0} %g), replica_groups=[2,4]<=[8]"
DONE = "  %rs.done = bf16[2]{0} reduce-scatter-done(%rs)"


def test_each_syntax():
    assert collectives("\n".join([MESH, LISTS, IOTA, DONE, "  %d = f32[] add(%x, %y)"])) == [
        Collective("all-reduce", "(f32[32]{0}, f32[])", 8),
        Collective("all-gather", "f32[8,4]{1,0}", 4),
        Collective("reduce-scatter", "bf16[2]{0}", 4),
    ]


def test_mesh_groups_over_one_axis():
    line = "%x = f32[4] all-reduce(%y), replica_groups=mesh['dp'=2,'mp'=4] {'mp'}"
    assert collectives(line)[0].group_size == 4


def test_mesh_groups_over_a_sub_axis():
    # 'b':(2)2 is the minor half of axis b (size 4): devices b=0,1 vs b=2,3 pair up by stride.
    line = "%x = f32[4] all-to-all(%y), replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}"
    assert collectives(line)[0].groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    line = "%x = f32[4] all-to-all(%y), replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}"
    assert collectives(line)[0].groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_stablehlo_dtypes():
    text = "\n".join(
        [
            "%2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0] : "
            "(tensor<8x16xbf16>, tensor<16x4xbf16>) -> tensor<8x4xbf16>",
            "%3 = stablehlo.exponential %2 : tensor<8x4xf32>",
            "%4 = stablehlo.reduce(%3 init: %c) applies stablehlo.add across dimensions = [1] : "
            "(tensor<8x4xf32>, tensor<f32>) -> tensor<8xf32>",
        ]
    )
    assert stablehlo_dtypes(text, "dot_general") == {"bf16"}
    assert stablehlo_dtypes(text, "exponential") == {"f32"}
    assert stablehlo_dtypes(text, "reduce") == {"f32"}
    assert stablehlo_dtypes(text, "tanh") == set()
    assert stablehlo_dtypes(text, "add") == set()  # only named as the reduce's reducer
    region = "\n".join(
        [
            '%4 = "stablehlo.all_reduce"(%3) <{replica_groups = dense<[[0, 1]]>}> ({',
            "^bb0(%a: tensor<bf16>, %b: tensor<bf16>):",
            "  %5 = stablehlo.add %a, %b : tensor<bf16>",
            "  stablehlo.return %5 : tensor<bf16>",
            "}) : (tensor<32xbf16>) -> tensor<32xbf16>",
        ]
    )
    assert stablehlo_dtypes(region, "all_reduce") == {"bf16"}


def test_result_bytes():
    (one,) = collectives("%x = (f32[8,4]{1,0}, bf16[10]{0}) all-reduce(%a, %b)")
    assert one.arrays == [("f32", (8, 4)), ("bf16", (10,))]
    assert one.result_bytes == 8 * 4 * 4 + 10 * 2


def test_replica_groups_as_device_ids_in_each_form():
    from fleetjax.hlo import replica_groups

    assert replica_groups(LISTS) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_groups(IOTA) == ((0, 1, 2, 3), (4, 5, 6, 7))
    transposed = "%a = f32[8] all-gather(%b), replica_groups=[2,4]<=[4,2]T(1,0)"
    assert replica_groups(transposed) == ((0, 2, 4, 6), (1, 3, 5, 7))
    over_mp = "%x = f32[4] all-reduce(%y), replica_groups=mesh['dp'=2,'mp'=4] {'mp'}"
    assert replica_groups(over_mp) == ((0, 1, 2, 3), (4, 5, 6, 7))
    over_dp = "%x = f32[4] all-reduce(%y), replica_groups=mesh['dp'=2,'mp'=4] {'dp'}"
    assert replica_groups(over_dp) == ((0, 4), (1, 5), (2, 6), (3, 7))
    reordered = (
        "%x = f32[4] all-reduce(%y), replica_groups=mesh['a'=2,'b'=2], "
        "device_ids=([2,2]T(1,0)) {'b'}"
    )
    assert replica_groups(reordered) == ((0, 2), (1, 3))
    assert replica_groups("%x = f32[4] all-reduce(%y), replica_groups={}") is None


def test_asynchronous_pairs_and_permute_groups():
    permute = "%p = f32[4]{0} collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}"
    sync, start, swap = collectives("\n".join([LISTS, IOTA, permute]))
    assert not sync.asynchronous and start.asynchronous and swap.asynchronous
    assert swap.groups == ((0, 1), (1, 0)) and swap.group_size is None


def test_an_asynchronous_start_counts_its_results_only():
    """XLA:GPU's start ops return (operands, results[, contexts])."""
    lines = [
        "%ag = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%p), replica_groups=[2,4]<=[8]",
        "%a2a = ((f32[4,2]{1,0}, bf16[4]{0}), (f32[4,2]{1,0}, bf16[4]{0})) "
        "all-to-all-start(%a, %b)",
        "%cp = (f32[3]{0}, f32[3]{0}, u32[], u32[]) collective-permute-start(%x), "
        "source_target_pairs={{0,1}}",
        "%ar = f32[5]{0} all-reduce-start(%y), replica_groups={{0,1}}",
    ]
    gather, swap, permute, reduce = collectives("\n".join(lines))
    assert gather.arrays == [("f32", (8, 4))] and gather.result_bytes == 8 * 4 * 4
    assert swap.arrays == [("f32", (4, 2)), ("bf16", (4,))]
    assert permute.arrays == [("f32", (3,))]
    assert reduce.arrays == [("f32", (5,))]


TRIPS = 'backend_config={"known_trip_count":{"n":"3"}}'
OVERLAPPED = "\n".join(
    [
        "HloModule m, is_scheduled=true",
        "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
        "  %x = f32[8]{0} get-tuple-element(%p), index=1",
        "  %ar = f32[8]{0} all-reduce-start(%x), replica_groups={{0,1}}",
        "  %d1 = f32[8,8]{1,0} dot(f32[8,8]{1,0} %w, f32[8,8]{1,0} %w), lhs_contracting_dims={1}",
        "  %ard = f32[8]{0} all-reduce-done(%ar)",
        "  %cp = f32[8]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}",
        "  ROOT %t = (s32[], f32[8]) tuple(%i, %ard)",
        "}",
        "ENTRY %main (a: f32[8]) -> f32[8] {",
        f"  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, {TRIPS}",
        "  ROOT %r = f32[8]{0} all-reduce(%a), replica_groups={{0,1}}",
        "}",
    ]
)


def test_overlap_hides_an_asynchronous_collective_behind_the_computation_between():
    """The start ... done window hides up to the dot between them; the synchronous permute
    and the entry's all-reduce hide nothing; a loop counts its body per trip."""
    comm = {"all-reduce": 5.0, "collective-permute": 7.0}
    found = hlo.overlap(
        OVERLAPPED,
        lambda line, shapes: 2.0 if " dot(" in line else 0.0,
        lambda c: comm[c.op],
    )
    assert found == hlo.Overlap(compute=3 * 2.0, communicate=3 * (5.0 + 7.0) + 5.0, hidden=3 * 2.0)
    longer = hlo.overlap(
        OVERLAPPED, lambda line, shapes: 9.0 if " dot(" in line else 0.0, lambda c: comm[c.op]
    )
    assert longer.hidden == 3 * 5.0  # at most the collective's own time
