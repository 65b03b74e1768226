"""The dashboard in a real headless browser (Debian's Chromium), against a real short training run:
live charts that fill in without a reload, then the finished run from its directory alone (charts,
the trajectory viewer's tokens, filters, the group view, export and replay), and two runs compared."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from browser import Lines, canvases, chart_points, chromium, js, serve, stop, wait
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
GROUP = 4


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Lines, str, Path]]:
    """`slime-async train` of the embedded default, short (as tests/e2e does), dashboard on a free port."""
    run_dir = tmp_path_factory.mktemp("runs")
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_async.cli", "train", str(REPO / "configs/local.yaml"), "--overwrite",
         f"run.dir={run_dir}", "rollout.batch_size=8", f"rollout.group_size={GROUP}",
         "rollout.filter_equal_rewards=false", "rollout.sampling.max_new_tokens=16", "engine.port=0",
         "warmstart.stages=[]", "warmstart.examples=64", "warmstart.check_tasks=8", "warmstart.min_success=0",
         "data.eval_every=0", "train.steps=12", "log.dashboard_port=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True)
    lines = Lines(proc)
    try:
        url = lines.expect(r"dashboard: (http://127\.0\.0\.1:\d+/)", timeout=120).group(1)
        yield proc, lines, url, run_dir / "local"
    finally:
        stop(proc)


def test_the_dashboard_of_a_live_run_fills_in_without_a_reload(training, browser: WebDriver) -> None:
    proc, lines, url, _ = training
    browser.get(url)  # printed before the warm-start: no step yet
    wait(browser, lambda d: len(chart_points(d)) >= 8, what="chart cards")
    assert js(browser, "return document.querySelector('.badge').textContent") == "live"
    wait(browser, lambda d: chart_points(d)["reward"] > 0 and canvases(d) >= 4, timeout=240,
         what="the first trainer step on the reward chart")
    first = chart_points(browser)["steptime"]
    wait(browser, lambda d: chart_points(d)["steptime"] > first, timeout=120, what="a later step, same page")
    assert js(browser, "return performance.getEntriesByType('navigation').length") == 1  # never reloaded
    wait(browser, lambda d: "trainer" in d.find_element(By.ID, "health").text, what="the processes' health")
    health = browser.find_element(By.ID, "health").text
    assert "rollout-0" in health and "engine-0" in health and "running" in health
    books = browser.find_element(By.ID, "books").text
    assert "received" in books and "DOES NOT ADD UP" not in books
    proc.wait(timeout=300)
    assert proc.returncode == 0, lines.text()[-3000:]
    assert "dashboard stopped" in lines.text()


@pytest.fixture(scope="module")
def finished(training) -> Iterator[tuple[str, Path]]:
    proc, _, _, run = training
    proc.wait(timeout=400)
    server, url, _ = serve(run, cwd=REPO)
    yield url, run
    stop(server)


def api(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def rows(d: WebDriver) -> list:
    return d.find_elements(By.CSS_SELECTOR, "[data-testid=row]")


def shown_total(d: WebDriver) -> int:
    text = d.find_element(By.ID, "count").text  # "1–50 of 96 trajectories"
    return int(text.split(" of ")[1].split()[0]) if " of " in text else 0


def test_a_finished_run_opens_from_its_directory_with_charts_and_the_viewer(finished, browser: WebDriver) -> None:
    url, run = finished
    browser.get(url)
    wait(browser, lambda d: canvases(d) >= 7, what="charts")
    points = chart_points(browser)
    for chart in ("reward", "heldout", "steptime", "throughput", "staleness", "publish", "buffer"):
        assert points[chart] > 0, (chart, points)
    assert js(browser, "return document.querySelector('.badge').textContent") == "finished"

    browser.find_element(By.ID, "tab-trajectories").click()
    total = api(url, "api/runs/0/trajectories?limit=1")["total"]
    assert total == 12 * 8  # every trained trajectory: 12 steps of 8
    wait(browser, lambda d: shown_total(d) == total and len(rows(d)) == 50, what="the first page")
    browser.find_element(By.ID, "next").click()
    wait(browser, lambda d: len(rows(d)) == total - 50, what="the second page")

    first = rows(browser)[0]
    traj = api(url, f"api/runs/0/trajectories/{first.get_attribute('data-id')}")
    first.click()
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-id") == traj["id"], what="detail")
    tokens = browser.find_elements(By.CSS_SELECTOR, "[data-testid=token]")
    assert len(tokens) == traj["completion_tokens"] > 0
    assert all("logprob" in t.get_attribute("title") and "version" in t.get_attribute("title") for t in tokens)
    by_mask = [t.value_of_css_property("background-color") for t in tokens]
    browser.find_element(By.ID, "colour-logprob").click()
    wait(browser, lambda d: [t.value_of_css_property("background-color") for t in
                             d.find_elements(By.CSS_SELECTOR, "[data-testid=token]")] != by_mask, what="recolour")
    assert f"slime-async replay {run}/exports/{traj['id']}.json" in browser.find_element(By.ID, "detail").text

    browser.find_element(By.CSS_SELECTOR, "[data-testid=group-button]").click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "[data-testid=group-sample]")) >= GROUP,
         what="the group view")
    assert "advantage" in browser.find_element(By.CSS_SELECTOR, "[data-testid=group]").text


def test_filters_narrow_the_list_as_the_store_says(finished, browser: WebDriver) -> None:
    url, _ = finished
    browser.get(url + "#trajectories")
    wait(browser, lambda d: len(rows(d)) > 0, what="rows")
    task = rows(browser)[0].find_elements(By.TAG_NAME, "td")[1].get_attribute("title")
    browser.find_element(By.ID, "f-task").send_keys(task)
    browser.find_element(By.ID, "f-apply").click()
    expected = api(url, f"api/runs/0/trajectories?task_id={task}")["total"]
    assert expected >= GROUP
    wait(browser, lambda d: shown_total(d) == expected and len(rows(d)) == expected, what="the task's rows")
    assert {r.find_elements(By.TAG_NAME, "td")[1].get_attribute("title") for r in rows(browser)} == {task}

    browser.find_element(By.ID, "f-clear").click()
    facets = api(url, "api/runs/0/facets")["stop_reasons"]
    reason = min(facets, key=facets.get)
    wait(browser, lambda d: reason in [o.get_attribute("value") for o in
                                       d.find_element(By.ID, "f-stop").find_elements(By.TAG_NAME, "option")],
         what="stop reasons")
    Select(browser.find_element(By.ID, "f-stop")).select_by_value(reason)
    browser.find_element(By.ID, "f-apply").click()
    wait(browser, lambda d: shown_total(d) == facets[reason], what=f"only {reason}")
    assert {r.find_elements(By.TAG_NAME, "td")[5].text for r in rows(browser)} == {reason}

    browser.find_element(By.ID, "f-clear").click()
    some = api(url, "api/runs/0/trajectories?limit=1")["rows"][0]["id"]
    prompt = api(url, f"api/runs/0/trajectories/{some}")["turns"][0]["prompt_text"].split("What is ")[1].split("?")[0]
    browser.find_element(By.ID, "f-text").send_keys(prompt)
    browser.find_element(By.ID, "f-apply").click()
    expected = api(url, f"api/runs/0/trajectories?text={urllib.request.quote(prompt)}")["total"]
    wait(browser, lambda d: shown_total(d) == expected and len(rows(d)) == expected, what="text search")
    assert all(prompt in r.text for r in rows(browser))


def test_an_exported_trajectory_replays_through_its_env(finished, tmp_path: Path) -> None:
    url, run = finished
    traj_id = api(url, "api/runs/0/trajectories?limit=1")["rows"][0]["id"]
    doc = api(url, f"api/runs/0/export/{traj_id}")  # what the viewer's export link does
    exported = run / "exports" / f"{traj_id}.json"
    assert json.loads(exported.read_text()) == doc

    def replay(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slime_async.cli", "replay", str(exported), *extra],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    same = replay()
    assert same.returncode == 0 and "the env behaves as recorded" in same.stdout, same.stdout + same.stderr
    # an env change: the reward now says every answer is right
    (tmp_path / "changed_env.py").write_text(
        "from typing import Any\nfrom envs.calculator import CalculatorEnv\nfrom slime_async.env import reward\n\n\n"
        "class AlwaysRight(CalculatorEnv):\n    @reward(inline=True)\n"
        "    def correct(self, completion: str, answer: Any) -> float:\n        return 1.0\n")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["env"]["name"] = "changed_env:AlwaysRight"
    cfg["run"]["python_path"] = [str(tmp_path)]
    (tmp_path / "changed.yaml").write_text(yaml.safe_dump(cfg))
    changed = replay("--config", str(tmp_path / "changed.yaml"))
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert f"rewards: recorded {doc['trajectory']['reward']:g}" in changed.stdout and "now 1 {'correct': 1.0}" in \
        changed.stdout
    bad = replay("--config", str(tmp_path / "nowhere.yaml"))
    assert bad.returncode == 2 and "nowhere.yaml" in bad.stderr


def test_two_runs_are_compared_on_the_same_charts(finished, browser: WebDriver, tmp_path: Path) -> None:
    _, run = finished
    other = tmp_path / "other"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("checkpoints", "weights", "tensorboard"))
    server, url, _ = serve(run, other, cwd=REPO)
    try:
        browser.get(url)
        wait(browser, lambda d: canvases(d) >= 7, what="charts")
        assert len(browser.find_elements(By.CSS_SELECTOR, ".run-chip")) == 2
        legend = browser.find_element(By.ID, "chart-reward").text
        assert "local: reward" in legend and "other: reward" in legend
        assert chart_points(browser)["reward"] == 2 * 12
    finally:
        stop(server)
