"""Clock jumps for the soak, one process at a time: build the wall-clock shim and set each process's offset.

The machine's clock is shared with everything else running on it, so the soak never steps it. Each
service it starts instead preloads `soak_clock.c` (built here once per source version with the system's
C compiler, into the user's deltamesh cache), which adds the number of seconds in the service's own
offset file to every wall-clock read (`time.time()`, `datetime.now()`, OpenSSL's certificate checks)
and leaves the monotonic clock alone, as an NTP step on a real host does. `ClockFiles.env` is what a
service is started with; `jump` and `reset` rewrite its file, which it reads again within 200 ms.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from deltamesh.cache import cache_dir

SOURCE = Path(__file__).resolve().with_name("soak_clock.c")


class ClockShimError(RuntimeError):
    """The shim could not be built (no C compiler?)."""


def shim_library() -> Path:
    """The built shim (`libsoakclock-<hash>.so` in the cache), compiled on first use."""
    source = SOURCE.read_bytes()
    folder = cache_dir("soak")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"libsoakclock-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ClockShimError("no C compiler (cc) to build the soak's clock shim")
    tmp = target.with_suffix(".tmp")
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ClockShimError(f"building {SOURCE.name} failed: {done.stderr.strip()}")
    tmp.rename(target)
    return target


class ClockFiles:
    """One offset file per service under `folder`; all start at 0."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.library = shim_library()
        self.offsets: dict[str, float] = {}

    def path(self, service: str) -> Path:
        return self.folder / f"{service}.offset"

    def env(self, service: str) -> dict[str, str]:
        """The environment a service is started with so that its wall clock follows its file."""
        if service not in self.offsets:
            self._write(service, 0.0)
        return {"LD_PRELOAD": str(self.library), "SOAK_CLOCK_OFFSET_FILE": str(self.path(service))}

    def jump(self, service: str, seconds: float) -> None:
        self._write(service, seconds)

    def reset(self, service: str) -> None:
        self._write(service, 0.0)

    def _write(self, service: str, seconds: float) -> None:
        tmp = self.path(service).with_suffix(".tmp")
        tmp.write_text(f"{seconds:.3f}\n")
        tmp.rename(self.path(service))  # whole: the shim never reads half a number
        self.offsets[service] = seconds
