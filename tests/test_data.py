"""gradleak.data: built-in offline sets, users' own files, and the errors that name the field."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch
from PIL import Image

from gradleak import data
from gradleak.data import builtin, sources
from gradleak.data.text import load_text
from gradleak.errors import BadInput, MissingAsset
from gradleak.registry import DATASETS


def test_registered():
    for name in ("cifar-samples", "cifar10-samples", "cifar100-samples", "imagenet-samples", "natural-crops",
                 "public-natural", "fashion-mnist", "image-folder", "npz", "lfw-faces"):
        assert name in DATASETS


def test_cifar_samples_are_40_real_images():
    s = data.load("cifar-samples")
    assert s.images.shape == (40, 3, 32, 32) and s.images.dtype == torch.float32
    assert s.labels.dtype == torch.int64 and s.num_classes == 110
    assert 0.0 <= s.images.min() and s.images.max() <= 1.0
    assert s.images.std() > 0.1  # real photos, not constants
    assert s.names[0] == "cifar10_00_3.png" and s.labels[0] == 3  # label = last number of the file name
    assert s.names[20].startswith("cifar100_00_") and s.labels[20] == 49 + 10  # CIFAR-100 offset by 10
    assert len({tuple(x.flatten()[:50].tolist()) for x in s.images}) == 40  # 40 distinct images
    assert torch.equal(data.load("cifar-samples", n=8).images, s.images[:8])  # deterministic order
    assert data.load("cifar10-samples").labels.max() < 10
    assert len(data.load("cifar100-samples")) == 20


def test_too_many_samples_names_batch_size():
    with pytest.raises(BadInput) as err:
        data.load("cifar-samples", n=64)
    assert err.value.field == "data.batch_size" and "natural-crops" in str(err.value)


def test_imagenet_samples_resize():
    s = data.load("imagenet-samples", size=32, n=3)
    assert s.images.shape == (3, 3, 32, 32) and s.labels.tolist() == [243, 559, 438]
    assert data.load("imagenet-samples", size=64, n=1).images.shape == (1, 3, 64, 64)


def test_natural_crops_any_number_and_seeded():
    a = data.load("natural-crops", n=50, size=16, seed=3)
    assert a.images.shape == (50, 3, 16, 16) and 0 <= a.images.min() and a.images.max() <= 1
    assert torch.equal(a.images, data.load("natural-crops", n=50, size=16, seed=3).images)
    assert not torch.equal(a.images, data.load("natural-crops", n=50, size=16, seed=4).images)


def test_public_natural_disjoint_from_attacked_sets():
    pub = data.load("public-natural", n=300, size=32, seed=0)
    assert pub.images.shape == (300, 3, 32, 32)
    assert not any(n.startswith(("cifar", "imagenet")) for n in pub.names)
    attacked = torch.cat([data.load("cifar-samples").images, data.load("imagenet-samples", size=32).images])
    d = torch.cdist(pub.images.flatten(1), attacked.flatten(1)) / (32 * 32 * 3) ** 0.5  # RMS pixel distance
    assert d.min() > 0.02


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(5, 8, 8, 3), dtype=np.uint8)
    y = np.array([0, 1, 2, 1, 0])
    np.savez(tmp_path / "d.npz", x=x, y=y)
    s = data.load("npz", path=str(tmp_path / "d.npz"))
    assert s.images.shape == (5, 3, 8, 8) and s.num_classes == 3
    assert torch.allclose(s.images, torch.from_numpy(x.transpose(0, 3, 1, 2) / 255.0).float())
    assert s.labels.tolist() == y.tolist()
    np.savez(tmp_path / "f.npz", images=s.images.numpy(), labels=y)
    assert torch.equal(data.load("npz", path=str(tmp_path / "f.npz")).images, s.images)


def test_npz_bad_inputs(tmp_path):
    with pytest.raises(BadInput) as err:
        data.load("npz", path=str(tmp_path / "nope.npz"))
    assert err.value.field == "data.path"
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 5, 7, 9, 2)))
    with pytest.raises(BadInput, match="shape"):
        data.load("npz", path=str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "range.npz", x=np.full((2, 3, 4, 4), 255.0))
    with pytest.raises(BadInput, match=r"\[0, 1\]"):
        data.load("npz", path=str(tmp_path / "range.npz"))
    np.savez(tmp_path / "nolabels.npz", z=np.zeros(3))
    with pytest.raises(BadInput, match="no image array"):
        data.load("npz", path=str(tmp_path / "nolabels.npz"))


def test_image_folder_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    originals = {}
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            arr = rng.integers(0, 256, size=(10, 10, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
            originals[f"{cls}/{i}.png"] = arr
    s = data.load("image-folder", path=str(tmp_path))
    assert s.images.shape == (4, 3, 10, 10) and s.labels.tolist() == [0, 0, 1, 1] and s.num_classes == 2
    for img, name in zip(s.images, s.names):
        assert torch.allclose(img, torch.from_numpy(originals[name].transpose(2, 0, 1) / 255.0).float())
    assert data.load("image-folder", path=str(tmp_path), size=6).images.shape == (4, 3, 6, 6)
    flat = tmp_path / "cat"
    assert data.load("image-folder", path=str(flat)).num_classes == 1


def test_image_folder_bad_inputs(tmp_path):
    with pytest.raises(BadInput) as err:
        data.load("image-folder", path=str(tmp_path / "missing"))
    assert err.value.field == "data.path"
    with pytest.raises(BadInput) as err:
        data.load("image-folder", path=str(tmp_path))  # empty folder
    assert err.value.field == "data.path"
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    Image.new("RGB", (5, 5)).save(tmp_path / "b.png")
    with pytest.raises(BadInput) as err:
        data.load("image-folder", path=str(tmp_path))
    # the user-facing keys, not the loader's own `size` argument
    assert err.value.field == "data.resize" and "data.image_size" in err.value.fix
    assert "data.size" not in str(err.value)
    assert data.load("image-folder", path=str(tmp_path), size=4).images.shape == (2, 3, 4, 4)


def test_unknown_names_and_options():
    with pytest.raises(BadInput) as err:
        data.load("no-such-set")
    assert err.value.field == "data.name"
    with pytest.raises(BadInput) as err:
        data.load("cifar-samples", colour="blue")
    assert err.value.field == "data.colour"
    with pytest.raises(BadInput) as err:
        data.load("natural-crops", n=0)
    assert err.value.field == "data.n"


def _write_idx(root, prefix, images, labels):
    with gzip.open(root / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(b"\0" * 16 + images.tobytes())
    with gzip.open(root / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(b"\0" * 8 + labels.tobytes())


def test_fashion_mnist_missing_asset(monkeypatch, tmp_path):
    monkeypatch.setattr(builtin, "FASHION_MNIST_DIR", tmp_path / "absent")
    with pytest.raises(MissingAsset) as err:
        data.load("fashion-mnist")
    assert "apt-get install -y dataset-fashion-mnist" in str(err.value)


def test_fashion_mnist_reader(monkeypatch, tmp_path):
    images = np.arange(3 * 28 * 28, dtype=np.uint8).reshape(3, 28, 28)
    _write_idx(tmp_path, "t10k", images, np.array([9, 0, 4], dtype=np.uint8))
    monkeypatch.setattr(builtin, "FASHION_MNIST_DIR", tmp_path)
    s = data.load("fashion-mnist", split="test")
    assert s.images.shape == (3, 1, 28, 28) and s.labels.tolist() == [9, 0, 4] and s.num_classes == 10
    assert torch.allclose(s.images[:, 0] * 255, torch.from_numpy(images).float())
    with pytest.raises(BadInput) as err:
        data.load("fashion-mnist", split="val")
    assert err.value.field == "data.split"


def test_fashion_mnist_real_files_if_installed():
    if not (builtin.FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
        with pytest.raises(MissingAsset):
            data.load("fashion-mnist", split="test")
        return
    s = data.load("fashion-mnist", split="test")
    assert s.images.shape == (10000, 1, 28, 28) and s.labels.max() == 9


def test_model_range_round_trip():
    x = torch.rand(2, 3, 4, 4)
    y = data.to_model_range(x)
    assert y.min() >= -1 and y.max() <= 1
    assert torch.allclose(data.from_model_range(y), x)


# --- text datasets -----------------------------------------------------------------------------------


def test_imdb_samples_one_text_per_review():
    try:
        ds = load_text("imdb-samples")
    except MissingAsset:
        pytest.skip("gensim test data not installed")
    assert len(ds) == 10 and len(set(ds.texts)) == 10
    assert all(t.strip() and len(t.split()) >= 4 for t in ds.texts)
    assert ds.texts[0].startswith("it was a bit bizarre and evil") and " ," not in ds.texts[0]
    assert not any(t.startswith("_*") for t in ds.texts)
    assert "mr. motos" in ds.texts[7]  # no sentence break after a title abbreviation
    assert len(load_text("imdb-samples", limit=3)) == 3


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def test_csv_header_with_other_names_is_not_a_sentence(tmp_path):
    p = _write(tmp_path, "r.csv", 'review,stars\n"Great movie, loved it.",5\nAwful from start to end.,1\nFine I guess.,3\n')
    want = ["Great movie, loved it.", "Awful from start to end.", "Fine I guess."]
    ds = load_text("csv", path=p, text_column="review")
    assert ds.texts == want
    ds = load_text("csv", path=p, text_column="review", label_column="stars")
    assert ds.texts == want and ds.labels.tolist() == [5, 1, 3]
    assert load_text("csv", path=p).texts == want  # header detected without any column given
    assert load_text("csv", path=p, text_column="0", label_column="1").labels.tolist() == [5, 1, 3]
    other = _write(tmp_path, "o.csv", "comment,score\nI liked it a lot really,4\nnot for me at all,2\n")
    assert load_text("csv", path=other).texts == ["I liked it a lot really", "not for me at all"]


def test_csv_without_header_keeps_every_row(tmp_path):
    p = _write(tmp_path, "h.csv", "Great movie loved it,1\nAwful really bad,0\nfine I guess so,1\n")
    ds = load_text("csv", path=p)
    assert ds.texts == ["Great movie loved it", "Awful really bad", "fine I guess so"]
    assert load_text("csv", path=p, text_column=0, label_column=1).labels.tolist() == [1, 0, 1]
    one = _write(tmp_path, "one.csv", "the first sentence here\nand the second one\n")
    assert load_text("csv", path=one).texts == ["the first sentence here", "and the second one"]
    # GLUE CoLA layout: source, label, marker, sentence; no header, unbalanced quotes
    cola = _write(tmp_path, "cola.tsv", 'gj04\t1\t\tOur friends won\'t buy this analysis.\n'
                  'gj04\t0\t*\tOne more "pseudo generalization and I\'m giving up.\n')
    ds = load_text("tsv", path=cola, label_column="1")
    assert ds.texts == ["Our friends won't buy this analysis.", 'One more "pseudo generalization and I\'m giving up.']
    assert ds.labels.tolist() == [1, 0]
    sst = _write(tmp_path, "sst.tsv", "sentence\tlabel\nhide new secretions \t0\nit 's a charming journey \t1\n")
    ds = load_text("tsv", path=sst)
    assert ds.texts == ["hide new secretions", "it 's a charming journey"] and ds.labels.tolist() == [0, 1]


def test_csv_wrong_column_name_lists_the_header(tmp_path):
    p = _write(tmp_path, "r.csv", "review,stars\nGreat movie loved it,5\nAwful really bad,1\n")
    with pytest.raises(BadInput) as err:
        load_text("csv", path=p, text_column="sentence")
    assert err.value.field == "data.text_column"
    assert "'review'" in str(err.value) and "'stars'" in str(err.value)
    with pytest.raises(BadInput) as err:
        load_text("csv", path=p, text_column="review", label_column="label")
    assert err.value.field == "data.label_column" and "'stars'" in str(err.value)
    with pytest.raises(BadInput) as err:
        load_text("csv", path=p, text_column="5")
    assert err.value.field == "data.text_column"


# --- labelled text tasks: WordNet POS, fortunes topics, users' CoLA / SST-5 / IMDb ------------------------


def test_wordnet_examples_labelled_by_part_of_speech():
    try:
        ds = load_text("wordnet-examples")
    except MissingAsset:
        pytest.skip("Debian wordnet-base not installed")
    assert ds.info["num_classes"] == 4 and ds.info["label_names"] == ["noun", "verb", "adjective", "adverb"]
    counts = np.bincount(ds.labels, minlength=4)
    assert len(ds) > 40_000 and counts.min() > 3_000 and counts.sum() == len(ds)
    assert len(set(ds.texts)) == len(ds) and all(len(t.split()) >= 3 for t in ds.texts)
    for text, label in [("the team is a unit", 0), ("The patient is respiring", 1), ("able to swim", 2),
                        ("they performed a cappella", 3)]:
        assert ds.labels[ds.texts.index(text)] == label
    assert len(load_text("wordnet-examples", limit=5)) == 5


def _wordnet_root(tmp_path):
    lic = "  1 This software and database is being provided to you\n"
    files = {"data.noun": '00001 03 n 01 dog 0 000 | a canine; "the dog barked all night"; "dog"\n',
             "data.verb": '00002 29 v 01 run 0 000 | move fast; "she runs every day"; "the dog barked all night"\n',
             "data.adj": '00003 00 a 01 able 0 000 | having skill; "able to swim"\n',
             "data.adv": '00004 02 r 01 fast 0 000 | quickly; "he drove very fast"\n'}
    for name, body in files.items():
        (tmp_path / name).write_text(lic + body, encoding="latin-1")
    return tmp_path


def test_wordnet_examples_labels_and_dedup_on_tiny_files(tmp_path):
    ds = load_text("wordnet-examples", root=str(_wordnet_root(tmp_path)))
    # read adj, adv, noun, verb; "dog" (1 word) dropped; the verb file's repeat keeps the noun label
    assert ds.texts == ["able to swim", "he drove very fast", "the dog barked all night", "she runs every day"]
    assert ds.labels.tolist() == [2, 3, 0, 1] and ds.info["num_classes"] == 4
    (tmp_path / "data.adv").unlink()
    with pytest.raises(MissingAsset) as err:
        load_text("wordnet-examples", root=str(tmp_path))
    assert "data.adv" in str(err.value) and "wordnet-base" in err.value.install


def test_fortunes_topics_real_quotes():
    try:
        ds = load_text("fortunes-topics")
    except MissingAsset:
        pytest.skip("Debian fortunes not installed")
    assert ds.info["label_names"] == ["computers", "politics", "science", "work"] and ds.info["num_classes"] == 4
    counts = np.bincount(ds.labels, minlength=4)
    assert 2_200 <= len(ds) <= 2_700 and counts.min() >= 400, counts  # 2,441 with fortunes 1:1.99.1
    assert len(set(ds.texts)) == len(ds)
    assert all(3 <= len(t.split()) <= 40 and t == " ".join(t.split()) for t in ds.texts)
    assert not any("\x08" in t or t.startswith("--") or " -- " + "Lazarus Long" in t for t in ds.texts)
    i = ds.texts.index("A billion here, a billion there -- pretty soon it adds up to real money.")
    assert ds.labels[i] == 1  # politics; the "-- Sen. Everett Dirksen" line is gone, the inline "--" stays


def test_fortunes_topics_parsing_and_missing_package(tmp_path):
    with pytest.raises(MissingAsset) as err:
        load_text("fortunes-topics", root=str(tmp_path))
    assert "apt-get install fortunes" in str(err.value)
    long = " ".join(["word"] * 41)
    (tmp_path / "computers").write_text(
        "Calm down, it's *____\b\b\b\bonly* ones\nand   zeroes.\n%\nNo.\n%\n" + long + "\n%\n"
        "Bus error -- driver executed.\n\t\t-- Anonymous, \"A Book of\n\t\t   Bugs\"\n%\n", encoding="utf-8")
    (tmp_path / "politics").write_text("Bus error -- driver executed.\n%\nVote early and vote often.\n"
                                       "\t\t-- Al Capone\n", encoding="utf-8")
    (tmp_path / "science").write_text("An _\bI satisfies a sentence.\n", encoding="utf-8")
    (tmp_path / "work").write_text("%\nWork is the curse of the drinking classes.\n%\n", encoding="utf-8")
    ds = load_text("fortunes-topics", root=str(tmp_path))
    assert ds.texts == ["Calm down, it's *only* ones and zeroes.", "Bus error -- driver executed.",
                        "Vote early and vote often.", "An I satisfies a sentence.",
                        "Work is the curse of the drinking classes."]
    assert ds.labels.tolist() == [0, 0, 1, 2, 3]  # the repeat in politics keeps its first topic
    assert len(load_text("fortunes-topics", root=str(tmp_path), max_words=5)) == 3


def test_cola_raw_tsv(tmp_path):
    rows = ("gj04\t1\t\tOur friends won't buy this analysis.\n"
            "gj04\t0\t*\tOne more \"pseudo generalization and I'm giving up.\n\n"
            "gj04\t1\t\tOur friends won't buy this analysis.\n")
    p = _write(tmp_path, "in_domain_train.tsv", rows)
    ds = load_text("cola", path=p)
    assert ds.texts == ["Our friends won't buy this analysis.", "One more \"pseudo generalization and I'm giving up."]
    assert ds.labels.tolist() == [1, 0] and ds.info["num_classes"] == 2 and ds.info["duplicates_dropped"] == 1
    assert ds.info["label_names"] == ["unacceptable", "acceptable"]
    assert len(load_text("cola", path=p, dedup=False)) == 3
    assert load_text("cola", path=str(tmp_path)).texts == ds.texts  # the folder holding in_domain_train.tsv
    assert data.load("cola", path=p).texts == ds.texts
    bad = _write(tmp_path, "bad.tsv", "sentence\tlabel\nhello there world\t1\n")
    for path in (bad, str(tmp_path / "none.tsv"), None):
        with pytest.raises(BadInput) as err:
            load_text("cola", path=path)
        assert err.value.field == "data.path"
    with pytest.raises(BadInput) as err:
        load_text("cola", path=str(tmp_path / "sub"))
    assert err.value.field == "data.path"


def test_sst5_fasttext_and_tree_formats(tmp_path):
    p = _write(tmp_path, "sst_train.txt", "__label__5 a gorgeous , witty , seductive movie .\n"
               "__label__1 a sour little movie .\n\n__label__3 it 's a film .\n")
    ds = load_text("sst5", path=p)
    assert ds.texts == ["a gorgeous , witty , seductive movie .", "a sour little movie .", "it 's a film ."]
    assert ds.labels.tolist() == [4, 0, 2] and ds.info["num_classes"] == 5
    assert ds.info["label_names"][0] == "very negative" and ds.info["label_names"][4] == "very positive"
    trees = _write(tmp_path, "train.txt", "(3 (2 It) (4 (2 's) (4 (3 (2 a) (4 (3 lovely) (2 film))) (2 .))))\n"
                   "(1 (2 -LRB-) (1 (1 dull) (2 -RRB-)))\n")
    ds = load_text("sst5", path=trees)
    assert ds.texts == ["It 's a lovely film .", "( dull )"] and ds.labels.tolist() == [3, 1]
    for text in ("__label__6 out of range\n", "__label__0 zero based\n", "(3 (2 unbalanced)\n", "plain sentence\n"):
        with pytest.raises(BadInput) as err:
            load_text("sst5", path=_write(tmp_path, "bad.txt", text))
        assert err.value.field == "data.path" and "line 1" in str(err.value)
    with pytest.raises(BadInput) as err:
        load_text("sst5", path=str(tmp_path))
    assert err.value.field == "data.path"


def test_imdb_folder(tmp_path):
    train = tmp_path / "aclImdb" / "train"
    for sub, reviews in {"pos": {"10_9.txt": "Loved it.<br /><br />Great   cast.", "2_8.txt": "A fine film."},
                         "neg": {"3_1.txt": "Dull and long.", "1_2.txt": "Awful film, really."}}.items():
        (train / sub).mkdir(parents=True)
        for name, text in reviews.items():
            (train / sub / name).write_text(text, encoding="utf-8")
    (train / "unsup").mkdir()
    (train / "unsup" / "0_0.txt").write_text("not labelled", encoding="utf-8")
    ds = load_text("imdb-folder", path=str(tmp_path / "aclImdb"))
    assert ds.texts == ["Awful film, really.", "Dull and long.", "A fine film.", "Loved it. Great cast."]
    assert ds.labels.tolist() == [0, 0, 1, 1] and ds.info["num_classes"] == 2
    assert load_text("imdb-folder", path=str(train)).texts == ds.texts
    assert load_text("imdb-folder", path=str(train), max_words=2).texts[3] == "Loved it."
    assert load_text("imdb-folder", path=str(tmp_path)).texts == ds.texts  # the folder above aclImdb
    (tmp_path / "empty").mkdir()
    for path in (str(tmp_path / "empty"), str(train / "pos" / "2_8.txt"), str(tmp_path / "nope"), None):
        with pytest.raises(BadInput) as err:
            load_text("imdb-folder", path=path)
        assert err.value.field == "data.path"


def test_num_classes_recorded(tmp_path):
    p = _write(tmp_path, "r.csv", "review,stars\nGreat movie loved it,5\nAwful really bad,1\n")
    ds = load_text("csv", path=p, label_column="stars")
    assert ds.info["labelled"] and ds.info["num_classes"] == 6
    ds = load_text("csv", path=p, text_column="review")
    assert not ds.info["labelled"] and "num_classes" not in ds.info
    try:
        rt = load_text("rt-sentences", limit=10)
        news = load_text("news-sentences", limit=10)
    except MissingAsset:
        pytest.skip("gensim test data not installed")
    assert rt.info["num_classes"] == 2 and rt.info["label_names"] == ["neg", "pos"]
    assert not news.info["labelled"]


def _toy(n):
    from gradleak.data.text import TextDataset

    return TextDataset("toy", [f"sentence number {i}" for i in range(n)], np.arange(n) % 3, {"source": "x"})


def test_split_counts_and_fractions():
    ds = _toy(100)
    members, test, pool = ds.split([30, 20, 40], seed=1)
    assert [len(members), len(test), len(pool)] == [30, 20, 40]
    idx = [set(part.info["indices"]) for part in (members, test, pool)]
    assert not (idx[0] & idx[1] or idx[0] & idx[2] or idx[1] & idx[2])
    assert not set(members.texts) & set(pool.texts)
    for part in (members, test, pool):
        assert part.texts == [ds.texts[i] for i in part.info["indices"]]
        assert part.labels.tolist() == ds.labels[part.info["indices"]].tolist()
        assert part.info["source"] == "x" and part.info["split_seed"] == 1
    again = ds.split([30, 20, 40], seed=1)
    assert again[0].texts == members.texts and again[2].texts == pool.texts
    assert ds.split([30, 20, 40], seed=2)[0].texts != members.texts
    parts = ds.split([0.7, 0.3], seed=0)
    assert [len(q) for q in parts] == [70, 30]
    assert sorted(parts[0].info["indices"] + parts[1].info["indices"]) == list(range(100))
    assert sum(len(q) for q in _toy(11).split([1 / 3, 1 / 3, 1 / 3])) == 11
    assert [len(q) for q in ds.split([0.5, 0.1])] == [50, 10]
    assert [len(q) for q in ds.split(np.array([5, 6]))] == [5, 6]


def test_split_refuses_bad_or_too_many_parts():
    ds = _toy(10)
    for parts in ([6, 5], [0.5, 4], [0, 3], [0.05, 0.95], [0.6, 0.6], "0.5", []):
        with pytest.raises(BadInput) as err:
            ds.split(parts)
        assert err.value.field == "data.name"
    with pytest.raises(BadInput) as err:
        ds.split([480, 1000], field="data.members")
    assert err.value.field == "data.members" and "1480" in str(err.value) and "10" in str(err.value)


def test_split_counts_repeated_sentences_once():
    from gradleak.data.text import TextDataset

    ds = TextDataset("rep", ["a b c", "d e f", "a b c", "g h i"], np.array([0, 1, 2, 1]))
    a, b = ds.split([2, 1], seed=0)
    assert not set(a.texts) & set(b.texts) and len(set(a.texts + b.texts)) == 3
    with pytest.raises(BadInput):
        ds.split([2, 2])
    assert sum(len(q) for q in ds.split([2, 2], dedup=False)) == 4


# --- modality and public/private overlap -------------------------------------------------------------


def test_dataset_modality():
    for name in ("cifar-samples", "imagenet-samples", "natural-crops", "public-natural", "fashion-mnist",
                 "image-folder", "npz"):
        assert data.dataset_modality(name) == "image"
    for name in ("rt-sentences", "news-sentences", "imdb-samples", "wordnet-examples", "fortunes-topics", "cola",
                 "sst5", "imdb-folder", "csv", "tsv", "hf"):
        assert data.dataset_modality(name) == "text"
    with pytest.raises(BadInput) as err:
        data.dataset_modality("no-such-set")
    assert err.value.field == "data.name"


@pytest.mark.parametrize("private,public", [("natural-crops", "natural-crops"), ("imagenet-samples", "natural-crops"),
                                            ("natural-crops", "natural-crops-a"), ("natural-crops-b", "imagenet-samples"),
                                            ("natural-crops-a", "natural-crops-a"),
                                            ("cifar-samples", "cifar10-samples"), ("public-natural", "public-natural")])
def test_check_disjoint_refuses_shared_photos(private, public):
    with pytest.raises(BadInput) as err:
        data.check_disjoint(private, public)
    assert err.value.field == "data.public"
    fix = err.value.fix
    suggested = fix.split("data.public=", 1)[1].split(",")[0].split(" ")[0]
    data.check_disjoint(private, suggested)  # the suggested set is disjoint indeed


@pytest.mark.parametrize("private,public", [("cifar-samples", "natural-crops"), ("imagenet-samples", "public-natural"),
                                            ("cifar10-samples", "cifar100-samples"), ("fashion-mnist", "natural-crops"),
                                            ("natural-crops-a", "natural-crops-b"), ("natural-crops-b", "natural-crops-a")])
def test_check_disjoint_accepts(private, public):
    data.check_disjoint(private, public)


def test_check_disjoint_unknown_names_and_defaults():
    with pytest.raises(BadInput) as err:
        data.check_disjoint("cifar-samples", "no-such-set")
    assert err.value.field == "data.public"
    with pytest.raises(BadInput) as err:
        data.check_disjoint("no-such-set", "public-natural")
    assert err.value.field == "data.name"
    assert data.default_public("cifar-samples") == "natural-crops"
    assert data.default_public("imagenet-samples") == "public-natural"


def test_every_builtin_image_set_has_its_sources_recorded():
    builtin_sets = [e.name for e in DATASETS if getattr(e.obj, "__module__", "") == builtin.__name__]
    assert builtin_sets and set(builtin_sets) <= set(sources.SOURCES)
    assert set().union(*sources.SOURCES.values()) <= set(sources.FAMILIES)


def test_lfw_faces_are_the_100_real_faces_of_the_subset():
    import skimage.data

    faces = data.load("lfw-faces")
    raw = np.asarray(skimage.data.lfw_subset())
    assert faces.images.shape == (100, 1, 25, 25) and faces.num_classes == 20
    assert torch.allclose(faces.images[:, 0].double(), torch.from_numpy(raw[:100]).double(), atol=1e-6)
    assert faces.labels.tolist() == [i % 20 for i in range(100)]
    assert data.load("lfw-faces", n=3).images.shape[0] == 3
    sources.check_disjoint("lfw-faces", "public-natural")  # the server's public photos are no LFW face
    assert sources.default_public("lfw-faces") == "natural-crops"
    with pytest.raises(BadInput, match="data.public"):
        sources.check_disjoint("lfw-faces", "lfw-faces")


def test_lfw_faces_through_the_pipeline_loader_become_rgb_at_the_configured_size():
    from gradleak.data.splits import load_images

    x, y = load_images("lfw-faces", 4, 64, 0, "data.batch_size")
    assert x.shape == (4, 3, 64, 64) and torch.equal(x[:, 0], x[:, 1]) and y.tolist() == [0, 1, 2, 3]
    assert 0 <= float(x.min()) and float(x.max()) <= 1


def test_natural_crops_halves_crop_disjoint_photos_and_the_whole_set_is_unchanged():
    """natural-crops-a / -b crop ImageNet sample photos 0-9 / 10-19 only (a same-distribution public/private split);
    natural-crops still crops all 20 photos with the same seeded draw as before the split."""
    from gradleak.data.base import random_square_crops

    a = builtin.natural_crops_a(n=64, size=16, seed=3)
    b = builtin.natural_crops_b(n=64, size=16, seed=3)
    assert set(a.meta["photos"]) <= set(range(10)) and set(b.meta["photos"]) <= set(range(10, 20))
    assert len(set(a.meta["photos"])) > 5 and len(set(b.meta["photos"])) > 5
    photos, labels, names = builtin._imagenet_photos()
    assert {n.split("#")[0] for n in a.names} <= set(names[:10]) and {n.split("#")[0] for n in b.names} <= set(names[10:])
    arrays, src, _ = random_square_crops(photos, 32, 16, 5, 0.25)
    whole = builtin.natural_crops(n=32, size=16, seed=5)
    assert torch.equal(whole.images, builtin.stack(arrays)) and whole.labels.tolist() == [labels[k] for k in src]
