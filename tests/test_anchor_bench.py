"""benchmarks/anchor.py: the lanes partition the grid, every arm pair is complete, the cells are
the shipped config plus overrides, and the reading names what the numbers show (no run here: fake rows). And
the paired analysis (per-image differences pooled over seeds, paired t, Holm over the conditions) on a hand-computed
example, and the reading follows the numbers."""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _anchor():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("anchor")


def test_lanes_partition_the_grid_into_complete_arm_pairs():
    a = _anchor()
    cells = a.grid("gen.safetensors")
    ids = [c["cell"] for c in cells]
    assert len(ids) == len(set(ids))
    assert set(c["lane"] for c in cells) == set(a.LANES)
    pairs = Counter((c["setting"], c["scale"], c["backbone"], c["attack"], c["image"], c["seed"]) for c in cells)
    assert set(pairs.values()) == {2}  # each (…, image, seed) once without and once with the anchor
    lane0 = [c for c in cells if c["lane"] == 0]
    assert {c["attack"] for c in lane0} == {"ig"} and {c["backbone"] for c in lane0} == set(a.BACKBONES)
    assert Counter((c["backbone"], c["anchor"]) for c in lane0) == {(b, x): 6 for b in a.BACKBONES for x in (0, 1)}
    for c in cells:
        ov = c["overrides"]
        assert f"attack.anchor={str(c['anchor']).lower()}" in ov and f"data.seed={c['image']}" in ov
        assert ("model.pretrain=null" in ov) == (c["backbone"] != "indomain")
        if c["attack"] == "gias":
            assert "attack.generator=gen.safetensors" in ov and "threat.public_data=true" in ov
    assert {c["seed"] for c in cells if c["lane"] == 2} == {1}  # the held-out seed
    # --part splits a lane without overlap
    lane1 = [c["cell"] for c in cells if c["lane"] == 1]
    assert sorted(lane1[0::2] + lane1[1::2]) == sorted(lane1)


def _row(c, psnr, bar=12.0):
    m = {"image_psnr_mean": psnr, "image_ssim_mean": psnr / 100, "psnr_max": psnr, "ssim_max": psnr / 100,
         "psnr_max_null_p99": bar, "psnr_grey": bar - 3, "psnr_flat": bar - 1, "psnr_mean_public": bar - 2,
         "ssim_max_null_p99": 0.3, "ssim_grey": 0.1, "ssim_flat": 0.2, "ssim_mean_public": 0.15}
    return {**{k: c[k] for k in ("cell", "lane", "setting", "scale", "backbone", "attack", "anchor", "image", "seed",
                                 "overrides")}, "command": "x", "metrics": m, "timings": {"attack_seconds": 1.0},
            "wall_seconds": 2.0}


def test_summary_paired_nulls_and_reading_from_rows(tmp_path):
    a = _anchor()
    cells = a.grid("g")
    rows = []
    for c in cells:
        if c["lane"] != 0:
            continue
        if c["backbone"] == "random":  # a clear gain, beyond the null
            psnr = 20.0 + c["image"] * 0.1 if c["anchor"] else 10.0 + c["image"] * 0.1
        elif c["backbone"] == "dinov2":  # no gain
            psnr = 10.0 + (c["image"] % 3) * 0.5
        else:
            continue  # indomain not run: no claim
        rows.append(_row(c, psnr))
    (tmp_path / "anchor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = a.summary(cells, tmp_path)
    r = s["vit4p8/cpu/random/ig/s0"]
    assert r["plain"]["n"] == r["anchor"]["n"] == r["pairs"] == 6 and abs(r["delta_psnr"] - 10.0) < 1e-9
    assert r["anchor"]["beyond_null"] == 6 and r["plain"]["beyond_null"] == 0
    d = s["vit4p8/cpu/dinov2/ig/s0"]
    assert d["delta_psnr"] == 0
    assert s["vit4p8/cpu/indomain/ig/s0"]["plain"]["n"] == 0
    conds = a.conditions(s)
    assert conds["vit4p8/cpu/random/ig"]["psnr"]["p_t"] < 1e-6 and conds["vit4p8/cpu/dinov2/ig"]["psnr"]["p_t"] == 1.0
    assert conds["vit4p8/cpu/random/ig"]["family_size"] == 2  # the two conditions with images, not their seeds
    reading = " ".join(a.verdict(conds, s))
    assert "IG on random" in reading.split("**No significant gain**")[0]
    assert "IG on dinov2" in reading.split("**No significant gain**")[1].split("Wilcoxon signed-rank test")[0]
    measured, unmeasured = reading.split("Not measured yet")
    assert "indomain" not in measured and "IG on indomain (vit4p8, cpu)" in unmeasured
    assert "GIAS on random (vit4p8, cpu)" in unmeasured
    md = a.markdown(s, cells, tmp_path, {})
    assert "| 0 | IG on the three backbones" in md and "24 / 36 | partial" in md
    assert "--set data.seed=U" in md and "configs/anchor/fmnist_b1.yaml" in md
    assert md == a.markdown(a.summary(cells, tmp_path), cells, tmp_path, {})  # regenerates identically
    assert "not measured yet" in a.size_check(s)
    big = [_row(c, 30.0 if c["anchor"] else 10.0) for c in cells
           if c["lane"] == 3 and c["backbone"] == "random" and c["attack"] == "ig" and c["image"] < 2]
    (tmp_path / "anchor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + big))
    line = a.size_check(a.summary(cells, tmp_path))
    assert "IG on random: Δ PSNR +20.00 dB at 12 blocks / patch 4 vs +10.00 dB at 4 blocks / patch 8 (images 0, 1)" in line


def _paired_rows(a, spec):
    """Rows from ``{(backbone, seed, image): (plain PSNR, anchor PSNR or None)}`` (IG, vit4p8, cpu)."""
    cells = {(c["backbone"], c["seed"], c["image"], c["anchor"]): c for c in a.grid("g")
             if c["setting"] == "vit4p8" and c["scale"] == "cpu" and c["attack"] == "ig"}
    rows = []
    for (b, k, u), (plain, anchored) in spec.items():
        rows.append(_row(cells[(b, k, u, False)], plain))
        if anchored is not None:
            rows.append(_row(cells[(b, k, u, True)], anchored))
    return rows


def test_paired_statistics_on_a_hand_computed_example(tmp_path):
    """Random-init IG: image 0 gains 0.5 dB at seed 0 and 1.5 at seed 1 (its difference: 1.0), image 1 gains 2 at
    seed 0 (seed 1 ran without the anchor only: no pair), image 2 gains 3 at both seeds -> differences 1, 2, 3: mean 2,
    sd 1, t = 2 / (1 / sqrt 3) = 2 sqrt 3 on 2 df, two-sided p = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14) (Student's
    t on 2 df in closed form), 95 % interval 2 ± t(0.975, 2) / sqrt 3 with t(0.975, 2) = 4.302653 (the table value);
    exact Wilcoxon: all three positive, 2 / 2^3 = 0.25. DINOv2 IG, seed 0 only: differences 2 and 4 -> mean 3, sd
    sqrt 2, se 1, t = 3 on 1 df (Cauchy): p = 1 - (2 / pi) atan 3. The family is the two conditions (random init's
    two seeds are one test), Holm: 2 * 0.0742 = 0.148 for random init, max(0.148, 1 * 0.205) = 0.205 for DINOv2;
    neither holds."""
    import math

    a = _anchor()
    spec = {("random", 0, 0): (10.0, 10.5), ("random", 1, 0): (10.0, 11.5),
            ("random", 0, 1): (10.0, 12.0), ("random", 1, 1): (10.0, None),
            ("random", 0, 2): (9.0, 12.0), ("random", 1, 2): (8.0, 11.0),
            ("dinov2", 0, 0): (10.0, 12.0), ("dinov2", 0, 1): (10.0, 14.0)}
    rows = _paired_rows(a, spec)
    rows[0]["revision"] = "abc1234+dirty"  # one run from uncommitted code: the reading names it
    (tmp_path / "anchor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = a.grid("g")
    summ = a.summary(cells, tmp_path)
    conds = a.conditions(summ)
    r = conds["vit4p8/cpu/random/ig"]
    assert r["psnr_differences"] == {0: 1.0, 1: 2.0, 2: 3.0}
    assert r["seeds"] == [0, 1] and r["seeds_per_image"] == {0: 2, 1: 1, 2: 2}
    assert r["pairs"] == 5 and r["pairs_improved"] == 5
    p = r["psnr"]
    assert p["n"] == 3 and p["improved"] == 3 and p["mean"] == pytest.approx(2.0)
    assert p["p_t"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)  # 0.07418
    half = 4.302653 / math.sqrt(3)
    assert (p["ci_low"], p["ci_high"]) == pytest.approx((2 - half, 2 + half), abs=1e-5)
    assert p["p_wilcoxon"] == pytest.approx(0.25) and p["wilcoxon_floor"] == 0.25
    d = conds["vit4p8/cpu/dinov2/ig"]["psnr"]
    assert d["n"] == 2 and d["mean"] == pytest.approx(3.0)
    assert d["p_t"] == pytest.approx(1 - 2 / math.pi * math.atan(3.0), rel=1e-9)  # 0.2048
    assert d["ci_low"] == pytest.approx(3 - 12.706205, abs=1e-5) and d["ci_high"] == pytest.approx(3 + 12.706205, abs=1e-5)
    # the family: the conditions measured, not the seed groups (three seed groups, two tests)
    assert sum(s["pairs"] > 0 for s in summ.values()) == 3
    assert {k: c["family_size"] for k, c in conds.items() if c["p_holm"] is not None} == \
        {"vit4p8/cpu/random/ig": 2, "vit4p8/cpu/dinov2/ig": 2}
    assert r["p_holm"] == pytest.approx(2 * p["p_t"])  # step-down
    assert conds["vit4p8/cpu/dinov2/ig"]["p_holm"] == pytest.approx(d["p_t"])
    assert conds["vit4p8/cpu/indomain/ig"]["p_holm"] is None  # not run: not in the family
    reading = a.verdict(conds, summ)
    assert "in each of the 2 conditions measured" in reading[0]
    assert reading[1].endswith("**holds here** under: no measured condition.")
    assert ("IG on random (vit4p8, cpu): Δ PSNR +2.00 dB (95 % CI -0.48 to +4.48), paired t p = 0.074, Holm 0.15, "
            "exact Wilcoxon p = 0.25; 3 of 3 images improve (5 of 5 pairs, seeds 0, 1)") in reading[2]
    assert "At 3 images its smallest two-sided p is 0.25" in reading[3] and "Holm over 2 raises to 0.5" in reading[3]
    assert "IG on random (vit4p8, cpu) seed 1: 2 of 6 images" in " ".join(reading)
    assert "(`+dirty`: to be rerun at a commit) behind: IG on random (vit4p8, cpu): 1 of 11 runs." \
        in " ".join(reading)
    md = a.markdown(summ, cells, tmp_path, {})
    assert "| vit4p8 | cpu | random | ig | 0, 1 | 3 (3) | 5 (5) | +2.00 | -0.48 to +4.48 | 0.074 | 0.15 | 0.25 |" in md


def _reading_follows(a, conds, summ):
    """Every measured condition's numbers stand in the bullet its numbers put it in: a gain (Δ > 0, Holm < 0.05;
    apart when at most half the anchored runs clear the null) or no significant gain."""
    lines = a.verdict(conds, summ)
    holds = next(x for x in lines if "**holds here**" in x)
    weak = next((x for x in lines if x.startswith("A significant gain")), "")
    none = next(x for x in lines if x.startswith("**No significant gain**"))
    n = 0
    for c in conds.values():
        if c["p_holm"] is None:
            continue
        text = a.describe(c)
        gain = c["psnr"]["mean"] > 0 and c["p_holm"] < 0.05
        assert (text in holds) == (gain and c["anchored_beyond_null"] > c["anchored_runs"] / 2), text
        assert (text in weak) == (gain and c["anchored_beyond_null"] <= c["anchored_runs"] / 2), text
        assert (text in none) == (not gain), text
        assert f"Holm {a.fmt_num(c['p_holm'], '.2g')}," in text and f"{a.fmt_num(c['psnr']['mean'], '+.2f')} dB" in text
        n += 1
    assert f"each of the {n} conditions measured" in lines[0]
    return lines


def test_the_reading_follows_the_numbers_and_moves_when_they_move(tmp_path):
    """On the stored rows (benchmarks/out/anchor.jsonl) and on a copy whose numbers are changed: the reading's
    placement of each condition is the numbers' (no sentence typed by hand)."""
    a = _anchor()
    out = BENCH / "out"
    cells = a.grid("g")
    summ = a.summary(cells, out)
    conds = a.conditions(summ)
    _reading_follows(a, conds, summ)
    # the stored rows' family: one test per measured condition, whatever the seeds
    assert {c["family_size"] for c in conds.values()} == {sum(c["p_holm"] is not None for c in conds.values())}
    # an anchor that hurts every pair: no gain anywhere, and the reading says so
    rows = [json.loads(x) for x in (out / "anchor.jsonl").read_text().splitlines() if x.strip()]
    for r in rows:
        if r.get("anchor") and "metrics" in r:
            r["metrics"]["image_psnr_mean"] -= 50.0
    (tmp_path / "anchor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summ2 = a.summary(cells, tmp_path)
    conds2 = a.conditions(summ2)
    lines = _reading_follows(a, conds2, summ2)
    assert "**holds here** under: no measured condition." in " ".join(lines)
    assert all(c["psnr"]["mean"] < 0 for c in conds2.values() if c["p_holm"] is not None)
