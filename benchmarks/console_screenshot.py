"""The README's picture of the web console: `deltamesh demo` runs, and once its trainer has made
`--after-steps` steps, headless chromium (benchmarks/setup_browser.sh) takes a screenshot of the
demo's console; then the demo is stopped with Ctrl-C (SIGINT), as a user would.

    .venv/bin/python benchmarks/console_screenshot.py --out docs/figures/console-demo.png
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/figures/console-demo.png", help="where the PNG goes")
    p.add_argument("--steps", type=int, default=300, help="the demo's steps (it is stopped before its end)")
    p.add_argument("--after-steps", type=int, default=25, help="trainer steps made before the picture")
    p.add_argument("--width", type=int, default=1500)
    p.add_argument("--height", type=int, default=1350)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    args = parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="console-shot-")) / "run"
    deltamesh = str(Path(sys.executable).with_name("deltamesh"))
    demo = subprocess.Popen([deltamesh, "demo", "--plain", "--steps", str(args.steps), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        while url is None:
            line = demo.stdout.readline()
            if not line:
                raise SystemExit("the demo ended before it printed its console's URL")
            found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        steps = run_dir / "trainer" / "policy.steps.jsonl"
        deadline = time.monotonic() + 600
        while not (steps.exists() and len(steps.read_text().splitlines()) >= args.after_steps):
            if demo.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the demo's trainer did not reach the steps asked for")
            time.sleep(0.5)
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size={args.width},{args.height}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            driver.get(url)
            time.sleep(4)  # a few of the page's polls: rates and timelines filled in
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
        print(f"{args.out}: the console at {url} after {args.after_steps} trainer steps")
    finally:
        demo.send_signal(signal.SIGINT)
        demo.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
