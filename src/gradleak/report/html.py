"""The self-contained HTML report (docs/DESIGN.md §4: ``DIR/report.html``): metric tables and figures, PNGs
embedded as base64 data URIs so the single file can be mailed.

``extra`` (the experiment's ``report`` dict, saved to ``DIR/report_data.json`` so ``gradleak report DIR``
can rebuild the page) may hold:

* ``figures``: ``[{"title", "path" (relative to DIR, or absolute), "caption"}]``;
* ``figure_rows``: ``[[title or index, ...], ...]`` — figures shown side by side in one row (e.g. ground
  truth next to reconstruction); figures in no row get a row each, after the grouped ones;
* ``tables``: ``[{"title", "columns": [key, ...], "rows": [dict, ...], "headers": [...] (optional)}]``;
* ``notes``: ``[str, ...]`` — paragraphs shown under the figures (e.g. which LPIPS/feature backbone was used); the
  notes on the threat model (``"threat model — ..."``) are folded under the metrics;
* ``answer``: the sentence the page opens with (``{"text", "level", "rule", "server", "chance_words", "keys"}``,
  built from the results by :func:`gradleak.run.answer.run_answer`; ``keys``: the metrics it is built from, the
  first, open group of the metric table).

The page leads with the answer, then the originals beside the reconstructions, then the metrics in folded groups
(:func:`metric_groups`).

The run's warnings (``results["details"]["warnings"]``, e.g. an attack on an under-determined setting) are shown in
a box under the title (a ``Warnings`` table of ``extra`` is then not repeated).

Leakage runs (``results["metrics"]`` holds ``rdlv_client{c}_round{r}``) get a section after the metrics: the
per-client, per-round table of :func:`gradleak.report.leakage.leakage_rows` (built from ``results`` alone), then
the PNGs ``reconstructions_client{c}_round{r}.png`` and ``tsne.png`` (not repeated under Figures).
"""

from __future__ import annotations

import base64
import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gradleak.report.markdown import fmt, fmt_p, p_floor_bound

MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".svg": "image/svg+xml",
        ".webp": "image/webp"}

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{{ title }} — gradleak report</title>
<style>
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { margin-bottom: .2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: .5em 0 1.5em; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; } th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.row { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; margin-bottom: 1.5em; }
figure { margin: 0; } figure img { image-rendering: pixelated; max-width: 100%; border: 1px solid #ddd; }
.row figure { flex: 1 1 0; min-width: 0; } /* the originals beside their reconstructions, however wide the grids */
figcaption { font-size: 13px; color: #555; max-width: 40em; } figcaption b { color: #222; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 13px; }
.missing { color: #a00; }
.warning { background: #fff4e5; border-left: 4px solid #b36b00; padding: .2em 1em; margin: 1em 0; }
.answer { font-size: 1.3em; font-weight: 600; margin: .8em 0 .3em; padding: .5em .8em; border-left: 6px solid #888; background: #f6f6f6; }
.answer.exact, .answer.strong { border-color: #b00020; background: #fdecee; }
.answer.partial { border-color: #b36b00; background: #fff4e5; } .answer.none { border-color: #2e7d32; background: #edf7ee; }
.why { color: #555; font-size: 14px; margin-top: 0; }
details { margin: .3em 0; } summary { cursor: pointer; font-weight: 600; padding: .2em 0; }
</style></head><body>
<h1>{{ title }}</h1>
<p class="sub">{% if experiment %}experiment <code>{{ experiment }}</code> · {% endif %}report written {{ written }}</p>
{% if answer %}<p class="answer {{ answer.level }}" id="answer">{{ answer.text }}</p>
<p class="why">{% if answer.server %}Under {{ answer.server }}. {% endif %}Level rule: {{ answer.rule }}.{% if answer.chance_words %} Chance: {{ answer.chance_words }}.{% endif %}</p>{% endif %}
{% if warnings %}<div class="warning" id="warnings">{% for w in warnings %}<p><b>Warning:</b> {{ w }}</p>{% endfor %}</div>{% endif %}

{% if leakage %}<h2>{{ leakage.title }}</h2>
<table><tr>{% for h in leakage.headers %}<th>{{ h }}</th>{% endfor %}</tr>
{% for r in leakage.rows %}<tr>{% for c in r %}<td{% if c.num %} class="num"{% endif %}>{{ c.text }}</td>{% endfor %}</tr>{% endfor %}
</table>
{% for f in leakage.figures %}<div class="row"><figure>{% if f.src %}<img src="{{ f.src }}" alt="{{ f.title }}">{% else %}<p class="missing">image missing: {{ f.path }}</p>{% endif %}
<figcaption><b>{{ f.title }}</b>{% if f.caption %}<br>{{ f.caption }}{% endif %}</figcaption></figure></div>
{% endfor %}{% endif %}

{% if figure_rows %}<h2>Figures</h2>
{% for row in figure_rows %}<div class="row">
{% for f in row %}<figure>{% if f.src %}<img src="{{ f.src }}" alt="{{ f.title }}">{% else %}<p class="missing">image missing: {{ f.path }}</p>{% endif %}
<figcaption><b>{{ f.title }}</b>{% if f.caption %}<br>{{ f.caption }}{% endif %}</figcaption></figure>
{% endfor %}</div>{% endfor %}{% endif %}
{% for note in notes %}<p>{{ note }}</p>{% endfor %}

<h2>Metrics</h2>
{% for g in metric_groups %}<details{% if g.open %} open{% endif %}><summary>{{ g.title }} ({{ g.rows|length }})</summary>
<table><tr><th>metric</th><th>value</th></tr>
{% for name, value in g.rows %}<tr><td>{{ name }}</td><td class="num">{{ value }}</td></tr>{% endfor %}
</table></details>
{% else %}<p>No metrics were recorded.</p>{% endfor %}
{% if threat %}<details id="threat"><summary>Threat model ({{ threat|length }} lines)</summary><ul>
{% for line in threat %}<li>{{ line }}</li>{% endfor %}</ul></details>{% endif %}

{% for t in tables %}<h2>{{ t.title }}</h2>
<table><tr>{% for h in t.headers %}<th>{{ h }}</th>{% endfor %}</tr>
{% for r in t.rows %}<tr>{% for c in r %}<td{% if c.num %} class="num"{% endif %}>{{ c.text }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endfor %}

{% if timings %}<h2>Timings</h2>
<table><tr><th>stage</th><th>seconds</th></tr>
{% for name, value in timings %}<tr><td>{{ name }}</td><td class="num">{{ value }}</td></tr>{% endfor %}
</table>{% endif %}

{% if artifacts %}<h2>Artifacts</h2><ul>{% for a in artifacts %}<li><code>{{ a }}</code></li>{% endfor %}</ul>{% endif %}

{% if environment %}<h2>Environment</h2>
<table>{% for name, value in environment %}<tr><th>{{ name }}</th><td>{{ value }}</td></tr>{% endfor %}</table>{% endif %}

<h2>Config</h2>
<pre>{{ config }}</pre>
<script>/* a real browser marks how many images decoded (scripts/check_report_in_browser.py reads it) */
window.addEventListener("load", function () {
  var imgs = Array.from(document.images), ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  document.body.setAttribute("data-images", ok.length + "/" + imgs.length);
  document.body.setAttribute("data-tables", String(document.querySelectorAll("table").length));
});</script>
</body></html>
"""


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(d, dict):
        return [(prefix or "value", d)]
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out += _flatten(v, key)
        else:
            out.append((key, v))
    return out


def _text(v: Any) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, (list, tuple)) and len(v) <= 8 and all(isinstance(e, (int, float)) for e in v):
        return ", ".join(_text(e) for e in v)
    return fmt(v, 4)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _embed(path: Path) -> str | None:
    if not path.is_file():
        return None
    mime = MIME.get(path.suffix.lower(), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _figure_rows(extra: dict, out_dir: Path) -> list[list[dict]]:
    figures = []
    for f in extra.get("figures") or []:
        p = Path(f.get("path", ""))
        full = p if p.is_absolute() else out_dir / p
        figures.append({"title": str(f.get("title", p.name)), "caption": str(f.get("caption", "") or ""),
                        "path": str(p), "src": _embed(full)})
    by_title = {f["title"]: i for i, f in enumerate(figures)}
    rows, used = [], set()
    for group in extra.get("figure_rows") or []:
        row = []
        for ref in group:
            i = ref if isinstance(ref, int) and not isinstance(ref, bool) else by_title.get(str(ref))
            if i is not None and 0 <= i < len(figures):
                row.append(figures[i])
                used.add(i)
        if row:
            rows.append(row)
    rows += [[f] for i, f in enumerate(figures) if i not in used]
    return rows


def _tables(extra: dict) -> list[dict]:
    out = []
    for t in extra.get("tables") or []:
        rows = list(t.get("rows") or [])
        columns = list(t.get("columns") or (list(rows[0]) if rows else []))
        headers = list(t.get("headers") or columns)
        out.append({"title": t.get("title", ""), "headers": headers,
                    "rows": [[{"text": _text(r.get(c)), "num": _is_num(r.get(c))} for c in columns] for r in rows]})
    return out


def _leakage_section(results: dict, extra: dict, out_dir: Path) -> dict | None:
    """Leakage runs (per-client, per-round RDLV metrics): the table of :mod:`gradleak.report.leakage` and its PNGs
    (the extra's figures named ``reconstructions_client{c}_round{r}.png`` / ``tsne.png``, else those found in
    ``out_dir``); ``None`` for any other run."""
    from gradleak.report.leakage import FIGURE_NAME, leakage_table

    table = leakage_table(results)
    if table is None:
        return None
    figures = []
    for f in extra.get("figures") or []:
        p = Path(f.get("path", ""))
        if FIGURE_NAME.match(p.name):
            full = p if p.is_absolute() else out_dir / p
            figures.append({"title": str(f.get("title", p.name)), "caption": str(f.get("caption", "") or ""),
                            "path": str(p), "src": _embed(full)})
    if not figures and out_dir.is_dir():  # a results.json without report_data.json
        found = [p for p in out_dir.glob("*.png") if FIGURE_NAME.match(p.name) and "_trial" not in p.name]
        key = lambda p: (p.name.startswith("tsne"), [int(t) for t in re.findall(r"\d+", p.name)])  # noqa: E731
        figures = [{"title": p.stem.replace("_", " "), "caption": "", "path": p.name, "src": _embed(p)}
                   for p in sorted(found, key=key)]
    shown = _tables({"tables": [table]})[0]
    return {"title": table["title"], "headers": shown["headers"], "rows": shown["rows"], "figures": figures}


def _yaml(config: Any) -> str:
    try:
        import yaml

        return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip()
    except Exception:
        return json.dumps(config, indent=2, default=str)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # numpy arrays / scalars, torch tensors
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`gradleak.atomic.write_text_atomic`: a temporary file beside it,
    then a rename); a private artifact (the report embedding the clients' images) stays 0600 from creation
    (:func:`gradleak.report.images.publish_mode`)."""
    from gradleak.atomic import write_text_atomic
    from gradleak.report.images import publish_mode

    write_text_atomic(path, text, mode=publish_mode(path), encoding="utf-8")


#: the pipeline's notes on the threat model (one per line of ``ThreatModel.describe``): folded under the metrics
THREAT_NOTE = "threat model — "
#: a null beside a metric (``<m>_null_median``, ``<m>_null_p99``, ``<m>_p_value``) or a trivial reference's score
#: (the mean public, grey and flat images; the word bag in random order): chance, not the attack
CHANCE = re.compile(r"_(null_median|null_p99|p_value)(_|$)|_(mean_public|grey|flat|bag_order)(_client\d+)?$")
PER_CLIENT = re.compile(r"_client\d+(_round\d+)?$")
#: a p-value's key: at the floor of its null's draws it reads "< 0.001", not 0.000999 (:func:`fmt_p`)
P_VALUE = re.compile(r"_p_value(_|$)")


def metric_groups(metrics: dict, answer_keys: list[str] | tuple = ()) -> list[dict]:
    """The metric table in folded groups: the numbers the answer sentence is built from (open; ``answer_keys``), the
    scores and the attack's own numbers, chance (nulls and trivial references), and the per-client (and per-round)
    metrics; empty groups are left out. Each group: ``{"title", "open", "rows": [(key, text)]}``."""
    rows = _flatten(metrics)
    head = set(answer_keys)
    groups = [("The answer's numbers: the headline and its null", True, [r for r in rows if r[0] in head]),
              ("Scores and the attack's own numbers", False,
               [r for r in rows if r[0] not in head and not CHANCE.search(r[0]) and not PER_CLIENT.search(r[0])]),
              ("Chance: nulls and trivial references", False,
               [r for r in rows if r[0] not in head and CHANCE.search(r[0]) and not PER_CLIENT.search(r[0])]),
              ("Per client and round", False, [r for r in rows if r[0] not in head and PER_CLIENT.search(r[0])])]
    return [{"title": t, "open": o, "rows": [(k, fmt_p(v, bare=True) if P_VALUE.search(k) and p_floor_bound(v)
                                              else _text(v)) for k, v in g]} for t, o, g in groups if g]


def render_html(results: dict, out_dir: Path, extra: dict | None = None) -> str:
    """The report page as a string (figures embedded); see :func:`write_report`."""
    import jinja2

    extra = extra or {}
    leakage = _leakage_section(results, extra, Path(out_dir))
    figure_rows = _figure_rows(extra, Path(out_dir))
    if leakage:  # its PNGs follow its table, not repeated under Figures
        paths = {f["path"] for f in leakage["figures"]}
        figure_rows = [row for row in ([f for f in row if f["path"] not in paths] for row in figure_rows) if row]
    # the run's warnings (e.g. lora_span on an under-determined setting) open the page, not a table at its end
    warnings = list(dict.fromkeys(str(w) for w in ((results.get("details") or {}).get("warnings") or [])))
    tables = [t for t in _tables(extra) if not (t["title"] == "Warnings" and warnings)]
    answer = extra.get("answer") if isinstance(extra.get("answer"), dict) and extra["answer"].get("text") else None
    if answer is not None:
        answer = {"text": str(answer["text"]), "level": str(answer.get("level") or ""),
                  "rule": str(answer.get("rule") or ""), "server": str(answer.get("server") or ""),
                  "chance_words": str(answer.get("chance_words") or "")}
    notes = [str(n) for n in extra.get("notes") or []]
    threat = [n[len(THREAT_NOTE):] for n in notes if n.startswith(THREAT_NOTE)]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        title=results.get("name") or "gradleak run",
        experiment=results.get("experiment"),
        written=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        answer=answer,
        notes=[n for n in notes if not n.startswith(THREAT_NOTE)],
        threat=threat,
        metric_groups=metric_groups(results.get("metrics") or {}, (extra.get("answer") or {}).get("keys") or []),
        timings=[(k, _text(v)) for k, v in _flatten(results.get("timings") or {})],
        environment=[(k, _text(v)) for k, v in _flatten(results.get("environment") or {})],
        artifacts=[str(a) for a in results.get("artifacts") or []],
        config=_yaml(results.get("config") or {}),
        figure_rows=figure_rows,
        leakage=leakage,
        tables=tables,
        warnings=warnings,
    )


def write_report(results: dict, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write ``out_dir/report.html`` (self-contained) and ``out_dir/report_data.json`` (= ``extra``); return the HTML path.

    ``results`` follows the results contract (``name``, ``config``, ``metrics``, ``timings``,
    ``environment``, ``artifacts``); ``extra`` is described in the module docstring. Both files are
    written atomically (temp file + ``os.replace``).
    """
    out = Path(out_dir)
    extra = dict(extra or {})
    write_atomic(out / "report_data.json", json.dumps(extra, indent=2, default=_json_default, allow_nan=True))
    html_path = out / "report.html"
    write_atomic(html_path, render_html(results, out, extra))
    return html_path


def rebuild_report(out_dir: str | Path) -> Path:
    """Rebuild ``report.html`` from ``out_dir/results.json`` and ``out_dir/report_data.json`` (if present)."""
    out = Path(out_dir)
    results = json.loads((out / "results.json").read_text())
    data = out / "report_data.json"
    extra = json.loads(data.read_text()) if data.is_file() else {}
    return write_report(results, out, extra)
