"""A real Prometheus server (Debian's ``prometheus``) scrapes every service of the
session's stack: scheduler, prefill and decode workers and their engine cores, and the
gateway. PromQL then counts the requests this test sent, and every panel of the Grafana
dashboard returns data."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest

from kvpush.services.launch.natsd import free_port

pytestmark = pytest.mark.timeout(300)

DASHBOARD = Path(__file__).resolve().parents[2] / "otel" / "grafana" / "dashboards" / "kvpush.json"
SENT = 6


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "no prometheus server: scripts/test.sh installs Debian's package (apt-get install prometheus)"
    folder = tmp_path_factory.mktemp("prometheus")
    targets = [{"targets": addresses, "labels": {"service": name}}
               for name, addresses in sorted(stack.metrics_targets.items())]
    (folder / "targets.json").write_text(json.dumps(targets))
    (folder / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvpush\n"
        f"    file_sd_configs: [{{files: ['{folder / 'targets.json'}']}}]\n")
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _up(url):
            assert process.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not start"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=5) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


async def until_value(url: str, promql: str, wanted, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        result = query(url, promql)
        value = float(result[0]["value"][1]) if result else None
        if value is not None and wanted(value):
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"{promql} = {value} after {timeout} s")


async def test_prometheus_scrapes_every_service_and_counts_the_requests_this_test_sent(stack, prometheus):
    expected_up = sum(len(a) for a in stack.metrics_targets.values())
    await until_value(prometheus, 'sum(up{job="kvpush"})', lambda v: v == expected_up, timeout=40)
    ok = 'sum(kvpush_requests_total{outcome="ok"}) or vector(0)'
    before = await until_value(prometheus, ok, lambda v: True)
    gateway_before = await until_value(prometheus, 'sum(kvpush_gateway_requests_total{status="200"}) or vector(0)',
                                       lambda v: True)
    async with httpx.AsyncClient(timeout=120) as http:
        replies = await asyncio.gather(*(
            http.post(stack.gateway_url + "/v1/completions",
                      json={"prompt": f"def f{i}():", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            for i in range(SENT)))
    assert [r.status_code for r in replies] == [200] * SENT
    # The decode worker counts each answer once.
    assert await until_value(prometheus, ok, lambda v: v >= before + SENT) == before + SENT
    assert await until_value(prometheus, 'sum(kvpush_gateway_requests_total{status="200"})',
                             lambda v: v >= gateway_before + SENT) == gateway_before + SENT
    # Metrics of the connector, recorded in the engine cores, are scraped too.
    await until_value(prometheus, "sum(kvpush_transfer_bytes_count)",
                      lambda v: v > 0)


async def test_every_panel_of_the_grafana_dashboard_returns_data(stack, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 6
    async with httpx.AsyncClient(timeout=120) as http:  # something to show
        for i in range(3):
            await http.post(stack.gateway_url + "/v1/completions", json={"prompt": f"x{i}", "max_tokens": 4})
    await asyncio.sleep(3)
    empty = []
    for title, expr in exprs:
        expr = expr.replace("$__rate_interval", "1m").replace("$__range", "5m")
        deadline = time.monotonic() + 20
        while not query(prometheus, expr):
            if time.monotonic() > deadline:
                empty.append((title, expr))
                break
            await asyncio.sleep(1)
    assert empty == []


async def test_every_service_says_ready_on_its_metrics_port_once_it_serves(stack):
    """/ready (otel/endpoint.py) is what a Kubernetes readiness probe asks: the scheduler
    takes requests, each worker's engine is up. The stack is ready, so all say 200."""
    async with httpx.AsyncClient(timeout=5) as http:
        for name, addresses in sorted(stack.metrics_targets.items()):
            if name == "gateway":
                continue  # its /ready is the gateway's own (tests/stack/test_gateway.py)
            reply = await http.get(f"http://{addresses[0]}/ready")
            assert (reply.status_code, reply.json()["status"]) == (200, "ready"), name
