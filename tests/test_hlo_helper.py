"""The HLO reader the other tests rely on, on each replica-group syntax XLA prints."""

from hlo import Collective, collectives

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
