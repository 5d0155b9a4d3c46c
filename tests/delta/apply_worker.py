"""Test helper process: applies versions to a directory in a loop until it is killed.

Usage: apply_worker.py DIR STEPS PUBLIC_KEY. STEPS holds `<name>.manifest` (signed envelope) and
`<name>.<i>.piece` files for the versions named `to_v2` (a delta v1 -> v2) and `to_v1` (a full
snapshot of v1). The worker prints "ready", then alternates both forever, printing each version
it reaches, so a test can SIGKILL it at any point of an apply.
"""

from __future__ import annotations

import sys
from pathlib import Path


def load_step(steps: Path, name: str, trusted):
    from deltamesh.delta import load_manifest

    manifest = load_manifest((steps / f"{name}.manifest").read_bytes(), trusted)
    pieces = [(steps / f"{name}.{i}.piece").read_bytes() for i in range(len(manifest.pieces))]
    return manifest, pieces


def main() -> int:
    from deltamesh.delta import apply_to_dir, dir_manifest, load_public_key

    target, steps, public = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    trusted = [load_public_key(public)]
    to_v2, to_v1 = load_step(steps, "to_v2", trusted), load_step(steps, "to_v1", trusted)
    # Start from whichever version an earlier, killed worker left behind.
    steps_in_turn = [to_v2, to_v1] if dir_manifest(target).version == 1 else [to_v1, to_v2]
    print("ready", flush=True)
    while True:
        for step in steps_in_turn:
            print(apply_to_dir(target, [step]).version, flush=True)


if __name__ == "__main__":
    sys.exit(main())
