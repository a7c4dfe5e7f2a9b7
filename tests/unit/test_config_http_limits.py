"""The client API's HTTP limits in the config: defaults (nothing limited per key, 30 s deadlines) and
bounds, a bad value naming its key, its value and the reason."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, LimitsSection, load_config
from gateway.server.api.admission import limiter_of


def test_defaults_limit_no_key_and_bound_reads_by_30_s() -> None:
    lim = load_config().limits
    assert lim.header_timeout_s == lim.body_timeout_s == 30.0
    assert (lim.per_key_max_concurrent, lim.per_key_rate_per_s, lim.per_key_burst) == (0, 0.0, 0)
    assert limiter_of(lim) is None
    limiter = limiter_of(LimitsSection(per_key_rate_per_s=2.5))
    assert limiter is not None and limiter.limits.capacity == 3


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("limits.header_timeout_s", 0, "must be in (0, 3600] seconds"),
        ("limits.body_timeout_s", 7200.0, "must be in (0, 3600] seconds"),
        ("limits.body_timeout_s", float("nan"), "must be a finite number"),
        ("limits.per_key_max_concurrent", -1, "must be >= 0"),
        ("limits.per_key_rate_per_s", -0.5, "must be a finite number >= 0"),
        ("limits.per_key_rate_per_s", float("inf"), "must be a finite number"),
        ("limits.per_key_burst", -2, "must be >= 0"),
        ("limits.per_key_burst", 5, "needs limits.per_key_rate_per_s > 0"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg and why in msg
