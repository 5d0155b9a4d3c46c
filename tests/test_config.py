"""The config loader: TOML + overrides into typed dataclasses, with clear errors."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deltamesh.config import ConfigError, load_config


@dataclass
class Inner:
    connections: int = 4
    cap_mbit: float | None = None


@dataclass
class Outer:
    region: str = "local"
    upstreams: list[str] = field(default_factory=list)
    relay: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.relay.connections < 1:
            raise ValueError("relay.connections must be >= 1")


def test_defaults_without_file():
    assert load_config(Outer) == Outer()


def test_file_section_and_overrides(tmp_path: Path):
    p = tmp_path / "c.toml"
    p.write_text('[gw]\nregion = "eu"\nupstreams = ["http://a"]\n[gw.relay]\nconnections = 8\ncap_mbit = 100\n')
    cfg = load_config(Outer, p, section="gw", overrides={"region": "us", "relay.connections": 2, "upstreams": None})
    assert cfg.region == "us"
    assert cfg.upstreams == ["http://a"]
    assert cfg.relay == Inner(connections=2, cap_mbit=100.0)


@pytest.mark.parametrize(
    "text, needle",
    [
        ('regoin = "x"\n', "unknown keys"),
        ("region = 3\n", "expected str"),
        ("[relay]\nconnections = 0\n", "must be >= 1"),
        ("[relay]\nconnections = true\n", "got bool"),
        ("region = \n", "cannot read config"),
    ],
)
def test_bad_config_is_an_error(tmp_path: Path, text: str, needle: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(Outer, p)
