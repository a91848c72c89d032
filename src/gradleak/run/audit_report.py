"""The audit's presentation: the console table rows, the "what to do next" facts and the HTML
report, all from the audit result dict that :func:`gradleak.run.audit.run_audit` writes as audit.json (so
``gradleak report DIR`` rebuilds it from audit.json alone)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from gradleak.evaluation.levels import leak_rank
from gradleak.run.answer import fmt_p

#: the threat flags that are server capabilities (an upgraded server may have them); the others are facts it learns
SERVER_CAPABILITIES = ("malicious", "prescribes_architecture", "public_data")

def fmt_value(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) and v == v else "n/a"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def shown_evidence(a: dict) -> dict:
    """The measurement an entry's level rests on, for the banner and the attack's row: the metric that decided the
    level (``decided_by``: e.g. word-bag recall for a word-bag ``partial``) with *its* null's 99th percentile and
    p-value; the headline only where the deciding measure has no null of its own (an exact count: the banner then
    says how many samples were exact) or the entry predates ``decided_by``. ``headline`` is set when it differs."""
    d = a.get("decided_by") or {}
    head = {"metric": a.get("metric"), "value": a.get("value"), "null_p99": a.get("null_p99"),
            "p_value": a.get("p_value")}
    if d.get("metric") and _number(d.get("null_p99")):
        out = {k: d.get(k) for k in ("metric", "value", "null_p99", "p_value")}
        out["decided"] = True
        if d["metric"] != head["metric"] and head["metric"]:
            out["headline"] = head
        return out
    return {**head, "decided": bool(d.get("metric")) and d.get("metric") == head["metric"]}


def client_words(client) -> str:
    """A client label in words: ``client 3``, or the secure-aggregation sum as it is (``the sum of 4 clients``)."""
    return str(client) if isinstance(client, str) and client.startswith("the sum of") else f"client {client}"


def evidence_words(a: dict) -> str:
    """``metric = v against a null 99th percentile of x (p = y)`` of :func:`shown_evidence`."""
    s = shown_evidence(a)
    text = (f"{s['metric']} = {fmt_value(s.get('value'))} against a null 99th percentile of "
            f"{fmt_value(s.get('null_p99'))} ({fmt_p(s.get('p_value'))})")
    if s.get("headline"):
        text += f"; headline {s['headline']['metric']} = {fmt_value(s['headline'].get('value'))}"
    if a.get("sample"):  # the counts the measurement rests on (membership: members vs non-members)
        text += f"; on {a['sample']}"
    return text



_MODALITY_REASON = re.compile(r"attacks (\w+) data, but this experiment's data are (\w+)")


def short_reason(reason: str) -> str:
    """A gate's refusal without its "Fix:" (the grouped rows name the attack and why, the full text is in audit.json)."""
    return (reason or "").split(" Fix: ")[0].strip()


def not_run_groups(result: dict) -> dict:
    """The attacks that did not run, grouped for the reader: ``other_modality`` ({attack modality: [names]}: attacks
    for another kind of data, one line instead of a row each, whether ``--only`` named them or not), ``left_out``
    (attacks that apply to this setup -- under the configured threat or its server upgrade -- and did not run only
    because ``--only`` left them out), ``left_out_not_applicable`` (left out, and the gate refuses them here anyway:
    ``[{name, reason}]``), ``left_out_known`` (False for an audit.json written before the left-out attacks were
    checked: ``left_out`` then holds every left-out name), ``other`` (the remaining refused entries, each with the
    gate's reason), ``by`` (what restricted the attacks: ``--only``, or a framework round audit's ``only_by``)."""
    mod = result.get("modality")
    other_mod: dict[str, list[str]] = {}
    other = []
    for a in result.get("attacks", []):
        if "level" in a:
            continue
        am = a.get("modality")
        m = _MODALITY_REASON.search(a.get("reason") or "")
        if m:  # an audit.json written before entries carried their modality
            am, mod = am or m.group(1), mod or m.group(2)
        if am and mod and am != mod and not a.get("applicable_under"):
            other_mod.setdefault(am, []).append(a["name"])
        else:
            other.append(a)
    split = result.get("left_out")
    left_na = []
    if isinstance(split, dict):
        left = [x["name"] for x in split.get("applicable") or []]
        for x in split.get("not_applicable") or []:
            am = x.get("modality")
            if am and mod and am != mod:
                other_mod.setdefault(am, []).append(x["name"])
            else:
                left_na.append(x)
    else:
        left = list(result.get("left_out_by_only") or [])
    return {"modality": mod, "other_modality": other_mod, "left_out": left, "left_out_not_applicable": left_na,
            "left_out_known": isinstance(split, dict), "other": other, "by": only_by(result)}


def only_by(result: dict) -> str:
    """What restricted the audit's attacks, as the reader wrote it: ``--only`` (``gradleak audit``), or the
    framework round audit's ``only_by`` (``attacks=[...]`` of ``FlowerAudit`` / ``NVFlareAudit``)."""
    return str(result.get("only_by") or "--only")


def left_out_words(g: dict) -> str:
    """The applicable attacks ``--only`` (``g["by"]``) left out, in words."""
    by = g.get("by", "--only")
    if not g["left_out_known"]:
        return f"left out by {by}: {', '.join(g['left_out'])}"
    return f"applicable to this setup, not run (left out by {by}): {', '.join(g['left_out'])}"


def not_tested_lines(result: dict) -> list[str]:
    """Reproducibility's "not tested", grouped (see :func:`not_run_groups`): first what could have run here and did
    not, then what is not applicable to this setup."""
    g = not_run_groups(result)
    lines = [left_out_words(g)] if g["left_out"] else []
    lines += [f"{len(v)} {am} attack(s), not applicable to {g['modality']} data: {', '.join(v)}"
              for am, v in g["other_modality"].items()]
    if g["left_out_not_applicable"]:
        lines.append(f"not applicable to this setup (and left out by {g['by']}): " + "; ".join(
            f"{x['name']}: {short_reason(x.get('reason', ''))}" for x in g["left_out_not_applicable"]))
    lines += [f"{a['name']}: {a.get('reason', '')}" for a in g["other"]]
    return lines


def console_rows(result: dict) -> list[tuple[str, ...]]:
    """The console table's rows (attack, applicable, level, headline (null p99), worst client, note): attacks for
    another modality grouped into one row, those left out by ``--only`` into another."""
    g = not_run_groups(result)
    grouped = {n for v in g["other_modality"].values() for n in v}
    rows = []
    for a in result["attacks"]:
        if a["name"] in grouped:
            continue
        ev = shown_evidence(a)
        val, p99 = ev.get("value"), ev.get("null_p99")
        rows.append((a["name"], "yes" if a.get("applicable") else ("upgrade" if a.get("applicable_under") else "no"),
                     a.get("level", "not run"),
                     (f"{ev['metric']} = {val:.4g}" + (f" ({p99:.4g})" if _number(p99) else "")
                      + (f"; {a['sample']}" if a.get("sample") else ""))
                     if _number(val) and "level" in a else "–",
                     client_words(a["worst_client"]) if "worst_client" in a else "–",
                     a.get("reason") or ""))
    if g["left_out"]:
        rows.append((f"{len(g['left_out'])} " + ("applicable, not run" if g["left_out_known"] else "left out"),
                     "yes" if g["left_out_known"] else "–", "not run", "–", "–", left_out_words(g)))
    for am, names in g["other_modality"].items():
        rows.append((f"{len(names)} {am} attacks", "no", "not run", "–", "–",
                     f"not applicable: this setup's data are {g['modality']} ({', '.join(names)})"))
    if g["left_out_not_applicable"]:
        rows.append((f"{len(g['left_out_not_applicable'])} not applicable", "no", "not run", "–", "–",
                     f"not applicable to this setup (and left out by {g['by']}): " + "; ".join(
                         f"{x['name']}: {short_reason(x.get('reason', ''))}" for x in g["left_out_not_applicable"])))
    return rows


def attack_line(entry: dict, seeds: list | None = None) -> str:
    """One attack's console line as an audit judges it (``gradleak audit`` and the framework round audits,
    :mod:`gradleak.run.round_audit`): its level in upper case (``EXACT``, ``NONE``, ``UNDEFINED``, ...), the measurement
    that decided it beside its null's 99th percentile (:func:`shown_evidence`; an undefined level without a number: its
    rule), the worst client, the seeds (``seeds``: more than one ran) and the time."""
    ev = shown_evidence(entry)
    v = ev.get("value")
    if entry.get("level") == "undefined" and not _number(v):
        inside = [str(entry.get("rule") or entry.get("reason") or "nothing was measured")]
    else:
        inside = [f"{ev['metric']} = {v if not isinstance(v, float) else round(v, 4)}",
                  f"null p99 {fmt_value(ev.get('null_p99'))}"]
    if entry.get("worst_client") is not None:
        inside.append(f"worst: {client_words(entry['worst_client'])}")
    if seeds:
        inside.append(f"worst of seeds {seeds}, median {entry.get('median')}")
    if _number(entry.get("seconds")):
        inside.append(f"{entry['seconds']:.0f} s")
    return f"{entry['name']}: {str(entry.get('level', 'not run')).upper()} ({', '.join(inside)})"


#: the console table's columns (:func:`console_rows`' order); the note is wrapped at words, never cut
CONSOLE_COLUMNS = ("attack", "applicable", "level", "headline (null p99)", "worst client", "note")


def console_table(result: dict, title: str):
    """The audit's console table (a ``rich`` Table of :func:`console_rows`): ``gradleak audit`` prints it, and so do
    the framework round audits (:func:`gradleak.run.round_audit.round_console`)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for col in CONSOLE_COLUMNS:
        table.add_column(col, overflow="fold")
    for row in console_rows(result):
        table.add_row(*(Text(x) for x in row))
    return table


def next_steps(result: dict) -> dict:
    """What "What to do next" says, from the audit's own facts: the leaking attacks, the deployment facts whose
    refusal kept an attack from running, and the defenses this setup accepts. Nothing is ranked or recommended
    here: that is ``gradleak audit --advise`` (:mod:`gradleak.run.advise`, :func:`advice_section`)."""
    from gradleak.evaluation.levels import LEAKING

    leaking = sorted([a for a in result["attacks"] if a.get("level") in LEAKING], key=leak_rank, reverse=True)
    facts = []  # (attack, [threat.<flag>, ...]): every deployment fact the gate withholds (it names them all at once)
    for a in not_run_groups(result)["other"]:
        reason = a.get("reason") or ""
        m = re.match(r"(threat\.\w+):", reason)
        if m and m.group(1).split(".")[1] not in SERVER_CAPABILITIES:
            flags = list(dict.fromkeys([m.group(1)] + re.findall(r"--set (threat\.\w+)=true", reason)))
            facts.append((a["name"], [f for f in flags if f.split(".")[1] not in SERVER_CAPABILITIES]))
    return {"leaking": [{"name": a["name"], "level": a["level"],
                         "server": a.get("threat_words", a.get("threat")),
                         "configured": bool(a.get("applicable"))} for a in leaking],
            "facts": facts, "defenses": result.get("defenses_available")}


def measured_epsilon_words(m: dict | None) -> str:
    """The advice row's words for the DP check at the strength found: the measured epsilon, its 95 % interval where
    the check fits one (SVT's sign-canary check gives a one-sided bound, no interval), the threat model, the verdict."""
    if "epsilon" not in (m or {}):
        return ""
    interval = m.get("interval")
    within = (f"95 % interval {fmt_value(interval[0])}–{fmt_value(interval[1])}, " if interval else "")
    return (f"; measured {fmt_value(m['epsilon'])} ({within}{m['threat_model'].replace('_', ' ')}): "
            f"{m['verdict'].replace('_', ' ')}")


def advice_rows(advice: dict) -> list[tuple[str, ...]]:
    """The advice table (``--advise``), cheapest first: defense, strength found (parameter), bracket, the leaking
    attacks' levels there, accuracy (vs without), cost, epsilon, status / note."""
    from gradleak.defenses.base import is_dp_defense

    rank = {n: i for i, n in enumerate(advice.get("ranking") or [])}
    rows = sorted(advice.get("rows") or [], key=lambda r: (rank.get(r["defense"], len(rank)), r["defense"]))
    base = (advice.get("baseline") or {}).get("accuracy")
    out = []
    for r in rows:
        acc, cost, eps = r.get("accuracy"), r.get("cost"), r.get("epsilon")
        out.append((r["defense"], f"{r['parameter']} = {fmt_value(r['strength'])}" if "strength" in r else "–",
                    f"[{fmt_value(r['bracket'][0])}, {fmt_value(r['bracket'][1])}]",
                    ", ".join(f"{a} {lv}" for a, lv in (r.get("levels") or {}).items()) or "–",
                    f"{fmt_value(acc)} (vs {fmt_value(base)})" if acc is not None else "–",
                    (f"{cost * 100:+.1f} pts" + (f" (± {r['cost_se'] * 100:.1f})" if r.get("cost_se") else ""))
                    if isinstance(cost, (int, float)) else "–",
                    (f"{fmt_value(eps)} (δ = {r.get('epsilon_delta', advice.get('delta', 1e-5)):g}"
                     + ("; no meaningful guarantee: ε > 10" if eps > 10 else "")
                     + (f"; {fmt_value(r['epsilon_attacked'])} over the audited round(s)"
                        if isinstance(r.get("epsilon_attacked"), (int, float)) else "")
                     + measured_epsilon_words(r.get("epsilon_measured")) + ")"
                     if isinstance(eps, (int, float))
                     else "not computed" if is_dp_defense(r["defense"]) else "–"),
                    "; ".join(x for x in (r.get("status", ""), r.get("note", ""), r.get("clip_note", ""),
                                          r.get("utility_note", ""), r.get("utility_error", "")) if x)))
    return out


def advice_section(advice: dict) -> str:
    """The "What to do next" advice: the recommendation, the table ranked by utility cost, the plot."""
    e = html.escape
    head = ("defense", "strength found", "bracket (weak, strong)", "levels there", "accuracy", "cost", "ε", "status")
    table = ("<table id=\"advice\"><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"
             + "".join("<tr>" + "".join(f"<td>{e(str(x))}</td>" for x in r) + "</tr>" for r in advice_rows(advice))
             + "</table>")
    notes = [f"Searched for: {', '.join(advice.get('attacks') or [])} (each back to level none = below its null, the "
             "attacks re-run at full strength against the defense); bisection on a log scale, "
             f"{advice.get('steps')} step(s) after the strong end; accuracy: the global model's test accuracy after "
             f"{advice.get('utility_rounds')} rounds of training without an attack (audit.utility_rounds; fresh samples "
             f"each round; {advice.get('test_size')} held-out samples, same seeds), cost = accuracy without minus with "
             "the defense; ε over those rounds (and over the audited round, where it differs)."]
    if advice.get("tested_against"):
        notes.append("Every probe and the recommendation were tested against: " + ", ".join(advice["tested_against"])
                     + " (every attack the audit measured, not only those that leaked).")
    for a, layers in (advice.get("margin") or {}).items():
        for layer, m in layers.items():
            notes.append(f"Leakage margin of {a} ({layer}): per-coordinate noise of std "
                         f"{fmt_value(m.get('drowning_noise_std'))} drowns the weakest direction the attack used, "
                         f"{fmt_value(m.get('drowning_noise_std_all'))} every direction (the spectral prediction, beside "
                         "the absolute-noise strength the search found).")
    b = advice.get("baseline") or {}
    if b.get("accuracy_curve"):
        notes.append("Undefended model's test accuracy over the utility rounds (before, halfway, end): "
                     + " → ".join(fmt_value(x) for x in b["accuracy_curve"]) + ".")
    if advice.get("cost_note"):
        notes.append(advice["cost_note"] + ".")
    if advice.get("test_size_note"):
        notes.append(advice["test_size_note"] + ".")
    if advice.get("unfinished"):
        notes.append(f"Not finished within the budget of {fmt_value(advice.get('budget_seconds'))} s: "
                     + ", ".join(advice["unfinished"]) + ".")
    plot = (f'<figure><img src="{e(advice["plot"])}" alt="privacy-utility plot"><figcaption>each attack\'s headline '
            "(null band shaded) and the test accuracy against the defense strength</figcaption></figure>"
            if advice.get("plot") else "")
    return (f'<p id="recommendation"><b>{e(advice.get("sentence", ""))}</b></p>' + table
            + "".join(f"<p>{e(n)}</p>" for n in notes) + plot)


def _png_size(path: Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


#: the displayed width a side-by-side image aims at (integer nearest-neighbour upscale towards it)
PAIR_TARGET_PX = 480


def _figure_pair(a: dict, out: Path, pngs: list[str], client=None) -> str:
    """PNGs of an attack in one row: the originals first, then the reconstructions beside them, each upscaled by an
    integer factor with nearest-neighbour (``image-rendering: pixelated``) so 32-pixel images are visible.
    ``client``: the audit's label of the client they belong to, set on the row and on every figure and image as
    ``data-client`` (beside ``data-role``: original / reconstruction / other)."""
    e = html.escape
    if not pngs:
        return ""
    who = f' data-client="{e(str(client))}"' if client is not None else ""
    summed = str(client).startswith("the sum of")

    def base(n: str) -> str:  # the file's own name: a round audit's PNGs sit in client_<c>/ folders
        return Path(n).name

    def order(n: str) -> tuple:
        return (0 if base(n).startswith("ground_truth") else 1 if base(n).startswith("reconstruction") else 2, n)

    figs = []
    for img in sorted(pngs, key=order):
        size = _png_size(out / str(a.get("out", "")) / img)
        k = max(1, min(4, PAIR_TARGET_PX // size[0])) if size and size[0] else 1
        width = f' width="{size[0] * k}"' if size else ""
        role = ("original" if base(img).startswith("ground_truth") else
                "reconstruction" if base(img).startswith("reconstruction") else "other")
        label = {"original": "originals (every summed client's private data)" if summed else
                             "original (the client's private data)",
                 "reconstruction": "reconstruction (the attack's output)"}.get(role, Path(img).stem)
        figs.append(f'<figure data-role="{role}"{who}><img src="{e(str(a["out"]))}/{e(img)}" alt="{e(label)}"{width}'
                    f' data-role="{role}"{who}><figcaption>{e(label)}<br><small>{e(img)}'
                    + (f", shown {k}×" if k > 1 else "") + "</small></figcaption></figure>")
    return f'<div class="pair"{who}>' + "".join(figs) + "</div>"


def client_key(client) -> tuple[int, int] | None:
    """``(trial, client index)`` of an audit client label (``per_client[i].client``, ``worst_client``), as
    :func:`gradleak.evaluation.images.grid_owner` reads it off the PNGs' names: ``3`` -> (0, 3), ``"1@trial2"`` ->
    (2, 1); the secure-aggregation sum (``"the sum of 4 clients"``, ``"...@trial2"``) -> (trial, 0), the one update
    the pipeline attacks there (its originals: every summed client's samples). None for any other label."""
    s, _, t = str(client).partition("@trial")
    try:
        trial = int(t) if t else 0
        return (trial, 0) if s.startswith("the sum of") else (trial, int(s))
    except ValueError:
        return None


def _client_label(a: dict, c: dict) -> str:
    """A per-client row's label (HTML): the client (the sum of N clients under secure aggregation), its level and the
    measurement that decided it (:func:`evidence_words`; an exact count, which has no null, before the headline)."""
    e = html.escape
    text = f"<b>{e(client_words(c['client']))}</b> — {e(str(c.get('level') or 'not graded').upper())}"
    ev = {"metric": a.get("metric"), **c}
    if c.get("level") in (None, "undefined") or not shown_evidence(ev).get("metric"):
        return text
    d = c.get("decided_by") or {}
    words = evidence_words(ev)
    if d.get("metric") and not _number(d.get("null_p99")) and d["metric"] != ev["metric"]:
        words = (f"{d['metric']} = {fmt_value(d.get('value'))}" + (f" of {c['n_total']}" if c.get("n_total") else "")
                 + f"; {words}")
    return text + f" — decided by {e(words)}"


def _image_evidence(a: dict, out: Path) -> str:
    """An attack's image evidence (docs/DESIGN.md §4), one row per attacked client: its originals beside its own
    reconstructions (the PNGs :func:`gradleak.evaluation.images.grid_owner` names for it), the worst (most leaking)
    client first (``worst_client``, then :func:`leak_rank`), each row labelled by :func:`_client_label`; any other
    PNG (t-SNE, ROC, the leakage kind's grids, a deployment's unscored reconstructions) in one row after them. A
    framework round audit keeps each client's PNGs in its own folder (``client_<c>/``, :mod:`gradleak.run.round_audit`):
    the folder names the client."""
    from gradleak.evaluation.images import grid_owner

    e = html.escape
    owned: dict[tuple[int, int], list[str]] = {}
    rest = []
    for n in (str(x) for x in a.get("artifacts", [])):
        o = grid_owner(n)
        folder = re.match(r"client_(\d+)/", n)
        if o and folder:
            o = (o[0], o[1], int(folder.group(1)))
        (owned.setdefault(o[1:], []) if o else rest).append(n)
    clients = list(a.get("per_client") or []) or [{**a, "client": a.get("worst_client", 0)}]  # a one-client entry
    worst = a.get("worst_client")
    clients.sort(key=lambda c: (worst is not None and c.get("client") == worst, leak_rank(c)), reverse=True)
    clients += [{"client": ci if not t else f"{ci}@trial{t}"} for t, ci in sorted(owned)  # not graded in audit.json
                if not any(client_key(c.get("client")) == (t, ci) for c in clients)]
    rows = []
    for c in clients:
        pngs = owned.pop(client_key(c.get("client")), [])
        if pngs:
            rows.append(f'<div class="client-row" data-client="{e(str(c["client"]))}" '
                        f'data-level="{e(str(c.get("level") or ""))}"><p class="client-label">{_client_label(a, c)}'
                        "</p>" + _figure_pair(a, out, pngs, c["client"]) + "</div>")
    return "".join(rows) + _figure_pair(a, out, rest)


def dp_check_words(dp: dict) -> list[str]:
    """The DP check (``audit.json`` ``dp_check``) in sentences: the verdict, each claim with its accountant, each
    measured threat model with its interval, the method."""
    from gradleak.evaluation.empirical_epsilon import fmt_epsilon

    out = [f"{dp['verdict'].replace('_', ' ').upper()}: {dp.get('sentence', '')}."]
    for c in dp.get("mechanisms") or []:
        out.append(f"claimed by {c['name']}" + (f" (where: {c['where']})" if c.get("where") else "")
                   + f": ε = {fmt_epsilon(c['claimed_epsilon'])} at δ = {c['delta']:g} ({c['accountant']}); covers "
                   + ", ".join(t.replace("_", " ") for t in c["covers"]))
    for m in dp.get("measured") or []:
        if m.get("kind") == "per_coordinate":  # NVFlare's SVTPrivacy (gradleak.run.svt_check)
            from gradleak.run.svt_check import check_words

            out.append(check_words(m))
            continue
        out.append(f"measured, {m['threat_model'].replace('_', ' ')}: ε = {fmt_epsilon(m['epsilon'])} (95 % interval "
                   f"{fmt_epsilon(m['interval'][0])}–{fmt_epsilon(m['interval'][1])}, 99.9 % lower end {fmt_epsilon(m['strict_lower'])}; "
                   f"threshold bound {fmt_epsilon(m['lower_bound'])} at {m['lower_bound_confidence']:.0%}; two-spread fit "
                   f"{fmt_epsilon(m['epsilon_separate_spreads'])}"
                   + (f"; one-run bound (Steinke et al. 2023) {fmt_epsilon(m['one_run_bound'])} at "
                      f"{100 * m['one_run']['confidence']:g} %, {m['one_run']['correct']} of {m['one_run']['guesses']} "
                      f"guesses right, at most {fmt_epsilon(m['one_run_ceiling'])} with these canaries"
                      if "one_run" in m else "")
                   + f") against the claimed {fmt_epsilon(m.get('claimed_epsilon'))}: "
                   f"{m.get('verdict', '').replace('_', ' ')}")
        if m.get("tests"):
            out.append(f"claim tests, {m['threat_model'].replace('_', ' ')} (each at α = "
                       f"{next(iter(m['tests'].values()))['alpha']:.2g}): " + "; ".join(
                           f"{name} p = {t['p_value']:.2g}" + (" REJECTS" if t["rejects"] else "")
                           for name, t in m["tests"].items()))
    if "canaries" in dp:
        out.append(f"{dp['canaries']} canary clients inserted and {dp['unseen_canaries']} never inserted, "
                   f"{dp['dimension']} trainable coordinates, {dp['rounds']} round(s), engine {dp['engine']}, "
                   f"{dp['seconds']:.1f} s. Method: {dp['method']}" + (f"; {dp['tests_method']}" if dp.get("tests_method")
                                                                         else ""))
    return out


def banner_colour(verdict: str) -> str:
    """The banner's colour for ``verdict``: red for a leak, amber for a leak only a stronger server reaches, green only
    for ``no_leak_found``; grey for ``undefined`` (nothing measured is not safety) and any verdict not listed."""
    return {"leaks": "#b00020", "leaks_stronger_server": "#b36b00", "no_leak_found": "#2e7d32",
            "undefined": "#555555"}.get(verdict, "#555555")


def _applicable_words(a: dict) -> str:
    return "yes" if a.get("applicable") else ("under upgrade" if a.get("applicable_under") == "upgraded" else "no")


def _deciding_measure(a: dict, ev: dict) -> str:
    """The attack table's "deciding measure" cell: the metric that decided the level and its value, the seeds' worst
    and median, the headline beside it when another metric decided, and the counts it rests on."""
    val = ev.get("value")
    if not (_number(val) and "level" in a):
        return "–"
    return (f"{ev['metric']} = {fmt_value(val)}"
            + (f" (worst of {len(a['per_seed'])} seeds; median {fmt_value(a.get('median'))})"
               if a.get("per_seed") and "median" in a and not ev.get("headline") else "")
            + (f"; headline {ev['headline']['metric']} = {fmt_value(ev['headline'].get('value'))}"
               if ev.get("headline") else "")
            + (f"; on {a['sample']}" if a.get("sample") else ""))


def attack_row(a: dict) -> str:
    """One attack's row of the report's attack table (the metric that decided the level, beside its own null)."""
    e = html.escape
    ev = shown_evidence(a)
    judged = "level" in a
    cells = (a["name"], _applicable_words(a), a.get("threat_words", a.get("threat", "–")), a.get("level", "not run"),
             _deciding_measure(a, ev), fmt_value(ev.get("null_p99")) if judged else "–",
             fmt_p(ev.get("p_value"), bare=True) if judged else "–",
             client_words(a["worst_client"]) if "worst_client" in a else "–",
             f"{a['n_success']} / {a['n_total']}" if a.get("n_success") is not None else "–",
             f"{a['seconds']:.0f} s" if "seconds" in a else "–",
             "; ".join(x for x in (a.get("rule", "") if judged else "", a.get("reason", "")) if x))
    return "<tr>" + "".join(f"<td>{e(str(x))}</td>" for x in cells) + "</tr>"


def grouped_rows(groups: dict) -> list[str]:
    """The attack table's grouped rows (:func:`not_run_groups`): the attacks ``--only`` left out, the attacks of
    another modality (one row per modality), and the left-out attacks that could not run here anyway."""
    e = html.escape
    rows = []
    if groups["left_out"]:
        rows.append(f'<tr class="grouped"><td>{len(groups["left_out"])} '
                    + ("applicable, not run" if groups["left_out_known"] else "left out")
                    + f'</td><td>{"yes" if groups["left_out_known"] else "–"}</td><td>–</td>'
                    "<td>not run</td>" + "<td>–</td>" * 6 + f"<td>{e(left_out_words(groups))}</td></tr>")
    for am, names in groups["other_modality"].items():
        rows.append(f'<tr class="grouped"><td>{len(names)} {e(am)} attacks</td><td>no</td><td>–</td><td>not run</td>'
                    + "<td>–</td>" * 6 + f"<td>not applicable: they attack {e(am)} data; this setup's data are "
                    f"{e(str(groups['modality']))} ({e(', '.join(names))})</td></tr>")
    if groups["left_out_not_applicable"]:
        rows.append(f'<tr class="grouped"><td>{len(groups["left_out_not_applicable"])} not applicable</td><td>no</td>'
                    "<td>–</td><td>not run</td>" + "<td>–</td>" * 6
                    + f"<td>not applicable to this setup (and left out by {e(groups['by'])}): " + e("; ".join(
                        f"{x['name']}: {short_reason(x.get('reason', ''))}" for x in groups["left_out_not_applicable"]))
                    + "</td></tr>")
    return rows


def attack_table_rows(result: dict) -> list[str]:
    """Every row of the report's attack table: one per attack, the attacks of another modality and those ``--only``
    left out grouped (:func:`grouped_rows`)."""
    groups = not_run_groups(result)
    grouped = {n for v in groups["other_modality"].values() for n in v}
    return [attack_row(a) for a in result["attacks"] if a["name"] not in grouped] + grouped_rows(groups)


def _margin_lines(a: dict) -> list[str]:
    """The leakage margin per attacked layer: how far the declared noise is from drowning what the attack read."""
    out = []
    for layer, m in (a.get("leakage_margin") or {}).items():
        sm = m.get("spectral_margin")
        out.append(f'<p class="margin">Leakage margin ({html.escape(layer)}): '
                   + (f"the weakest direction the attack used stands {fmt_value(sm)}x the noise edge; "
                      if isinstance(sm, float) and sm == sm else "no declared noise; ")
                   + f"noise of per-coordinate std {fmt_value(m.get('drowning_noise_std'))} would drown it, "
                   f"{fmt_value(m.get('drowning_noise_std_all'))} every direction of this upload.</p>")
    return out


def _client_table(a: dict) -> str:
    """Every attacked client of the evidence run, its level and deciding measure beside its null and its own
    warnings ("" with one client)."""
    e = html.escape
    if not (a.get("per_client") and len(a["per_client"]) > 1):
        return ""
    crow = []
    for c in a["per_client"]:
        cv = shown_evidence({"metric": a.get("metric"), **c})  # a client's entry: no headline name of its own
        crow.append(f"<tr><td>{e(client_words(c['client']))}</td><td>{e(c['level'])}</td>"
                    f"<td>{e(str(cv.get('metric') or ''))} = {fmt_value(cv.get('value'))}"
                    f"{e('; on ' + c['sample']) if c.get('sample') else ''}</td>"
                    f"<td>{fmt_value(cv.get('null_p99'))}</td><td>{fmt_p(cv.get('p_value'), bare=True)}</td>"
                    f"<td>{e('; '.join(c.get('warnings') or []))}</td></tr>")
    return ("<table><tr><th>client</th><th>level</th><th>deciding measure</th><th>null p99</th><th>p</th>"
            "<th>this client's warnings</th></tr>" + "".join(crow) + "</table>")


def _rows_table(a: dict) -> str:
    """The evidence's private samples beside their reconstructions, an exact one highlighted ("" without rows)."""
    e = html.escape
    if not a.get("evidence_rows"):
        return ""
    tr = []
    for r in a["evidence_rows"]:
        exact = r["reference"].lower().split() == str(r["reconstruction"]).lower().split()
        style = ' style="background:#ffd6d6"' if exact else ""
        tr.append(f"<tr{style}><td>{e(r['reference'])}</td><td>{e(str(r['reconstruction']))}</td>"
                  f"<td>{'exact' if exact else ''}</td></tr>")
    return "<table><tr><th>private</th><th>reconstruction</th><th></th></tr>" + "".join(tr) + "</table>"


def evidence_section(a: dict, out: Path) -> str:
    """One judged attack's evidence: its level and rule, what decided it and on which client, its warnings, the
    leakage margin, every client's row, the full-strength settings tried, the images (:func:`_image_evidence`) or
    sentences, and the link to the attack's own report."""
    e = html.escape
    parts = [f"<h3>{e(a['name'])} — {e(a['level'].upper())} ({e(a.get('rule', ''))})</h3>"]
    if a["level"] != "undefined":
        parts.append(f'<p class="decided">Decided by: {e(evidence_words(a))}'
                     + (f"; the evidence is {e(client_words(a['worst_client']))}" if "worst_client" in a else "")
                     + "</p>")
    for w in dict.fromkeys(a.get("warnings") or []):
        parts.append(f'<p class="warning"><b>Warning:</b> {e(str(w))}</p>')
    parts += _margin_lines(a)
    clients = _client_table(a)
    if clients:
        parts.append(clients)
    if a.get("per_variant"):
        parts.append("<p>full-strength settings tried: " + e("; ".join(
            f"{json.dumps(v['variant']) if isinstance(v['variant'], dict) else v['variant']} (seed {v['seed']}): "
            f"{v['level']}, {fmt_value(v.get('value'))}" for v in a["per_variant"])) + "</p>")
    if a.get("out"):
        parts.append(_image_evidence(a, out))
    rows = _rows_table(a)
    if rows:
        parts.append(rows)
    if a.get("out") and (out / str(a["out"]) / "report.html").is_file():  # a round audit's attack has none
        parts.append(f'<p><a href="{e(a["out"])}/report.html">full report of this attack</a></p>')
    return "\n".join(parts)


def _defense_items(ds: list[dict] | None) -> list[str]:
    """The defenses this setup accepts, per stage (facts, not advice; None: an older audit.json without them)."""
    e = html.escape
    if ds is None:
        return ["<li>Defenses that apply: not recorded in this audit.json (rerun the audit); "
                "<code>gradleak list</code> lists every defense.</li>"]
    out = []
    for stage, where in (("update", "<code>defenses: [{name, params}]</code>, on each upload"),
                         ("training", "<code>defense: {name, ...}</code>, in local training")):
        names = [d for d in ds if d["stage"] == stage]
        if names:
            out.append(f"<li>Defenses this setup accepts ({where}): " + ", ".join(
                f'<b title="{e(d["summary"])}">{e(d["name"])}</b>' for d in names)
                + " (<code>gradleak list</code> describes each and its parameters).</li>")
    return out


def next_steps_items(result: dict) -> list[str]:
    """The "What to do next" list (:func:`next_steps`' facts in words): the leaking attacks, the deployment facts
    that kept an attack from running and the ``--set`` that grants them, the defenses this setup accepts, how to
    measure one, and where the advice is (``--advise``) when this audit has none."""
    e = html.escape
    nxt = next_steps(result)
    todo = []
    if nxt["leaking"]:
        todo.append("<li>Leaking here: " + "; ".join(
            f"<b>{e(x['name'])}</b> ({e(x['level'])}, under {e(str(x['server']))}"
            + ("" if x["configured"] else ", a stronger server than configured") + ")" for x in nxt["leaking"])
                    + ". Each is a way your clients' data can be read from their updates in this setup.</li>")
    else:
        todo.append("<li>No attack leaked above its null here (evidence, not proof: see what was not tested under "
                    "Reproducibility).</li>")
    for name, flags in nxt["facts"]:
        flags = [flags] if isinstance(flags, str) else flags
        todo.append(f"<li>{e(name)} did not run because the threat model withholds "
                    + " and ".join(f"<code>{e(f)}</code>" for f in flags)
                    + f"; if your deployment leaks {'it' if len(flags) == 1 else 'them'}, rerun with <code>"
                    + e(" ".join(f"--set {f}=true" for f in flags)) + "</code>.</li>")
    ds = nxt["defenses"]
    todo += _defense_items(ds)
    live = "server_round" in result  # a framework round audit (run/round_audit.py): each attack once, as configured
    if nxt["leaking"] and ds and live:
        todo.append("<li>To measure one, add it to the federation (the app and its gradleak config) and rerun it with "
                    "the audit, or run <code>gradleak audit CONFIG</code> on the defended config: that audit attacks "
                    "a defended setup at full strength.</li>")
    elif nxt["leaking"] and ds:
        todo.append("<li>To measure one, add it to the config and rerun this audit (the command under "
                    "Reproducibility); the audit attacks a defended setup at full strength.</li>")
    if result.get("advice") is None:
        todo.append("<li>This report does not rank or recommend defenses: <code>gradleak audit CONFIG --advise</code> "
                    + ("(in a Flower app: <code>FlowerAudit(..., advise=True)</code>) " if live else "")
                    + "searches the weakest strength of each that stops every leaking attack, and what it costs.</li>")
    return todo


#: the report's style sheet (the banner's colour is set per verdict, :func:`banner_colour`)
REPORT_STYLE = """body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}.banner{color:#fff;background:COLOUR;padding:1em;font-size:1.2em}
.pair{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start;margin:.5em 0}
.client-row{border-top:1px solid #ddd;margin:.8em 0;padding-top:.3em}.client-label{margin:.2em 0}
.pair figure{margin:0;max-width:100%}.pair img{image-rendering:pixelated;image-rendering:crisp-edges;max-width:100%;height:auto;border:1px solid #ddd}
figcaption{font-size:13px;color:#444}.warning{background:#fff4e5;border-left:4px solid #b36b00;padding:.5em}
tr.grouped td{color:#666}code{word-break:break-all}"""

#: a real browser marks how many evidence images decoded (the headless check, scripts/check_report_in_browser.py)
REPORT_SCRIPT = """<script>/* a real browser marks how many evidence images decoded (the headless check reads it) */
window.addEventListener("load", function () {
  var imgs = Array.from(document.images), ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  document.body.setAttribute("data-images", ok.length + "/" + imgs.length);
  document.body.setAttribute("data-tables", String(document.querySelectorAll("table").length));
});</script>"""


def reproducibility_items(result: dict) -> str:
    """The "Reproducibility" list: the command, the config hash and seed, the evidence record, the versions, what was
    not tested and what measured nothing."""
    e = html.escape
    not_tested = not_tested_lines(result)
    rec = result.get("evidence_record")  # gradleak.run.evidence; an older audit.json has none
    record_words = json.dumps({k: rec.get(k) for k in ("config_sha256", "gradleak_version", "source")}) if rec else "none"
    return f"""<li>command: <code id="command">{e(result['command'])}</code></li>
<li>config hash: {e(result['config_hash'])}; seed: {e(str(result['seed']))}</li>
<li>evidence record (<code>evidence_record</code> in audit.json: config, weights, split seeds, source): {e(record_words)}</li>
<li>versions: {e(json.dumps(result['environment']))}</li>
<li>not tested: {'<ul>' + ''.join(f'<li>{e(x)}</li>' for x in not_tested) + '</ul>' if not_tested else 'nothing'}</li>
<li>undefined (measured nothing): {e('; '.join(result.get('undefined') or []) or 'none')}</li>"""


def coverage_words(result: dict) -> str:
    """What was attacked: every client of the round, with the full-strength settings (``gradleak audit``) or each
    attack once as configured (a framework round audit)."""
    if "server_round" not in result:
        return ("Every client of the audited round was attacked; each attack also ran the full-strength settings it "
                "derives from the declared defenses (listed under its evidence); the worst client and setting are the "
                "evidence.")
    return ("Every client of the audited round was attacked on its own upload, each attack once as configured (a "
            "framework round audit runs no full-strength variants); the worst client is the evidence.")


def write_audit_report(result: dict, out: Path) -> Path:
    """One self-contained HTML page: verdict banner, what to do next (:func:`next_steps_items`), setup, threat,
    per-attack table (:func:`attack_table_rows`: attacks for another modality on one line), evidence worst first
    (:func:`evidence_section`: one row per attacked client, the worst first: its originals beside its own
    reconstructions, :func:`_image_evidence`), reproducibility (:func:`reproducibility_items`)."""
    from gradleak.evaluation.levels import level_rank
    from gradleak.report.html import write_atomic

    e = html.escape
    out = Path(out)
    ran = sorted([a for a in result["attacks"] if "level" in a], key=lambda a: (-level_rank(a["level"]), a["name"]))
    evidence = [evidence_section(a, out) for a in ran]
    lv = result["levels"]
    advice = result.get("advice")
    advice_html = advice_section(advice) if advice is not None else ""
    dp = result.get("dp_check")
    dp_html = ("<h2 id=\"dp_check\">Does the DP claim hold? (measured ε beside the accountant's)</h2><ul>"
               + "".join(f"<li>{e(x)}</li>" for x in dp_check_words(dp)) + "</ul>") if dp else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>gradleak audit</title>
<style>{REPORT_STYLE.replace("COLOUR", banner_colour(result["verdict"]))}</style>
</head><body>
<div class="banner" id="verdict">{e(result['headline'])}</div>
<h2 id="next">What to do next</h2><ul>{''.join(next_steps_items(result))}</ul>{advice_html}
<p>Levels (each beyond its null: {e(lv['null'])}; exact-image threshold {lv['psnr_db']:g} dB):</p>
<ul>{''.join(f'<li>{e(k)}: {e(v)}</li>' for k, v in lv['rules'].items())}</ul>
<p>{e(coverage_words(result))}</p>
{dp_html}<h2>Configuration</h2><ul>{''.join(f'<li>{e(x)}</li>' for x in result['setup'])}</ul>
<h2>Threat model (configured)</h2><ul>{''.join(f'<li>{e(x)}</li>' for x in result['threat'])}</ul>
<h2>Attacks</h2><table id="attacks"><tr><th>attack</th><th>applicable</th><th>server</th><th>level</th><th>deciding measure</th>
<th>null p99</th><th>p</th><th>worst client</th><th>exact samples</th><th>time</th><th>rule / note</th></tr>{''.join(attack_table_rows(result))}</table>
<h2>Evidence (worst level first)</h2>{''.join(evidence) or '<p>no attack ran</p>'}
<h2>Reproducibility</h2><ul>{reproducibility_items(result)}</ul>
{REPORT_SCRIPT}
</body></html>"""
    path = out / "report.html"
    write_atomic(path, page)
    return path
