"""The Grafana dashboard the chart ships (dashboards/splitserve.json): every field it sets is one
Grafana's dashboard model knows (the grafana-foundation-sdk's, generated from Grafana's schema),
and every series it queries is one splitserve exports. That each query returns data from a real
Prometheus scraping a running app: tests/integration/test_serve_app.py."""

from __future__ import annotations

import json
import re

from grafana_foundation_sdk.models.dashboard import Dashboard

from splitserve.metrics import Metrics

from .chart import CHART

DASHBOARD = CHART / "dashboards" / "splitserve.json"


def plain(o):
    """A foundation-sdk object as the JSON Grafana would store."""
    if hasattr(o, "to_json"):
        o = o.to_json()
    if isinstance(o, dict):
        return {k: plain(v) for k, v in o.items()}
    if isinstance(o, list):
        return [plain(v) for v in o]
    if hasattr(o, "value") and not isinstance(o, (int, float, str, bool)):  # an enum
        return o.value
    return o


def unknown_fields(doc: dict) -> list[str]:
    """Paths of what Grafana's model drops or changes when it reads `doc`."""
    out, bad = plain(Dashboard.from_json(doc)), []

    def walk(a, b, path):
        if isinstance(a, dict):
            for k, v in a.items():
                if not isinstance(b, dict) or k not in b:
                    bad.append(f"{path}/{k}")
                else:
                    walk(v, b[k], f"{path}/{k}")
        elif isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                bad.append(path)
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    walk(x, y, f"{path}[{i}]")
        elif a != b:
            bad.append(f"{path}: {a!r} read as {b!r}")

    walk(doc, out, "")
    return bad


def test_every_field_is_one_grafanas_dashboard_model_knows():
    doc = json.loads(DASHBOARD.read_text())
    assert unknown_fields(doc) == []
    broken = json.loads(DASHBOARD.read_text())  # the check can fail: a misspelled field is found
    broken["panels"][0]["gridpos"] = broken["panels"][0].pop("gridPos")
    assert unknown_fields(broken) == ["/panels[0]/gridpos"]


def test_panels_are_prometheus_queries_laid_out_without_overlap():
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(set(ids)) == len(ids)
    cells = set()
    for p in doc["panels"]:
        assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]
        assert all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        g = p["gridPos"]
        here = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not here & cells and all(x < 24 for x, _ in here), p["title"]
        cells |= here


def test_every_series_queried_is_one_splitserve_exports():
    m = Metrics()
    exported = set()
    for family in m.registry.collect():
        exported |= {family.name} | {family.name + suffix for suffix in ("_bucket", "_count", "_sum", "_total")}
    doc = json.loads(DASHBOARD.read_text())
    queried = {name for p in doc["panels"] for t in p["targets"] for name in re.findall(r"splitserve_[a-z_]+", t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)
