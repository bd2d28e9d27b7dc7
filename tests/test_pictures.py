"""The plan page (``explain(...).save_html``): one self-contained file whose figures are explain's.

The default tests read the page as HTML; ``test_the_page_opens_in_chromium_...`` (slow) opens it in a real
browser: ``pip install -e .[browser]``, ``apt-get install chromium`` (Debian's), then
``pytest -m slow tests/test_pictures.py``. It fails, never skips, when either is missing.
"""

from __future__ import annotations

import os
import re
from html.parser import HTMLParser

import pytest

import dynshard
from distributed import run_ranks
from dynshard.planning import Plan
from dynshard.planning.costs import memory_at_rest, step_collectives
from dynshard.pictures import Measured, Section, render
from dynshard.pictures.schedule import simulated
from workers_pictures import offline_plans, pages_of_a_job
from workers_plan_files import plan_64_ranks


class Page(HTMLParser):
    """Every start tag's attributes, and the page's text."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def having(self, tag: str, cls: str | None = None, **data) -> list[dict]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in a.get("class", "").split())
                and all(a.get(f"data-{k}") == str(v) for k, v in data.items())]


@pytest.fixture(scope="module")
def offline() -> dict[str, list[Plan]]:
    return {name: [Plan.from_json(text) for text in texts]
            for name, texts in run_ranks(offline_plans, 1, timeout=300)[0].items()}


def assert_self_contained(text: str) -> None:
    assert "<script" not in text.lower() and " src=" not in text and "url(" not in text and "@import" not in text
    assert all(href.startswith("#") for href in re.findall(r'href="([^"]*)"', text))
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


@pytest.mark.parametrize("name", ["tp", "zero3", "hybrid", "autodist"])
def test_the_page_draws_each_plans_memory_and_collectives_as_explain_prints_them(offline, name, tmp_path):
    plans = offline[name]
    path = dynshard.explain(plans).save_html(str(tmp_path / "plan.html"))
    text = open(path).read()
    assert_self_contained(text)
    page = Page(text)
    assert str(dynshard.explain(plans)) in "".join(page.text).replace("\r", "")     # the text it prints, verbatim
    for index, plan in enumerate(plans):
        for row in memory_at_rest(plan):
            drawn = {a["data-part"]: int(a["data-bytes"]) for a in page.having("rect", "part")
                     if a["data-bar"].startswith(row.ranks)}
            assert {k: drawn.get(k, 0) for k in ("parameters", "buffers", "gradients", "optimizer")} == {
                "parameters": row.parameters, "buffers": row.buffers, "gradients": row.gradients,
                "optimizer": row.optimizer}, row.ranks
        predicted = plan.predicted.cost.bytes_per_rank if plan.predicted.cost is not None else None
        if predicted and plan.pipeline is None:     # what the step adds to the bytes at rest, as predicted
            drawn = {a["data-part"]: int(a["data-bytes"]) for a in page.having("rect", "part")}
            assert {k: drawn.get(k, 0) for k in ("gathered", "activations", "transient")} == {
                k: getattr(predicted, k) for k in ("gathered", "activations", "transient")}
        assert predicted, name          # every plan planned with a device profile is priced, hybrid ones too
        drawn = sorted((a["data-kind"], a["data-dim"], int(a["data-count"]), int(a["data-bytes"]))
                       for a in page.having("rect", "collective"))
        assert drawn == sorted((c.kind, c.dim, c.count, c.bytes) for c in step_collectives(plan))
        assert drawn, "every case here communicates"
    if name == "tp":      # the two equal layers fold into one row
        assert {a["data-block"]: a["data-count"] for a in page.having("tr") if "data-block" in a}["blocks.0-1"] == "2"


def test_the_pipeline_schedule_is_the_simulated_one_action_for_action(offline):
    plan, = offline["hybrid"]
    page = Page(dynshard.explain([plan]).to_html())
    schedule, result = simulated(plan)
    actions = page.having("rect", "action")
    assert sorted((a["data-action"], float(a["data-start"])) for a in actions) == sorted(
        (str(action), round(start, 6)) for timeline in result.timeline for start, _, action in timeline)
    assert float(page.having("b", makespan=f"{result.makespan:.6g}")[0]["data-makespan"]) == result.makespan
    # the stage boundary is drawn where the plan says stage 1 starts
    assert f"stage 1 starts at {plan.pipeline.starts[0]}" in "".join(page.text)


def test_autodists_choice_is_drawn_against_every_hand_plan_it_priced(offline):
    plan, = offline["autodist"]
    page = Page(dynshard.explain([plan]).to_html())
    record = plan.predicted.autodist
    peaks = {a["data-plan"]: int(a["data-bytes"]) for a in page.having("rect", "peak")}
    assert peaks == {**{c.plan: c.peak_bytes for c in record.candidates},
                     f"chosen: {record.chosen}": plan.predicted.cost.bytes_per_rank.peak}
    compute = {a["data-plan"]: float(a["data-seconds"]) for a in page.having("rect", "time", part="compute")}
    assert all(compute[c.plan] == pytest.approx(c.compute_seconds, rel=1e-5) for c in record.candidates)
    assert page.having("b", gap=record.gap)
    # the budget is the memory chart's limit, and the chosen plan's bars hold its predicted parts
    drawn = {a["data-part"]: int(a["data-bytes"]) for a in page.having("rect", "part")}
    assert {k: drawn.get(k, 0) for k in ("activations", "transient")} == {
        k: getattr(plan.predicted.cost.bytes_per_rank, k) for k in ("activations", "transient")}
    assert f"limit {record.mem_constraint_gb * 1024 ** 3 / 1024:.3g} KiB" in "".join(page.text)
    # from a running job, the chosen plan's measured step is drawn under its prediction
    section = Section(plan, Measured(step_seconds=0.125))
    measured, = Page(render([section], "job")).having("rect", "measured")
    assert float(measured["data-seconds"]) == 0.125


@pytest.mark.slow
def test_a_64_rank_32_layer_hybrid_page_folds_its_layers_and_stays_small(tmp_path):
    (text, _), = run_ranks(plan_64_ranks, 1, timeout=300)[0]
    plan = Plan.from_json(text)
    path = dynshard.explain([plan]).save_html(str(tmp_path / "plan64.html"))
    assert os.path.getsize(path) < 1_000_000
    page = Page(open(path).read())
    folded = {a["data-block"]: int(a["data-count"]) for a in page.having("tr") if "data-block" in a}
    assert sum(n for block, n in folded.items() if block.startswith("blocks.")) == 32
    assert max(folded.values()) >= 7, folded          # each stage's layers on one row


def test_a_running_jobs_page_shows_what_this_rank_measured_and_its_pipeline_traces(tmp_path):
    result = run_ranks(pages_of_a_job, 2, str(tmp_path), timeout=300)[0]
    page = Page(result["tp_page"])
    assert_self_contained(result["tp_page"])
    measured = {a["data-part"]: int(a["data-bytes"]) for a in page.having("rect", "part")
                if a["data-bar"].startswith("this rank, measured")}
    assert measured["activations"] == result["saved_bytes"] > 0
    assert measured["parameters"] == result["held_bytes"]
    predicted = memory_at_rest(Plan.from_json(result["tp_plan"]))[0]
    assert measured["parameters"] == predicted.parameters       # the plan's bytes are what the rank holds
    assert "as traced on this rank" in "".join(page.text)

    page = Page(result["pipe_page"])
    lanes = {a["data-action"] for a in page.having("rect", "action")}
    assert any(re.fullmatch(r"\d+F\d+", name) for name in lanes)
    text = "".join(page.text)
    assert f"Measured: each rank's latest step from the traces in {tmp_path}" in text
    assert sorted(os.listdir(tmp_path)) == ["dynshard_trace_rank0.json", "dynshard_trace_rank1.json"]
    assert int(page.having("rect", "total", dim="pp")[0]["data-wire"]) == result["p2p_bytes"] > 0
    assert int(page.having("b", sent=result["sent_bytes"])[0]["data-sent"]) > 0
    held = {a["data-part"]: int(a["data-bytes"]) for a in page.having("rect", "part")
            if a["data-bar"].startswith("this rank, measured")}
    plan = Plan.from_json(result["pipe_plan"])
    assert held["parameters"] == memory_at_rest(plan)[0].parameters     # rank 0 holds stage 0's tensors


@pytest.mark.slow
def test_the_page_opens_in_chromium_with_no_console_error_and_no_request(offline, tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser test needs playwright: pip install -e .[browser] (and Debian's chromium)")
    if not os.path.exists("/usr/bin/chromium"):
        pytest.fail("the browser test needs Debian's chromium: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for name, plans in offline.items():
            path = dynshard.explain(plans).save_html(str(tmp_path / f"{name}.html"))
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            messages, requests = [], []
            page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: messages.append(f"error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(f"file://{path}")
            page.wait_for_load_state("load")
            assert messages == [] and requests == [f"file://{path}"], (name, messages, requests)
            # what the browser laid out is what explain counts
            drawn = page.eval_on_selector_all("rect.collective", "els => els.map(e => +e.dataset.bytes)")
            assert sorted(drawn) == sorted(c.bytes for plan in plans for c in step_collectives(plan))
            widths = page.eval_on_selector_all("rect.part", "els => els.map(e => e.getBoundingClientRect().width)")
            assert widths and all(w >= 0 for w in widths) and max(widths) > 10
            page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
            assert os.path.getsize(tmp_path / f"{name}.png") > 10_000
            page.close()
        browser.close()
