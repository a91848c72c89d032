"""UTR's sentence-search budget: automatic from the expected sentence count (``time_budget: null``, the default;
:func:`gradleak.attacks.utr.attack.auto_time_budget`), an explicit number honoured, and a search that stops as soon as
every expected sentence is verified, well before its budget."""

from __future__ import annotations

import pytest

from test_utr import _short_rt, _view, minilm  # noqa: F401  (module-scoped fixture of the UTR tests)


def test_auto_budget_grows_with_the_expected_sentences_and_is_capped():
    from gradleak.attacks.utr.attack import (AUTO_BUDGET_MAX, AUTO_BUDGET_MIN, UTRAttack, UTRConfig,
                                             auto_time_budget)

    assert UTRConfig().time_budget is None  # the default is the automatic rule
    budgets = [auto_time_budget(n) for n in range(1, 300)]
    assert all(a <= b for a, b in zip(budgets, budgets[1:]))  # grows with the sentence count ...
    assert budgets[0] == AUTO_BUDGET_MIN == 60.0 and auto_time_budget(8) == 70.0
    assert auto_time_budget(16) == 110.0  # 8 clients x 2 sentences under secure aggregation: within 2 minutes
    assert auto_time_budget(1000) == AUTO_BUDGET_MAX == 600.0  # ... and is capped
    assert auto_time_budget(None) == AUTO_BUDGET_MAX  # count unknown: the cap (the former fixed budget)

    bag_enc, sp_enc = {"causal": False, "pairs": {102: {5, 9, 12}, 7: {1}}}, {"sep": 102}
    assert UTRAttack().sentence_budget(16, bag_enc, sp_enc) == auto_time_budget(16)
    assert UTRAttack().sentence_budget(None, bag_enc, sp_enc) == auto_time_budget(3)  # the [SEP] positions read
    assert UTRAttack().sentence_budget(None, {"causal": True}, {"sep": None}) == AUTO_BUDGET_MAX
    assert UTRAttack(time_budget=7).sentence_budget(16, bag_enc, sp_enc) == 7.0  # an explicit budget is honoured
    assert UTRAttack(time_budget=float("inf")).sentence_budget(16, bag_enc, sp_enc) == float("inf")


def test_audit_variants_keep_the_automatic_budget_and_cap_an_explicit_one():
    from gradleak.attacks.utr import UTRAttack
    from gradleak.defenses.declared import DeclaredDefenses

    sa = DeclaredDefenses(secure_aggregation=True, clients=8)
    assert UTRAttack.audit_variants({}, sa) == [{"noise": "estimate"}]  # the automatic budget: left unset
    assert UTRAttack.audit_variants({"time_budget": 600.0}, sa) == [{"noise": "estimate", "time_budget": 120.0}]


@pytest.mark.timeout(120)
def test_search_stops_once_every_sentence_is_verified(minilm):
    """The smallest real case of tests/test_utr.py (MiniLM rf = 2, 2 short RT sentences): every sentence is verified
    within seconds, and the search stops there -- whatever its budget, explicit or automatic."""
    from gradleak.attacks.utr import UTRAttack

    view, _ = _view(minilm, _short_rt(2))
    for attack, budget in ((UTRAttack(time_budget=600.0), 600.0), (UTRAttack(), 60.0)):
        info = attack.reconstruct(view).info
        assert info["time_budget"] == budget and info["time_budget_auto"] == (attack.time_budget is None)
        assert info["verified_sentences"] == 2 and info["unverified_sentences"] == 0
        assert not info["search_truncated"]
        assert info["sentence_seconds"] < 0.25 * budget  # stopped at the last verification, not at the budget


def test_a_spent_budget_still_runs_the_inferred_lengths_and_reports_the_cut(monkeypatch):
    """The length-hypothesis loop (saturated first layer adapter): with the budget spent, the inferred lengths still
    run once, the other hypotheses are skipped, and the result says so (``search_truncated``)."""
    from gradleak.attacks.common.encoder_search import EncoderChainSearch

    s = EncoderChainSearch.__new__(EncoderChainSearch)
    s.time_budget, s.max_peel_sweeps, s.lengths = 0.0, 60, [3, 2]
    runs = []
    monkeypatch.setattr(s, "_length_hypotheses", lambda: [[3, 2], [3, 3], [2, 2]], raising=False)
    monkeypatch.setattr(s, "_reset_peel", lambda: None, raising=False)
    monkeypatch.setattr(s, "_construct", lambda: [[0, 1, 2, 9], [0, 1, 9]], raising=False)

    def run_peel(chains, info, t0, stale_limit):
        runs.append(list(s.lengths))
        return [c[1:-1] for c in chains], {**info, "verified_sentences": 0, "joint_residual": 1.0}

    monkeypatch.setattr(s, "_run_peel", run_peel, raising=False)
    out, info = s._run_hypotheses({"search_truncated": False}, 0.0)
    assert runs == [[3, 2]] and info["length_hypotheses_tried"] == 1 and info["search_truncated"]
    assert out == [[1, 2], [1]]
