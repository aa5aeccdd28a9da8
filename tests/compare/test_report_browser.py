"""`harness report` read as a person reads it: a real failing run (a precision fault planted in a real
model, `harness run` in a subprocess), the report opened from file:// in Debian's headless Chromium
(driven by selenium), a screenshot taken, and the page's *visible* text (innerText, not the HTML
source) checked for the failing item, its message and the module it names; the per-layer plot must
be an image the browser decoded (naturalWidth > 0). A passing run's report shows the matrix.

Chromium and chromedriver come from Debian (`apt-get install chromium chromium-driver`; .ci/run
installs them). Without them this fails in CI (CI=true) and skips elsewhere, with one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO_SUITES, TINY_PRUNE

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]  # tests/: faulty_models.py
HARNESS = str(Path(sys.executable).with_name("harness"))
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000"]


def _missing(what: str) -> None:
    msg = f"{what}: apt-get install -y chromium chromium-driver (.ci/run does), pip install selenium ('.[test]')"
    if os.environ.get("CI"):
        pytest.fail(f"the browser test cannot run in CI: {msg}", pytrace=False)
    pytest.skip(f"no browser here ({msg})")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    # Debian's chromium; a GitHub-hosted Ubuntu runner ships Google Chrome with its chromedriver instead
    chromium = next(filter(None, map(shutil.which, ("chromium", "google-chrome", "google-chrome-stable"))), None)
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        _missing("chromium or chromedriver not on PATH")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium not installed")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium  # Debian's build: selenium must not go looking for (downloading) one
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    b = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    try:
        yield b
    finally:
        b.quit()


def _suite(adapter: str | None) -> str:
    model = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + (f'adapter = "{adapter}"\n' if adapter else "")
    return 'backends = ["cpu"]\ndtypes = ["float32"]\n' + model + TINY_PRUNE


def _harness(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200", "HARNESS_CONFIG": str(project / "harness.toml"),
                        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([HARNESS, *args], cwd=project, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """Two tiny Llama suites with goldens made here: ``bad`` (layer 1's MLP 2 % off outside float64,
    faulty_models.low_precision_mlp) and ``good``."""
    p = tmp_path_factory.mktemp("report-project")
    shutil.copytree(REPO_SUITES / "configs", p / "suites" / "configs")
    (p / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\n')
    (p / "suites" / "bad.toml").write_text(_suite("faulty_models:low_precision_mlp"))
    (p / "suites" / "good.toml").write_text(_suite(None))
    r = _harness(p, "golden", "generate", "bad", "good")
    assert r.returncode == 0, r.stdout + r.stderr
    return p


def _run_and_report(project: Path, name: str, *suites: str) -> tuple[subprocess.CompletedProcess, Path]:
    # precision, training and the dynamic-cache decode: a few items, one plot kind each
    run = _harness(project, "run", *suites, "-c", "precision", "-c", "training", "-c", "decode",
                   "-k", "not decode or dynamic", "--results", f"res-{name}")
    page = project / f"{name}.html"
    r = _harness(project, "report", f"res-{name}", "--history", "", "-o", str(page), "--title", f"{name} run")
    assert r.returncode == 0, r.stdout + r.stderr
    return run, page


def _open(browser, page: Path, shot: Path) -> str:
    browser.get(page.as_uri())
    # the whole page in one screenshot: the window as tall as the document
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(max(int(height), 800), 12000))
    assert browser.save_screenshot(str(shot)), f"no screenshot written to {shot}"
    return browser.find_element("tag name", "body").text  # what is rendered and visible, not the source


def test_failing_run_report_shows_the_failure_its_module_and_plots(browser, project, tmp_path):
    run, page = _run_and_report(project, "failing", "bad", "good")
    assert run.returncode == 1, run.stdout + run.stderr  # the planted fault fails the run
    shot = tmp_path / "report-failing.png"
    text = _open(browser, page, shot)
    assert shot.stat().st_size > 20_000, shot.stat().st_size  # a rendered page, not a blank one

    assert "1 failed, 0 errors" in text, text[:2000]
    assert "suites.bad.toml::precision[cpu-float32]" in text, text[:3000]
    assert "model.layers.1.mlp diverges from the golden" in text  # the failure message
    assert "first divergent module: model.layers.1.mlp" in text  # the module it names
    # the matrix, every row, with the precision headline
    for row in ("bad precision cpu float32 failed isolated_worst_budget_use=",
                "good precision cpu float32 passed isolated_worst_budget_use=",
                "good training cpu float32 passed training_backward_worst_budget_use="):
        assert row in " ".join(text.replace("\t", " ").split()), row
    # the plots: the failing item's error per layer against its budget, decoded by the browser
    imgs = browser.find_elements("css selector", "img[alt='rel RMSE per layer vs its tolerance']")
    assert imgs, "no per-layer plot on the page"
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", imgs[0]) > 0
    for alt in ("budget use per module", "training trajectory inside its envelope", "decode budget use per step"):
        shown = browser.find_elements("css selector", f"img[alt='{alt}']")
        assert shown and all(browser.execute_script("return arguments[0].naturalWidth", i) > 0 for i in shown), alt
    # the log is there but collapsed: its text is not visible until opened
    log = browser.find_element("xpath", "//details[summary[text()='log']]")
    assert log.get_attribute("open") is None and "isolated" not in log.find_element("tag name", "pre").text


def test_passing_run_report_shows_the_matrix(browser, project, tmp_path):
    run, page = _run_and_report(project, "passing", "good")
    assert run.returncode == 0, run.stdout + run.stderr
    text = _open(browser, page, tmp_path / "report-passing.png")
    flat = " ".join(text.split())
    assert "all items passed" in flat and "No item failed." in flat
    for check in ("precision", "training", "decode"):
        assert f"good {check} cpu float32 passed" in flat, check
    assert "Matrix: suite x check x backend x dtype (3 rows)" in flat
