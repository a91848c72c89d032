"""Text datasets (SPEC §3.5) registered in ``DATASETS``: real sentences from offline assets, local files, HF.

Every loader returns a :class:`TextDataset` (sentences + integer labels). Built-in sources (ASSETS.md):

* ``rt-sentences``     -- 200 Rotten Tomatoes sentences (gensim test data, latin-1, ``__label__pos/neg``).
* ``news-sentences``   -- sentences split from the 299 ABC news documents of gensim's ``lee_background.cor``.
* ``imdb-samples``     -- the 10 IMDb reviews of gensim's ``alldata-id-10.txt`` (first sentence of each).
* ``wordnet-examples`` -- quoted example sentences of the WordNet 3.0 glosses (Debian ``wordnet-base``).
* ``csv`` / ``tsv``    -- a local file (e.g. CoLA / SST-2 dumps): ``path=``, ``text_column=``, ``label_column=``.
* ``hf``               -- an HF ``datasets`` dataset the user has cached (``path=``, ``split=``, columns).
"""

from __future__ import annotations

import csv
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.errors import BadInput, MissingAsset
from gradleak.registry import DATASETS

GENSIM_INSTALL = "pip install --no-deps gensim==4.4.0"
WORDNET_INSTALL = "sudo apt-get install -y wordnet-base"
WORDNET_DIR = Path("/usr/share/wordnet")


@dataclass
class TextDataset:
    name: str
    texts: list[str]
    labels: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.texts)

    def batch(self, batch_size: int, seed: int = 0, offset: int = 0) -> tuple[list[str], np.ndarray]:
        """A reproducible batch of distinct sentences (shuffled with ``seed``, then ``offset`` into it)."""
        if batch_size < 1:
            raise BadInput("data.batch_size", f"must be >= 1, got {batch_size}.", "use e.g. 8.")
        if batch_size > len(self.texts):
            raise BadInput("data.batch_size", f"{batch_size} is more than the {len(self.texts)} sentences of "
                           f"'{self.name}'.", f"use at most {len(self.texts)} or a larger dataset.")
        order = np.random.default_rng(seed).permutation(len(self.texts))
        idx = np.roll(order, -offset)[:batch_size]
        return [self.texts[i] for i in idx], self.labels[idx]


def _gensim_file(name: str) -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset("gensim test data", GENSIM_INSTALL)
    p = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / name
    if not p.exists():
        raise MissingAsset(f"gensim/test/test_data/{name}", GENSIM_INSTALL)
    return p


def _limit(texts: list[str], labels: list[int], limit: int | None, name: str, info: dict | None = None) -> TextDataset:
    if limit is not None:
        texts, labels = texts[:limit], labels[:limit]
    return TextDataset(name, texts, np.asarray(labels, dtype=np.int64), info or {})


@DATASETS.register("rt-sentences", "200 Rotten Tomatoes sentences, pos/neg (gensim test data)")
def rt_sentences(limit: int | None = None, **_: Any) -> TextDataset:
    p = _gensim_file("pang_lee_polarity.cor")
    texts, labels = [], []
    for line in p.read_text(encoding="latin-1").splitlines():
        line = line.strip()
        m = re.match(r"__label__(\w+)\s+(.*)", line)
        if not m:
            continue
        texts.append(m.group(2).strip())
        labels.append(1 if m.group(1) == "pos" else 0)
    return _limit(texts, labels, limit, "rt-sentences", {"source": str(p)})


def _split_sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text.strip())
    return [s.strip() for s in parts if 4 <= len(s.split()) <= 40]


@DATASETS.register("news-sentences", "sentences of the 299 ABC news documents (gensim lee_background.cor)")
def news_sentences(limit: int | None = None, **_: Any) -> TextDataset:
    p = _gensim_file("lee_background.cor")
    texts = []
    for doc in p.read_text(encoding="latin-1").splitlines():
        texts.extend(_split_sentences(doc))
    return _limit(texts, [0] * len(texts), limit, "news-sentences", {"source": str(p)})


@DATASETS.register("imdb-samples", "first sentence of each of gensim's 10 IMDb reviews")
def imdb_samples(limit: int | None = None, **_: Any) -> TextDataset:
    p = _gensim_file("alldata-id-10.txt")
    texts = []
    for line in p.read_text(encoding="latin-1").splitlines():
        body = re.sub(r"^_\*\d+\s*", "", line.strip())
        body = re.sub(r"<br\s*/?>", " ", body)
        sents = _split_sentences(body)
        if sents:
            texts.append(sents[0])
    return _limit(texts, [0] * len(texts), limit, "imdb-samples", {"source": str(p)})


@DATASETS.register("wordnet-examples", "quoted example sentences of WordNet 3.0 glosses (Debian wordnet-base)")
def wordnet_examples(limit: int | None = None, root: str | None = None, **_: Any) -> TextDataset:
    d = Path(root) if root else WORDNET_DIR
    files = sorted(d.glob("data.*")) if d.exists() else []
    if not files:
        raise MissingAsset(f"WordNet 3.0 ({d}/data.*)", WORDNET_INSTALL)
    texts: list[str] = []
    seen: set[str] = set()
    for f in files:
        for line in f.read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            gloss = line.split("|", 1)[1]
            for ex in re.findall(r'"([^"]+)"', gloss):
                ex = ex.strip()
                if len(ex.split()) >= 3 and ex not in seen:
                    seen.add(ex)
                    texts.append(ex)
    return _limit(texts, [0] * len(texts), limit, "wordnet-examples", {"source": str(d)})


def _read_delimited(path: str | None, delimiter: str, text_column: str | int | None, label_column: str | int | None,
                    has_header: bool | None, limit: int | None, name: str) -> TextDataset:
    if not path:
        raise BadInput("data.path", f"the '{name}' dataset needs a file path.", "set data.path=/path/to/file.")
    p = Path(path).expanduser()
    if not p.exists():
        raise BadInput("data.path", f"'{p}' does not exist.", "give the path to an existing CSV/TSV file.")
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.reader(f, delimiter=delimiter, quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL))
    if not rows:
        raise BadInput("data.path", f"'{p}' is empty.", "give a file with one sentence per row.")
    header = rows[0]
    if has_header is None:
        has_header = isinstance(text_column, str) or any(h.lower() in ("sentence", "text", "label") for h in header)
    body = rows[1:] if has_header else rows

    def col(c: str | int | None, default: int | None) -> int | None:
        if c is None:
            return default
        if isinstance(c, int) or (isinstance(c, str) and c.isdigit()):
            return int(c)
        if not has_header or c not in header:
            raise BadInput("data.text_column" if c == text_column else "data.label_column",
                           f"column '{c}' is not in the header {header}.", "use a header name or a 0-based index.")
        return header.index(c)

    guess_text = None
    if has_header:
        for cand in ("sentence", "text", "review"):
            if cand in header:
                guess_text = header.index(cand)
    ti = col(text_column, guess_text if guess_text is not None else (len(header) - 1))
    li = col(label_column, header.index("label") if has_header and "label" in header else None)
    texts, labels = [], []
    for r in body:
        if len(r) <= ti:
            continue
        texts.append(r[ti].strip())
        try:
            labels.append(int(float(r[li])) if li is not None and li < len(r) else 0)
        except ValueError:
            labels.append(0)
    return _limit(texts, labels, limit, name, {"source": str(p)})


@DATASETS.register("csv", "local CSV file (e.g. SST-2/IMDb dumps): path, text_column, label_column")
def csv_file(path: str | None = None, text_column: str | int | None = None, label_column: str | int | None = None,
             has_header: bool | None = None, limit: int | None = None, **_: Any) -> TextDataset:
    return _read_delimited(path, ",", text_column, label_column, has_header, limit, "csv")


@DATASETS.register("tsv", "local TSV file (e.g. GLUE CoLA/SST-2 .tsv): path, text_column, label_column")
def tsv_file(path: str | None = None, text_column: str | int | None = None, label_column: str | int | None = None,
             has_header: bool | None = None, limit: int | None = None, **_: Any) -> TextDataset:
    return _read_delimited(path, "\t", text_column, label_column, has_header, limit, "tsv")


@DATASETS.register("hf", "an HF `datasets` dataset available offline (path, split, text_column, label_column)")
def hf_dataset(path: str | None = None, split: str = "train", text_column: str = "sentence",
               label_column: str | None = "label", subset: str | None = None, limit: int | None = None,
               **_: Any) -> TextDataset:
    if importlib.util.find_spec("datasets") is None:
        raise BadInput("data.name", "the 'hf' source needs the `datasets` package.", "pip install datasets.")
    if not path:
        raise BadInput("data.path", "the 'hf' dataset needs a dataset name or path.", "e.g. data.path=glue data.subset=cola.")
    import datasets

    try:
        ds = datasets.load_dataset(path, subset, split=split)
    except Exception as err:  # noqa: BLE001 - datasets raises many types
        raise BadInput("data.path", f"cannot load the HF dataset '{path}' ({err}).",
                       "check the name/split and that it is in your HF cache (HF_DATASETS_OFFLINE=1).") from None
    if text_column not in ds.column_names:
        raise BadInput("data.text_column", f"'{text_column}' is not a column of {ds.column_names}.", "pick one of them.")
    texts = list(ds[text_column])
    labels = list(ds[label_column]) if label_column and label_column in ds.column_names else [0] * len(texts)
    return _limit(texts, labels, limit, f"hf:{path}", {"source": path, "split": split})


def load_text(name: str, **kwargs: Any) -> TextDataset:
    """Load a registered text dataset by name (``field`` data.name in errors)."""
    loader = DATASETS.get(name, field="data.name")
    ds = loader(**kwargs)
    if not isinstance(ds, TextDataset):
        raise BadInput("data.name", f"'{name}' is not a text dataset.", "use rt-sentences, news-sentences, csv, tsv, hf, ...")
    return ds
