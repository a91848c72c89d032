"""gradleak audit --advise: the weakest defense strength that stops every leaking attack, its cost;
the search resumes without rerunning a probe, the budget bounds it, bad input exits 2."""

from __future__ import annotations

import json
import os
import math

import pytest
from typer.testing import CliRunner

from gradleak.errors import BadInput

TEXT = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
        "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2},
        "fl": {"algorithm": "fedsgd", "rounds": 1}, "threat": {"preset": "honest-but-curious"}}


@pytest.mark.timeout(600)
def test_advice_round_trip_recommended_strength_gives_no_leak_found(tmp_path, one_thread):
    """A tiny text setup where UTR leaks: --advise (noise and pruning, 1 bisection step) recommends a strength,
    measures the accuracy with and without it on the same seeds, and that strength set in the config gives
    `no_leak_found` in a plain audit; the report shows the table, the recommendation and the plot."""
    from gradleak.cli import app
    from gradleak.run.audit import run_audit

    raw = {**TEXT, "audit": {"advise": {"candidates": ["gaussian_noise", "topk_pruning"], "steps": 1}}}
    cfg = tmp_path / "advise.yaml"
    cfg.write_text(json.dumps(raw))
    cli = CliRunner().invoke(app, ["audit", str(cfg), "--out", str(tmp_path / "a"), "--only", "utr", "--workers", "1"])
    assert cli.exit_code == 0, cli.output
    res = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert res["verdict"] == "leaks"
    assert "what stops each leak" in cli.output and "Recommended: " in cli.output  # the console says it too
    adv = res["advice"]
    assert adv["attacks"] == ["utr"] and adv["baseline"]["levels"] == {"utr": res["attacks"][0]["level"]}
    assert isinstance(adv["baseline"]["accuracy"], float) and adv["test_size"] == 64
    rec = adv["recommendation"]
    assert rec is not None and rec["defense"] in ("gaussian_noise", "topk_pruning")
    row = next(r for r in adv["rows"] if r["defense"] == rec["defense"])
    assert row["levels"] == {"utr": "none"} and isinstance(row["accuracy"], float)
    assert row["cost"] == pytest.approx(adv["baseline"]["accuracy"] - row["accuracy"])
    assert [p[0] for p in row["probes"][:2]] == [row["bracket"][1], 0.1 if rec["defense"] == "gaussian_noise"
                                                 else pytest.approx(0.978, abs=1e-3)]  # strong end, one step
    assert len(row["probes"]) == 2 or row["probes"][2][0] == row["bracket"][0]  # (+ the weak end if all stopped)
    assert rec["strength"] == row["strength"] and row["interval"][1] == row["strength"]
    assert f"--set '{rec['set'][0]}'" in " ".join(cli.output.split())
    page = (tmp_path / "a" / "report.html").read_text()
    assert 'id="advice"' in page and 'id="recommendation"' in page and "advice.png" in page
    assert (tmp_path / "a" / "advice.png").stat().st_size > 1000
    # the round trip: the recommended strength, set in the config, gives no_leak_found in a plain audit
    plain = run_audit(TEXT, tmp_path / "b", rec["set"], only=["utr"], log=lambda m: None)
    assert plain["verdict"] == "no_leak_found", plain["headline"]
    # the page in a real browser (headless Chromium) when the machine has one: the plot decodes
    import shutil
    import sys
    from pathlib import Path

    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium here (apt-get install chromium): the report was checked as text only")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_report_in_browser import check

    assert check(tmp_path / "a" / "report.html") == []


# ------------------------------------------------------------------------------------------------ the search (probes faked)

LEAKS = {"attacks": [{"name": "utr", "level": "partial"}, {"name": "dlg", "level": "none"}]}


@pytest.fixture(autouse=True)
def one_batch(monkeypatch, request):
    """The flow tests below count probes on the audited victim batch alone (``batches = 1``); the batch checks have
    their own tests (``test_a_strength_*_victim_batch*``), which ask for ``batches`` explicitly."""
    from gradleak.run import advise_options

    monkeypatch.setattr(advise_options, "BATCHES", 1)
    if "post_processing" not in request.node.name:  # the flow tests count every probe of a search without the rule
        from gradleak.run import advise_carry

        monkeypatch.setattr(advise_carry, "RULE", False)


def _fake(calls, threshold=0.05, kill_at=None, clock=None):
    """A probe: UTR stops when the per-coordinate noise std reaches ``threshold``; accuracy falls with the noise."""

    def probe(raw, out_dir, only, device, workers, utility_from):
        calls.append(out_dir)
        if kill_at is not None and len(calls) == kill_at:
            raise KeyboardInterrupt  # a kill in the middle of the search
        if clock is not None:
            clock[0] += 10.0
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        level = "none" if std >= threshold else "partial"
        return {"verdict": "leaks" if level != "none" else "no_leak_found", "accuracy": 0.8 - min(std, 0.5),
                "attacks": {a: {"level": level, "metric": "m", "value": 1 - std, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    return probe


def _fake_utility(calls=None):
    """A utility run: the accuracy falls with the noise like the fake probe's; the baseline reports its norms."""

    def utility(raw, attacks, rounds, device, norms, accuracy_start=None):
        if calls is not None:
            calls.append(raw)
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        acc = 0.8 - min(std, 0.5)
        out = {"accuracy": acc, "accuracy_start": 0.5, "accuracy_curve": [0.5, acc], "rounds": rounds}
        if (raw.get("defense") or {}).get("name") == "dpsgd":
            out["dp_epsilon"] = 3.0
        if norms:
            out.update(update_norms=[0.04, 0.02, 0.03, 0.05], sample_gradient_norms=[0.5, 0.7, 0.6])
        return out

    return utility


@pytest.fixture
def fake_utility(monkeypatch):
    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", _fake_utility(calls))
    return calls


def test_bisection_finds_the_weakest_stopping_strength_and_resumes_without_rerunning(tmp_path, monkeypatch,
                                                                                      fake_utility):
    """The search on a log scale brackets the threshold; after a kill mid-search the rerun runs only the probes not
    finished before (each cell once in the JSONL) and ends with the same advice."""
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls, kill_at=3))
    with pytest.raises(KeyboardInterrupt):
        mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None)
    # strong end, first bisection step, then killed in the second (no baseline probe: the audit is the baseline)
    assert len(calls) == 3
    calls2: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls2))
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None)
    # the killed probe, 2 more against the screen (utr, the attack that leaked), then the check against every attack
    assert len(calls2) == 4 and adv["ran_now"][0] == "gaussian_noise:std=0.01[utr]"
    rows = [json.loads(x) for x in (tmp_path / adv["jsonl"]).read_text().splitlines()]
    ids = [r["cell"] for r in rows if not r["cell"].startswith("utility:")]
    assert len(ids) == len(set(ids)) == 6  # strong end + 4 steps + the check, none twice
    assert [i.split("#")[0] for i in ids][-1] == "gaussian_noise:std=0.0562"  # the check: every attack
    utility_ids = [r["cell"] for r in rows if r["cell"].startswith("utility:")]
    assert len(utility_ids) == len(set(utility_ids)) == 2  # the baseline's and the found strength's, each once
    assert len(fake_utility) == 2
    (row,) = adv["rows"]
    lo, hi = row["interval"]
    assert lo < 0.05 <= hi == row["strength"]
    assert hi / lo == pytest.approx(10 ** (4 / 2 ** 4), rel=0.02)  # 4 halvings of the 4 decades on a log scale
    # every attack the audit measured is probed (dlg did not leak undefended, but a defense could make it the best)
    assert row["bracket"] == [1e-3, 10.0] and row["levels"] == {"utr": "none", "dlg": "none"}
    assert row["searched_against"] == ["utr"] and "unverified" not in row
    assert adv["tested_against"] == ["utr", "dlg"]
    assert adv["baseline"]["accuracy"] == 0.8 and row["cost"] == pytest.approx(hi)
    assert adv["recommendation"]["defense"] == "gaussian_noise" and adv["attacks"] == ["utr"]
    # a third call runs nothing
    calls3: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls3))
    again = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None)
    assert calls3 == [] and again["rows"][0]["strength"] == hi


def _two_attack_probe(calls, utr_stops=0.05, dlg_leaks=(0.01, 0.3)):
    """UTR (leaked undefended) stops from ``utr_stops``; DLG (``none`` undefended) leaks inside ``dlg_leaks``: a
    defense in that range leaves the lossy attack above its null."""

    def probe(raw, out_dir, only, device, workers, utility_from):
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        calls.append((std, tuple(only)))
        lv = {"utr": "none" if std >= utr_stops else "partial",
              "dlg": "partial" if dlg_leaks[0] <= std < dlg_leaks[1] else "none"}
        return {"verdict": "leaks" if "partial" in [lv[a] for a in only] else "no_leak_found",
                "attacks": {a: {"level": lv[a], "metric": "m", "value": 0.5, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    return probe


def test_the_search_screens_with_the_leaking_attacks_and_checks_every_attack_at_the_strength_found(
        tmp_path, monkeypatch, fake_utility):
    """The bisection probes only the attack that leaked (utr); the strength found is probed against every tested
    attack; where another attack still leaks there, the search resumes above it against every attack, and the
    strength reported stops them all."""
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _two_attack_probe(calls))
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None)
    (row,) = adv["rows"]
    screen = [c for c in calls if c[1] == ("utr",)]  # (no baseline probe: the audit's levels are the baseline)
    full = [c for c in calls if set(c[1]) == {"utr", "dlg"}]
    assert len(screen) == 5 and len(full) >= 2 and len(screen) + len(full) == len(calls)
    utr_found = min(s for s, _ in screen if s >= 0.05)
    assert full[0][0] == utr_found < 0.3  # the check at the screen's strength: dlg leaks there
    assert row["verification"]["strength"] == utr_found and row["verification"]["levels"]["dlg"] == "partial"
    assert row["status"] == "stopped" and row["strength"] >= 0.3 and row["interval"][0] >= utr_found
    assert row["levels"] == {"utr": "none", "dlg": "none"}
    assert all(set(o) == {"utr", "dlg"} for s, o in calls[len(screen):])  # after the check: every attack
    assert adv["recommendation"]["strength"] == row["strength"]
    # where the check passes, one extra probe: no resumed search
    calls2: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _two_attack_probe(calls2, dlg_leaks=(0.0, 0.0)))
    adv = mod.advise(TEXT, tmp_path / "b", LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None)
    assert [set(o) for _, o in calls2] == [{"utr"}] * 5 + [{"utr", "dlg"}]
    assert adv["rows"][0]["strength"] == calls2[-1][0] and "verification" not in adv["rows"][0]


def test_a_strength_the_budget_left_unchecked_is_never_recommended(tmp_path, monkeypatch, fake_utility):
    from gradleak.run import advise as mod

    clock = [0.0]
    monkeypatch.setattr(mod, "clock", lambda: clock[0])
    calls: list = []
    inner = _two_attack_probe(calls, dlg_leaks=(0.0, 0.0))

    def probe(*a, **k):
        clock[0] += 10.0
        return inner(*a, **k)

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None,
                     budget_seconds=35)
    (row,) = adv["rows"]
    assert row["status"] == "unfinished" and row["unverified"] is True and "not recommended" in row["note"]
    assert all(o == ("utr",) for _, o in calls) and adv["recommendation"] is None and adv["ranking"] == []


def test_not_stopped_within_the_bracket_and_a_configured_defense_is_the_starting_point(tmp_path, monkeypatch,
                                                                                        fake_utility):
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls, threshold=100.0))  # beyond the bracket's strong end
    raw = {**TEXT, "defenses": [{"name": "gaussian_noise", "params": {"std": 0.01, "per_coordinate": True}}]}
    adv = mod.advise(raw, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=3, log=lambda m: None)
    (row,) = adv["rows"]
    assert row["status"] == "not_stopped" and row["bracket"] == [0.01, 10.0] and row["starting_point"] == 0.01
    assert "not stopped within [0.01, 10]" in row["note"] and adv["recommendation"] is None
    assert len(calls) == 1  # the strong end: no bisection (the audit's levels are the baseline)
    # every probe stops: the weak end is measured too, and reported as the strength (weaker ones not searched)
    calls.clear()
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls, threshold=0.0))
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=2, log=lambda m: None)
    (row,) = adv["rows"]
    assert [p[0] for p in row["probes"]] == [10.0, 0.1, 0.01, 1e-3, 1e-3] and row["strength"] == 1e-3
    assert row["probes"][-1][1] == "gaussian_noise:std=0.001"  # the check of the found strength against every attack
    assert row["interval"] == [None, 1e-3] and "weak end" in row["note"] and len(calls) == 5


def test_budget_marks_unfinished_defenses(tmp_path, monkeypatch, fake_utility):
    """Each fake probe takes 10 (fake) seconds. The searches advance together, one probe of each per batch: the noise
    search's strong end beside the baseline utility run (10 s; DP-Gaussian fits its clipping norm to that run, so it
    starts after it), then the noise search's first bisection step beside DP-Gaussian's strong end (30 s; its fake
    probe leaks there: not stopped, its search over); a 25 s budget then ends the noise search, listed as
    unfinished in the advice and the report. A budget spent after the first batch starts no other candidate.
    (Every tested attack leaked here, so the search's probes are the full check; a screened strength left unchecked
    is never recommended: :func:`test_a_strength_the_budget_left_unchecked_is_never_recommended`.)"""
    from gradleak.run import advise as mod
    from gradleak.run.audit_report import advice_section

    clock = [0.0]
    monkeypatch.setattr(mod, "clock", lambda: clock[0])
    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls, clock=clock))
    adv = mod.advise(TEXT, tmp_path, {"attacks": [{"name": "utr", "level": "partial"}]},
                     candidates=["gaussian_noise", "dp_gaussian"], steps=3, budget_seconds=25, log=lambda m: None)
    assert adv["unfinished"] == ["gaussian_noise"] and len(calls) == 3
    noise, dp = adv["rows"]  # the candidates' order, though DP-Gaussian began later
    assert noise["strength"] == 0.1 and noise["interval"] == [1e-3, 0.1] and "unfinished (budget)" in noise["note"]
    assert dp["status"] == "not_stopped" and "strength" not in dp
    assert adv["recommendation"]["defense"] == "gaussian_noise"  # stops, though not the weakest: said
    page = advice_section(adv)
    assert "Not finished within the budget of 25 s: gaussian_noise" in page
    clock[0] = 0.0
    calls.clear()
    adv = mod.advise(TEXT, tmp_path / "spent", {"attacks": [{"name": "utr", "level": "partial"}]},
                     candidates=["gaussian_noise", "dp_gaussian"], steps=3, budget_seconds=5, log=lambda m: None)
    assert adv["unfinished"] == ["gaussian_noise", "dp_gaussian"] and len(calls) == 1  # the first batch only
    noise, dp = adv["rows"]
    assert noise["strength"] == 10.0 and "unfinished (budget)" in noise["note"]
    assert dp["status"] == "unfinished" and "not started" in dp["note"]


def test_strength_scales_and_the_gaussian_epsilon():
    from gradleak.run.advise_candidates import CANDIDATE_BY_NAME as C
    from gradleak.run.advise_search import midpoint
    from gradleak.run.advise_utility import gaussian_epsilon

    assert midpoint(C["gaussian_noise"], 1e-3, 10.0) == pytest.approx(0.1)
    assert midpoint(C["topk_pruning"], 0.5, 0.999) == pytest.approx(1 - math.sqrt(0.5 * 0.001), abs=1e-3)
    assert midpoint(C["stochastic_quantization"], 8, 1) == 3 and midpoint(C["stochastic_quantization"], 2, 1) is None
    e1, e2 = gaussian_epsilon(1.0, 1), gaussian_epsilon(2.0, 1)
    assert e1 > e2 > 0 and gaussian_epsilon(1.0, 4) > e1
    # the Gaussian mechanism at sigma = 1 is (eps, 1e-5)-DP with eps near 4.4 (RDP conversion; the optimum is ~3.7)
    assert 3.5 < e1 < 6


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("args, field", [(["--advise", "--budget", "-1"], "--budget"),
                                         (["--set", "audit.advise=3"], "audit.advise"),
                                         (["--set", "audit.advise={steps: -1}"], "audit.advise.steps"),
                                         (["--budget", "60"], "--budget")])
def test_bad_advise_input_exits_2_naming_the_field(tmp_path, args, field):
    from gradleak.cli import app

    cfg = tmp_path / "a.yaml"
    cfg.write_text(json.dumps(TEXT))
    res = CliRunner().invoke(app, ["audit", str(cfg), "--out", str(tmp_path / "o"), "--only", "utr", *args])
    assert res.exit_code == 2, res.output
    assert field in res.output
    assert not (tmp_path / "o").exists()


def test_bad_advise_section_in_the_api():
    from gradleak.run.advise_options import advise_section, check_budget

    with pytest.raises(BadInput, match="audit.advise.candidates"):
        advise_section({"candidates": ["nope"]})
    with pytest.raises(BadInput, match="audit.budget"):
        check_budget(0, "audit.budget")
    assert advise_section(True)["candidates"] is None and advise_section(False) is None


def test_a_probe_whose_attacks_all_fail_to_fit_reports_their_reason_not_a_threat_error(tmp_path, monkeypatch):
    """A secure-aggregation probe whose K clients' data do not fit: every run is refused once the data are known;
    the probe reports the setup's own error for each attack (it used to describe the setup with the first attack's
    config, which for ProjRes needs a threat upgrade, and raised that instead; now an audit whose every run
    is refused is bad input, not an undefined verdict), and the advice counts it as unmeasured, not a stop."""
    from gradleak.run import audit as audit_mod
    from gradleak.run.advise_probes import outcome, probe

    monkeypatch.setattr(audit_mod, "_run_one", lambda name, cand, out, dev: {
        "bad_input": "data.batch_size: 8 clients' sentences are more than the 200 texts", "seconds": 0.0})
    raw = {**TEXT, "data": {**TEXT["data"], "nonmembers": 8}}
    row = probe(raw, str(tmp_path), ["projres", "utr"], None, 1, ["utr"])
    assert row["field"] == "data.batch_size" and row["refused"].startswith("data.batch_size: 8 clients'")
    assert all(row["attacks"][a]["reason"].startswith("data.batch_size") for a in ("projres", "utr"))
    assert outcome(row, ["projres", "utr"]) == "unmeasured"


def test_the_table_says_when_epsilon_guarantees_nothing():
    from gradleak.run.audit_report import advice_rows

    adv = {"delta": 1e-5, "baseline": {"accuracy": 0.5}, "ranking": ["dp_gaussian", "dpsgd"],
           "rows": [{"defense": "dp_gaussian", "parameter": "noise_multiplier", "strength": 0.001, "bracket": [1e-3, 10],
                     "accuracy": 0.5, "cost": 0.0, "epsilon": 5.5e5, "status": "stopped"},
                    {"defense": "dpsgd", "parameter": "noise_multiplier", "strength": 2.0, "bracket": [1e-3, 10],
                     "accuracy": 0.5, "cost": 0.0, "epsilon": 2.1, "status": "stopped"}]}
    (dp, sgd) = advice_rows(adv)
    assert dp[6] == "5.5e+05 (δ = 1e-05; no meaningful guarantee: ε > 10)" and sgd[6] == "2.1 (δ = 1e-05)"


def test_the_table_words_a_measured_epsilon_with_and_without_an_interval():
    """The DP check at the strength found: a fitted epsilon shows its 95 % interval; SVT's sign-canary check gives a
    one-sided bound without one, and the row (and the HTML report built from it) still renders."""
    from gradleak.run.audit_report import advice_rows, advice_section

    row = {"parameter": "noise_var", "strength": 100.0, "bracket": [0.01, 100.0], "accuracy": 0.5, "cost": 0.0,
           "status": "stopped"}
    adv = {"delta": 1e-5, "baseline": {"accuracy": 0.5}, "ranking": ["nvflare_svt", "dp_gaussian"],
           "rows": [{**row, "defense": "nvflare_svt", "epsilon": 2.4e7, "epsilon_measured": {
               "verdict": "vacuous", "claimed_epsilon": 2.4e7, "epsilon": 1.5e5, "interval": None,
               "threat_model": "each_upload"}},
                    {**row, "defense": "dp_gaussian", "epsilon": 4.7, "epsilon_measured": {
                        "verdict": "consistent", "claimed_epsilon": 4.7, "epsilon": 4.65, "interval": [3.37, 6.13],
                        "threat_model": "each_upload"}}]}
    svt, dp = advice_rows(adv)
    assert "measured 1.5e+05 (each upload): vacuous" in svt[6] and "interval" not in svt[6]
    assert "measured 4.65 (95 % interval 3.37–6.13, each upload): consistent" in dp[6]
    assert "vacuous" in advice_section(adv)


def test_a_configured_defense_is_strengthened_in_its_own_mode_only():
    """A configured absolute-noise defense is the absolute candidate's starting point and is replaced by it; the
    per-coordinate candidate is added beside it."""
    from gradleak.run.advise_candidates import CANDIDATE_BY_NAME as C
    from gradleak.run.advise_candidates import defended_config, starting_point

    raw = {**TEXT, "defenses": [{"name": "gaussian_noise", "params": {"std": 1e-5}}, {"name": "clipping",
                                                                                     "params": {"max_norm": 5.0}}]}
    assert starting_point(raw, C["gaussian_noise_absolute"]) == 1e-5 and starting_point(raw, C["gaussian_noise"]) is None
    a = defended_config(raw, C["gaussian_noise_absolute"], 1e-3)["defenses"]
    assert a == [{"name": "clipping", "params": {"max_norm": 5.0}},
                 {"name": "gaussian_noise", "params": {"std": 1e-3, "per_coordinate": False, "relative": False}}]
    b = defended_config(raw, C["gaussian_noise"], 0.5)["defenses"]
    assert len(b) == 3 and b[-1] == {"name": "gaussian_noise", "params": {"std": 0.5, "per_coordinate": True}}


def test_a_dp_row_with_a_hollow_epsilon_ranks_after_plain_noise_at_the_same_cost(tmp_path, monkeypatch, fake_utility):
    """Both stop every attack at no accuracy cost: the DP row whose epsilon is far above 10 (its clipping norm above
    the update's norm: absolute noise under a DP name) is not recommended over plain noise; with a meaningful epsilon
    it would be (the standard first)."""
    from gradleak.run import advise as mod

    def probe(raw, out_dir, only, device, workers, utility_from):
        return {"verdict": "no_leak_found", "accuracy": 0.5,
                "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None: {
        "accuracy": 0.5, "accuracy_start": 0.4, "rounds": rounds})  # every defense costs nothing
    adv = mod.advise(TEXT, tmp_path / "a", LEAKS, candidates=["dp_gaussian", "gaussian_noise"], steps=1,
                     log=lambda m: None)
    dp = next(r for r in adv["rows"] if r["defense"] == "dp_gaussian")
    assert dp["strength"] == 1e-3 and dp["epsilon"] > 10  # sigma 0.001 over the utility rounds
    assert dp["cost"] == 0 and "clip_norm" not in dp and "no update norm observed" in dp["clip_note"]
    assert adv["ranking"] == ["gaussian_noise", "dp_gaussian"] and adv["recommendation"]["defense"] == "gaussian_noise"
    monkeypatch.setattr("gradleak.run.advise_utility.gaussian_epsilon", lambda *a, **k: 2.0)  # a meaningful epsilon: DP first again
    adv = mod.advise(TEXT, tmp_path / "b", LEAKS, candidates=["dp_gaussian", "gaussian_noise"], steps=1,
                     log=lambda m: None)
    assert adv["recommendation"]["defense"] == "dp_gaussian"


def test_the_probes_test_set_fits_a_small_fixed_dataset():
    """The 40 CIFAR samples cannot spare 64 held-out images beside up to 8 one-image clients: the probes take what is
    left (40 - 8 - 1 = 31) instead of failing every probe; generated and text sets keep 64."""
    from gradleak.config.loading import load_yaml
    from gradleak.run.advise_probes import TEST_SIZE, spare_images
    from gradleak.run.audit import plan_audit

    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "audit"
    cifar = ["data.name=cifar-samples", "data.public=natural-crops", "model.num_classes=110"]
    cfg = plan_audit(load_yaml(root / "vit_lora.yaml"), cifar, ["lora_span"])[3][0][2]
    assert spare_images(cfg) == 31
    cfg = plan_audit(load_yaml(root / "vit_lora.yaml"), cifar + ["data.batch_size=4"], ["lora_span"])[3][0][2]
    assert spare_images(cfg) == 40 - 8 * 4 - 1
    cfg = plan_audit(load_yaml(root / "vit_lora.yaml"), ["data.name=natural-crops", "data.public=public-natural",
                                                         "model.num_classes=110"], ["lora_span"])[3][0][2]
    assert spare_images(cfg) == TEST_SIZE
    assert spare_images(plan_audit(TEXT, [], ["utr"])[3][0][2]) == TEST_SIZE


def test_dp_candidates_clip_at_the_median_observed_norm_and_report_both_epsilons(tmp_path, monkeypatch, fake_utility):
    """The baseline utility run's observed norms set the DP candidates' clipping norms (DP-Gaussian: the median upload
    norm, DP-SGD: the median per-sample gradient norm), which the probes and the recommendation use; epsilon is
    reported over the utility rounds and over the audited round, and the cost comes from the utility runs."""
    from gradleak.run import advise as mod
    from gradleak.run.advise_utility import gaussian_epsilon

    seen: list = []

    def probe(raw, out_dir, only, device, workers, utility_from):
        seen.append(raw)
        return {"verdict": "no_leak_found", "dp_epsilon": 40.0,
                "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["dp_gaussian", "dpsgd"], steps=1, utility_rounds=7,
                     log=lambda m: None)
    dp, sgd = adv["rows"]
    assert dp["clip_norm"] == 0.035 and "median" in dp["clip_note"]  # median of [0.04, 0.02, 0.03, 0.05]
    assert sgd["clip_norm"] == 0.6 and "per-sample" in sgd["clip_note"]
    probed = [d["params"] for r in seen for d in r.get("defenses") or [] if d["name"] == "dp_gaussian"]
    assert probed and all(p["max_norm"] == 0.035 for p in probed)
    assert all((r.get("defense") or {}).get("max_grad_norm") == 0.6 for r in seen if r.get("defense"))
    assert '"max_norm": 0.035' in dp["set"][0] and '"max_grad_norm": 0.6' in sgd["set"][0]
    assert dp["epsilon"] == pytest.approx(gaussian_epsilon(dp["strength"], 7))
    assert dp["epsilon_attacked"] == pytest.approx(gaussian_epsilon(dp["strength"], 1))
    assert dp["epsilon"] > dp["epsilon_attacked"] and "7 utility round" in dp["epsilon_note"]
    assert sgd["epsilon"] == 3.0 and sgd["epsilon_attacked"] == 40.0  # the utility run's accountant, the probe's
    assert adv["baseline"]["accuracy"] == 0.8 and dp["cost"] == 0 and adv["utility_rounds"] == 7
    assert fake_utility[0].get("defenses") in (None, [])  # the baseline trains without an added defense
    trained = [d["params"] for r in fake_utility for d in r.get("defenses") or [] if d["name"] == "dp_gaussian"]
    assert trained == [{**trained[0], "max_norm": 0.035}]  # the utility run trains with the fitted norm too
    assert [r["defense"]["max_grad_norm"] for r in fake_utility if r.get("defense")] == [0.6]


def test_rdlv_filter_is_listed_as_not_applicable_without_batchnorm_and_admitted_with_it():
    from gradleak.config.loading import load_yaml
    from gradleak.run.advise_candidates import CANDIDATE_BY_NAME as C
    from gradleak.run.advise_candidates import defended_config
    from gradleak.run.advise_probes import not_admitted
    from gradleak.run.advise_search import midpoint

    from pathlib import Path

    spec = C["rdlv_filter"]
    why = not_admitted({**TEXT, "data": {**TEXT["data"], "test_size": 8}}, spec, ["utr"])
    assert why is not None and "rdlv_filter" in why or "image" in why
    vit = load_yaml(Path(__file__).resolve().parents[1] / "configs" / "audit" / "vit_lora.yaml")
    assert "no BatchNorm layer" in not_admitted(vit, spec, ["lora_span"])
    leak = load_yaml(Path(__file__).resolve().parents[1] / "configs" / "leakage" / "fmnist_resnet18.yaml")
    assert not_admitted(leak, spec, ["bn_inversion"]) is None
    assert defended_config(leak, spec, 0.5)["defense"] == {"name": "rdlv_filter", "threshold": 0.5}
    assert midpoint(spec, 1.0, 0.0) == 0.5  # a linear scale (the RDLV may be 0)


@pytest.mark.parametrize("value", ["0", "2.5", "true"])
def test_bad_utility_rounds_exits_2_naming_the_field(tmp_path, value):
    from gradleak.cli import app

    cfg = tmp_path / "a.yaml"
    cfg.write_text(json.dumps(TEXT))
    res = CliRunner().invoke(app, ["audit", str(cfg), "--out", str(tmp_path / "o"), "--only", "utr", "--advise",
                                   "--set", f"audit.utility_rounds={value}"])
    assert res.exit_code == 2, res.output
    assert "audit.utility_rounds" in res.output and not (tmp_path / "o").exists()


def test_unknown_executor_exits_2(tmp_path):
    from gradleak.cli import app

    cfg = tmp_path / "a.yaml"
    cfg.write_text(json.dumps(TEXT))
    res = CliRunner().invoke(app, ["audit", str(cfg), "--out", str(tmp_path / "o"), "--only", "utr", "--advise",
                                   "--executor", "spark"])
    assert res.exit_code == 2 and "--executor" in res.output, res.output


def test_a_parallel_executor_gets_every_strong_end_at_once_and_picklable_jobs(tmp_path, monkeypatch, fake_utility):
    """--executor ray/local: the candidates' strong-end probes go to the cell loop as one batch under that executor
    (then the bisections find them done), as do the utility runs; the jobs pickle (they cross processes). The cell
    loop runs them inline here (the fakes live in this process); the executors themselves are tested in
    tests/test_sweep.py."""
    import pickle

    from gradleak.run import advise as mod
    from gradleak.run import cells as cells_mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake(calls))
    real = cells_mod.run_cells
    batches: list = []

    def spy(cells, jsonl, row, **kw):
        batches.append((kw.get("executor"), [c.id.split("#")[0] for c in cells]))
        for c in cells:
            pickle.dumps((c.fn, c.args))
        return real(cells, jsonl, row, **{**kw, "executor": "inline"})

    monkeypatch.setattr(cells_mod, "run_cells", spy)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise", "topk_pruning", "clipping"], steps=1,
                     log=lambda m: None, executor="ray", workers=3)
    parallel = [ids for ex, ids in batches if ex == "ray"]
    # the strong ends beside the baseline utility run (no baseline probe: the audit's levels are the baseline)
    assert parallel[0] == ["gaussian_noise:std=10[utr]", "clipping:max_norm=0.0001[utr]",
                           "topk_pruning:prune_fraction=0.999[utr]", "utility:baseline"]
    assert batches[-1][1][0].startswith("utility:gaussian_noise") and adv["executor"] == "ray"  # the found ones
    assert len(calls) == len(set(calls))  # no probe ran twice


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_utility_run_trains_fresh_samples_each_round_with_the_defense_in_place(one_thread):
    """The real utility run (tiny): the accuracy before training and after the rounds, one upload norm per client and
    round and one gradient norm per sample; a clipping defense is in place in every round (every upload within its
    bound); a data set too small for the rounds cycles through what it has."""
    from gradleak.run.advise_utility import plan_utility, utility_job

    raw = {**TEXT, "data": {**TEXT["data"], "test_size": 16}}
    res = utility_job(raw, ["utr"], 3, None, norms=True)
    assert len(res["accuracy_curve"]) == 4 and res["accuracy_start"] == res["accuracy_curve"][0]
    assert res["rounds"] == 3 == res["slices"] and res["test_samples"] == 16
    assert len(res["update_norms"]) == 3 and len(res["sample_gradient_norms"]) == 6
    bound = min(res["update_norms"]) / 2
    clipped = utility_job({**raw, "defenses": [{"name": "clipping", "params": {"max_norm": bound}}]}, ["utr"], 3,
                          None, norms=True)
    assert all(n <= bound * (1 + 1e-6) for n in clipped["update_norms"])
    _, slices = plan_utility(raw, ["utr"], 500)  # rt-sentences: 200 sentences, 16 for the test, 2 a round
    assert slices == (200 - 16) // 2


def test_costs_are_flagged_when_the_undefended_model_does_not_learn(tmp_path, monkeypatch):
    from gradleak.run import advise as mod

    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake([]))
    flat = {"accuracy": 0.5, "accuracy_start": 0.5, "accuracy_curve": [0.5, 0.5, 0.5]}
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None: {**flat, "rounds": rounds})
    adv = mod.advise(TEXT, tmp_path / "a", LEAKS, candidates=["gaussian_noise"], steps=1, utility_rounds=5,
                     log=lambda m: None)
    assert "does not rise over the 5 utility round(s)" in adv["cost_note"] and adv["rows"][0]["cost"] == 0
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", _fake_utility())  # 0.5 -> 0.8: it learns, no flag
    adv = mod.advise(TEXT, tmp_path / "b", LEAKS, candidates=["gaussian_noise"], steps=1, log=lambda m: None)
    assert "cost_note" not in adv and adv["utility_rounds"] == 20


def test_a_utility_run_that_diverges_is_a_measured_outcome_and_ranks_last(tmp_path, monkeypatch, one_thread):
    """A defense under which training diverges (a NaN upload in round 3 of 5: the real builtin engine raises it) stops
    the utility run there with the round, client and lr recorded and the accuracy measured at that point -- not a
    failed cell -- and advise ranks such a defense after every defense the model trains under, whatever its cost."""
    import torch

    import gradleak.fl.engines as engines
    from gradleak.errors import TrainingDiverged
    from gradleak.run import advise as mod
    from gradleak.run.advise_utility import utility_job

    real, calls = engines.rounds_engine, []

    def poisoned(*a, **k):
        fn = real(*a, **k)

        def run(model, clients, **kw):
            calls.append(1)
            if len(calls) == 3:  # the model the server sends in round 3 has exploded
                with torch.no_grad():
                    next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
            return fn(model, clients, **kw)

        return run

    monkeypatch.setattr(engines, "rounds_engine", poisoned)
    raw = {**TEXT, "data": {**TEXT["data"], "test_size": 16}}
    res = utility_job(raw, ["utr"], 5, None)
    assert res["diverged"] == {"round": 3, "client": 0, "lr": 0.05} and len(calls) == 3
    assert len(res["accuracy_curve"]) == 3 and res["accuracy"] == res["accuracy_curve"][-1]  # start, round 2, round 3
    monkeypatch.setattr(engines, "rounds_engine", real)
    with pytest.raises(TrainingDiverged, match="fl.lr: training diverged"):  # still a BadInput naming the field
        raise TrainingDiverged(0, 2, 0.05)

    def utility(raw, attacks, rounds, device, norms, accuracy_start=None):  # the stronger noise is cheaper on paper but cannot be trained
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        out = {"accuracy": 0.8, "accuracy_start": 0.5, "accuracy_curve": [0.5, 0.8], "rounds": rounds}
        if raw.get("defenses") and raw["defenses"][0]["name"] == "topk_pruning":
            out.update(accuracy=0.6, accuracy_curve=[0.5, 0.6])
        elif std:
            out["diverged"] = {"round": 4, "client": 0, "lr": 0.05}
        return out

    def probe(raw, out_dir, only, device, workers, utility_from):
        return {"verdict": "no_leak_found", "accuracy": 0.5,
                "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", utility)
    adv = mod.advise(TEXT, tmp_path / "a", LEAKS, candidates=["gaussian_noise", "topk_pruning"], steps=1,
                     log=lambda m: None)
    noise = next(r for r in adv["rows"] if r["defense"] == "gaussian_noise")
    assert noise["cost"] == 0 and "training diverged under this defense" in noise["utility_note"]
    assert adv["ranking"] == ["topk_pruning", "gaussian_noise"] and adv["recommendation"]["defense"] == "topk_pruning"


def test_a_cost_within_the_test_sets_sampling_error_is_said_to_be_indistinguishable_from_none(tmp_path, monkeypatch):
    """The cost's standard error from the test samples (two binomial proportions) is in each row and the table; a
    recommendation whose cost is within twice it says so, one beyond it does not."""
    from gradleak.run import advise as mod
    from gradleak.run.advise_utility import cost_sampling_error
    from gradleak.run.audit_report import advice_rows

    assert cost_sampling_error(0.5, 0.5, 400) == pytest.approx(math.sqrt(0.5 / 400))
    assert cost_sampling_error(0.5, None, 400) is None and cost_sampling_error(0.5, 0.4, 0) is None

    def probe(raw, out_dir, only, device, workers, utility_from):
        return {"verdict": "no_leak_found", "accuracy": 0.5,
                "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    for acc, said in ((0.78, True), (0.5, False)):  # baseline 0.8, 64 test samples: 2 SE = 0.12 and 0.15
        monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None, acc=acc: {
            "accuracy": acc if raw.get("defenses") else 0.8, "accuracy_start": 0.5, "rounds": rounds})
        adv = mod.advise({**TEXT, "data": {**TEXT["data"], "test_size": 64}}, tmp_path / str(acc), LEAKS,
                         candidates=["gaussian_noise"], steps=1, log=lambda m: None)
        row = adv["rows"][0]
        assert row["cost_se"] == pytest.approx(math.sqrt((0.8 * 0.2 + acc * (1 - acc)) / 64))
        assert ("not distinguishable from no cost" in adv["sentence"]) is said
        assert f"(± {row['cost_se'] * 100:.1f})" in advice_rows(adv)[0][5]


def test_an_undefended_run_that_diverges_is_said_to_be_the_baseline_of_every_cost(tmp_path, monkeypatch):
    from gradleak.run import advise as mod

    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake([]))
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None: {
        "accuracy": 0.3, "accuracy_start": 0.25, "accuracy_curve": [0.25, 0.3], "rounds": rounds,
        **({} if raw.get("defenses") else {"diverged": {"round": 7, "client": 1, "lr": 0.5}})})
    adv = mod.advise(TEXT, tmp_path / "a", LEAKS, candidates=["gaussian_noise"], steps=1, log=lambda m: None)
    assert adv["baseline"]["diverged"]["round"] == 7
    assert "undefended model's own training diverged" in adv["cost_note"] and "round 7 at lr 0.5" in adv["cost_note"]


def test_a_defense_that_leaves_another_attack_leaking_is_not_a_stop(tmp_path, monkeypatch, fake_utility):
    """Advice is a claim about the strongest attacker: a probe where the attack that leaked undefended is stopped
    but another measured attack (one at `none` undefended) now leaks does not stop the leak."""
    from gradleak.run import advise as mod

    def probe(raw, out_dir, only, device, workers, utility_from):
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        levels = {"utr": "none" if std >= 0.05 else "partial", "dlg": "partial" if std > 0 else "none"}
        return {"verdict": "leaks", "attacks": {a: {"level": levels[a], "metric": "m", "value": 1.0, "null_p99": 0.5,
                                                     "null_median": 0.4} for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=2, log=lambda m: None)
    (row,) = adv["rows"]
    assert row["status"] == "not_stopped" and row["levels"]["dlg"] == "partial"
    assert adv["recommendation"] is None


def test_dp_rows_carry_the_measured_epsilon_beside_the_accountants(tmp_path, monkeypatch, fake_utility):
    """Each DP row carries both ε: the accountant's (epsilon, epsilon_attacked) and the probe's measured one at the
    strength found (the audit's dp_check, gradleak.run.dp_check), shown in the advice table."""
    from gradleak.run import advise as mod
    from gradleak.run.audit_report import advice_rows

    def probe(raw, out_dir, only, device, workers, utility_from):
        return {"verdict": "no_leak_found", "dp_epsilon": 4.0,
                "dp_check": {"verdict": "consistent", "claimed_epsilon": 4.7, "epsilon": 3.9,
                             "interval": [2.5, 5.5], "threat_model": "each_upload"},
                "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["dp_gaussian"], steps=1, utility_rounds=7, log=lambda m: None)
    (row,) = adv["rows"]
    assert row["epsilon_measured"]["epsilon"] == 3.9 and row["epsilon_measured"]["verdict"] == "consistent"
    assert isinstance(row["epsilon_attacked"], float)
    cell = advice_rows(adv)[0][6]
    assert "measured 3.9 (95 % interval 2.5–5.5, each upload): consistent" in cell


def test_a_probe_keeps_the_audits_dp_check_compact(tmp_path, monkeypatch):
    from gradleak.run.advise_probes import probe

    audit = {"verdict": "no_leak_found", "attacks": [],
             "dp_check": {"verdict": "claim_violated", "claimed_epsilon": 2.0, "sentence": "...",
                          "measured": [{"threat_model": "final_model", "epsilon": 1.0, "interval": [0.5, 1.5]},
                                       {"threat_model": "each_upload", "epsilon": 9.0, "interval": [8.0, 10.0]}]}}
    monkeypatch.setattr("gradleak.run.audit.run_audit", lambda *a, **k: audit)
    out = probe(TEXT, str(tmp_path), ["utr"], None, 1, [])
    assert out["dp_check"] == {"verdict": "claim_violated", "claimed_epsilon": 2.0, "epsilon": 9.0,
                               "interval": [8.0, 10.0], "threat_model": "each_upload"}


def test_checks_against_every_attack_wait_for_the_screens_and_run_together(tmp_path, monkeypatch, fake_utility):
    """A check of a found strength against every tested attack (minutes on an image config) never shares a batch
    with screen probes (seconds): it waits until no search still bisects, so the candidates' checks run as one batch
    on the workers. The undefended baseline is the audit's own result: no probe runs without a defense."""
    from gradleak.run import advise as mod
    from gradleak.run import cells as cells_mod

    seen: list = []

    def probe(raw, out_dir, only, device, workers, utility_from):
        ds = raw.get("defenses") or []
        seen.append((ds, tuple(only)))
        std = next((d["params"]["std"] for d in ds if d["name"] == "gaussian_noise"), 0.0)
        pruned = any(d["name"] == "topk_pruning" for d in ds)  # stops at every strength: its weak end is probed too
        lv = {"utr": "none" if std >= 0.05 or pruned else "partial", "dlg": "none"}
        return {"verdict": "x", "attacks": {a: {"level": lv[a], "metric": "m", "value": 0.5, "null_p99": 0.5,
                                                "null_median": 0.4} for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    real = cells_mod.run_cells
    batches: list = []

    utilities: list = []

    def spy(cells, jsonl, row, **kw):
        batches.append([c.id.split("#")[0] for c in cells if not c.id.startswith("utility:")])
        utilities.append([c.id.split("#")[0] for c in cells if c.id.startswith("utility:")])
        return real(cells, jsonl, row, **{**kw, "executor": "inline"})

    monkeypatch.setattr(cells_mod, "run_cells", spy)
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise", "topk_pruning"], steps=4,
                     log=lambda m: None)
    # each candidate's utility run at the strength checked starts beside the checks, and is not run again after
    at_checks = utilities[[i for i, b in enumerate(batches) if b and "[" not in b[0]][0]]
    assert sorted(at_checks) == sorted(f"utility:{p.split(':')[0]}:{p.split(':')[1]}" for p in
                                       next(b for b in batches if b and "[" not in b[0]))
    assert len(fake_utility) == 3  # the baseline's and the two candidates', each once
    assert all(ds for ds, _ in seen)  # every probe carries a defense
    assert adv["baseline"]["levels"] == {"utr": "partial", "dlg": "none"} and adv["probes"]["baseline"]["from_audit"]
    kinds = [{"[" in p for p in b} for b in batches if b]
    assert all(len(k) == 1 for k in kinds)  # never a check beside a screen probe
    checks = [b for b in batches if b and "[" not in b[0]]
    assert len(checks) == 1 and sorted(p.split(":")[0] for p in checks[0]) == ["gaussian_noise", "topk_pruning"]
    assert batches.index(checks[0]) == max(i for i, b in enumerate(batches) if any("[" in p for p in b)) + 1
    assert all(r["status"] == "stopped" and r["levels"] == {"utr": "none", "dlg": "none"} for r in adv["rows"])


def test_a_budget_spent_during_the_checks_holds_back_those_not_started(tmp_path, monkeypatch, fake_utility):
    """The budget bounds the checks too: a check the cell loop has not started when the budget is spent is held back
    (never started), its candidate unfinished and unverified, never recommended; the check that ran counts. A rerun
    with no budget starts the held-back check and ends with both verified."""
    from gradleak.run import advise as mod

    clock = [0.0]
    monkeypatch.setattr(mod, "clock", lambda: clock[0])

    def probe(raw, out_dir, only, device, workers, utility_from):
        clock[0] += 10.0
        ds = raw.get("defenses") or []
        std = next((d["params"]["std"] for d in ds if d["name"] == "gaussian_noise"), 0.0)
        lv = "none" if std >= 0.05 or any(d["name"] == "topk_pruning" for d in ds) else "partial"
        return {"verdict": "x", "attacks": {a: {"level": lv if a == "utr" else "none", "metric": "m", "value": 0.5,
                                                "null_p99": 0.5, "null_median": 0.4} for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    kw = dict(candidates=["gaussian_noise", "topk_pruning"], steps=4, log=lambda m: None)
    adv = mod.advise(TEXT, tmp_path, LEAKS, budget_seconds=115, **kw)  # 11 screen probes: 110 s, then the checks
    noise, topk = adv["rows"]
    assert noise["status"] == "stopped" and "unverified" not in noise and noise["levels"]["dlg"] == "none"
    assert topk["status"] == "unfinished" and topk["unverified"] is True and "not recommended" in topk["note"]
    assert topk["levels"] == {"utr": "none", "dlg": "not checked: the budget was spent"}
    assert "weak end" in topk["note"] and "[0.5, 0.5]" not in topk["note"]  # stops at its weak end
    assert adv["ranking"] == ["gaussian_noise"] and clock[0] == 120.0  # the held-back check never ran
    # nor did the held-back candidate's utility run (never recommended: its cost is not needed); the others ran
    def pruned(raw):
        return any(d["name"] == "topk_pruning" for d in raw.get("defenses") or [])

    assert not any(pruned(raw) for raw in fake_utility) and len(fake_utility) == 2  # the baseline, gaussian_noise
    assert "accuracy" not in topk and "budget was spent" in topk["utility_note"] and "utility_error" not in topk
    assert noise["accuracy"] is not None
    clock[0] = 0.0
    adv = mod.advise(TEXT, tmp_path, LEAKS, **kw)  # resumed: only the held-back check runs, and topk's utility run
    assert clock[0] == 10.0 and all(r["status"] == "stopped" and "unverified" not in r for r in adv["rows"])
    assert [pruned(raw) for raw in fake_utility[2:]] == [True] and adv["rows"][1]["accuracy"] is not None


def _fake_by_batch(calls, thresholds):
    """A probe whose stopping std depends on the victim batch (``data.seed``): ``thresholds[data.seed]``."""

    def probe(raw, out_dir, only, device, workers, utility_from):
        calls.append((out_dir, (raw.get("data") or {}).get("seed", 0)))
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        level = "none" if std >= thresholds[(raw.get("data") or {}).get("seed", 0)] else "partial"
        return {"verdict": "leaks" if level != "none" else "no_leak_found", "accuracy": 0.8 - min(std, 0.5),
                "attacks": {a: {"level": level, "metric": "m", "value": 1 - std, "null_p99": 0.5, "null_median": 0.4}
                            for a in only}}

    return probe


def test_a_strength_that_stops_every_victim_batch_is_checked_on_each(tmp_path, monkeypatch, fake_utility):
    from gradleak.run import advise as mod
    from gradleak.run.advise_options import BATCH_SEED_STEP

    calls: list = []
    step = BATCH_SEED_STEP
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_by_batch(calls, {0: 0.05, step: 0.05, 2 * step: 0.05}))
    adv = mod.advise(TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None, batches=3)
    row = next(r for r in adv["rows"] if r["defense"] == "gaussian_noise")
    assert row["status"] == "stopped"
    assert [b["data_seed"] for b in row["batches"]] == [0, step, 2 * step]
    assert all(b["stopped"] and b["strength"] == row["strength"] for b in row["batches"])
    assert sorted({seed for _, seed in calls}) == [0, step, 2 * step]
    assert sum(seed == step for _, seed in calls) == 1  # one probe per further batch, at the strength found


def test_a_strength_one_victim_batch_survives_is_raised_until_it_stops_that_batch_too(tmp_path, monkeypatch,
                                                                                     fake_utility):
    """The NVFlare-SVT failure mode: a strength found on the audited batch leaves a new batch leaking; the search
    resumes above it on that batch, and the recommendation is the stronger strength."""
    from gradleak.run import advise as mod
    from gradleak.run.advise_options import BATCH_SEED_STEP

    calls: list = []
    step = BATCH_SEED_STEP
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_by_batch(calls, {0: 0.01, step: 0.01, 2 * step: 0.2}))
    one = mod.advise(TEXT, tmp_path / "one", LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None,
                     batches=1)
    three = mod.advise(TEXT, tmp_path / "three", LEAKS, candidates=["gaussian_noise"], steps=4, log=lambda m: None,
                       batches=3)
    r1 = next(r for r in one["rows"] if r["defense"] == "gaussian_noise")
    r3 = next(r for r in three["rows"] if r["defense"] == "gaussian_noise")
    assert r1["strength"] < 0.2 <= r3["strength"]
    leaked = [b for b in r3["batches"] if b["stopped"] is False]
    assert leaked and leaked[0]["data_seed"] == 2 * step and leaked[0]["strength"] == r1["strength"]
    assert r3["batches"][-1] == {**r3["batches"][-1], "data_seed": 2 * step, "stopped": True,
                                 "strength": r3["strength"]}


def test_advise_section_takes_batches():
    from gradleak.run.advise_options import advise_section

    assert advise_section(True)["batches"] == 1  # this module's fixture: the default is BATCHES
    assert advise_section({"batches": 3})["batches"] == 3
    with pytest.raises(BadInput, match="batches"):
        advise_section({"batches": 0})


# ------------------------------------------------------------------------------------------------ the post-processing rule

def _fake_rule(calls, spot_leaks=False, variant_leaks=False):
    """A probe where UTR stops at noise std 0.05 and DLG never leaks, except (``spot_leaks``) in the spot check, or
    (``variant_leaks``) its noise-aware variant on the raw upload (``audit.params.dlg``)."""

    def probe(raw, out_dir, only, device, workers, utility_from):
        calls.append((os.path.basename(out_dir), list(only), (raw.get("data") or {}).get("seed", 0)))
        std = next((d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise"), 0.0)
        trained = (raw.get("defense") or {}).get("noise_multiplier", 0.0)
        out = {}
        for a in only:
            lv = "none" if max(std, trained) >= 0.05 else "partial"
            if a == "dlg":
                aware = ((raw.get("audit") or {}).get("params") or {}).get("dlg")
                lv = "partial" if (spot_leaks and "spotcheck" in str(out_dir)) or (variant_leaks and aware) else "none"
            out[a] = {"level": lv, "metric": "m", "value": 1 - std, "null_p99": 0.5, "null_median": 0.4,
                      "p_value": 0.4}
        return {"verdict": "no_leak_found", "accuracy": 0.8 - min(std, 0.5), "attacks": out}

    return probe


RULE_LEAKS = {"attacks": [{"name": "utr", "level": "partial"},
                          {"name": "dlg", "level": "none", "p_value": 0.31, "seconds": 5.0}]}


def test_post_processing_carries_a_none_attack_past_every_check_of_an_update_defense(tmp_path, monkeypatch,
                                                                                     fake_utility):
    """DLG read none on the raw upload: an update defense's checks (3 victim batches) do not rerun it; it comes back
    as none with the rule's words, each further batch's raw upload is measured once, and the recommendation's spot
    check reruns it at the recommended strength."""
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_rule(calls))
    adv = mod.advise(TEXT, tmp_path, RULE_LEAKS, candidates=["gaussian_noise"], steps=2, log=lambda m: None,
                     batches=3, post_processing_rule=True)
    row = next(r for r in adv["rows"] if r["defense"] == "gaussian_noise")
    assert row["status"] == "stopped" and row["carried"] == ["dlg"]
    defended = [c for c in calls if c[0].startswith("gaussian_noise")]
    assert defended and all("dlg" not in only for _, only, _ in defended)  # never rerun under the defense
    refs = sorted(seed for name, only, seed in calls if name.startswith("reference") and "dlg" in only)
    assert len(refs) == 2 and 0 not in refs  # batches 1 and 2 on their raw uploads (batch 0: the audit's own)
    assert row["levels"]["dlg"].startswith("none (post-processing: measured undefended at p = 0.31")
    assert all(b["levels"]["dlg"].startswith("none (post-processing") for b in row["batches"])
    spot = [c for c in calls if c[0].startswith("spotcheck")]
    assert [only for _, only, _ in spot] == [["dlg"]] and row["spot_check"]["level"] == "none"
    assert adv["recommendation"]["defense"] == "gaussian_noise"


def test_post_processing_never_carries_into_a_training_time_defense(tmp_path, monkeypatch, fake_utility):
    """DP-SGD changes what the client computes: its checks run every tested attack (no shortcut), on each batch."""
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_rule(calls))
    adv = mod.advise(TEXT, tmp_path, RULE_LEAKS, candidates=["dpsgd"], steps=1, log=lambda m: None, batches=3,
                     post_processing_rule=True)
    row = next(r for r in adv["rows"] if r["defense"] == "dpsgd")
    assert "carried" not in row and "spot_check" not in row
    checks = [only for name, only, _ in calls if name.startswith("dpsgd") and "_utr_" not in name]  # not the screen
    assert len(checks) >= 3 and all("dlg" in only for only in checks)
    assert not any(name.startswith(("reference", "spotcheck")) for name, _, _ in calls)
    assert all("post-processing" not in lv for lv in row["levels"].values())


def test_post_processing_needs_the_noise_aware_variant_at_none_on_the_raw_upload(tmp_path, monkeypatch,
                                                                                  fake_utility):
    """An attack whose noise-aware variant leaks on the raw upload is not carried: the check reruns it."""
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_rule(calls, variant_leaks=True))
    monkeypatch.setattr("gradleak.run.advise_carry.noise_aware_variants", lambda raw, attacks: {a: [{"noise_model": "declared"}]
                                                                          for a in attacks if a == "dlg"})
    adv = mod.advise(TEXT, tmp_path, RULE_LEAKS, candidates=["gaussian_noise"], steps=1, log=lambda m: None,
                     batches=1, post_processing_rule=True)
    row = next(r for r in adv["rows"] if r["defense"] == "gaussian_noise")
    assert "carried" not in row
    assert any(name.startswith("reference") and "noise_model" in name for name, _, _ in calls)
    assert any(name.startswith("gaussian_noise") and "dlg" in only for name, only, _ in calls)


def test_post_processing_spot_check_that_leaks_withdraws_the_recommendation(tmp_path, monkeypatch, fake_utility):
    from gradleak.run import advise as mod

    calls: list = []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_rule(calls, spot_leaks=True))
    adv = mod.advise(TEXT, tmp_path, RULE_LEAKS, candidates=["gaussian_noise"], steps=1, log=lambda m: None,
                     batches=1, post_processing_rule=True)
    row = next(r for r in adv["rows"] if r["defense"] == "gaussian_noise")
    assert row["status"] == "failed" and "spot check failed" in row["note"]
    assert row["spot_check"]["level"] == "partial" and adv["recommendation"] is None


def test_an_update_defense_utility_run_reuses_the_baseline_accuracy_before_training(tmp_path, monkeypatch):
    """The accuracy before training is measured once: an update defense's run starts from the baseline's model
    (given to it), DP-SGD's (a training-time defense changes the model) measures its own."""
    from gradleak.run import advise as mod

    seen: list = []

    def utility(raw, attacks, rounds, device, norms, accuracy_start=None):
        seen.append(((raw.get("defense") or {}).get("name") or [d["name"] for d in raw.get("defenses") or []],
                     accuracy_start))
        return {**_fake_utility()(raw, attacks, rounds, device, norms), "accuracy_start": 0.25}

    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", utility)
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_rule([]))
    mod.advise(TEXT, tmp_path, RULE_LEAKS, candidates=["gaussian_noise", "dpsgd"], steps=1, log=lambda m: None)
    assert ([], None) in seen  # the baseline measures it
    assert (["gaussian_noise"], 0.25) in seen and ("dpsgd", None) in seen
    assert all(s is None for n, s in seen if n == "dpsgd")


def test_a_probe_keeps_a_dp_check_without_an_interval(monkeypatch, tmp_path):
    """NVFlare SVT's sign-canary check reports a bound, not a fitted interval: the probe keeps what the check measured
    (it failed with a KeyError before, so the SVT candidate's search read 'failed')."""
    from gradleak.run.advise_probes import probe
    from gradleak.run import audit

    def fake_audit(raw, out_dir, overrides, device, only, log, workers):
        return {"verdict": "no_leak_found", "attacks": [{"name": "utr", "level": "none"}],
                "dp_check": {"verdict": "vacuous", "claimed_epsilon": 2.41e4,
                             "measured": [{"epsilon": 1.25e3, "threat_model": "each upload"}]}}

    monkeypatch.setattr(audit, "run_audit", fake_audit)
    r = probe(TEXT, str(tmp_path), ["utr"], None, 1, [])
    assert r["dp_check"] == {"verdict": "vacuous", "claimed_epsilon": 2.41e4, "epsilon": 1.25e3, "interval": None,
                             "threat_model": "each upload"}


def test_secure_aggregation_is_an_fl_stage_object_that_the_advice_asks():
    """Secure aggregation is :mod:`gradleak.fl.secure_aggregation`'s FL-stage object: its spec carries it, and the
    probe config, the ``--set`` overrides, the starting point and the utility row's note are its answers. Another
    FL-stage object with answers of its own is followed the same way (the advice asks the object, not a name)."""
    from gradleak.fl.secure_aggregation import SECURE_AGGREGATION, SecureAggregation
    from gradleak.run.advise_candidates import CANDIDATE_BY_NAME as C
    from gradleak.run.advise_candidates import defended_config, set_strings, starting_point
    from gradleak.run.advise_utility import fill_utility

    spec = C["secure_aggregation"]
    assert spec["fl_stage"] is SECURE_AGGREGATION and (spec["stage"], spec["weak"], spec["strong"]) == ("fl", 2, 8)
    raw = {**TEXT, "fl": {**TEXT["fl"], "clients": 3}, "data": {**TEXT["data"], "nonmembers": 8},
           "threat": {**TEXT["threat"], "individual_updates": True}}
    cfg = defended_config(raw, spec, 4)
    assert cfg["fl"] == {**raw["fl"], "secure_aggregation": True, "clients": 4} and cfg["data"]["nonmembers"] == 6
    assert "individual_updates" not in cfg["threat"] and raw["threat"]["individual_updates"] is True
    assert set_strings(raw, spec, 4) == ["fl.secure_aggregation=true", "fl.clients=4", "data.nonmembers=6"]
    assert starting_point(raw, spec) is None and starting_point(cfg, spec) == 4

    class Toy(SecureAggregation):
        name = "toy_stage"

        def configure(self, raw, value):
            return {**raw, "fl": {**raw["fl"], "toy": value}}

        def set_strings(self, raw, value):
            return [f"fl.toy={value}"]

        def strength(self, raw):
            return (raw.get("fl") or {}).get("toy")

        def utility_note(self, clients):
            return f"toy federation of {clients}"

    toy = Toy().advice_spec()
    assert defended_config(TEXT, toy, 5)["fl"]["toy"] == 5 and set_strings(TEXT, toy, 5) == ["fl.toy=5"]
    assert starting_point(TEXT, toy) is None and starting_point(defended_config(TEXT, toy, 5), toy) == 5
    row = {"strength": 5}
    fill_utility(row, toy, {"accuracy": 0.5, "rounds": 2}, {"baseline": {"accuracy": 0.6}, "test_size": 64}, 1)
    assert row["utility_note"] == "toy federation of 5" and row["cost"] == pytest.approx(0.1)
