"""A real headless browser for the dashboard's tests: Debian's Chromium driven by Selenium through
Debian's chromedriver (`make test` installs both; Selenium's own driver download is never used)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium(width: int = 1500, height: int = 1000) -> WebDriver:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    assert not missing, f"{missing} not installed: `make browser` (apt-get install chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def wait(driver: WebDriver, condition, timeout: float = 60, what: str = "") -> object:
    """Wait (bounded) until `condition(driver)` is truthy; on timeout say what and show the page's errors."""
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition)
    except Exception as exc:
        logs = [e["message"] for e in driver.get_log("browser")]
        banner = driver.execute_script("return document.getElementById('error')?.textContent")
        raise AssertionError(f"timed out waiting for {what}; page error banner: {banner!r}; console: {logs}") from exc


def js(driver: WebDriver, script: str) -> object:
    return driver.execute_script(script)


def chart_points(driver: WebDriver) -> dict[str, int]:
    """Points drawn by each chart (the page records them on its card), by chart id."""
    return js(driver, "return Object.fromEntries([...document.querySelectorAll('[data-testid=chart]')]"
                      ".map(c => [c.id.slice(6), Number(c.dataset.points || 0)]))")  # type: ignore[return-value]


def canvases(driver: WebDriver) -> int:
    return js(driver, "return document.querySelectorAll('#chart-grid canvas').length")  # type: ignore[return-value]


class Lines:
    """A child process's output lines, read on a thread; `expect` waits (bounded) for a pattern."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line)
                self._new.notify_all()
        with self._new:
            self.lines.append("")  # end of output
            self._new.notify_all()

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        regex = re.compile(pattern)
        seen = 0
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    if match := regex.search(line):
                        return match
                seen = len(self.lines)
                if self.lines and self.lines[-1] == "":
                    raise AssertionError(f"exited before printing {pattern!r}:\n{''.join(self.lines[-40:])}")
                if not self._new.wait(timeout):
                    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{''.join(self.lines[-40:])}")

    def text(self) -> str:
        return "".join(self.lines)


def serve(*runs: Path, cwd: Path) -> tuple[subprocess.Popen, str, Lines]:
    """`slime-async dashboard RUN ... --port 0` as a process; its URL once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "slime_async.cli", "dashboard", *map(str, runs), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    lines = Lines(proc)
    return proc, lines.expect(r"(http://127\.0\.0\.1:\d+/)").group(1), lines


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def screenshots(driver: WebDriver, url: str, out: Path) -> list[Path]:
    """The README's pictures: the charts, a trajectory's tokens, a group (docs/images/)."""
    from selenium.webdriver.common.by import By

    out.mkdir(parents=True, exist_ok=True)
    driver.get(url)
    wait(driver, lambda d: canvases(d) >= 6, what="charts")
    shots = [out / "dashboard-charts.png"]
    driver.save_screenshot(str(shots[-1]))
    driver.find_element(By.ID, "tab-trajectories").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=row]"), what="rows")
    driver.find_element(By.ID, "f-text").send_keys("tool_response")
    driver.find_element(By.ID, "f-apply").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=row]"), what="rows")
    driver.find_elements(By.CSS_SELECTOR, "[data-testid=row]")[0].click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=token]"), what="tokens")
    driver.find_element(By.ID, "colour-version").click()
    shots.append(out / "dashboard-trajectory.png")
    driver.save_screenshot(str(shots[-1]))
    driver.find_element(By.CSS_SELECTOR, "[data-testid=group-button]").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "[data-testid=group-sample]"), what="group")
    shots.append(out / "dashboard-group.png")
    driver.save_screenshot(str(shots[-1]))
    return shots


if __name__ == "__main__":  # python tests/dashboard/browser.py URL OUT_DIR: the README's screenshots
    drv = chromium(1500, 950)
    try:
        print(screenshots(drv, sys.argv[1], Path(sys.argv[2])))
    finally:
        drv.quit()
