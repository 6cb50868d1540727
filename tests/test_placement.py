"""Placement maths: pure functions, no cluster."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlnb.cluster.placement import (
    COLLOCATED,
    DISAGGREGATED,
    HYBRID,
    parse_slots,
    placement_mode,
    resolve_placement,
)
from rlnb.errors import ConfigError, PlacementError


@pytest.mark.parametrize(
    "spec,n,expected",
    [
        ("all", 3, (0, 1, 2)),
        ("ALL", 1, (0,)),
        (0, 4, (0,)),
        ("2", 4, (2,)),
        ("0-3", 4, (0, 1, 2, 3)),
        ("2,3", 4, (2, 3)),
        ("3,1", 4, (1, 3)),
        ("0-1,4", 5, (0, 1, 4)),
        (" 1 - 2 ", 3, (1, 2)),
        ([0, 2], 3, (0, 2)),
        (["0-1", 3], 4, (0, 1, 3)),
    ],
)
def test_parse_slots_valid(spec, n, expected):
    assert parse_slots(spec, n) == expected


@pytest.mark.parametrize(
    "spec,n,fragment",
    [
        ("0-4", 4, "slot 4 in '0-4' is beyond the cluster: valid slots are 0-3"),
        (7, 2, "slot 7 in 7 is beyond the cluster: valid slots are 0-1"),
        ("3-1", 4, "range '3-1' is reversed; write 1-3"),
        ("0,0", 2, "slot 0 appears twice"),
        ("0-1,1", 2, "slot 1 appears twice"),
        ("", 2, "cannot parse ''"),
        ("a-b", 2, "cannot parse 'a-b'"),
        ([], 2, "empty slot selection"),
        (None, 2, "expected a slot selection"),
        (True, 2, "expected a slot selection"),
        (1.5, 2, "got float 1.5"),
        ("all", 0, "'all' selects nothing"),
    ],
)
def test_parse_slots_errors_name_key_value_and_range(spec, n, fragment):
    with pytest.raises(PlacementError) as e:
        parse_slots(spec, n, key="component_placement.actor")
    msg = str(e.value)
    assert fragment in msg
    assert msg.startswith("component_placement.actor:")
    assert e.value.key == "component_placement.actor"
    assert isinstance(e.value, ConfigError)


@given(st.integers(1, 16), st.data())
def test_parse_slots_roundtrips_any_subset(n, data):
    subset = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    spec = ",".join(str(s) for s in subset)
    assert parse_slots(spec, n) == tuple(subset)


def test_modes():
    assert placement_mode({"actor": (0, 1), "rollout": (0, 1), "env": (0, 1)}) == COLLOCATED
    assert placement_mode({"actor": (0,)}) == COLLOCATED
    assert placement_mode({"actor": (0, 1), "rollout": (2,), "env": (3,)}) == DISAGGREGATED
    assert placement_mode({"actor": (0, 1), "rollout": (0, 1), "env": (2, 3)}) == HYBRID
    assert placement_mode({"actor": (0, 1), "rollout": (1, 2)}) == HYBRID


def test_resolve_recipe_style_placement():
    p = resolve_placement({"actor,rollout": "0-1", "env": "2-3"}, num_slots=4)
    assert p.slots == {"actor": (0, 1), "rollout": (0, 1), "env": (2, 3)}
    assert p.mode == HYBRID
    assert p["env"] == (2, 3)
    assert p.components_on(0) == ["actor", "rollout"]
    assert resolve_placement({"actor,rollout,env": "all"}, 2).mode == COLLOCATED


def test_node_groups():
    groups = {"sim": [2, 3], "train": [0, 1]}
    p = resolve_placement(
        {"env": {"node_group": "sim", "slots": "1"}, "actor": {"node_group": "train"}}, 4, groups
    )
    assert p.slots == {"env": (3,), "actor": (0, 1)}
    with pytest.raises(PlacementError, match=r"node group 'simm' has no workers.*Did you mean 'sim'\?"):
        resolve_placement({"env": {"node_group": "simm"}}, 4, groups)
    with pytest.raises(PlacementError, match=r"component_placement.env.slots: slot 2 .* valid slots are 0-1"):
        resolve_placement({"env": {"node_group": "sim", "slots": "0-2"}}, 4, groups)
    with pytest.raises(PlacementError, match="unexpected keys \\['slot'\\]"):
        resolve_placement({"env": {"node_group": "sim", "slot": 0}}, 4, groups)


def test_a_component_placed_on_a_host_by_name_gets_that_hosts_slots():
    hosts = {"gpu-node-3": [2, 3], "cpu-node-1": [0, 1]}
    p = resolve_placement(
        {"actor": {"host": "gpu-node-3"}, "env,rollout": {"host": "cpu-node-1", "slots": "1"}}, 4, hosts=hosts
    )
    assert p.slots == {"actor": (2, 3), "env": (1,), "rollout": (1,)}
    with pytest.raises(PlacementError, match=r"host 'gpu-node3' has no workers; the cluster's hosts: "
                                             r"\['cpu-node-1', 'gpu-node-3'\].*Did you mean 'gpu-node-3'\?"):  # fmt: skip
        resolve_placement({"actor": {"host": "gpu-node3"}}, 4, hosts=hosts)
    with pytest.raises(PlacementError, match="expected node_group or host, one of them"):
        resolve_placement(
            {"actor": {"host": "gpu-node-3", "node_group": "sim"}}, 4, {"sim": [0]}, hosts=hosts
        )
    with pytest.raises(
        PlacementError, match=r"component_placement.actor.slots: slot 2 .* valid slots are 0-1"
    ):
        resolve_placement({"actor": {"host": "gpu-node-3", "slots": "0-2"}}, 4, hosts=hosts)


def test_resolve_errors():
    with pytest.raises(PlacementError, match="component 'actor' is placed twice"):
        resolve_placement({"actor": 0, "actor,rollout": 1}, 2)
    with pytest.raises(PlacementError, match=r"unknown component 'actr'.*Did you mean 'actor'\?"):
        resolve_placement({"actr": 0}, 2, known=["actor", "rollout", "env"])
    with pytest.raises(PlacementError, match=r"no placement for \['env'\]"):
        resolve_placement({"actor": 0}, 2, required=["actor", "env"])
    with pytest.raises(PlacementError, match="empty component name"):
        resolve_placement({"actor,": 0}, 2)
    with pytest.raises(PlacementError, match="expected a mapping"):
        resolve_placement("actor: 0", 2)
    with pytest.raises(
        PlacementError,
        match=r"component_placement.actor: slot 2 in '0-5' is beyond the cluster: valid slots are 0-1",
    ):
        resolve_placement({"actor": "0-5"}, 2)
    p = resolve_placement({"actor": 0, "rollout": 1}, 2)
    with pytest.raises(
        PlacementError, match=r"no placement for component 'rollut'; .*Did you mean 'rollout'\?"
    ):
        p["rollut"]
