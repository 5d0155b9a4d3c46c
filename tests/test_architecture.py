"""The layering of docs/ARCHITECTURE.md, enforced: what each top-level folder may import.

Imports point down the stack base <- delta <- gateway <- trainer <- mesh; nothing imports the
benchmarks or the tests; code names the installed package (`deltamesh.delta`), never a bare folder.
Every import statement counts, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the deltamesh parts its code may import (besides itself)
ALLOWED = {
    "deltamesh": set(),
    "delta": {"base"},
    "gateway": {"base", "delta"},
    "trainer": {"base", "delta", "gateway"},
    "mesh": {"base", "delta", "gateway", "trainer"},
}
PARTS = ("delta", "gateway", "trainer", "mesh")
FORBIDDEN_TOP = {"benchmarks", "tests", "delta", "gateway", "trainer", "mesh"}


def part_of(module: str) -> str | None:
    """Which part a `deltamesh...` module belongs to ("base" for the root package's own modules)."""
    names = module.split(".")
    if names[0] != "deltamesh":
        return None
    if len(names) > 1 and names[1] in PARTS:
        return names[1]
    return "base"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`; relative imports are resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.parent.relative_to(ROOT).parts
    dotted = ("deltamesh",) + (package if package[0] != "deltamesh" else package[1:])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = dotted[: len(dotted) - node.level + 1]
                found.append((node.lineno, ".".join(base + ((node.module,) if node.module else ()))))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def violations(folder: str) -> list[str]:
    own = "base" if folder == "deltamesh" else folder
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module in imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            top = module.split(".")[0]
            if top in FORBIDDEN_TOP:
                bad.append(f"{where} (import deltamesh.<part>, never a bare folder, benchmarks or tests)")
                continue
            part = part_of(module)
            if part is not None and part != own and part not in ALLOWED[folder]:
                bad.append(f"{where} ({folder} may import only {sorted(ALLOWED[folder]) or 'nothing of deltamesh'})")
    return bad


@pytest.mark.parametrize("folder", list(ALLOWED))
def test_imports_point_down(folder):
    assert violations(folder) == []


def test_the_checker_sees_a_wrong_import(tmp_path, monkeypatch):
    """A module of the base layer that imports the gateway is caught (the checker is not vacuous)."""
    root = tmp_path / "repo"
    (root / "deltamesh").mkdir(parents=True)
    (root / "deltamesh" / "bad.py").write_text("def f():\n    from deltamesh.gateway import fetch\n")
    (root / "delta").mkdir()
    (root / "delta" / "rel.py").write_text("from ..mesh import cli\nimport benchmarks.codec\n")
    monkeypatch.setitem(globals(), "ROOT", root)
    assert violations("deltamesh") == ["deltamesh/bad.py:2 imports deltamesh.gateway (deltamesh may import only "
                                       "nothing of deltamesh)"]
    assert [v.split(" (")[0] for v in violations("delta")] == ["delta/rel.py:1 imports deltamesh.mesh",
                                                              "delta/rel.py:2 imports benchmarks.codec"]


def test_docs_state_the_same_rules():
    """docs/ARCHITECTURE.md lists, for each folder, the parts it may import, as enforced here."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for folder, allowed in ALLOWED.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(f"| `{folder}/`")), None)
        assert line is not None, f"docs/ARCHITECTURE.md has no row for {folder}/"
        cell = line.split("|")[3]
        named = {p for p in ("base", *PARTS) if f"`{p}`" in cell}
        assert named == allowed, f"{folder}/: docs say {sorted(named)}, the test enforces {sorted(allowed)}"


FACES = ("deltamesh.gateway", "deltamesh.gateway.server", "deltamesh.gateway.fetch", "deltamesh.trainer",
         "deltamesh.mesh.pool")


@pytest.mark.parametrize("package", FACES)
def test_each_face_offers_every_name_it_lists(package):
    """A package's `__init__` exports its face (`__all__`), and every name in it resolves (lazy ones too)."""
    import importlib

    module = importlib.import_module(package)
    assert module.__all__, f"{package} exports nothing"
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == [], f"{package} lists names it does not offer: {missing}"


def test_gateway_holds_no_pool_or_publisher_side():
    """The gateway folder is the server and the shared fetcher: the pool's side of the protocol lives in
    mesh/pool/ and the publisher in trainer/, so no gateway module names them."""
    names = {p.relative_to(ROOT / "gateway").as_posix() for p in (ROOT / "gateway").rglob("*.py")}
    assert not names & {"weight_sync.py", "head_check.py", "head_watch.py", "publisher.py", "shard_publisher.py",
                        "upload.py", "origin_link.py"}
    top = {n for n in names if "/" not in n}
    assert top == {"__init__.py", "config.py", "plan.py", "version_parts.py"}, top
