"""The control arm's defaults: each shipped method's default lies inside its searched space and names its sources."""

import pytest

from peftune.sweep import spaces

SHIPPED = sorted((spaces.SEARCH_SPACES_DIR / spaces.METHODS_SUBDIR).glob("*.yaml"))


def inside(param, value) -> bool:
    """Whether the searched ``param`` can propose ``value``."""
    if isinstance(param, (spaces.FloatRange, spaces.IntRange)):
        return param.low <= value <= param.high
    return value in param.choices if isinstance(param, spaces.Choice) else value == param.value


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_default_lies_in_the_searched_space(path):
    space = spaces.load_method_space(path)
    params = space.params()
    outside = {key: value for key, value in space.default.items() if key in params and not inside(params[key], value)}
    assert not outside, f"{path.name}: default outside the searched space: {outside}"
    drawn = [key for key, param in params.items() if not isinstance(param, spaces.Fixed) and key not in space.default]
    assert not drawn, f"{path.name}: the default leaves {drawn} to the sampler (the control arm must be one setting)"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_default_value_names_its_source(path):
    source = spaces.load_method_space(path).default_source
    for value in ("lr", "dropout", "weight decay"):
        assert value in source, f"{path.name}: the default's source does not say where its {value} comes from"
    assert "peftune's choice" in source or "report" in source or "et al." in source
