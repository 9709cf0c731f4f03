"""HealthPolicy: the documented defaults, the formula, and device/host agreement (bit for bit)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_gradstats.stats.health import HealthPolicy

INF, NAN = math.inf, math.nan


def formula(norms, vt=1e-7, et=10.0, vp=0.5, ep=0.8):
    """The score written out the obvious way, independent of HealthPolicy's code."""
    if not norms:
        return 1.0
    if any(not math.isfinite(x) for x in norms):
        return 0.0
    v = sum(1 for x in norms if x < vt) / len(norms)
    e = sum(1 for x in norms if x > et) / len(norms)
    return min(1.0, max(0.0, 1.0 - vp * v - ep * e))


def test_documented_defaults():
    p = HealthPolicy()
    assert (p.vanishing_threshold, p.exploding_threshold, p.vanishing_penalty, p.exploding_penalty) == (
        1e-7,
        10.0,
        0.5,
        0.8,
    )


@pytest.mark.parametrize(
    "norms, expected",
    [
        ([], 1.0),
        ([1.0, 2.0, 3.0], 1.0),
        ([0.0, 1.0], 0.75),  # one of two vanishing: 1 - 0.5/2
        ([100.0, 1.0], 0.6),  # one of two exploding: 1 - 0.8/2
        ([100.0, 100.0], 0.2),
        ([0.0, 100.0], 1.0 - 0.25 - 0.4),
        ([1e-7, 10.0], 1.0),  # thresholds are strict
        ([1.0, NAN], 0.0),
        ([1.0, INF], 0.0),
        ([0.0, 0.0, 0.0], 0.5),
    ],
)
def test_known_scores(norms, expected):
    p = HealthPolicy()
    host = p.score_host(norms)
    dev = p.score(torch.tensor(norms, dtype=torch.float64))
    assert host == pytest.approx(expected, abs=1e-15)
    assert dev.dtype == torch.float64 and dev.dim() == 0
    assert float(dev) == host


def test_clamped_to_zero_with_custom_penalties():
    p = HealthPolicy(exploding_penalty=2.0)
    assert p.score_host([100.0, 100.0]) == 0.0
    assert float(p.score(torch.tensor([100.0, 100.0], dtype=torch.float64))) == 0.0


def test_nonfinite_counts_as_exploding_not_vanishing():
    p = HealthPolicy()
    van, exp = p.classify(torch.tensor([NAN, INF, 0.0, 1.0, 50.0], dtype=torch.float64))
    assert van.tolist() == [False, False, True, False, False]
    assert exp.tolist() == [True, True, False, False, True]
    assert p.classify_host([NAN, INF, 0.0, 1.0, 50.0]) == (van.tolist(), exp.tolist())


def test_bad_policy_rejected():
    with pytest.raises(TypeError, match="vanishing_threshold"):
        HealthPolicy(vanishing_threshold=None)
    with pytest.raises(ValueError, match="exploding_penalty"):
        HealthPolicy(exploding_penalty=float("nan"))


@pytest.mark.parametrize("field", ["vanishing_threshold", "exploding_threshold", "vanishing_penalty",
                                   "exploding_penalty"])
@pytest.mark.parametrize(
    "value,error",
    [
        (float("-inf"), ValueError),
        (float("nan"), ValueError),
        (-1e-9, ValueError),
        (-3, ValueError),
        (torch.tensor(-1.0), ValueError),
        ("10", TypeError),
        (b"10", TypeError),
        (True, TypeError),
        (False, TypeError),
        (None, TypeError),
        ([1.0], TypeError),
        (1 + 2j, TypeError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor(True), TypeError),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_nonsense_is_rejected_naming_the_field(field, value, error):
    with pytest.raises(error, match=f"HealthPolicy.{field} must be"):
        HealthPolicy(**{field: value})


def test_numpy_bool_is_rejected():
    import numpy as np

    with pytest.raises(TypeError, match="exploding_threshold"):
        HealthPolicy(exploding_threshold=np.True_)


def test_accepted_values_keep_host_and_device_scores_identical():
    """What the validation protects: with every accepted policy the device and host scores agree bit for bit (an
    inf penalty used to give 0.0 on one and NaN on the other)."""
    import numpy as np

    norms = torch.tensor([0.0, 1e-9, 0.5, 11.0, 1e30], dtype=torch.float64)
    for policy in [
        HealthPolicy(0, 0, 0, 0),
        HealthPolicy(np.float64(1e-3), np.int64(5), torch.tensor(2.0), 1e300),
        HealthPolicy(exploding_penalty=1e308, vanishing_penalty=1e308),
    ]:
        assert float(policy.score(norms)) == policy.score_host(norms.tolist())


def test_trainer_rejects_a_policy_that_is_not_one():
    from torch_gradstats.training import Trainer

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="health_policy must be a HealthPolicy or None, got str"):
        Trainer(model, opt, torch.nn.MSELoss(), health_policy="x")


_norm = st.one_of(
    st.floats(min_value=0.0, max_value=1e30, allow_nan=False),
    st.sampled_from([0.0, 1e-7, 1e-8, 10.0, 10.000001, INF, NAN]),
)


@settings(max_examples=200, deadline=None)
@given(
    norms=st.lists(_norm, max_size=40),
    vt=st.floats(1e-12, 1e-3),
    et=st.floats(1.0, 1e4),
    vp=st.floats(0.0, 2.0),
    ep=st.floats(0.0, 2.0),
)
def test_device_and_host_agree_bitwise(norms, vt, et, vp, ep):
    p = HealthPolicy(vt, et, vp, ep)
    host = p.score_host(norms)
    dev = float(p.score(torch.tensor(norms, dtype=torch.float64).reshape(-1)))
    assert dev == host
    assert host == pytest.approx(formula(norms, vt, et, vp, ep), abs=1e-12)
    assert 0.0 <= host <= 1.0


def test_numpy_and_tensor_scalars_and_unordered_thresholds_are_accepted():
    import numpy as np

    p = HealthPolicy(vanishing_threshold=torch.tensor(1e-3), exploding_threshold=np.float32(1e-4))
    assert isinstance(p.vanishing_threshold, float) and isinstance(p.exploding_threshold, float)
    # a norm between the two is both vanishing and exploding, as in the original collector
    norms = torch.tensor([5e-4, 1.0], dtype=torch.float64)
    assert p.score_host(norms.tolist()) == float(p.score(norms)) == max(0.0, 1 - 0.5 * 0.5 - 0.8 * 1.0)
    with pytest.raises(TypeError, match="vanishing_threshold must be a real number"):
        HealthPolicy(vanishing_threshold="small")


@pytest.mark.parametrize("inf", [math.inf, np.float64("inf"), np.float32("inf"), torch.tensor(math.inf)],
                         ids=["float", "np.float64", "np.float32", "tensor"])
def test_infinite_thresholds_are_accepted_with_plain_comparison_semantics(inf):
    norms = [0.0, 1e-9, 0.5, 11.0, 1e300, NAN, INF]
    never_explodes = HealthPolicy(exploding_threshold=inf)
    assert never_explodes.exploding_threshold == math.inf
    # no finite norm is above inf; a non-finite norm still counts as exploding
    assert never_explodes.classify_host(norms)[1] == [False, False, False, False, False, True, True]
    assert never_explodes.score_host([0.5, 11.0, 1e300]) == 1.0
    # every finite norm is below inf: all of them vanish (0 is the vanishing threshold that never fires)
    all_vanish = HealthPolicy(vanishing_threshold=inf)
    assert all_vanish.classify_host(norms)[0] == [True, True, True, True, True, False, False]
    assert all_vanish.score_host([0.5, 1.0]) == 0.5
    for policy in (never_explodes, all_vanish, HealthPolicy(inf, inf)):
        t = torch.tensor(norms, dtype=torch.float64)
        dev_v, dev_e = policy.classify(t)
        assert (dev_v.tolist(), dev_e.tolist()) == policy.classify_host(norms)
        for sub in (norms[:5], norms):
            assert float(policy.score(torch.tensor(sub, dtype=torch.float64))) == policy.score_host(sub)


def test_infinite_threshold_through_the_collector_as_in_the_original():
    """The original collector accepted inf thresholds; the drop-in replacement does too."""
    from torch_gradstats.compat.collector import SeedGradientCollector, materialize_grad_stats

    model = torch.nn.Linear(4, 4)
    (model(torch.randn(8, 4)) * 1e6).sum().backward()  # norms far above the default exploding threshold
    stats = materialize_grad_stats(SeedGradientCollector(exploding_threshold=float("inf")).collect_async(
        model.parameters()))
    assert not stats["has_exploding"] and stats["gradient_health"] == 1.0


@pytest.mark.parametrize("field", ["vanishing_penalty", "exploding_penalty"])
def test_infinite_penalty_is_rejected(field):
    with pytest.raises(ValueError, match=f"HealthPolicy.{field} must be finite .*got inf"):
        HealthPolicy(**{field: math.inf})


@pytest.mark.parametrize("field", ["vanishing_threshold", "exploding_threshold", "vanishing_penalty",
                                   "exploding_penalty"])
@pytest.mark.parametrize("value", [math.nan, np.float32("nan"), torch.tensor(math.nan)], ids=repr)
def test_nan_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"HealthPolicy.{field} must be a number, not NaN"):
        HealthPolicy(**{field: value})


@pytest.mark.parametrize("field", ["vanishing_threshold", "exploding_threshold", "vanishing_penalty",
                                   "exploding_penalty"])
@pytest.mark.parametrize("value", [10**400, -(10**400), "longdouble"])
def test_a_number_too_large_for_a_float_is_a_value_error_naming_the_field(field, value):
    if value == "longdouble":
        if np.finfo(np.longdouble).max <= np.finfo(np.float64).max:
            pytest.skip("numpy's longdouble is float64 on this platform: 1e400 is inf there")
        value = np.longdouble("1e400")
    with pytest.raises(ValueError, match=f"HealthPolicy.{field} must be a number a float can hold") as info:
        HealthPolicy(**{field: value})
    assert len(str(info.value)) < 200  # the 401-digit number is shortened


@pytest.mark.parametrize("field", ["vanishing_threshold", "exploding_threshold", "vanishing_penalty",
                                   "exploding_penalty"])
@pytest.mark.parametrize("value", [np.int64(3), np.int8(3), np.uint16(3), np.float32(3.0), np.float16(3.0),
                                   np.float64(3.0)], ids=repr)
def test_numpy_scalars_are_accepted_wherever_a_python_number_is(field, value):
    policy = HealthPolicy(**{field: value})
    assert getattr(policy, field) == 3.0 and type(getattr(policy, field)) is float
    assert policy == HealthPolicy(**{field: 3})


@pytest.mark.parametrize("field", ["vanishing_threshold", "exploding_threshold", "vanishing_penalty",
                                   "exploding_penalty"])
def test_a_string_is_a_type_error_naming_the_field_and_what_is_accepted(field):
    with pytest.raises(TypeError) as info:
        HealthPolicy(**{field: "1"})
    assert str(info.value) == (f"HealthPolicy.{field} must be a real number (an int, a float, a numpy scalar or a "
                               "one-element real tensor), got '1' (str)")
