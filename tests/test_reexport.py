"""agent.http.reexport: vLLM's /metrics relabelled (real captured page, hostile pages, a real
Prometheus); the fetch around it is tests/test_upstream.py's."""

from __future__ import annotations

import http.server
import math
import random
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.http.reexport import (
    PageError,
    Relabeller,
    registry_names,
    relabel_page,
)
from agent.http.upstream import UpstreamMetrics
from tests.conftest import require
from tests.infra.prometheus import (
    PrometheusServer,
    promtool_binary,
    promtool_check_metrics,
    write_targets,
)
from tests.kit.metrics import BAD_PAGES, OPENMETRICS_PAGE, PAGES, PREFILL_LABELS, VLLM_PAGE

DROPPED = ("process_", "python_", "http_")

Key = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Key, float]:
    """Every sample client_python's parser sees: (name, labels) -> value."""
    found: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in found, f"duplicate series {key}"
            found[key] = s.value
    return found


def same(a: float, b: float) -> bool:
    """Equal values, NaN included."""
    return (math.isnan(a) and math.isnan(b)) or a == b


def promtool_errors(text: str) -> str:
    """promtool's parse errors for ``text`` ("" when it parses; lint findings are fine)."""
    require(promtool_binary() is not None, "promtool not installed (Debian package prometheus)")
    code, output = promtool_check_metrics(text)
    if code in (0, 3) and "error while linting" not in output:
        return ""
    return f"exit {code}: {output[-2000:]}"


# --- the captured vLLM page ------------------------------------------------------------------


def test_captured_page_is_genuine() -> None:
    """The fixture is what vLLM 0.32 serves: ~600 lines, 39 vllm: families, promtool-clean."""
    page = VLLM_PAGE.read_text()
    families = {f.name: f.type for f in text_string_to_metric_families(page)}
    vllm = {n for n in families if n.startswith("vllm:") and not n.endswith("_created")}
    assert len(vllm) == 39
    assert families["vllm:time_to_first_token_seconds"] == "histogram"
    assert families["vllm:prompt_tokens"] == "counter"
    assert any(n.startswith(DROPPED) for n in families)
    assert promtool_errors(page) == ""


def test_every_vllm_sample_kept_with_our_labels() -> None:
    """Output samples are exactly upstream's vllm: samples plus role/node/slurm_job_id."""
    page = VLLM_PAGE.read_text()
    out = relabel_page(page, PREFILL_LABELS)
    expected = {
        (name, labels | frozenset(PREFILL_LABELS.items())): value
        for (name, labels), value in samples(page).items()
        if name.startswith("vllm:")
    }
    got = samples(out)
    assert got.keys() == expected.keys()
    assert all(same(got[k], v) for k, v in expected.items())
    assert len(got) > 300


def test_families_keep_names_types_and_help() -> None:
    """Same vllm: family names (colons kept), types and HELP; TYPE lines match sample names."""
    page = VLLM_PAGE.read_text()
    out = relabel_page(page, PREFILL_LABELS)
    before = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(page)}
    after = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(out)}
    assert after == {n: v for n, v in before.items() if n.startswith("vllm:")}
    assert "# TYPE vllm:prompt_tokens_total counter\n" in out
    assert "# TYPE vllm:time_to_first_token_seconds histogram\n" in out
    assert (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny",role='
        in out
    )
    typed = {line.split()[2] for line in out.splitlines() if line.startswith("# TYPE")}
    for line in out.splitlines():
        if not line.startswith("#"):
            name = line.split("{", 1)[0]
            assert name in typed or name.rsplit("_", 1)[0] in typed, line


def test_output_parses_in_promtool() -> None:
    """promtool finds no parse error in the relabelled real page."""
    assert promtool_errors(relabel_page(VLLM_PAGE.read_text(), PREFILL_LABELS)) == ""


def test_upstream_process_python_http_families_dropped() -> None:
    """They describe vLLM's API process only and clash with the agent's own."""
    out = relabel_page(VLLM_PAGE.read_text(), PREFILL_LABELS)
    names = {f.name for f in text_string_to_metric_families(out)}
    assert not [n for n in names if n.startswith(DROPPED)]
    for prefix in DROPPED:
        assert f"\n{prefix}" not in out
        assert f" {prefix}" not in out


def test_our_label_values_are_escaped() -> None:
    """Backslash, quote and newline in our values survive promtool and the parser."""
    tricky = {"role": "prefill", "node": 'a\\b"c\nd', "slurm_job_id": ""}
    out = relabel_page(VLLM_PAGE.read_text(), tricky)
    assert promtool_errors(out) == ""
    for _, labels in samples(out):
        assert dict(labels)["node"] == 'a\\b"c\nd'


def test_bad_label_names_refused() -> None:
    """Adding job/instance/le or an invalid name is a programming error, caught at once."""
    for labels in ({"job": "x"}, {"instance": "x"}, {"le": "1"}, {"no-dash": "x"}, {"__x": "y"}):
        with pytest.raises(ValueError, match="label"):
            UpstreamMetrics("http://127.0.0.1:1/metrics", labels)
        with pytest.raises(ValueError, match="label"):
            relabel_page("", labels)


# --- odd but valid pages -----------------------------------------------------------------------


def test_odd_but_valid_page() -> None:
    """Escapes, spacing, timestamps, summaries, untyped samples: all kept and re-escaped."""
    out = relabel_page((PAGES / "odd-but-valid.txt").read_text(), PREFILL_LABELS)
    assert promtool_errors(out) == ""
    got = samples(out)
    values = {n: {k: v for k, v in labels if k not in PREFILL_LABELS} for n, labels in got}
    odd = [dict(labels) for n, labels in got if n == "vllm:odd_labels"]
    assert {
        "path": "C:\\dir\\file",
        "quote": 'say "hi"',
        "multi": "line1\nline2",
        "utf8": "Grüße ✓",
        **PREFILL_LABELS,
    } in odd
    assert {"spaced": "yes", "trailing": "comma", **PREFILL_LABELS} in odd
    assert "vllm:counted_total" in values
    assert "vllm:untyped_thing" in values
    assert "vllm:counted_total{" in out
    assert "} 5 1700000000000\n" in out
    assert "# TYPE vllm:untyped_thing untyped\n" in out
    assert "# TYPE vllm:never_observed counter\n" in out
    assert "Label values with a backslash \\\\ and a newline \\n in HELP." in out
    assert not [n for n in values if n.startswith(DROPPED)]


def test_upstream_job_instance_and_our_labels_renamed() -> None:
    """Upstream job/instance/role/node/slurm_job_id move to upstream_*; ours win; no clash."""
    out = relabel_page((PAGES / "odd-but-valid.txt").read_text(), PREFILL_LABELS)
    renamed = {
        "upstream_upstream_job": "vllm",  # upstream_job was taken by upstream itself
        "upstream_job": "x",
        "upstream_instance": "10.0.0.1:8000",
        "upstream_role": "decode",
        "upstream_node": "other",
        "upstream_slurm_job_id": "7",
        **PREFILL_LABELS,
    }
    got = samples(out)
    assert ("vllm:odd_labels", frozenset(renamed.items())) in got
    for _, labels in got:
        names = {k for k, _ in labels}
        assert not names & {"job", "instance"}
        assert {k: v for k, v in labels if k in PREFILL_LABELS} == PREFILL_LABELS


def test_samples_before_their_type_are_regrouped() -> None:
    """promtool refuses a TYPE after samples; the output puts HELP/TYPE first."""
    page = 'x_a 1\n# TYPE x_b gauge\nx_b 1\nx_a{k="v"} 2\n# HELP x_b B.\n'
    out = relabel_page(page, PREFILL_LABELS)
    assert promtool_errors(out) == ""
    assert out.index("# HELP x_b B.") < out.index("# TYPE x_b gauge") < out.index("x_b{")
    assert out.count("# TYPE x_a untyped") == 1


def test_empty_page_is_empty() -> None:
    """An empty upstream page is valid and re-exports nothing."""
    assert relabel_page("", PREFILL_LABELS) == ""


# --- the relabeller: the next page of the same shape --------------------------------------------


def outcome(relabel: Callable[[str], str], page: str) -> str:
    """What relabelling ``page`` gives: the text, or the PageError's message."""
    try:
        return relabel(page)
    except PageError as exc:
        return f"PageError: {exc}"


def new_values(page: str, seed: int) -> str:
    """``page`` with every sample's value replaced (what the next scrape of vLLM looks like)."""
    rnd = random.Random(seed)
    return re.sub(
        r"(?m)^([a-z][^ \n]*) [^ \n]+$",
        lambda m: f"{m[1]} {rnd.choice(['0', '1.5', '-2e-07', '+Inf', 'NaN', str(rnd.random())])}",
        page,
    )


@pytest.mark.parametrize("first", [VLLM_PAGE, PAGES / "odd-but-valid.txt"], ids=lambda p: p.name)
def test_relabeller_agrees_with_relabel_page_on_every_next_page(first: Path) -> None:
    """A page of the last one's shape is cut and joined, not parsed: it must come out exactly as
    relabel_page makes it, and any other page (a new series, a changed HELP, a value that is not
    a float, a changed timestamp, a hostile page) too, errors included."""
    page = first.read_text()
    reserved = ["vllm:num_requests_running"]
    relabeller = Relabeller(PREFILL_LABELS, reserved_names=reserved)

    def reference(text: str) -> str:
        return relabel_page(text, PREFILL_LABELS, reserved_names=reserved)

    lines = page.splitlines(keepends=True)
    sample = next(i for i, line in enumerate(lines) if line.startswith("vllm:"))
    nexts = [
        page,
        *(new_values(page, seed) for seed in range(5)),
        page.replace("# HELP vllm:", "# HELP  vllm:", 1),
        re.sub(r"(?m)^(# HELP [^\n]* )[^ \n]+$", r"\1changed", page, count=1),
        re.sub(r"(?m)^(# TYPE [^\n]* )[^ \n]+$", r"\1summary", page, count=1),
        page.replace(" 1700000000000\n", " 1700000000001\n"),
        page.replace(" 1700000000000\n", " 1.5\n"),
        # A timestamp equal to the value: the line's last token is not its value.
        re.sub(r" [^ \n]+ 1700000000000\n", " 17 17\n", page),
        re.sub(r" [^ \n]+ 1700000000000\n", " 17 18\n", page),
        page.replace("# HELP vllm:", "# HELP vllm:x", 1),
        "".join([*lines[:sample], lines[sample].replace('="', '="new', 1), *lines[sample:]]),
        "".join(
            [
                *lines[:sample],
                lines[sample].rsplit(" ", 1)[0] + " 1 1700000000000\n",
                *lines[sample + 1 :],
            ]
        ),
        *(
            re.sub(r"(?m)^(vllm:[^ \n]*) [^ \n]+$", rf"\1 {bad}", page, count=3)
            for bad in ("1e400", "x", "", "1\x00")
        ),
        page[:-1],
        page.replace("\n", " \n", 1),
        *(path.read_text() for path in BAD_PAGES if path.suffix == ".txt"),
        "",
    ]
    relabeller.relabel(page)
    shape = relabeller._shape  # the fast path is taken for the next scrape's page
    assert shape is not None
    assert shape.fill(new_values(page, 99)) is not None
    for i, text in enumerate(nexts):
        assert outcome(relabeller.relabel, text) == outcome(reference, text), i
        # And the same page again, now that it (or nothing) is the shape kept.
        assert outcome(relabeller.relabel, text) == outcome(reference, text), i
        assert outcome(relabeller.relabel, new_values(text, i)) == outcome(
            reference, new_values(text, i)
        ), i


# --- hostile pages -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", BAD_PAGES, ids=[p.name for p in BAD_PAGES])
def test_hostile_page_refused(path: Path) -> None:
    """Every hostile page is refused whole: PageError (or undecodable as UTF-8)."""
    data = path.read_bytes()
    try:
        page = data.decode("utf-8")
    except UnicodeDecodeError:
        assert path.suffix == ".bin"  # render() refuses these before parsing
        return
    with pytest.raises(PageError, match=r"line \d+|newline"):
        relabel_page(page, PREFILL_LABELS)


def test_hostile_fixtures_cover_the_brief() -> None:
    """The named hostile cases exist, so the parametrized test cannot silently shrink."""
    names = {p.name for p in BAD_PAGES}
    for needed in (
        "malformed-line",
        "nul",
        "binary",
        "invalid-utf8",
        "duplicate-help",
        "duplicate-type",
        "duplicate-series",
        "truncated",
        "histogram-no-inf",
    ):
        assert any(needed in n for n in names), needed


def test_one_corrupt_line_in_the_real_page_refuses_all() -> None:
    """A NUL or a junk line in the middle of a genuine page refuses the whole page."""
    lines = VLLM_PAGE.read_text().splitlines(keepends=True)
    for junk in ("\x00\n", "garbage here\n", 'vllm:x{a="b} 1\n', "vllm:x 1 2 3\n"):
        with pytest.raises(PageError, match=f"line {len(lines) // 2 + 1}"):
            relabel_page(
                "".join([*lines[: len(lines) // 2], junk, *lines[len(lines) // 2 :]]),
                PREFILL_LABELS,
            )


def test_openmetrics_page_refused() -> None:
    """vLLM's /metrics/ (OpenMetrics, bug #1177's vllm_ sample names) is not mistaken for
    classic."""
    with pytest.raises(PageError, match="OpenMetrics"):
        relabel_page(OPENMETRICS_PAGE.read_text(), PREFILL_LABELS)


# --- next to the agent's own registry ------------------------------------------------------------


def agent_registry() -> prometheus_client.CollectorRegistry:
    """A registry shaped like the agent's: counters, gauges, a histogram, process/platform."""
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    labels = list(PREFILL_LABELS)
    prometheus_client.Counter("tilert_agent_restarts", "R.", labels, registry=registry).labels(
        **PREFILL_LABELS
    ).inc()
    prometheus_client.Gauge("tilert_agent_upstream_up", "U.", labels, registry=registry).labels(
        **PREFILL_LABELS
    ).set(1)
    prometheus_client.Histogram(
        "tilert_agent_probe_seconds", "P.", labels, registry=registry
    ).labels(**PREFILL_LABELS).observe(0.1)
    return registry


def test_combined_with_the_agents_own_page() -> None:
    """generate_latest(own) + re-export parses in promtool and client_python, no family twice."""
    registry = agent_registry()
    own = prometheus_client.generate_latest(registry).decode()
    # an upstream that also serves a family under one of our names: it must be dropped
    hostile = (
        VLLM_PAGE.read_text()
        + "# TYPE tilert_agent_restarts_total counter\ntilert_agent_restarts_total 9\n"
    )
    out = relabel_page(hostile, PREFILL_LABELS, reserved_names=registry_names(registry))
    combined = own + out
    assert promtool_errors(combined) == ""
    names = [f.name for f in text_string_to_metric_families(combined)]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert "tilert_agent_restarts_total 9" not in combined
    assert "vllm:time_to_first_token_seconds" in names
    assert "process_cpu_seconds" in names
    samples(combined)  # no duplicate series either


def test_reserved_names_are_widened() -> None:
    """A reserved family name also reserves what parsers fold into it (_total, _created, ...)."""
    page = (
        "# TYPE mine_total counter\nmine_total 1\n# TYPE mine_created gauge\nmine_created 1\n"
        "# TYPE theirs gauge\ntheirs 1\n"
    )
    out = relabel_page(page, PREFILL_LABELS, reserved_names=["mine"])
    assert "mine" not in out
    assert "theirs{" in out


@pytest.fixture
def static_exporter() -> Iterator[Callable[[bytes], str]]:
    """``start(page)`` serves ``page`` as classic text on a loopback port; returns host:port."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(page: bytes) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", prometheus_client.CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.prometheus
def test_real_prometheus_scrapes_the_combined_page(
    tmp_path: Path,
    static_exporter: Callable[[bytes], str],
    prometheus_factory: Callable[[Path], PrometheusServer],
) -> None:
    """Prometheus takes the page whole: vllm: names, our labels, no exported_* labels."""
    registry = agent_registry()
    odd = (PAGES / "odd-but-valid.txt").read_text()
    odd = odd[odd.index("# HELP vllm:odd_labels") : odd.index("# TYPE vllm:counted_total")]
    page = prometheus_client.generate_latest(registry).decode() + relabel_page(
        VLLM_PAGE.read_text() + odd,
        PREFILL_LABELS,
        reserved_names=registry_names(registry),
    )
    target = static_exporter(page.encode())
    targets = tmp_path / "targets.json"
    write_targets(targets, [{"targets": [target], "labels": {}}])
    prom = prometheus_factory(targets)
    prom.wait_for(f'up{{instance="{target}"}} == 1', timeout=60)
    [health] = [t for t in prom.targets() if t["labels"]["instance"] == target]
    assert health["health"] == "up", health
    assert not health["lastError"], health
    ttft = prom.query(
        "count by (role, node, slurm_job_id, job) (vllm:time_to_first_token_seconds_bucket)"
    )
    assert [r["metric"] for r in ttft] == [{**PREFILL_LABELS, "job": "tilert"}]
    assert prom.query('{__name__=~"vllm:.+", exported_job!=""}') == []
    assert prom.query('{__name__=~"vllm:.+", exported_instance!=""}') == []
    renamed = prom.query('vllm:odd_labels{upstream_instance="10.0.0.1:8000"}')
    assert len(renamed) == 1
    assert renamed[0]["metric"]["instance"] == target
    quantile = prom.query("histogram_quantile(0.5, vllm:time_to_first_token_seconds_bucket)")
    assert len(quantile) == 1
    scraped = prom.query(f'scrape_samples_scraped{{instance="{target}"}}')
    expected = len(samples(page))
    assert int(float(scraped[0]["value"][1])) == expected
