"""The one `--set` grammar (megatrain/settings.py) and the TOML values the configs write."""
import tomllib

import pytest

from megatrain.settings import SettingError, check_setting, parse_setting, toml_value


@pytest.mark.parametrize("text, t, value", [
    ("3", int, 3), ("1_000", int, 1000), ("3e-4", float, 3e-4), ("on", bool, True), ("No", bool, False),
    ("'bf16'", str, "bf16"), ("none", int | None, None), ("2", int | None, 2), ("[0, 7]", tuple[int, ...], (0, 7)),
    ("0,7", tuple[int, ...], (0, 7)),
])
def test_parse_setting(text, t, value):
    assert parse_setting("k", text, t) == value


@pytest.mark.parametrize("text, t, expected", [("two", int, "k must be an integer"), ("maybe", bool, "true or false"),
                                                ("inf", float, "a number"), ("none", int, "an integer"),
                                                ("[0, x]", tuple[int, ...], "k must be an integer")])
def test_bad_text_names_the_key_and_the_type(text, t, expected):
    with pytest.raises(SettingError, match=expected):
        parse_setting("k", text, t)


def test_toml_values_round_trip_and_types_are_checked():
    for v in (True, 3, 0.5, 1e-05, "a \"quoted\" name"):
        assert tomllib.loads(f"k = {toml_value(v)}")["k"] == v
    assert check_setting("k", 2, float) == 2.0 and check_setting("k", [1, 2], tuple[int, ...]) == (1, 2)
    with pytest.raises(SettingError, match="k must be an integer"):
        check_setting("k", True, int)  # a bool is not a count
