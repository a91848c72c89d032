"""The graded level rules of every reconstruction kind (issue 26), table-driven on plain dicts: both sides of every
threshold, NaN, the verdict and its banner (issue 31: the verdict units' guards; fast, so `make mutation` runs them
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


def _mem(auc, tpr, d99=0.08, t99=0.05):
    return {"auc": auc, "auc_distance": abs(auc - 0.5) if auc == auc else NAN, "auc_distance_null_p99": d99,
            "tpr_at_1pct_fpr": tpr, "tpr_at_1pct_fpr_null_p99": t99}


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
])
def test_membership_levels(m, level):
    assert grade("membership", m)["level"] == level


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
