"""benchmarks/anchor.py (issue 28 item 5): the lanes partition the grid, every arm pair is complete, the cells are
the shipped config plus overrides, and the reading names what the numbers show (no run here: fake rows)."""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path

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


def test_summary_welch_nulls_and_reading_from_rows(tmp_path):
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
    assert r["plain"]["n"] == r["anchor"]["n"] == 6 and abs(r["delta_psnr"] - 10.0) < 1e-9 and r["p_psnr"] < 1e-6
    assert r["anchor"]["beyond_null"] == 6 and r["plain"]["beyond_null"] == 0
    d = s["vit4p8/cpu/dinov2/ig/s0"]
    assert d["delta_psnr"] == 0 and d["p_psnr"] > 0.5
    assert s["vit4p8/cpu/indomain/ig/s0"]["plain"]["n"] == 0
    reading = " ".join(a.verdict(s))
    assert "IG on random" in reading.split("**No significant gain**")[0]
    assert "IG on dinov2" in reading.split("**No significant gain**")[1]
    measured, unmeasured = reading.split("Not measured yet")
    assert "indomain" not in measured and "IG on indomain (vit4p8, cpu, seed 0)" in unmeasured
    assert "GIAS on random (vit4p8, cpu, seed 0)" in unmeasured
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
