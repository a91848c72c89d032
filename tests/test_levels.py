"""The graded level rules of every reconstruction kind, table-driven on plain dicts: both sides of every
threshold, NaN, the verdict and its banner (the verdict units' guards; fast, so `make mutation` runs them
per mutant of gradleak.evaluation.levels)."""

from __future__ import annotations

import pytest

from gradleak.evaluation.levels import grade, verdict_of

NAN = float("nan")


def _img(psnr_max, ssim_max, above=0, p99=15.0, s99=0.3, mean_pub=14.0, grey=11.0):
    return {"psnr_max": psnr_max, "psnr_max_null_p99": p99, "psnr_max_mean_public": mean_pub, "psnr_max_grey": grey,
            "ssim_max": ssim_max, "ssim_max_null_p99": s99, "ssim_max_mean_public": 0.2, "ssim_max_grey": 0.05,
            "images_above_threshold": above}


@pytest.mark.parametrize("m, level", [
    (_img(31.0, 0.95, above=1), "exact"),
    (_img(29.9, 0.95, above=0), "strong"),          # just below the exact threshold
    (_img(20.0, 0.51), "strong"),
    (_img(20.0, 0.49), "partial"),                   # SSIM below 0.5: not strong
    (_img(15.01, 0.2), "partial"),                   # just beyond the null's 99th percentile
    (_img(15.0, 0.2), "none"),                       # at the 99th percentile: not beyond
    (_img(14.5, 0.2, p99=14.0, mean_pub=14.8), "none"),  # beyond the random-image null but not the mean image
    (_img(14.9, 0.2, p99=14.0, mean_pub=14.8), "partial"),
    (_img(NAN, 0.2), "undefined"),
    ({**_img(20.0, 0.2), "psnr_max_null_p99": NAN, "psnr_max_mean_public": NAN, "psnr_max_grey": NAN}, "undefined"),
    (_img(14.0, 0.2, above=3), "none"),              # "above threshold" not beyond the null is not trusted
    (_img(14.0, 0.99, above=0), "strong"),           # SSIM alone beyond its null and >= 0.5
])
def test_image_levels(m, level):
    assert grade("images", m, 30.0)["level"] == level


def test_patch_levels_use_exact_patches():
    base = _img(40.0, 0.9)
    assert grade("patches", {**base, "patches_exact": 16}, 30.0)["level"] == "exact"
    assert grade("patches", {**base, "patches_exact": 0}, 30.0)["level"] == "strong"


def _txt(exact=0, r1=20.0, r2=2.0, bag=30.0, bag99=40.0, r1_99=25.0, r2_99=5.0, bag_order=3.0, p_bag=0.001,
         p_r1=0.001):
    return {"sentences_exact": exact, "rouge1_f1": r1, "rouge1_f1_null_p99": r1_99, "rouge2_f1": r2,
            "rouge2_f1_null_p99": r2_99, "rouge2_f1_bag_order": bag_order, "word_bag_recall": bag,
            "word_bag_recall_null_p99": bag99, "word_bag_recall_p_value": p_bag, "rouge1_f1_p_value": p_r1}


@pytest.mark.parametrize("m, level", [
    (_txt(exact=1, r1=100, r2=100, bag=100), "exact"),
    (_txt(r1=89.2, r2=77.5, bag=100), "strong"),     # the dp 1e-9 case: near-verbatim, not one exact
    (_txt(r1=60, r2=50.0, bag=100), "strong"),
    (_txt(r1=60, r2=49.9, bag=100), "partial"),       # ROUGE-2 below 50: the words, not the sentences
    (_txt(r1=41, r2=10, bag=100), "partial"),         # gaussian 1e-8: word bag 100/100
    (_txt(bag=40.01), "partial"),
    (_txt(bag=40.01, p_bag=0.006), "none"),           # beyond p99 but not at p < 0.005 (two routes, Bonferroni)
    (_txt(bag=40.0), "none"),
    (_txt(bag=30.0, r1=25.5, p_r1=0.004), "partial"),  # the words leak through the sentences
    (_txt(bag=30.0, r1=25.5, p_r1=0.006), "none"),
    (_txt(r1=24.0, r2=60.0, r2_99=5.0, bag_order=70.0, bag=30), "none"),  # ROUGE-2 at the bag-in-random-order bar
    (_txt(bag=NAN, bag99=NAN, r1=25.5), "partial"),   # no word bag: ROUGE-1 F1 decides
    (_txt(bag=NAN, bag99=NAN, r1=25.0), "none"),
    (_txt(bag=NAN, bag99=NAN, r1=NAN), "undefined"),
])
def test_text_levels(m, level):
    assert grade("token_sequences", m)["level"] == level


def _mem(auc, tpr, d99=0.08, t99=0.05, nonmembers=200.0):
    m = {"auc": auc, "auc_distance": abs(auc - 0.5) if auc == auc else NAN, "auc_distance_null_p99": d99,
         "tpr_at_1pct_fpr": tpr, "tpr_at_1pct_fpr_null_p99": t99, "members": 16.0}
    if nonmembers is not None:
        m["nonmembers"] = nonmembers
    return m


@pytest.mark.parametrize("m, level", [
    (_mem(1.0, 1.0), "strong"),
    (_mem(0.9, 0.1), "strong"),
    (_mem(0.9, 0.099), "partial"),                   # TPR below 0.1
    (_mem(0.9, 0.04, t99=0.05), "partial"),
    (_mem(0.581, 0.0), "partial"),
    (_mem(0.58, 0.0), "none"),                       # |AUC - 0.5| at the bar: not beyond
    (_mem(0.30, 0.0), "partial"),                    # an inverted signal leaks too
    (_mem(0.45, 0.0), "none"),
    (_mem(NAN, NAN), "undefined"),                   # no non-members: nothing measured
    # a 1 % FPR needs 100 non-members: fewer, and the TPR is not graded; the AUC beyond its null still leaks
    (_mem(1.0, 1.0, nonmembers=100.0), "strong"),
    (_mem(1.0, 1.0, nonmembers=99.0), "partial"),
    (_mem(1.0, 1.0, nonmembers=16.0), "partial"),
    (_mem(1.0, 1.0, nonmembers=None), "partial"),    # no count recorded: nothing shows the FPR is resolved
    (_mem(0.55, 1.0, nonmembers=16.0), "partial"),   # the TPR at FPR 0 beyond its null: a leak, never green
    (_mem(0.55, 0.09, nonmembers=16.0), "none"),     # ... below 0.1, as the strong bar
    (_mem(0.55, 1.0, t99=1.0, nonmembers=16.0), "none"),  # ... at its null's 99th percentile
])
def test_membership_levels(m, level):
    assert grade("membership", m)["level"] == level


@pytest.mark.parametrize("nonmembers, graded", [(16.0, False), (48.0, False), (99.0, False), (100.0, True),
                                                (200.0, True)])
def test_membership_tpr_is_graded_only_where_the_non_members_resolve_one_percent(nonmembers, graded):
    """The new user's case: 16 non-members cannot show a 1 % FPR (it is the TPR at FPR 0): no strong, the reason
    with the count in the rule and the evidence; 200 do: strong."""
    g = grade("membership", _mem(1.0, 1.0, nonmembers=nonmembers))
    assert g["evidence"]["tpr_at_1pct_fpr_graded"] is graded
    assert g["level"] == ("strong" if graded else "partial")
    why = f"needs >= 100 non-members, has {int(nonmembers)}"
    assert (why in g["rule"]) is not graded and (why in g["evidence"].get("tpr_at_1pct_fpr_not_graded", "")) is not graded


@pytest.mark.parametrize("m, level", [
    ({"rdlv": 4.86, "rdlv_null_p99": 1.0, "ssim": 0.91, "ssim_null_p99": 0.4, "psnr_max": 31.0}, "exact"),
    ({"rdlv": 4.86, "rdlv_null_p99": 1.0, "ssim": 0.91, "ssim_null_p99": 0.4, "psnr_max": 25.0}, "strong"),
    ({"rdlv": 4.86, "rdlv_null_p99": 1.0, "ssim": 0.45, "ssim_null_p99": 0.4, "psnr_max": 25.0}, "partial"),
    ({"rdlv": 1.1, "rdlv_null_p99": 5.7, "ssim": 0.3, "ssim_null_p99": 0.4, "psnr_max": 12.0}, "none"),  # 8-image client
    ({"rdlv": 5.7, "rdlv_null_p99": 5.7, "ssim": 0.3, "ssim_null_p99": 0.4, "psnr_max": 12.0}, "none"),
    ({"rdlv": NAN, "rdlv_null_p99": 5.7}, "undefined"),
])
def test_leakage_levels(m, level):
    assert grade("leakage", m, 30.0)["level"] == level


def test_verdict_is_never_green_over_a_leak():
    from gradleak.run.audit import verdict_and_headline as _verdict

    none = {"name": "a", "level": "none", "applicable": True, "metric": "psnr_max", "value": 9.0}
    part = {"name": "utr", "level": "partial", "applicable": True, "metric": "rouge1_f1", "value": 41.0,
            "null_p99": 24.0, "p_value": 0.001, "rule": "word-bag recall beyond the null", "worst_client": 1,
            "threat_words": "an honest-but-curious server"}
    up = {**part, "name": "peftleak", "level": "exact", "applicable": False}
    undef = {"name": "projres", "level": "undefined", "applicable": True}
    assert verdict_of([none]) == "no_leak_found"
    assert verdict_of([none, part]) == "leaks"
    assert verdict_of([none, up]) == "leaks_stronger_server"
    assert verdict_of([none, up, part]) == "leaks"
    assert verdict_of([undef]) == "undefined"  # nothing measured: no green
    assert verdict_of([]) == "undefined"
    v, banner = _verdict([none, part, undef])
    assert v == "leaks" and banner.startswith("LEAKS: PARTIAL leakage by utr, client 1")
    assert "24" in banner and "41" in banner  # the value beside its null
    v, banner = _verdict([none, undef])
    assert v == "no_leak_found" and "none above its null" in banner and "1 undefined" in banner and "projres" in banner


def test_secure_aggregation_over_one_client_exposes_its_update():
    from gradleak.fl.threat import ThreatConfig

    one = ThreatConfig().resolve(secure_aggregation=True, clients=1)
    assert one.individual_updates and "sum of one update is that update" in one.exposure
    assert any("sum of one update" in line for line in one.describe())
    two = ThreatConfig().resolve(secure_aggregation=True, clients=2)
    assert not two.individual_updates and two.exposure is None


# ------------------------------------------------------------------ the whole judgement: level, rule and evidence
# (mutation check of the evaluation units, docs/MUTATION.md: the banner prints the rule and the evidence, so both are part of
# the contract; each expected dict below is worked out by hand from the unit's rule table)

def _same(a, b) -> bool:
    """Equality with NaN == NaN (missing metrics are NaN in the evidence)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


def _img_ev(psnr, ssim, p=0.002, psnr_bar=15.0, ssim_bar=0.3):
    return {"psnr_max": psnr, "psnr_max_bar": psnr_bar, "ssim_max": ssim, "ssim_max_bar": ssim_bar,
            "psnr_max_p_value": p}


@pytest.mark.parametrize("kind, m, thr, want", [
    ("images", {**_img(31.0, 0.95, above=2), "psnr_max_p_value": 0.002}, 30.0,
     {"level": "exact", "rule": "a private image reconstructed at PSNR >= 30 dB",
      "evidence": {**_img_ev(31.0, 0.95), "n_exact": 2.0}}),
    ("images", {**_img(31.0, 0.95, above=1), "psnr_max_p_value": 0.002}, 25.5,
     {"level": "exact", "rule": "a private image reconstructed at PSNR >= 25.5 dB",
      "evidence": {**_img_ev(31.0, 0.95), "n_exact": 1.0}}),
    ("images", {**_img(20.0, 0.6), "psnr_max_p_value": 0.002}, 30.0,
     {"level": "strong", "rule": "best-image SSIM beyond the null (and the mean public, grey and flat images) and >= 0.5",
      "evidence": _img_ev(20.0, 0.6)}),
    ("images", {**_img(20.0, 0.5), "psnr_max_p_value": 0.002}, 30.0,   # SSIM at 0.5 exactly: strong (>=)
     {"level": "strong", "rule": "best-image SSIM beyond the null (and the mean public, grey and flat images) and >= 0.5",
      "evidence": _img_ev(20.0, 0.5)}),
    ("images", _img(20.0, 0.49), 30.0,                                 # no p-value given: NaN in the evidence
     {"level": "partial", "rule": "best-image PSNR beyond the null's 99th percentile (and the mean public, grey and flat images)",
      "evidence": _img_ev(20.0, 0.49, p=NAN)}),
    ("images", {**_img(14.0, 0.2, p99=13.0, mean_pub=14.5, grey=14.2), "ssim_max_null_p99": 0.1}, 30.0,
     {"level": "none", "rule": "best-image PSNR not beyond the null",   # the bar is the mean public image (14.5)
      "evidence": _img_ev(14.0, 0.2, p=NAN, psnr_bar=14.5, ssim_bar=0.2)}),
    ("images", {**_img(14.0, 0.2, p99=13.0, mean_pub=12.0, grey=14.6)}, 30.0,
     {"level": "none", "rule": "best-image PSNR not beyond the null",   # ... or the grey image (14.6)
      "evidence": _img_ev(14.0, 0.2, p=NAN, psnr_bar=14.6)}),
    ("images", _img(NAN, 0.9), 30.0,
     {"level": "undefined", "rule": "best-image PSNR or its null is missing / NaN", "evidence": {"psnr_max": NAN}}),
    ("patches", {**_img(40.0, 0.9), "patches_exact": 16, "psnr_max_p_value": 0.001}, 30.0,
     {"level": "exact", "rule": "private image patches recovered (median of the recovered) at PSNR >= 30 dB",
      "evidence": {**_img_ev(40.0, 0.9, p=0.001), "n_exact": 16.0}}),
    ("patches", {**_img(40.0, 0.9), "patches_exact": 1}, 30.0,
     {"level": "exact", "rule": "private image patches recovered (median of the recovered) at PSNR >= 30 dB",
      "evidence": {**_img_ev(40.0, 0.9, p=NAN), "n_exact": 1.0}}),
    ("patches", {**_img(40.0, 0.9), "images_above_threshold": 4}, 30.0,   # the patch count decides, not the image one
     {"level": "strong", "rule": "best-image SSIM beyond the null (and the mean public, grey and flat images) and >= 0.5",
      "evidence": _img_ev(40.0, 0.9, p=NAN)}),
    ("patches", {**_img(14.0, 0.9, above=0), "patches_exact": 3, "ssim_max_null_p99": 0.95}, 30.0,
     {"level": "none", "rule": "best-image PSNR not beyond the null",   # exact patches not beyond the null: not trusted
      "evidence": _img_ev(14.0, 0.9, p=NAN, ssim_bar=0.95)}),
])
def test_image_kinds_judgement_in_full(kind, m, thr, want):
    got = grade(kind, m, thr)
    assert _same(got, want), got


def _txt_ev(exact, r1, r2, bag, r2_bar=5.0, r1_bar=25.0, bag_bar=40.0):
    return {"rouge1_f1": r1, "rouge2_f1": r2, "word_bag_recall": bag, "sentences_exact": exact,
            "rouge2_f1_bar": r2_bar, "rouge1_f1_bar": r1_bar, "word_bag_recall_bar": bag_bar}


@pytest.mark.parametrize("m, want", [
    (_txt(exact=1, r1=100.0, r2=100.0, bag=100.0),
     {"level": "exact", "rule": "a private sentence reconstructed word for word", "evidence": _txt_ev(1.0, 100.0, 100.0, 100.0)}),
    (_txt(exact=1, r1=20.0, r2=2.0, bag=30.0),  # one exact sentence is exact even when the averages are low
     {"level": "exact", "rule": "a private sentence reconstructed word for word", "evidence": _txt_ev(1.0, 20.0, 2.0, 30.0)}),
    (_txt(r1=89.2, r2=77.5, bag=100.0, bag_order=6.0),
     {"level": "strong", "rule": "ROUGE-2 F1 beyond the null (and the word bag in random order) and >= 50",
      "evidence": _txt_ev(0.0, 89.2, 77.5, 100.0, r2_bar=6.0)}),
    (_txt(r1=60.0, r2=49.9, bag=100.0),
     {"level": "partial", "rule": "word-bag recall beyond the null's 99th percentile: the private words leak",
      "evidence": _txt_ev(0.0, 60.0, 49.9, 100.0)}),
    (_txt(bag=30.0, r1=25.5, p_r1=0.0049),
     {"level": "partial", "rule": "ROUGE-1 F1 beyond the null's 99th percentile: the private words leak",
      "evidence": _txt_ev(0.0, 25.5, 2.0, 30.0)}),
    (_txt(bag=30.0, r1=25.5, p_r1=0.005),       # p must be below 0.005 (the Bonferroni half of 1 %)
     {"level": "none", "rule": "word-bag recall not beyond the null", "evidence": _txt_ev(0.0, 25.5, 2.0, 30.0)}),
    (_txt(bag=40.5, p_bag=NAN),                  # no p-value: the 99th percentile alone decides
     {"level": "partial", "rule": "word-bag recall beyond the null's 99th percentile: the private words leak",
      "evidence": _txt_ev(0.0, 20.0, 2.0, 40.5)}),
    (_txt(bag=NAN, bag99=NAN, r1=25.5),
     {"level": "partial", "rule": "ROUGE-1 F1 beyond the null's 99th percentile: the private words leak",
      "evidence": _txt_ev(0.0, 25.5, 2.0, NAN, bag_bar=NAN)}),
    (_txt(bag=NAN, bag99=NAN, r1=24.0),
     {"level": "none", "rule": "ROUGE-1 F1 not beyond the null", "evidence": _txt_ev(0.0, 24.0, 2.0, NAN, bag_bar=NAN)}),
    (_txt(bag=NAN, bag99=40.0),
     {"level": "undefined", "rule": "word_bag_recall or its null is missing / NaN",
      "evidence": _txt_ev(0.0, 20.0, 2.0, NAN)}),
    (_txt(bag=NAN, bag99=NAN, r1=NAN),
     {"level": "undefined", "rule": "rouge1_f1 or its null is missing / NaN",
      "evidence": _txt_ev(0.0, NAN, 2.0, NAN, bag_bar=NAN)}),
])
def test_text_judgement_in_full(m, want):
    got = grade("token_sequences", m)
    assert _same(got, want), got


def _mem_full(auc, tpr, d99=0.08, t99=0.05, low=NAN, high=NAN, members=16.0, nonmembers=120.0):
    return {**_mem(auc, tpr, d99, t99), "auc_low": low, "auc_high": high, "members": members, "nonmembers": nonmembers}


def _mem_ev(auc, tpr, low=NAN, high=NAN, t_bar=0.05, d_bar=0.08, members=16.0, nonmembers=120.0):
    ev = {"auc": auc, "auc_interval": [low, high], "tpr_at_1pct_fpr": tpr, "tpr_at_1pct_fpr_bar": t_bar,
          "auc_distance_bar": d_bar, "members": members, "nonmembers": nonmembers,
          "tpr_at_1pct_fpr_graded": nonmembers >= 100}
    if nonmembers < 100:
        ev["tpr_at_1pct_fpr_not_graded"] = UNRESOLVED.format(int(nonmembers))
    return ev


UNRESOLVED = ("TPR at 1 % FPR not graded: needs >= 100 non-members, has {} (a 1 % FPR is 1 of 100; raise "
              "data.nonmembers, the candidates per client)")


@pytest.mark.parametrize("m, want", [
    (_mem_full(1.0, 1.0, low=0.97, high=1.0),
     {"level": "strong", "rule": "TPR at 1 % FPR >= 0.1 and beyond the null", "evidence": _mem_ev(1.0, 1.0, 0.97, 1.0)}),
    (_mem_full(0.9, 0.1),                        # TPR at 0.1 exactly: strong (>=)
     {"level": "strong", "rule": "TPR at 1 % FPR >= 0.1 and beyond the null", "evidence": _mem_ev(0.9, 0.1)}),
    (_mem_full(0.9, 0.3, t99=0.3),               # TPR at its null's 99th percentile: not strong
     {"level": "partial", "rule": "AUC above 0.5 beyond the null's 99th percentile of |AUC - 0.5|",
      "evidence": _mem_ev(0.9, 0.3, t_bar=0.3)}),
    (_mem_full(0.3, 0.0),
     {"level": "partial", "rule": "AUC below (an inverted signal) 0.5 beyond the null's 99th percentile of |AUC - 0.5|",
      "evidence": _mem_ev(0.3, 0.0)}),
    (_mem_full(0.55, 0.0, members=8.0, nonmembers=100.0),
     {"level": "none", "rule": "|AUC - 0.5| not beyond the null", "evidence": _mem_ev(0.55, 0.0, members=8.0, nonmembers=100.0)}),
    (_mem_full(1.0, 1.0, nonmembers=16.0),       # the TPR at FPR 0 of 16 non-members: not graded, the AUC decides
     {"level": "partial", "rule": "AUC above 0.5 beyond the null's 99th percentile of |AUC - 0.5|; "
                                  + UNRESOLVED.format(16), "evidence": _mem_ev(1.0, 1.0, nonmembers=16.0)}),
    (_mem_full(0.55, 1.0, nonmembers=48.0),      # the AUC at chance, the TPR at FPR 0 beyond its null: partial
     {"level": "partial", "rule": "TPR at FPR 0 (members above every non-member) >= 0.1 and beyond the null; "
                                  + UNRESOLVED.format(48), "evidence": _mem_ev(0.55, 1.0, nonmembers=48.0)}),
    (_mem_full(0.55, 0.0, nonmembers=48.0),
     {"level": "none", "rule": "|AUC - 0.5| not beyond the null; " + UNRESOLVED.format(48),
      "evidence": _mem_ev(0.55, 0.0, nonmembers=48.0)}),
    ({**_mem_full(0.9, 0.5), "auc": NAN},        # a distance but no AUC: nothing measured
     {"level": "undefined", "rule": "AUC undefined (needs members and non-members among the candidates)",
      "evidence": _mem_ev(NAN, 0.5)}),
    ({**_mem_full(0.9, 0.5), "auc_distance_null_p99": NAN},
     {"level": "undefined", "rule": "AUC undefined (needs members and non-members among the candidates)",
      "evidence": _mem_ev(0.9, 0.5, d_bar=NAN)}),
])
def test_membership_judgement_in_full(m, want):
    got = grade("membership", m)
    assert _same(got, want), got


def _leak(rdlv, p99, ssim, s99, psnr, excess=0.5, p=0.001):
    return {"rdlv": rdlv, "rdlv_null_p99": p99, "rdlv_excess": excess, "rdlv_p_value": p, "ssim": ssim,
            "ssim_null_p99": s99, "psnr_max": psnr}


def _leak_ev(rdlv, p99, ssim, s99, psnr, excess=0.5, p=0.001):
    return {"rdlv": rdlv, "rdlv_null_p99": p99, "rdlv_excess": excess, "rdlv_p_value": p, "ssim": ssim,
            "ssim_bar": s99, "psnr_max": psnr}


@pytest.mark.parametrize("args, thr, want", [
    ((4.86, 1.0, 0.91, 0.4, 30.0), 30.0, ("exact", "a best-matched reconstruction at PSNR >= 30 dB")),  # at thr: exact
    ((4.86, 1.0, 0.91, 0.4, 30.0), 31.5, ("strong", "SSIM beyond the null and >= 0.5")),
    ((4.86, 1.0, 0.91, 0.4, 31.5), 31.5, ("exact", "a best-matched reconstruction at PSNR >= 31.5 dB")),
    ((1.0, 1.0, 0.3, 0.4, 35.0), 30.0, ("none", "RDLV not beyond the null")),  # PSNR alone, RDLV at its null: not exact
    ((0.5, 1.0, 0.91, 0.4, 25.0), 30.0, ("strong", "SSIM beyond the null and >= 0.5")),  # SSIM decides strong alone
    ((4.86, 1.0, 0.5, 0.4, 25.0), 30.0, ("strong", "SSIM beyond the null and >= 0.5")),
    ((4.86, 1.0, 0.49, 0.4, 25.0), 30.0, ("partial", "RDLV beyond the null's 99th percentile (random held-out images, best of N)")),
    ((4.86, 1.0, 0.6, 0.6, 25.0), 30.0, ("partial", "RDLV beyond the null's 99th percentile (random held-out images, best of N)")),
    ((1.0, 1.0, 0.3, 0.4, 12.0), 30.0, ("none", "RDLV not beyond the null")),
    ((NAN, 1.0, 0.3, 0.4, 12.0), 30.0, ("undefined", "RDLV or its null is missing / NaN")),
    ((2.0, NAN, 0.3, 0.4, 12.0), 30.0, ("undefined", "RDLV or its null is missing / NaN")),
])
def test_leakage_judgement_in_full(args, thr, want):
    got = grade("leakage", _leak(*args), thr)
    assert _same(got, {"level": want[0], "rule": want[1], "evidence": _leak_ev(*args)}), got


def test_the_level_helpers():
    from gradleak.evaluation.levels import LEVELS, bar, beyond, leak_rank, level_rank, number

    assert [level_rank(x) for x in ("undefined", "none", "partial", "strong", "exact")] == [0, 1, 2, 3, 4]
    assert LEVELS == ("undefined", "none", "partial", "strong", "exact")
    assert number({"a": "2.5"}, "a") == 2.5 and number({"a": 3}, "a") == 3.0
    for bad in ({"a": None}, {"a": "x"}, {"a": [1]}, {}):
        assert number(bad, "a") != number(bad, "a")  # NaN
    assert bar({"k_null_p99": 1.0, "k_r": 2.0, "k_s": NAN}, "k", ("r", "s")) == 2.0
    assert bar({"k_null_p99": 3.0, "k_r": 2.0}, "k", ("r",)) == 3.0
    assert bar({"k_null_p99": NAN, "k_r": 2.0}, "k", ("r",)) == 2.0
    assert bar({"k_null_p99": 3.0, "k_r": 9.0}, "k") == 3.0  # references only when named
    assert bar({}, "k") != bar({}, "k")
    assert beyond({"k": 2.0, "k_null_p99": 1.0}, "k") is True
    assert beyond({"k": 1.0, "k_null_p99": 1.0}, "k") is False
    assert beyond({"k": NAN, "k_null_p99": 1.0}, "k") is None and beyond({"k": 1.0}, "k") is None
    assert grade("pixels", {"x": 1.0}) == {"level": "undefined", "evidence": {},
                                           "rule": "no level rule for the reconstruction kind 'pixels'"}
    # leak_rank: level first, then samples reconstructed, then the lower p-value, then the larger value; NaN last
    runs = [{"level": "partial", "n_success": 0, "p_value": 0.001, "value": 5.0},
            {"level": "strong", "n_success": 0, "p_value": 0.01, "value": 1.0},
            {"level": "partial", "n_success": 2, "p_value": 0.5, "value": 0.0},
            {"level": "partial", "n_success": 0, "p_value": 0.002, "value": 50.0},
            {"level": "partial", "n_success": 0, "p_value": NAN, "value": 99.0},
            {"level": "partial", "n_success": 0, "p_value": 0.001, "value": NAN},
            {"level": "partial", "n_success": None, "p_value": 0.001, "value": 6.0},
            {"value": 1e9}]
    order = sorted(range(len(runs)), key=lambda i: leak_rank(runs[i]), reverse=True)
    assert order == [1, 2, 6, 0, 5, 3, 4, 7]
    assert leak_rank({"level": "none", "p_value": "x", "value": "y"}) == (1, 0, -2.0, -1e300)


def test_the_default_threshold_is_30_db_and_a_missing_null_keeps_the_value_in_the_evidence():
    from gradleak.evaluation.images import grade_images
    from gradleak.evaluation.leakage import grade_leakage
    from gradleak.evaluation.patches import grade_patches

    assert grade_leakage(_leak(4.86, 1.0, 0.91, 0.4, 30.5))["level"] == "exact"  # 30.5 >= 30 (not 31)
    assert grade("leakage", _leak(4.86, 1.0, 0.91, 0.4, 30.5))["level"] == "exact"
    img = {**_img(31.0, 0.95, above=1), "patches_exact": 1}
    assert grade_images(img)["rule"] == "a private image reconstructed at PSNR >= 30 dB"
    assert grade_patches(img)["rule"] == "private image patches recovered (median of the recovered) at PSNR >= 30 dB"
    assert grade("images", img)["rule"] == "a private image reconstructed at PSNR >= 30 dB"
    no_null = {**_img(20.0, 0.9), "psnr_max_null_p99": NAN, "psnr_max_mean_public": NAN, "psnr_max_grey": NAN}
    assert _same(grade("images", no_null), {"level": "undefined", "rule": "best-image PSNR or its null is missing / NaN",
                                            "evidence": {"psnr_max": 20.0}})


def test_strong_image_ssim_must_also_beat_the_mean_public_image():
    """SSIM beyond the random-image null but not beyond the mean public image's SSIM is no sample-specific image."""
    m = {**_img(20.0, 0.6), "ssim_max_mean_public": 0.7}
    assert grade("images", m)["level"] == "partial"
    assert grade("images", {**m, "ssim_max_mean_public": 0.55})["level"] == "strong"
    assert grade("images", {**m, "ssim_max_mean_public": 0.1, "ssim_max_grey": 0.65})["level"] == "partial"


def test_a_near_flat_image_beating_grey_is_no_leak_the_flat_reference_is_the_bar():
    """A reconstruction a hair above the grey image (an attack's near-constant output under heavy DP noise: lora_span
    at 14.15 dB vs grey 14.08 in the vit_lora advice) is no private image: the best flat image (each original's own
    mean colour) is a bar too, computed by reference_images."""
    import torch

    from gradleak.evaluation.nulls import reference_images

    g = torch.Generator().manual_seed(0)
    y = (0.3 + 0.2 * torch.rand(2, 3, 16, 16, generator=g)).clamp(0, 1)
    refs = reference_images(y, torch.rand(8, 3, 16, 16, generator=g))
    flat = y.mean(dim=(2, 3), keepdim=True).expand_as(y)
    mse = ((flat - y) ** 2).mean(dim=(1, 2, 3))
    assert refs["psnr_max_flat"] == pytest.approx(float((10 * torch.log10(1 / mse)).max()), rel=1e-4)
    assert refs["psnr_max_flat"] > refs["psnr_max_grey"]  # the best uniform image beats grey
    m = {**_img(14.154, 0.069, p99=13.07, mean_pub=12.64, grey=14.08), "ssim_max_null_p99": 0.111}
    assert grade("images", m)["level"] == "partial"  # without the flat reference: a false alarm
    assert grade("images", {**m, "psnr_max_flat": 16.5, "ssim_max_flat": 0.0})["level"] == "none"
    assert grade("images", {**m, "psnr_max": 16.6, "psnr_max_flat": 16.5})["level"] == "partial"


def test_an_attack_that_found_nothing_to_use_is_undefined_not_none():
    """DAGER on an adapters-only upload reports a failure (no attention-layer gradient): not applicable, nothing
    measured -- `undefined`, never a `none` counted among the attacks that ran."""
    got = grade("token_sequences", {**_txt(r1=0.0, r2=0.0, bag=0.0), "attack_failed": 1.0})
    assert got["level"] == "undefined" and got["rule"].startswith("not applicable")
    assert grade("token_sequences", {**_txt(r1=0.0, r2=0.0, bag=0.0), "attack_failed": 0.0})["level"] == "none"
    assert grade("token_sequences", {**_txt(bag=40.01), "attack_failed": 0.5})["level"] == "partial"  # some trials ran


def _toy_unit():
    """A reconstruction kind registered at test time only: it scores every client in one run (``<m>_client<c>``),
    grades its own metric ``m`` against its null and says what an undefined result lacks."""
    from gradleak.evaluation.base import EvaluationUnit
    from gradleak.evaluation.levels import beyond, graded

    def grade_toy(m, thr):
        if m.get("m") != m.get("m"):
            return graded("undefined", "toy: m not measured")
        return graded("partial" if beyond(m, "m") else "none", "toy: m beyond its null", m=m.get("m"))

    return EvaluationUnit("toy_kind", evaluate=lambda *a: None, headline="m", grade=grade_toy, sweep_metric="m",
                          rules="partial: toy m beyond its null", scores_every_client=True,
                          truth_fields=lambda data, trial, batches, threat, cfg: ({}, {"toy_truth": len(batches)}),
                          undefined_hint=lambda m: " -- set toy.field")


def test_a_kind_registered_later_owns_its_rules_and_clients_without_touching_run(monkeypatch):
    """The level rules, the per-client split and the undefined reason are the evaluation unit's (docs/DESIGN.md §2):
    the audit's report lists every registered unit's rules (none is empty), and a kind registered at test time that
    scores every client in one run is split into its clients, keeps their labels under secure aggregation (the image
    kind's evidence is credited to the sum), is judged by its own grade and says what its undefined result lacks --
    asked of the unit by run/, which names no kind."""
    from types import SimpleNamespace

    from gradleak.evaluation import EVALUATORS
    from gradleak.registry import Entry
    from gradleak.run.answer import client_metric_sets
    from gradleak.run.audit_judge import judge, mark_undefined, sum_label
    from gradleak.run.audit_words import level_rules

    assert all(e.obj.rules for e in EVALUATORS)
    monkeypatch.setitem(EVALUATORS._entries, "toy_kind", Entry("toy_kind", _toy_unit(), "toy"))
    rules = level_rules()
    assert rules["toy_kind"] == "partial: toy m beyond its null"
    assert set(rules) == set(EVALUATORS.names()) and rules["images"].startswith("exact: an image at PSNR")
    sets = client_metric_sets("toy_kind", {"m_client2": 3.0, "m_null_p99_client2": 1.0, "m_client0": 0.5,
                                           "m_null_p99_client0": 1.0})
    assert sets == [(0, {"m": 0.5, "m_null_p99": 1.0}), (2, {"m": 3.0, "m_null_p99": 1.0})]
    assert client_metric_sets("images", {"psnr_max_client1": 3.0}) == [(0, {"psnr_max_client1": 3.0})]
    assert sum_label(2, 3, "toy_kind") == 2 and sum_label(2, 3, "images") == "the sum of 3 clients"
    cfg = SimpleNamespace(metrics=SimpleNamespace(psnr_threshold_db=30.0))
    assert [judge("toy_kind", m, cfg).level for _, m in sets] == ["none", "partial"]
    entry = {"rule": "toy: m not measured"}
    mark_undefined(entry, "toy_kind", {})
    assert entry["undefined"] and entry["reason"].startswith("undefined: toy: m not measured -- set toy.field;")


def test_the_membership_unit_grants_its_candidates_and_keeps_the_labels_for_the_evaluation():
    """What the membership kind needs beside the private batch is its unit's (``truth_fields``): the server is
    granted the candidates (each client's members and its own non-members, shuffled by the seed), the evaluation
    alone gets which are members; no null pool is drawn (its null is the candidates'); without non-members the
    undefined reason names data.nonmembers."""
    from types import SimpleNamespace

    from gradleak.evaluation import unit

    u = unit("membership")
    data = SimpleNamespace(nonmembers=lambda trial, c: [f"n{c}{i}" for i in range(3)])
    batches = [(["a0", "a1"], None), (["b0"], None)]
    cfg = SimpleNamespace(seed=4)
    granted, fields = u.truth_fields(data, 0, batches, SimpleNamespace(individual_updates=True), cfg)
    cands, member = granted["public_data"]["candidates"], fields["membership"]
    assert sorted(cands[0]) == ["a0", "a1", "n00", "n01", "n02"] and sorted(cands[1]) == ["b0", "n10", "n11", "n12"]
    assert [c for c, m in zip(cands[0], member[0]) if m] == [c for c in cands[0] if c.startswith("a")]
    again, _ = u.truth_fields(data, 0, batches, SimpleNamespace(individual_updates=True), cfg)
    assert again == granted  # seeded: the same draw
    summed, sfields = u.truth_fields(data, 0, batches, SimpleNamespace(individual_updates=False), cfg)
    assert list(summed["public_data"]["candidates"]) == [0] and sum(sfields["membership"][0]) == 3
    assert not u.draws_null_pool and unit("images").draws_null_pool
    assert "data.nonmembers" in u.undefined_hint({"nonmembers": 0}) and u.undefined_hint({"nonmembers": 100}) == ""
