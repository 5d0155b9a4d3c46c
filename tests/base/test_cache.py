"""The user cache folder: never inside the source checkout, and where the environment says."""

from __future__ import annotations

from pathlib import Path

from deltamesh.cache import cache_dir

ROOT = Path(__file__).resolve().parents[2]


def test_cache_follows_the_environment_and_stays_out_of_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("DELTAMESH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("models") == tmp_path / "home" / ".cache" / "deltamesh" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("transfer", "results.json") == tmp_path / "xdg" / "deltamesh" / "transfer" / "results.json"
    monkeypatch.setenv("DELTAMESH_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"
    assert ROOT not in cache_dir().parents


def test_no_module_writes_a_cache_into_the_checkout():
    offenders = [str(p.relative_to(ROOT)) for folder in ("benchmarks", "mesh", "deltamesh", "gateway", "trainer", "delta")
                 for p in (ROOT / folder).rglob("*.py")
                 if p != ROOT / "deltamesh" / "cache.py" and '".cache"' in p.read_text()]
    assert offenders == [], offenders
