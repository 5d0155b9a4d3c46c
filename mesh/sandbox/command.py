"""The command lines that start the sandbox's runner, and what of the host they expose.

In "bwrap" mode the sandbox's root is an empty tmpfs: the only host paths in it are the
interpreter's own files, bound read-only (the executable, its standard library, the shared
libraries and the dynamic loader it needs), found by asking the interpreter once. Everything else
(the pool's config, tokens, keys, the project's checkout, /root, /proc) is absent, not just unreadable.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from dataclasses import dataclass

from deltamesh.mesh.sandbox.config import SandboxConfig
from deltamesh.mesh.sandbox.results import SandboxError

PYTHON_FLAGS = ("-I", "-S", "-B")  # isolated (no PYTHON* env, no user site), no site-packages, no .pyc writes
SCRATCH = "/tmp"
ENV = {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "LANG": "C.UTF-8", "TMPDIR": SCRATCH}
PROBE = ("import json, sys, sysconfig; print(json.dumps({'executable': sys.executable, 'path': sys.path, "
         "'libdirs': [sysconfig.get_config_var('LIBDIR'), '/usr/lib/' + (sysconfig.get_config_var('MULTIARCH') "
         "or ''), '/lib/' + (sysconfig.get_config_var('MULTIARCH') or '')]}))")


@dataclass(frozen=True)
class Runtime:
    """The interpreter to run and the host paths it needs, as bwrap arguments."""

    executable: str
    mounts: tuple[str, ...]
    """`--symlink TARGET PATH` for each symlink on the way to a needed path, then `--ro-bind P P`."""


def elf_interpreter(path: str) -> str | None:
    """The dynamic loader named in an ELF64 executable's PT_INTERP header, or None (static, not ELF)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:5] != b"\x7fELF\x02":
            return None
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
            if p_type == 3:
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    return None


def _mounts_for(paths: list[str]) -> tuple[str, ...]:
    """Bind each path read-only at its own place, recreating the symlinks met on the way (merged-usr
    /lib -> usr/lib), and binding no path twice or inside another bound one."""
    symlinks: dict[str, str] = {}
    binds: set[str] = set()
    for path in paths:
        current = "/"
        for part in os.path.normpath(path).split("/")[1:]:
            current = os.path.join(current, part)
            if os.path.islink(current):
                symlinks[current] = os.readlink(current)
                current = os.path.realpath(current)
        binds.add(current)
    kept = sorted(b for b in binds if not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds))
    args: list[str] = []
    for link, target in sorted(symlinks.items()):
        if not any(link.startswith(b + "/") for b in kept):
            args += ["--symlink", target, link]
    for bind in kept:
        args += ["--ro-bind", bind, bind]
    return tuple(args)


def probe_runtime(python: str) -> Runtime:
    """Ask the interpreter where its standard library and libraries are; SandboxError if it cannot run."""
    try:
        out = subprocess.run([python, *PYTHON_FLAGS, "-c", PROBE], capture_output=True, text=True, timeout=30,
                             check=True, env=ENV).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"the sandbox's interpreter {python} does not run: {exc}") from exc
    info = json.loads(out)
    executable = os.path.realpath(info["executable"])
    needed = [executable, *(p for p in info["path"] if os.path.isdir(p)),
              *(d for d in info["libdirs"] if d and os.path.isdir(d))]
    loader = elf_interpreter(executable)
    if loader:
        needed.append(loader)
    return Runtime(executable=executable, mounts=_mounts_for(needed))


def bwrap_argv(bwrap: str, config: SandboxConfig, runtime: Runtime, harness: str) -> list[str]:
    """bubblewrap in new user, PID, network, mount, IPC and UTS namespaces, uid `config.uid` inside;
    the runner as its command. No /proc: a test cannot reach the runner's file descriptors through it."""
    argv = [bwrap, "--unshare-user", "--uid", str(config.uid), "--gid", str(config.gid), "--disable-userns",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in ENV.items():
        argv += ["--setenv", name, value]
    # The root and /dev are bwrap's own tmpfs, unbounded: read-only, so that the scratch tmpfs is all there is to write.
    argv += [*runtime.mounts, "--dev", "/dev", "--size", str(config.scratch_bytes), "--tmpfs", SCRATCH,
             "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", SCRATCH]
    return argv + [runtime.executable, *PYTHON_FLAGS, "-c", harness]


def rlimits_argv(runtime: Runtime, harness: str) -> list[str]:
    """The weaker mode: the same runner as a plain process (no namespaces, the host's filesystem)."""
    return [runtime.executable, *PYTHON_FLAGS, "-c", harness]
