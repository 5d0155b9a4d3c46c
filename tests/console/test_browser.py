"""The console in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver (both installed by benchmarks/setup_browser.sh, which `make test` runs), on a live
mini-mesh of real processes (tests/console/conftest.py). The test reads what the page shows, as an
operator would: a pool's version after a publish, the RTT of the relay link, and a pool flagged stale
once its region's gateway is stopped; it saves screenshots beside the test's files."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromedriver are not installed (benchmarks/setup_browser.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1250", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def cell(driver, selector: str) -> str:
    """The text of the first element `selector` finds, or "" when there is none yet. Read in one script
    call: the page re-renders every poll, so an element found by one call may be gone by the next."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : '';", selector)


def test_the_page_shows_a_publish_a_links_rtt_and_a_stale_pool_after_its_gateway_stops(mini_mesh, browser, tmp_path):
    console = mini_mesh.start_console()
    browser.get(console.url)
    version = mini_mesh.publish()
    for pool in ("pool-us", "pool-eu"):
        mini_mesh.wait_for(lambda: cell(browser, f'tr[data-pool="{pool}"] td.version') == f"v{version}", 30,
                           f"{pool} shown on v{version}")
    assert cell(browser, 'tr[data-pool="pool-eu"] td.state').startswith("current")
    rtt = mini_mesh.wait_for(lambda: re.fullmatch(r"\d+\.\d\d / \d+\.\d\d", cell(browser, 'tr[data-link="us->eu"] td.rtt')),
                             30, "the relay link's RTT row")
    assert rtt
    assert mini_mesh.wait_for(lambda: cell(browser, f'div.timeline[data-version="{version}"] .what'), 30,
                              "the version's timeline").startswith("everywhere in")
    assert cell(browser, "#heads") == f"policy: head v{version}"
    browser.save_screenshot(str(tmp_path / "console-live.png"))

    mini_mesh.processes["relay"].stop()  # region eu loses its gateway: pool-eu gets nothing new from now on
    newer = mini_mesh.publish()
    mini_mesh.wait_for(lambda: cell(browser, 'tr[data-pool="pool-us"] td.version') == f"v{newer}", 30,
                       "pool-us on the newer version")
    state = mini_mesh.wait_for(lambda: "stale" in cell(browser, 'tr[data-pool="pool-eu"] td.state')
                               and cell(browser, 'tr[data-pool="pool-eu"] td.state'), 30, "pool-eu flagged stale")
    assert "its gateway does not answer" in state
    assert cell(browser, 'tr[data-pool="pool-eu"] td.version') == f"v{version}"
    assert "not answering" in cell(browser, "#problems")
    mini_mesh.wait_for(lambda: cell(browser, f'div.timeline[data-version="{newer}"] .what').startswith(
        "not yet at eu, pool-eu"), 10, "the newest version's timeline naming where it is missing")
    browser.save_screenshot(str(tmp_path / "console-stale.png"))
    assert (tmp_path / "console-stale.png").stat().st_size > 10_000

    page = browser.page_source + str(browser.get_cookies()) + browser.execute_script(
        "return JSON.stringify(window.localStorage) + document.cookie")
    assert not [name for name, token in mini_mesh.tokens.items() if token in page]
