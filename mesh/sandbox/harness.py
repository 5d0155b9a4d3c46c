"""The test runner that runs inside the sandbox, as `python -I -S -B -c <this file's source>`.

It is a standalone script (standard library only, nothing of deltamesh: the sandbox sees no
site-packages), importing only cheap modules: its start-up is paid by every execution. It reads one
job, marshalled by the pool, on stdin ({"program", "tests", "limits", ...}), prints a `ready` line,
then runs each test in a child process of its own: the child puts itself in a
new process group, points stdout and stderr at a scratch file, sets the rlimits, executes the program
and then the test in one namespace, and reports its outcome on a pipe. The runner never executes
model-written code itself, so it judges each child from outside: by the report, the exit status and
its own per-test deadline (a child past it is killed with its whole process group). Each result is
one line on stdout, `result INDEX OUTCOME SECONDS BASE64-OF-OUTPUT`, printed as soon as the test ends, so that the results of the tests that
finished survive a wall-clock kill of the whole sandbox.

The child's code runs in the same interpreter as the program, so a hostile program can fake its own
outcome (as with any in-process test runner); the sandbox protects the host, not the reward.
"""

import binascii
import errno
import marshal
import os
import resource
import select
import signal
import sys
import time

REPORT_FD = 3
# errno values by which the kernel says a limit was reached: process count (fork), open files,
# file size (Python ignores SIGXFSZ, so an oversized write raises EFBIG), and the scratch tmpfs full.
LIMIT_ERRNOS = {errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.EFBIG, errno.ENOSPC, errno.ENOMEM}


def set_limits(limits):
    cpu = limits["cpu_s"]
    # The soft limit sends SIGXCPU; the hard one, a second later, SIGKILL for a program that catches it.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def outcome_of(exc):
    if isinstance(exc, AssertionError):
        return "failed"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in LIMIT_ERRNOS):
        return "resource_limit"
    return "error"


def child(job, test, out_fd, report_fd):
    """Runs in the forked child: never returns."""
    status = "error"
    me = os.getpid()
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.dup2(report_fd, REPORT_FD)
        os.closerange(REPORT_FD + 1, 1 << 16)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        set_limits(job["limits"])
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(job["program"], "<program>", "exec"), scope)
        exec(compile(test, "<test>", "exec"), scope)
        status = "passed"
    except BaseException as exc:  # noqa: BLE001 - whatever the program raises is its outcome
        status = outcome_of(exc)
        try:
            import traceback  # here, not at the top: only a test that raises pays for it

            # From the program's frames on: the runner's own frame says nothing to the model.
            traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        except BaseException:  # noqa: BLE001 - out of memory or a closed stderr: the outcome still counts
            pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        if os.getpid() == me:  # not the processes the program forked, which end here too
            os.write(REPORT_FD, status.encode())
    finally:
        os._exit(0)


def kill_group(pgid):
    """SIGKILL the test's process group until it is gone (a fork bomb may still be forking)."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.001)


def remove_tree(top):
    """What a test left in its directory (shutil.rmtree without shutil's import time); never follows a
    symlink out of it."""
    for root, dirs, files in os.walk(top, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            path = os.path.join(root, name)
            try:
                os.unlink(path) if os.path.islink(path) else os.rmdir(path)
            except OSError:
                pass
    try:
        os.rmdir(top)
    except OSError:
        pass


def tail(out_fd, cap):
    size = os.fstat(out_fd).st_size
    data = os.pread(out_fd, cap, max(0, size - cap))
    text = data.decode("utf-8", "replace")
    return f"[... {size - cap} bytes cut]\n{text}" if size > cap else text


def judge(report, status, timed_out):
    if timed_out:
        return "timeout", ""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        # SIGKILL we did not send: the CPU hard limit, or the kernel out of memory.
        if sig in (signal.SIGXCPU, signal.SIGKILL, signal.SIGXFSZ):
            return "resource_limit", f"killed by {signal.Signals(sig).name}"
        return "error", f"killed by {signal.Signals(sig).name}"
    if report in ("passed", "failed", "error", "resource_limit"):
        return report, ""
    return "error", f"exited with status {os.waitstatus_to_exitcode(status)} before the test finished"


def run_test(job, index, test):
    cap = job["output_bytes"]
    # Each test works in a fresh directory the runner made, and only that directory is removed after
    # it: the runner deletes nothing it did not create, wherever it is started.
    workdir = os.path.abspath(f"test-{index}-{os.urandom(6).hex()}")
    os.mkdir(workdir, 0o700)
    out_fd = os.open(os.path.join(workdir, ".output"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    read_end, write_end = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.chdir(workdir)
        child(job, test, out_fd, write_end)
    os.close(write_end)
    # The child may not have reached setpgid yet: make the group from here too, so killpg finds it.
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], job["test_timeout_s"])
    timed_out = not ready
    if timed_out:
        os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(pidfd)
    kill_group(pid)  # what the test left running: it must not eat the next test's time and processes
    report = os.read(read_end, 64).decode("ascii", "replace")
    os.close(read_end)
    outcome, note = judge(report, status, timed_out)
    stderr = tail(out_fd, cap)
    os.close(out_fd)
    remove_tree(workdir)
    if note:
        stderr = (stderr + "\n" if stderr else "") + note
    output = binascii.b2a_base64(stderr.encode(), newline=False).decode()
    return f"result {index} {outcome} {time.monotonic() - start:.6f} {output}\n"


def main():
    job = marshal.loads(sys.stdin.buffer.read())
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for index, test in enumerate(job["tests"]):
        out.write(run_test(job, index, test))
        out.flush()


main()
