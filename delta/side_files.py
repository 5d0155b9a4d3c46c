"""Side files: the non-weight files of a model directory (config, tokenizer, generation settings) that
travel with a version, so that a pool's synced directory is a model any engine or `from_pretrained` loads.

The trainer picks them from its model directory (`read_side_files`); the manifest lists each one's
name, size and digest (`Manifest.content_digest`) under the trainer's signature, and its bytes travel as a raw piece of the
version (docs/FORMAT.md, section 2.3). A delta re-ships only the side files that changed since its
base; a receiver keeps the others from the version it holds when their hashes match
(`place_side_files`), and a receiver that lacks one cannot take the delta (it takes a full snapshot,
which ships every side file). A name is a plain file name, checked wherever one is read
(`side_file_problem`): no path separator, no leading dot (so neither `.` nor `..`), never a weight file
or the manifest file, so a hostile manifest cannot write outside the directory or over the weights.
This module imports no torch: the manifest checks names with it on a gateway host.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from .errors import BaseMismatchError, CorruptError

if TYPE_CHECKING:
    from .manifest import Manifest

log = logging.getLogger(__name__)

MANIFEST_FILE = "deltamesh-manifest.json"
"""The body of the manifest a synced directory holds (docs/FORMAT.md, section 3)."""
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
"""Files a version rewrites itself: never side files."""
SIDE_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
"""What Hugging Face writes beside the weights of a text model: config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json, vocab.json or
vocab.txt, merges.txt, tokenizer.model (sentencepiece), chat_template.jinja, *.tiktoken. Pickled or
code files (`*.bin`, `*.py`) are not carried: a pool has no use for them and should never run them."""

# Bounds a reader checks before it allocates anything by a manifest's word. The largest tokenizer.json
# of today's open models is ~33 MB (Gemma 3); a model directory has a dozen side files at most.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_SIDE_FILE_BYTES = 64 << 20
MAX_SIDE_FILES = 64
MAX_SIDE_TOTAL_BYTES = 256 << 20


def side_file_problem(name: object) -> str | None:
    """Why `name` cannot be a side file's name, or None if it can."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        return f"{str(name)[:140]!r} is not a plain file name matching {NAME_RE.pattern}"
    if name == MANIFEST_FILE or name.endswith(WEIGHT_SUFFIXES):
        return f"{name!r} is a weight or manifest file"
    return None


def read_side_files(directory: str | Path) -> dict[str, bytes]:
    """The side files of a Hugging Face model directory, by name: every regular file (or link to one)
    with a side-file suffix and a valid name. Files over the bounds are left out with a warning (the
    version is published without them), never silently."""
    root = Path(directory)
    files: dict[str, bytes] = {}
    total = 0
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(SIDE_SUFFIXES) or side_file_problem(entry.name) or not entry.is_file():
            continue
        size = entry.stat().st_size
        if size > MAX_SIDE_FILE_BYTES or total + size > MAX_SIDE_TOTAL_BYTES or len(files) == MAX_SIDE_FILES:
            log.warning("%s: side file %s (%d bytes) left out: over the bounds of %d files, %d bytes each, "
                        "%d in all", root, entry.name, size, MAX_SIDE_FILES, MAX_SIDE_FILE_BYTES, MAX_SIDE_TOTAL_BYTES)
            continue
        files[entry.name] = entry.read_bytes()
        total += len(files[entry.name])
    return files


def place_side_files(target: Path, manifest: Manifest, shipped: Mapping[str, bytes], held: Path | None) -> None:
    """Write the side files of `manifest` into the new version's directory `target`, fsynced.

    Each listed file comes from `shipped` (verified bytes that the applied versions carried) or else
    from the directory of the version held before (`held`) when its hash matches; a listed file found in
    neither raises BaseMismatchError (what is held is not the base this delta assumes: take a full
    snapshot). Files of `held` that the manifest does not list (an operator's own, or every side file
    under an old-format manifest) are carried over as they are.
    """
    listed = {f.name for f in manifest.files}
    for f in manifest.files:
        problem = side_file_problem(f.name)  # checked when the manifest was read; a write outside is never worth a risk
        if problem:
            raise CorruptError(f"side file: {problem}")
        data = shipped.get(f.name)
        if data is None or manifest.content_digest(data) != f.hash:
            data = _held(held, f.name, f.hash, manifest)
        if data is None:
            raise BaseMismatchError(f"{manifest.model_id} v{manifest.version}: side file {f.name} ({f.hash}) is "
                                    f"neither shipped by the versions applied nor held at the base")
        _write(target / f.name, data)
    if held is None:
        return
    for entry in held.iterdir():
        name = entry.name
        if name in listed or side_file_problem(name) or not entry.is_file() or (target / name).exists():
            continue
        _write(target / name, entry.read_bytes())


def _held(held: Path | None, name: str, expected: str, manifest: Manifest) -> bytes | None:
    if held is None:
        return None
    try:
        data = (held / name).read_bytes()
    except OSError:
        return None
    return data if manifest.content_digest(data) == expected else None


def _write(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:  # the directory is new: an existing name would mean a bug, not a file to replace
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
