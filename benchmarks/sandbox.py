"""Executions per second of the sandbox for model-written code: bubblewrap vs a plain subprocess.

Two workloads: a trivial passing program (one assert), and a HumanEval-sized one (HumanEval/0,
`has_close_elements`, with its canonical solution and its `check` function of 7 asserts, run as one
test the way HumanEval scores). Three modes, taking turns within each repeat so that they see the same
background load: "sandboxed" (isolation "bwrap": user, PID, network and mount namespaces, the
unprivileged uid), "plain" (isolation "rlimits": the same runner, rlimits and uid in a plain
subprocess, no namespaces) and "bare" (`python -I -S -B -c program+tests` in a subprocess: no runner,
no limits; the floor). Each repeat runs `--executions` executions per workload and mode through one
Sandbox with `--workers` at once; reported: the median executions/s over the repeats, and
sandboxed / plain. Targets (issue 19): sandboxed >= 0.5x plain and >= 20 executions/s on 2 cores.

    .venv/bin/python benchmarks/sandbox.py [--executions 80] [--workers 4] [--repeats 3] [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

from common import bench_parser, emit, parse_bench_args

from deltamesh.mesh.sandbox import Sandbox, SandboxConfig

HUMANEVAL_0 = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True

    return False
'''
HUMANEVAL_0_CHECK = '''def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False


check(has_close_elements)
'''
WORKLOADS = {
    "trivial": ("def f():\n    return 1\n", ["assert f() == 1"]),
    "humaneval": (HUMANEVAL_0, [HUMANEVAL_0_CHECK]),
}
MODES = ("sandboxed", "plain", "bare")
ISOLATION = {"sandboxed": "bwrap", "plain": "rlimits"}


async def _bare(python: str, program: str, tests: list[str], slots: asyncio.Semaphore) -> bool:
    async with slots:
        proc = await asyncio.create_subprocess_exec(python, "-I", "-S", "-B", "-c", "\n".join([program, *tests]),
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return await proc.wait() == 0


async def executions_per_s(mode: str, sandboxes: dict[str, Sandbox], workload: str, n: int, workers: int) -> float:
    program, tests = WORKLOADS[workload]
    started = time.perf_counter()
    if mode == "bare":
        slots = asyncio.Semaphore(workers)
        python = sandboxes["plain"].config.python
        ok = await asyncio.gather(*(_bare(python, program, tests, slots) for _ in range(n)))
    else:
        results = await asyncio.gather(*(sandboxes[mode].run(program, tests) for _ in range(n)))
        ok = [r.passed for r in results]
    seconds = time.perf_counter() - started
    if not all(ok):
        raise RuntimeError(f"{mode} {workload}: {ok.count(False)} of {n} executions did not pass")
    return n / seconds


async def measure(args: Any) -> dict[str, Any]:
    sandboxes = {mode: Sandbox(SandboxConfig(isolation=iso, workers=args.workers)) for mode, iso in ISOLATION.items()}
    runs: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in WORKLOADS}
    for mode in MODES:  # warm-up: page cache, first namespace set-up
        await executions_per_s(mode, sandboxes, "trivial", args.workers, args.workers)
    for _ in range(args.repeats):
        for workload in WORKLOADS:
            for mode in MODES:
                runs[workload][mode].append(await executions_per_s(mode, sandboxes, workload, args.executions,
                                                                   args.workers))
    rows = {}
    for workload, by_mode in runs.items():
        medians = {mode: statistics.median(values) for mode, values in by_mode.items()}
        rows[workload] = {**{f"{m}_per_s": round(v, 1) for m, v in medians.items()},
                          "sandboxed_over_plain": round(medians["sandboxed"] / medians["plain"], 2),
                          "sandboxed_over_bare": round(medians["sandboxed"] / medians["bare"], 2),
                          "runs": {m: [round(v, 1) for v in values] for m, values in by_mode.items()}}
    return {"workloads": rows, "executions": args.executions, "workers": args.workers, "repeats": args.repeats}


def print_table(result: dict[str, Any]) -> None:
    print(f"sandbox executions/s (median of {result['repeats']}; {result['executions']} executions, "
          f"{result['workers']} at once; {result['cores']} cores, load {result['load_before']} -> "
          f"{result['load_after']})")
    print(f"{'workload':<10} {'sandboxed':>10} {'plain':>8} {'bare':>8} {'sandboxed/plain':>16} {'sandboxed/bare':>15}")
    for name, row in result["workloads"].items():
        print(f"{name:<10} {row['sandboxed_per_s']:>10} {row['plain_per_s']:>8} {row['bare_per_s']:>8} "
              f"{row['sandboxed_over_plain']:>16} {row['sandboxed_over_bare']:>15}")
    print("targets: sandboxed >= 0.5x plain and >= 20 executions/s on 2 cores")


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, quick="20 executions per workload and mode", repeats="repeats of each measurement")
    p.add_argument("--executions", type=int, default=80, help="executions per workload, mode and repeat")
    p.add_argument("--workers", type=int, default=4, help="executions at once (the sandbox's workers)")
    args = parse_bench_args(p, argv)
    if args.quick:
        args.executions = 20
    load_before = os.getloadavg()
    result = asyncio.run(measure(args))
    result.update(cores=os.cpu_count(), load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in os.getloadavg()])
    emit(result, args, print_table)


if __name__ == "__main__":
    main()
