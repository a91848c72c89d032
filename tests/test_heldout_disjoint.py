"""Held out means disjoint data: a cell labelled held out draws no private sample that a tuned cell
drew, checked through the pipeline's own draw (``benchmarks/_bench.client_samples``: data only, no model). PEFTLeak's
held-out cells are disjoint from every other cell; the anchor study's seed 1 and the leakage study's null seed 4242
are new seeds on the same images, and their labels say so; the leakage study's seed 1 draws other images. Text: a
cell's seed permutes the same sentences, so UTR's seed 4242 and ProjRes's seeds 1 and 2 are new seeds on the same
sentences (labelled so, with the counts measured here); ProjRes's WordNet cells draw no quote any tuned cell drew.
optnoise, dp_check, advise (its seed 1, the advice's extra victim batches and the unsearched round trip) and info_limit:
each cell's draw comes from the benchmark's own cell builder (the overrides / config it runs), and a held-out cell's
data follow another seed than every tuned cell's and resolve to no sample a tuned cell draws
(:func:`assert_held_out_disjoint`)."""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from functools import lru_cache
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@lru_cache(maxsize=None)
def _raw(config: str) -> dict:
    from gradleak.config.loading import load_yaml

    return load_yaml(Path(config))


def samples(config, overrides) -> set[str]:
    """Every private sample any client of the cell holds, in any trial."""
    drawn = _bench("_bench").client_samples(_raw(str(config)), list(overrides))
    return {s for held in drawn.values() for s in held}


@pytest.fixture(scope="module")
def peftleak():
    p = _bench("peftleak")
    cells = [(table, cell, p._overrides(ov)) for table, cell, _, ov in p.cells(False)]
    return p, {cell: (p.split_of(table, ov), samples(p.CONFIG, ov)) for table, cell, ov in cells}


def test_client_samples_are_the_pipeline_draw_identified_by_file():
    """The identities are the images the pipeline gives the client (CIFAR: files shared by cifar-samples and
    cifar10/100-samples), and the cached set keeps its real labels."""
    import torch

    from gradleak.data.splits import ImageData, _shared_set
    from gradleak.run import validate

    p = _bench("peftleak")
    ov = ["data.seed=4", "seed=4"]
    ids = _bench("_bench").client_samples(_raw(str(p.CONFIG)), ov)[(0, 0)]
    ds = _shared_set("cifar-samples", ())
    x, _ = ImageData(validate(_raw(str(p.CONFIG)), ov)[1]).clients(0, 1 << 30)[0]
    assert len(ids) == len(set(ids)) == 32
    assert torch.equal(x, ds.images[[ds.names.index(i) for i in ids]])
    assert not torch.equal(ds.labels, torch.arange(len(ds.labels)))  # the tag never reaches the cache
    first = samples(p.CONFIG, ["data.seed=0"])
    assert first == set(ds.names[:32])  # seed 0: the set's first B images
    assert samples(p.CONFIG, ["data.name=cifar100-samples", "data.batch_size=20"]) == set(ds.names[20:])


def test_peftleak_held_out_cells_share_no_image_with_any_tuned_cell(peftleak):
    p, cells = peftleak
    held = {c: s for c, (split, s) in cells.items() if split == "held out"}
    tuned = set().union(*(s for split, s in cells.values() if split == "tuned"))
    others = set().union(*(s for split, s in cells.values() if split != "held out"))
    assert set(held) == {f"ho-fmnist-B32-{d}-s{p.HELDOUT_SEED}" for d in ("paper", "improved")}
    for cell, s in held.items():
        assert len(s) == 32, cell
        assert not s & tuned, cell
        assert not s & others, cell  # and no other cell of the benchmark draws them either


def test_peftleak_tuned_cells_leave_no_cifar_image_or_imagenet_photo_unseen(peftleak):
    """Why the held-out cells leave CIFAR: the data seed 0 cells draw all 40 CIFAR images and crops of all 20
    ImageNet photos, so another seed of either set is never held out."""
    from gradleak.data import load

    _, cells = peftleak
    tuned = set().union(*(s for split, s in cells.values() if split == "tuned"))
    assert set(load("cifar-samples").names) <= tuned
    assert set(load("imagenet-samples", size=32).names) <= tuned


def test_peftleak_seed4_once_held_out_is_the_same_images_and_no_longer_labelled_held_out(peftleak):
    _, cells = peftleak
    split4, s4 = cells["t1-cifar-B32-paper-s4"]
    assert split4 == "other seed"
    assert len(s4 & cells["t1-cifar-B32-paper-s0"][1]) == 26  # the review's count: 26 of 32 are seed 0's


def test_anchor_seed1_is_a_new_seed_on_the_same_images_and_labelled_so():
    a = _bench("anchor")
    cells = a.grid("gen.safetensors")
    by_seed: dict[int, set] = {}
    per_image: dict[tuple, set] = {}
    for c in cells:
        if c["attack"] != "ig" or c["anchor"]:  # the images depend on data.seed only: one arm per image suffices
            continue
        s = samples(a.CONFIG, c["overrides"])
        by_seed.setdefault(c["seed"], set()).update(s)
        per_image.setdefault((c["image"], c["seed"]), set()).update(s)
    assert set(by_seed) == {0, 1} and len(by_seed[0]) == 6
    assert by_seed[1] == by_seed[0]  # seed 1 holds exactly seed 0's 6 images
    assert all(per_image[(u, 1)] == per_image[(u, 0)] for u in a.IMAGES)
    assert a.SEED_LABELS == {0: "tuned", 1: "new seed, same images: not held-out data"}
    assert "held-out seed" not in a.LANES[2][0] and "not held-out data" in a.LANES[2][0]


def test_leakage_seed4242_is_the_same_images_and_seed1_other_images():
    lk = _bench("leakage")
    cells = {c["cell"]: c for c in lk.cells()}
    drawn = {cid: samples(c["config"], c["overrides"]) for cid, c in cells.items()}

    def data_seed(c):
        return int(dict(o.split("=", 1) for o in c["overrides"] if "=" in o).get("data.seed", 0))

    tuned = set().union(*(drawn[cid] for cid, c in cells.items() if data_seed(c) == 0))
    # seed 4242 sets seed= only: the same images as the tuning seed's run, labelled as not held out
    assert drawn["null/seed4242"] == drawn["null/seed0"] == drawn["main/seed0"]
    assert lk.NULL_SEED_LABELS == {0: "tuning", 4242: "new seed, same images: not held-out data"}
    # seed 1 (data.seed=1: "held-out images" in the main and gradonly tables) draws images no tuned cell holds
    held = [cid for cid, c in cells.items() if data_seed(c) != 0]
    assert set(held) == {"main/seed1", f"gradonly/seed{lk.GRADONLY_HELDOUT}/full",
                         f"gradonly/seed{lk.GRADONLY_HELDOUT}/tuned"}
    for cid in held:
        assert drawn[cid] and not drawn[cid] & tuned, cid


def drawn(raw: dict, overrides=()) -> set[str]:
    """Every private sample of a cell given as a raw config dict (the UTR grid's cells)."""
    return {s for held in _bench("_bench").client_samples(raw, list(overrides)).values() for s in held}


def _section(name: str) -> str:
    text = (BENCH.parent / "docs" / "REPRODUCTION.md").read_text()
    return text[text.index(f"<!-- BEGIN {name} -->"):text.index(f"<!-- END {name} -->")]


@pytest.fixture(scope="module")
def utr_cells():
    u = _bench("utr")
    return u, {cid: (raw["seed"], raw["data"]["name"], drawn(raw)) for _, cid, raw in u.grid(False, None)}


def test_utr_seed4242_is_a_new_seed_on_the_same_sentences_and_labelled_so(utr_cells):
    """A text cell's seed permutes the same 200 RT sentences (``TextDataset.batch``): the seed-0 cells draw 128 of
    them, so no seed-4242 cell is disjoint from them -- the counts ``utr.SEED_OVERLAP`` prints, measured here."""
    from gradleak.data.text import load_text

    u, cells = utr_cells
    paper = _bench("_utr_paper")
    assert {seed for seed, _, _ in cells.values()} == set(u.FAIR_SEEDS) == set(paper.SEEDS) == {0, 4242}
    held = {cid: s for cid, (seed, _, s) in cells.items() if seed == 4242}
    assert {cells[cid][1] for cid in held} == {"rt-sentences"} and all(held.values())
    tuned = set().union(*(s for seed, data, s in cells.values() if seed == 0 and data == "rt-sentences"))
    o = u.SEED_OVERLAP
    assert len(set(load_text("rt-sentences").texts)) == o["rt"]
    assert len(tuned) == o["seed0"]
    every = set().union(*held.values())
    assert (len(every), len(every & tuned)) == (o["seed4242"], o["shared"])
    shares = {cid: len(s & tuned) / len(s) for cid, s in held.items()}
    assert int(100 * min(shares.values())) == o["least_cell_pct"]  # every seed-4242 cell: mostly seed-0 sentences
    assert max(shares.values()) == 1.0  # and some only seed-0 sentences
    # the NOTES' hand-run seeds (rf = 1 B = 16) are new seeds on the same sentences too
    for seed, k in ((1, 7), (777, 11), (4242, 14)):
        assert len(drawn(u.cell_config("minilm", 16, rf=1, seed=seed)) & tuned) == k, seed
    assert "1, 777 and 4242 (new seeds on the\n    same RT sentences, not held-out data: 7, 11 and 14 of their 16" in u.NOTES
    # the labels, and the docs section they were regenerated into (--report-only)
    assert paper.SEED_LABELS == {0: "tuned on", 4242: "new seed, same sentences: not held-out data"}
    assert u.seed_label(4242) == u.seed_label(1) == paper.SEED_LABELS[4242]
    assert "4242 held out" not in u.FAIR_INTRO and "not held-out data" in u.FAIR_INTRO
    doc = _section("utr")
    assert "(held out)" not in doc and "held-out seed" not in doc and "4242 held out" not in doc
    assert u.SEED_NOTE in doc and doc.count("4242 (new seed, same sentences: not held-out data)") >= 20


def test_utr_heldout_dager_cells_draw_no_sentence_a_tuned_cell_draws(utr_cells):
    """DAGER's held-out rows (``utr.HELDOUT``) run the tuned seed and span tolerances on the news sentences: no tuned
    cell (seed 0 on RT, where the extended search and the tolerances were tuned) draws any of their sentences; the only
    other cells that read a news sentence are the B = 256 capacity cells (UTR, tuned on RT)."""
    u, cells = utr_cells
    held = {cid: s for cid, (_, _, s) in cells.items() if cid.endswith(f"/{u.HELDOUT}")}
    assert sorted(held) == [f"t1/minilm/dager_lora_L{u.DAGER_LAYERS}/B{B}/{u.HELDOUT}" for B in u.HELDOUT_BS]
    assert {cells[cid][:2] for cid in held} == {(0, u.HELDOUT_DATA)}
    assert all(len(s) == int(cid.split("/B")[1].split("/")[0]) for cid, s in held.items())
    every = set().union(*held.values())
    tuned = set().union(*(s for seed, data, s in cells.values() if seed == 0 and data == "rt-sentences"))
    assert tuned and not every & tuned
    others = {cid for cid, (_, _, s) in cells.items() if cid not in held and s & every}
    assert others <= {cid for cid in cells if cid.startswith("cap/") and cid.endswith("/B256")}
    assert all(cells[cid][1] == u.HELDOUT_DATA for cid in others)
    # the label says held-out data only where the data is held out
    assert "held-out data" in u.HELDOUT_LABEL and u.HELDOUT_DATA in u.HELDOUT_LABEL
    assert u.fair_cell("t1/minilm/x/B4", u.HELDOUT) == "t1/minilm/x/B4/heldout"


def _projres_draw(raw: dict, overrides: list[str], cfg) -> dict[str, set]:
    """A ProjRes cell's members (``client_samples``), non-member candidates (``TextData.nonmembers``), test and
    min-max reference quotes, and FISGuard's public set as ``FISGuard.apply`` draws it (``(set name, sentence)``)."""
    from gradleak.data.splits import TextData
    from gradleak.defenses.training import PUBLIC_TEXT_DEFAULTS

    data, d = TextData(cfg), cfg.defense
    clients = [(t, c) for t in range(cfg.trials) for c in range(cfg.fl.clients)]
    other = set(data.test(cfg.model.num_classes)[0]) if cfg.data.test_size else set()
    if d.name == "minmax":
        other |= {s for c in range(cfg.fl.clients)
                  for s in data.reference(c, getattr(d, "reference_size", None) or cfg.data.batch_size)[0]}
    public: set = set()
    if d.name == "fisguard":
        name = getattr(d, "public", None) or next(n for n in PUBLIC_TEXT_DEFAULTS if n != cfg.data.name)
        public = {(name, s) for s in _public(name, getattr(d, "public_size", 2000), cfg.seed + 99)}
    return {"members": drawn(raw, overrides), "nonmembers": {s for t, c in clients for s in data.nonmembers(t, c)},
            "other": other, "public": public}


@lru_cache(maxsize=None)
def _public(name: str, size: int, seed: int) -> tuple[str, ...]:
    from gradleak.data.text import load_text

    ds = load_text(name)
    return tuple(ds.batch(min(size, len(ds)), seed=seed)[0])


@pytest.fixture(scope="module")
def projres_cells():
    """Every ProjRes cell's draw; cells that draw alike (same seed, data, split sizes and data-using defense) once."""
    from gradleak.data.splits import TextData
    from gradleak.run import validate

    p = _bench("projres")
    raw = _raw(str(p.CONFIG))
    cells, done = {}, {}
    for c in p.grid(argparse.Namespace(rounds=None, lr=None, tiny=False, quick=False), quick=False):
        _, cfg = validate(copy.deepcopy(raw), list(c["overrides"]))
        d = cfg.defense
        key = (cfg.seed, cfg.data.name, cfg.fl.clients, TextData.client_size(cfg), cfg.trials, cfg.data.nonmembers,
               cfg.data.test_size, cfg.data.batch_size, d.name if d.name in ("minmax", "fisguard") else None,
               getattr(d, "reference_size", None), getattr(d, "public", None), getattr(d, "public_size", None))
        if key not in done:
            done[key] = _projres_draw(raw, c["overrides"], cfg)
        cells[c["cell"]] = (c["params"], done[key])
    return p, cells


def test_projres_seeds_1_and_2_reuse_the_tuned_quotes_and_are_labelled_so(projres_cells):
    """Seed 0's cells draw 2,406 of the 2,441 quotes (members, non-member candidates, test and min-max reference
    quotes), so every seed-1 / seed-2 cell's members and candidates are almost all quotes they drew: the counts
    ``projres.SEED_OVERLAP`` prints, measured here."""
    from gradleak.data.text import load_text

    p, cells = projres_cells
    quotes = [(prm, d) for prm, d in cells.values() if prm["data"] == p.DEFAULT_DATA]
    tuned = [d for prm, d in quotes if prm["seed"] == 0]
    seen = set().union(*(d["members"] | d["nonmembers"] | d["other"] for d in tuned))
    tuned_members = set().union(*(d["members"] for d in tuned))
    o = p.SEED_OVERLAP
    assert len(set(load_text(p.DEFAULT_DATA).texts)) == o["quotes"] and len(seen) == o["seed0"]
    other = {(prm.get("setting", "batch"), prm["seed"]): d for prm, d in quotes if prm["seed"]}
    assert set(other) == {k for k in o if isinstance(k, tuple)}
    for key, d in other.items():
        m, n = d["members"], d["nonmembers"]
        assert (len(m & seen), len(m), len(n & seen), len(n)) == o[key], key
        assert m & tuned_members, key  # some of its members are a seed-0 cell's members, not only its candidates
    assert p.HELDOUT_LABELS["seed1"] == "seed 1 (new seed, same quotes: not held-out data)"
    assert p.SEED_LABEL == "new seed, same quotes: not held-out data"
    doc = _section("projres")
    assert "held-out seed" not in doc and "| seed1 |" not in doc and "### Held out" not in doc
    assert p.seed_overlap_note() in doc and p.HELDOUT_LABELS["seed1"] in doc


def test_projres_wordnet_cells_draw_no_quote_any_other_cell_draws(projres_cells):
    """The WordNet cells are held-out data: no member or candidate is a sentence a fortunes cell drew. Their only
    contact with the tuned cells: some are among the 2,000 WordNet examples the seed-0 FISGuard cells use as public
    data (Q; the WordNet cells' own Q is news sentences), ``projres.WORDNET_PUBLIC``."""
    p, cells = projres_cells
    wn = [d for prm, d in cells.values() if prm["data"] == "wordnet-examples"]
    assert len(wn) == 4 and all(prm["seed"] == 0 for prm, _ in cells.values() if prm["data"] == "wordnet-examples")
    quotes = set().union(*(d["members"] | d["nonmembers"] | d["other"]
                           for prm, d in cells.values() if prm["data"] == p.DEFAULT_DATA))
    public = {s for prm, d in cells.values() if prm["data"] == p.DEFAULT_DATA and prm["seed"] == 0
              for name, s in d["public"] if name == "wordnet-examples"}
    assert len(public) == 2000
    for d in wn:
        m, n = d["members"], d["nonmembers"]
        assert m and n and not (m | n) & quotes
        assert {name for name, _ in d["public"]} <= {"news-sentences"}
        assert (len(m & public), len(m), len(n & public), len(n)) == p.WORDNET_PUBLIC
    assert p.HELDOUT_LABELS["wordnet"] == "WordNet gloss examples (held out: no quote a tuned cell drew)"
    assert p.HELDOUT_LABELS["wordnet"] in _section("projres")


_DRAWN: dict[str, frozenset] = {}


def draw(raw: dict, overrides=()) -> tuple[tuple, frozenset]:
    """A cell's data draw: what its samples follow -- ``(modality, data.name, data.seed)`` for images,
    ``(modality, data.name, seed)`` for sentences (gradleak.data.splits: ``ImageData`` draws with ``data.seed``,
    ``TextData`` permutes with ``seed``) -- and the private samples that resolves to (``client_samples``; cells
    whose data, seed the draw follows, FL plan and trials agree are drawn once)."""
    import json

    from gradleak.run import validate

    _, cfg = validate(copy.deepcopy(raw), list(overrides))
    follows = int(cfg.data.seed if cfg.modality == "image" else cfg.seed)
    key = json.dumps([cfg.modality, cfg.data.model_dump(), follows, cfg.fl.model_dump(), cfg.trials], sort_keys=True,
                     default=str)
    if key not in _DRAWN:
        _DRAWN[key] = frozenset(drawn(raw, overrides))
    return (cfg.modality, cfg.data.name, follows), _DRAWN[key]


def assert_held_out_disjoint(cells: dict[str, tuple[str, tuple, frozenset]], tuned=("tuned",),
                             held=("held out",)) -> None:
    """``cells``: id -> (role, what the data follow, samples) as :func:`draw` gives them. A held-out cell's data
    follow another seed than every tuned cell's, and it draws no sample any tuned cell draws."""
    ref = {c: v for c, v in cells.items() if v[0] in tuned}
    out = {c: v for c, v in cells.items() if v[0] in held}
    assert ref and out, f"roles {sorted({v[0] for v in cells.values()})}: expected {tuned} and {held}"
    keys = {k for _, k, _ in ref.values()}
    seen = frozenset().union(*(s for _, _, s in ref.values()))
    for cid, (_, key, s) in out.items():
        assert s, f"{cid}: draws no sample"
        assert key not in keys, f"{cid} is held out, but its data follow {key} as a tuned cell's do"
        assert not s & seen, f"{cid} is held out, but draws {sorted(s & seen)[:3]} that a tuned cell draws"


def test_assert_held_out_disjoint_fails_on_a_shared_seed_or_sample():
    a, b = ("image", "x", 0), ("image", "x", 1)
    assert_held_out_disjoint({"t": ("tuned", a, frozenset({"i0"})), "h": ("held out", b, frozenset({"i1"}))})
    for held in [("held out", a, frozenset({"i1"})), ("held out", b, frozenset({"i0", "i1"})),
                 ("held out", b, frozenset())]:
        with pytest.raises(AssertionError):
            assert_held_out_disjoint({"t": ("tuned", a, frozenset({"i0"})), "h": held})
    with pytest.raises(AssertionError):  # no held-out cell at all
        assert_held_out_disjoint({"t": ("tuned", a, frozenset({"i0"}))})


def audited(raw: dict, attack: str) -> dict:
    """The config an audit of ``raw`` (its ``--set`` strings applied) hands ``attack``: the audit's gate
    (``gradleak.run.audit.gate_attack``: the configured threat or its smallest upgrade)."""
    from gradleak.run.audit import gate_attack

    _, plan, err = gate_attack(raw, attack)
    assert plan is not None, err
    return plan[1]


def test_info_limit_held_out_images_share_no_image_with_the_tuned_one():
    """benchmarks/info_limit.py: the images follow ``data.seed`` (the cell sets it with ``seed``); the held-out
    cells' audits and oracle ceilings draw no image the tuned cell's draw (the overrides its job runs:
    ``audit_overrides`` / ``ceiling_overrides``; K does not change the draw)."""
    from gradleak.run.audit import audit_overrides

    b = _bench("info_limit")
    raw = _raw(str(b.CONFIG))
    got = {}
    for c in b.cells():  # the audit runs --only lora_span: the config it hands lora_span
        audit = audited(audit_overrides(copy.deepcopy(raw), b.audit_overrides(c)), "lora_span")
        got[c["cell"] + "/audit"] = (c["role"], *draw(audit))
        got[c["cell"] + "/ceiling"] = (c["role"], *draw(raw, b.ceiling_overrides(c, 1)))
        assert got[c["cell"] + "/audit"][1:] == got[c["cell"] + "/ceiling"][1:]  # the ceiling attacks the same image
    assert {v[0] for v in got.values()} == set(b.IMAGES.values()) == {"tuned", "held out"}
    assert_held_out_disjoint(got)
    assert b.label("none", False) == "information absent above the edge"
    assert b.label("none", True) == "information present, missed"
    assert b.label("partial", False) == "leaks"


def test_optnoise_held_out_image_is_no_image_a_tuned_cell_or_an_anchor_run_drew():
    """benchmarks/optnoise.py: every cell (scale and attack) at ``data.seed`` = U; the held-out image is no image the
    tuned cells draw, and -- as its docstring says -- no anchor.py run drew it, while the tuned one is an anchor run's
    (it was chosen there)."""
    o = _bench("optnoise")
    raw = _raw(str(o.CONFIG))
    cells = o.cells(Path("unused")) + o.scale_cells()
    got = {c["cell"]: (c["role"], *draw(raw, c["overrides"])) for c in cells}
    assert {v[0] for v in got.values()} == set(o.IMAGES.values()) == {"tuned", "held out"}
    assert_held_out_disjoint(got)
    a = _bench("anchor")
    anchor = frozenset().union(*(draw(_raw(str(a.CONFIG)), c["overrides"])[1] for c in a.grid("gen.safetensors")))
    held = frozenset().union(*(s for role, _, s in got.values() if role == "held out"))
    tuned = frozenset().union(*(s for role, _, s in got.values() if role == "tuned"))
    assert tuned <= anchor and not held & anchor


def _dp_check_cells(d) -> list[tuple[dict, tuple]]:
    """benchmarks/dp_check.py's check cells (correct mechanisms and breakages): ``(row, job args)``."""
    return [(row, args) for row, job, args in d.cells("", Path("unused"), timing=True) if job is d.check]


def test_dp_check_held_out_seeds_draw_no_sentence_the_shipped_seed_draws():
    """benchmarks/dp_check.py: the client's sentences follow ``seed``; every held-out cell (correct mechanisms,
    DP-SGD's own seeds, the breakages) draws none the shipped seed's cells draw, in the config the check validates
    (``cell_config``)."""
    d = _bench("dp_check")
    got = {row["cell"]: (row["role"], *draw(d.cell_config(*args[:2]))) for row, args in _dp_check_cells(d)}
    assert {v[0] for v in got.values()} == {"shipped", "held out"}
    assert_held_out_disjoint(got, tuned=("shipped",))


def _advise_draws() -> dict[str, dict[str, tuple]]:
    """benchmarks/advise.py, per config: every victim batch its cells attack -- the audited batch (``cell_overrides``;
    the round trip at the searched seed is this batch), the advice's extra batches (``batch_config``: ``seed`` and
    ``data.seed`` moved by ``BATCH_SEED_STEP``) and the round trip at the unsearched batch (``unsearched_overrides``)
    -- as ``{id: (seed, kind, what the data follow, samples)}``, each through the config the audit hands an attack
    (:func:`audited`: the attack does not change the draw)."""
    from gradleak.run.advise_probes import batch_config
    from gradleak.run.advise_options import BATCHES
    from gradleak.run.audit import audit_overrides

    a = _bench("advise")
    out: dict[str, dict[str, tuple]] = {}
    for cid, name, seed in a.cells():
        path, only = a.CONFIGS[name]
        raw = _raw(str(BENCH.parent / path))
        attack = (only or ["utr" if raw["experiment"] == "text" else "lora_span"])[0]
        resolved = audit_overrides(copy.deepcopy(raw), a.cell_overrides(seed))
        got = out.setdefault(name, {})
        for b in range(BATCHES):
            got[f"{cid}/batch{b}"] = (seed, "searched", *draw(audited(batch_config(resolved, b), attack)))
        unsearched = audit_overrides(copy.deepcopy(raw), a.unsearched_overrides(seed))
        got[f"{cid}/unsearched"] = (seed, "unsearched", *draw(audited(unsearched, attack)))
    return out


def test_advise_seed1_extra_batches_and_unsearched_round_trips_draw_no_seed0_victim():
    """benchmarks/advise.py: seed 1 is the held-out repetition, so none of its victim batches (audited and extra) is
    a victim of seed 0's search; each round trip's unsearched batch is no victim of any search of its config; and
    a cell's extra batches are new victims. Before the cell set ``data.seed``, vit_lora's seed 1 searched seed 0's
    three images (``data.seed`` 0, 1009, 2018)."""
    a = _bench("advise")
    draws = _advise_draws()
    assert set(draws) == set(a.CONFIGS) and set(a.SEEDS) == {0, 1}
    for name, got in draws.items():
        role = {cid: ("tuned" if seed == 0 and kind == "searched" else "held out")
                for cid, (seed, kind, _, _) in got.items()}
        assert_held_out_disjoint({cid: (role[cid], key, s) for cid, (_, _, key, s) in got.items()})
        searched = {cid: (kind, key, s) for cid, (_, kind, key, s) in got.items() if kind == "searched"}
        assert_held_out_disjoint({cid: ("tuned" if kind == "searched" else "held out", key, s)
                                  for cid, (_, kind, key, s) in got.items()})  # unsearched vs every searched batch
        for cid, (_, key, s) in searched.items():  # every searched batch is its own victims
            others = [(k, x) for c, (_, k, x) in searched.items() if c != cid]
            assert all(key != k and not s & x for k, x in others), cid


def _defended_draws(d) -> list[tuple[dict, set[str]]]:
    """Every defended.py cell (``row``, its private samples), the image part's noisy cells and ceilings included
    (a stand-in drowning std and K: the draw does not depend on them); cells that draw alike drawn once."""
    import json

    args = argparse.Namespace(cells=None)
    gen = [*d.text_cells(args), *d.model_cells(args), *d.projres_cells(args), *d.peftleak_cells(args),
           *d.image_cells(args, {s: 1.0 for s in d.SEEDS}, {s: {5} for s in d.SEEDS})]
    seen: dict[str, set[str]] = {}
    out = []
    for row, raw in gen:
        key = json.dumps([raw["seed"], raw["data"], raw.get("fl"), raw.get("trials"), raw["experiment"]],
                         sort_keys=True, default=str)
        if key not in seen:
            seen[key] = drawn(raw)
        out.append((row, seen[key]))
    return out


def test_defended_held_out_cells_draw_no_sample_a_tuned_cell_draws():
    """benchmarks/defended.py: images follow ``data.seed``, sentences ``seed``; every cell sets both
    to its seed, so the held-out cells (seed 11 / PEFTLeak's 65124) draw no image or sentence any tuned cell draws --
    before, the 25 held-out lora_span cells varied ``seed`` only and reused the tuned image."""
    d = _bench("defended")
    cells = _defended_draws(d)
    assert {r["split"] for r, _ in cells} == {"tuned", "held out"}
    tuned = set().union(*(s for r, s in cells if r["split"] == "tuned"))
    held = [(r, s) for r, s in cells if r["split"] == "held out"]
    assert len(held) > 100 and all(s for _, s in held)
    for r, s in held:
        assert not s & tuned, r["cell"]
    # the image cells: one Fashion-MNIST image per seed, a different one for the held-out seed (the old draw: the same)
    img = {r["seed"]: s for r, s in cells if r["part"].startswith("image")}
    assert len(img[0]) == len(img[11]) == 1 and img[0] != img[11]
    raw = next(raw for row, raw in d.image_cells(argparse.Namespace(cells=None), {11: 1.0}) if row["seed"] == 11)
    assert raw["data"]["seed"] == raw["seed"] == 11
    old = copy.deepcopy(raw)
    old["data"]["seed"] = 0
    assert drawn(old) == img[0]  # what the held-out rows drew before: the tuned image


def test_learned_held_out_cells_draw_no_sample_a_tuned_cell_draws():
    """benchmarks/learned.py: every cell sets ``seed`` and ``data.seed`` to its split's seed (sentences follow
    ``seed``, images ``data.seed``); its defenses do not change the draw. The held-out cells (seed 11) draw no sentence
    any tuned cell (seed 0) draws, and the held-out image cells no image a tuned one draws, in the overrides each cell's
    audit runs (beside the learned attack: UTR on text, lora_span on images)."""
    lr = _bench("learned")
    cells = lr.cells(Path("unused"))
    assert {c["split"] for c in cells} == {"tuned", "held out"} and lr.SPLITS[0] == "tuned"
    assert all(f"seed={c['seed']}" in c["overrides"] and f"data.seed={c['seed']}" in c["overrides"] for c in cells)
    from gradleak.run.audit import audit_overrides, gate_attack

    assert {c["config"] for c in cells} == {"text_adapters", "vit_lora"}
    got: dict[str, dict] = {}
    for c in cells:  # the configs the audit hands the learned attack (its threat upgrade) and the reference attack
        raw = audit_overrides(copy.deepcopy(_raw(str(BENCH.parent / lr.CONFIGS[c["config"]][0]))), c["overrides"])
        reference = "utr" if raw.get("experiment") == "text" else "lora_span"
        for attack in (c["learned"], reference):
            if gate_attack(raw, attack)[1] is not None:  # the learned one is not applicable under DP-SGD
                got.setdefault(c["config"], {})[f"{c['cell']}/{attack}"] = (c["split"], *draw(audited(raw, attack)))
    text, image = got["text_adapters"], got["vit_lora"]
    assert sum(k.endswith("/utr") for k in text) == sum(c["config"] == "text_adapters" for c in cells)
    assert sum(k.endswith("/learned_wordbag") for k in text) > 20 and sum(k.endswith("/learned_image") for k in image) > 10
    assert sum(k.endswith("/lora_span") for k in image) == sum(c["config"] == "vit_lora" for c in cells)
    for drawn in got.values():
        assert_held_out_disjoint(drawn)
