"""The parts of a resident model's bytes per device (router/policy/parts.py): what a device bar
draws sums exactly to what admission counts."""

from hypothesis import given, strategies as st

from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.router.policy.parts import COMPONENTS, by_device, split

bytes_ = st.integers(min_value=0, max_value=1 << 34)
components = st.dictionaries(st.sampled_from(COMPONENTS), bytes_, max_size=len(COMPONENTS))


@given(held=st.dictionaries(st.sampled_from(["GPU0", "GPU1", "CPU"]), bytes_, min_size=1),
       pools=st.dictionaries(st.sampled_from(["GPU0", "GPU1", "CPU"]), components))
def test_each_device_parts_sum_to_what_it_holds(held, pools):
    out = split(held, pools)
    for device, total in held.items():
        assert sum(out.get(device, {}).values()) == total
        assert all(v > 0 for v in out.get(device, {}).values())


def test_a_fitted_model_keeps_its_proportions_and_the_rounding_goes_to_its_largest_part():
    out = split({"GPU0": 1000}, {"GPU0": {"weights": 1500, "kv": 500, "compute": 1}})
    assert out == {"GPU0": {"weights": 749 + 2, "kv": 249}}  # 3/4 and 1/4, 2 bytes of rounding to weights


def test_emulated_devices_share_each_component_as_they_share_the_total():
    inv = EmulatedInventory({"GPU0": 1 << 30, "GPU1": 1 << 30})
    ds = frozenset({"GPU0", "GPU1"})
    pools = {"CPU": {"weights": 101, "kv": 50}}
    mapped = by_device(pools, lambda p: inv.to_inventory(ds, p))
    assert mapped == {"GPU0": {"weights": 51, "kv": 25}, "GPU1": {"weights": 50, "kv": 25}}
    held = inv.to_inventory(ds, {"CPU": 151})
    assert {d: sum(v.values()) for d, v in split(held, mapped).items()} == held
