"""The interactive report opened in headless Chromium: the plotly plots render, offline, and hovering shows a run.

Skipped only when no Chromium is installed and ``CI`` is not set; in CI (``CI=true``) a missing
browser fails the test (CI installs Debian's ``chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from analysis.render import html_report
from analysis.report import build_report
from analysis.runs import read_sweep_record
from sweep_record import TrialSpec, counts, record_sweep

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# a hover is what the user does first: trigger one on the first point of the main plot once the page loaded
HOVER_SCRIPT = """
<script>
window.addEventListener("load", function () {
  var plot = document.querySelector("#score-vs-params .js-plotly-plot");  // the search trials' plot
  Plotly.Fx.hover(plot, [{curveNumber: 0, pointNumber: 0}]);
  document.body.setAttribute("data-test-hovered", "yes");
});
</script>
"""


def find_browser() -> str:
    browser = os.environ.get("PEFTUNE_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no Chromium is installed (apt-get install -y chromium)")
        pytest.skip("no Chromium installed (apt-get install -y chromium); CI runs this test")
    return browser


def dump_dom(browser: str, page, profile) -> str:
    """The DOM after the page's scripts ran (``--virtual-time-budget`` lets timers and rendering finish)."""
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=15000",
        "--dump-dom",
        page.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_report_html_renders_in_chromium(tmp_path):
    browser = find_browser()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    scores = {"frozen": 0.3, "lora": 0.6, "adapter": 0.65, "bitfit": 0.5}
    trials = [
        TrialSpec(
            f"t{i}",
            method,
            {"rank": 8} if method == "lora" else {"bottleneck": 16} if method == "adapter" else {},
            [{"sst_accuracy": s - 0.1, "para_accuracy": s + 0.1, "sts_pearson": s}],
            counts([0, 2_000, 9_000, 1_000][i]),
        )
        for i, (method, s) in enumerate(scores.items())
    ]
    trials.append(
        TrialSpec(
            "t9",
            "lora",
            {"rank": 64},
            [{"sst_accuracy": 0.2, "para_accuracy": 0.4, "sts_pearson": 0.3}],
            counts(16_000),
            status="early_stopped",
        )
    )
    _, _, run_ids = record_sweep(uri, "html_sweep", ["sst", "para", "sts"], trials, artifact_dir=tmp_path / "art")
    report = build_report(read_sweep_record("html_sweep", uri))
    page = tmp_path / "report.html"
    page.write_text(html_report(report) + HOVER_SCRIPT, encoding="utf-8")

    text = page.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]+src=", text), "plotly.js must be inlined: the page has to work offline"
    assert text.count("plotly.js v") >= 1

    dom = dump_dom(browser, page, tmp_path / "profile")
    assert 'data-test-hovered="yes"' in dom, "the page's scripts did not run to the end"
    # plotly drew its SVG for the score plot, the three task plots and the importance bars
    assert dom.count('class="main-svg"') >= 5
    # one drawn marker per plotted trial in each of the four scatter plots, plus the reference diamonds
    assert dom.count('class="point"') >= 4 * len(trials)
    assert "Best configuration per method and size" in dom
    # hovering the first point (frozen) shows its hyperparameters and its MLflow run id
    hover = dom[dom.index('class="hovertext"') :][:4000]
    assert "frozen" in hover and "lr: 0.001" in hover and f"run {run_ids['t0']}" in hover
