"""Held out means disjoint data (issue 41 item 2): a cell labelled held out draws no private sample that a tuned cell
drew, checked through the pipeline's own draw (``benchmarks/_bench.client_samples``: data only, no model). PEFTLeak's
held-out cells are disjoint from every other cell; the anchor study's seed 1 and the leakage study's null seed 4242
are new seeds on the same images, and their labels say so; the leakage study's seed 1 draws other images."""

from __future__ import annotations

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
