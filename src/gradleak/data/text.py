"""Text datasets (SPEC §3.5) registered in ``DATASETS``: real sentences from offline assets, local files, HF.

Every loader returns a :class:`TextDataset` (sentences + integer labels). Built-in sources (ASSETS.md):

* ``rt-sentences``     -- 200 Rotten Tomatoes sentences (gensim test data, latin-1, ``__label__pos/neg``).
* ``news-sentences``   -- sentences split from the 299 ABC news documents of gensim's ``lee_background.cor``.
* ``imdb-samples``     -- the 10 IMDb reviews of gensim's ``alldata-id-10.txt`` (first sentence of 4+ words of each).
* ``wordnet-examples`` -- quoted example sentences of the WordNet 3.0 glosses (Debian ``wordnet-base``).
* ``csv`` / ``tsv``    -- a local file (e.g. CoLA / SST-2 dumps): ``path=``, ``text_column=``, ``label_column=``.
* ``hf``               -- an HF ``datasets`` dataset the user has cached (``path=``, ``split=``, columns).
"""

from __future__ import annotations

import csv
import importlib.util
import io
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


_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "prof", "mt"})


def _tokenized_sentences(text: str) -> list[str]:
    """Sentences of lower-cased, space-tokenized text (``word ,  word .  next``), detokenized.

    A sentence ends at a stand-alone ``.``/``!``/``?`` token (runs such as ``. .`` or ``? !`` stay with it),
    except after a title abbreviation (``mr .  moto``).
    """
    sents: list[list[str]] = []
    cur: list[str] = []
    for tok in text.split():
        is_end = re.fullmatch(r"[.!?]+", tok) is not None
        if is_end and not cur and sents:  # a run of end marks: attach to the previous sentence
            sents[-1].append(tok)
            continue
        cur.append(tok)
        if is_end and not (len(cur) >= 2 and cur[-2] in _ABBREVIATIONS and tok == "."):
            sents.append(cur)
            cur = []
    if cur:
        sents.append(cur)
    out = []
    for toks in sents:
        s = " ".join(toks)
        s = re.sub(r"\s+([,.!?;:)])", r"\1", s)
        s = re.sub(r"\(\s+", "(", s)
        out.append(s.strip())
    return out


@DATASETS.register("imdb-samples", "first sentence (of 4+ words) of each of gensim's 10 IMDb reviews")
def imdb_samples(limit: int | None = None, **_: Any) -> TextDataset:
    """One text per review of ``alldata-id-10.txt`` (one review a line, ``_*<id> `` then lower-cased tokens).

    The first sentence of at least 4 words (a whole review can exceed a 512-token model), e.g.
    ``"it was a bit bizarre and evil and i enjoyed it a lot, the characters ... well."``. Label 0 for all:
    the file carries no sentiment labels.
    """
    p = _gensim_file("alldata-id-10.txt")
    texts = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        body = re.sub(r"^_\*\d+\s*", "", line.strip())
        body = re.sub(r"<br\s*/?>", " ", body)
        sents = _tokenized_sentences(body)
        if not sents:
            continue
        texts.append(next((s for s in sents if len(re.findall(r"\w+", s)) >= 4), sents[0]))
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


#: Header names taken as the text column when ``text_column`` is not given (first match wins).
TEXT_COLUMN_NAMES = ("sentence", "text", "review", "content", "comment", "document", "utterance")
#: Header names taken as the label column when ``label_column`` is not given.
LABEL_COLUMN_NAMES = ("label", "labels", "sentiment", "class", "target")
_SNIFF_ROWS = 50


def _is_index(c: str | int | None) -> bool:
    return isinstance(c, int) or (isinstance(c, str) and c.strip().isdigit())


class _FixedDialectSniffer(csv.Sniffer):
    """``csv.Sniffer`` whose ``has_header`` uses the delimiter we already know (its own guess can pick a
    comma inside a TSV's sentences, or fail with csv.Error on one-column files)."""

    def __init__(self, dialect: type[csv.Dialect]):
        super().__init__()
        self._dialect = dialect

    def sniff(self, sample: str, delimiters: str | None = None) -> type[csv.Dialect]:  # noqa: ARG002
        return self._dialect


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _sniff_header(rows: list[list[str]]) -> bool:
    """Whether ``rows[0]`` looks like a header: a known column name; or a column that is numeric in every
    later row but not in the first (``stars`` over ``5, 1, 3``); or, with 3+ later rows to compare,
    ``csv.Sniffer().has_header``'s vote (it also compares fixed value lengths, unreliable on fewer rows)."""
    first = [h.strip() for h in rows[0]]
    if any(h.lower() in TEXT_COLUMN_NAMES or h.lower() in LABEL_COLUMN_NAMES for h in first):
        return True
    body = rows[1:_SNIFF_ROWS]
    for j, h in enumerate(first):
        vals = [r[j].strip() for r in body if len(r) > j and r[j].strip()]
        if vals and all(_is_number(v) for v in vals):
            return not _is_number(h)
    if len(body) < 3:
        return False
    buf = io.StringIO()  # the parsed rows, re-written losslessly as plain CSV for the sniffer
    csv.writer(buf, dialect=csv.excel).writerows(rows[:_SNIFF_ROWS])
    try:
        return bool(_FixedDialectSniffer(csv.excel).has_header(buf.getvalue()))
    except (csv.Error, ValueError, TypeError):
        return False


def _read_delimited(path: str | None, delimiter: str, text_column: str | int | None, label_column: str | int | None,
                    has_header: bool | None, limit: int | None, name: str) -> TextDataset:
    """Rows of a CSV/TSV as sentences + labels; the header row (when there is one) is never a sentence.

    Header: ``has_header`` if given; else a header is required when ``text_column``/``label_column`` is
    a name (not a 0-based index), and otherwise detected (:func:`_sniff_header`). Text column: the named
    or indexed one, else a header name of :data:`TEXT_COLUMN_NAMES`, else the column with the longest
    values. Label column: the named or indexed one, else a header name of :data:`LABEL_COLUMN_NAMES`,
    else none (labels 0). Non-numeric labels read as 0.
    """
    if not path:
        raise BadInput("data.path", f"the '{name}' dataset needs a file path.", "set data.path=/path/to/file.")
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInput("data.path", f"'{p}' does not exist.", "give the path to an existing CSV/TSV file.")
    tsv = delimiter == "\t"  # GLUE TSVs hold unbalanced quotes: read them as plain characters
    dialect = type("_Dialect", (csv.excel_tab if tsv else csv.excel,),
                   {"delimiter": delimiter, "quoting": csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL})
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        rows = [r for r in csv.reader(f, dialect=dialect) if any(c.strip() for c in r)]
    if not rows:
        raise BadInput("data.path", f"'{p}' is empty.", "give a file with one sentence per row.")
    named = any(c is not None and not _is_index(c) for c in (text_column, label_column))
    if has_header is None:
        has_header = named or _sniff_header(rows)
    header = [h.strip() for h in rows[0]] if has_header else []
    body = rows[1:] if has_header else rows
    width = max(len(r) for r in rows)

    def col(c: str | int | None, fld: str) -> int:
        if _is_index(c):
            i = int(c)  # type: ignore[arg-type]
            if i >= width:
                raise BadInput(fld, f"column {i} does not exist: the rows of '{p}' have at most {width} columns.",
                               f"use a 0-based index below {width}" + (f" or one of the names {header}." if header else "."))
            return i
        c = str(c).strip()
        if not has_header:
            raise BadInput(fld, f"column '{c}' is a name, but '{p}' is read without a header row.",
                           f"use a 0-based column index (0..{width - 1}).")
        if c in header:
            return header.index(c)
        folded = [h.lower() for h in header]
        if c.lower() in folded:
            return folded.index(c.lower())
        raise BadInput(fld, f"column '{c}' is not in the header (first row) of '{p}', whose columns are {header}.",
                       f"use one of {header}, or a 0-based column index (0..{width - 1}).")

    def named_default(names: tuple[str, ...]) -> int | None:
        folded = [h.lower() for h in header]
        return next((folded.index(n) for n in names if n in folded), None)

    li = col(label_column, "data.label_column") if label_column is not None else named_default(LABEL_COLUMN_NAMES)
    if text_column is not None:
        ti = col(text_column, "data.text_column")
    else:
        ti = named_default(TEXT_COLUMN_NAMES)
        if ti is None:  # the column with the longest values (ties: the last), never the label column
            sample = body[:_SNIFF_ROWS] or rows
            cands = [j for j in range(width) if j != li] or [0]
            ti = max(cands, key=lambda j: (sum(len(r[j]) for r in sample if len(r) > j), j))
    texts, labels = [], []
    for r in body:
        if len(r) <= ti or not r[ti].strip():
            continue
        texts.append(r[ti].strip())
        try:
            labels.append(int(float(r[li])) if li is not None and li < len(r) else 0)
        except ValueError:
            labels.append(0)
    if not texts:
        raise BadInput("data.path", f"'{p}' has no sentences in column {ti}"
                       f"{' after its header row' if has_header else ''}.",
                       "give a file with one sentence per row, or pick the column with data.text_column.")
    info = {"source": str(p), "header": header or None, "text_column": ti, "label_column": li}
    return _limit(texts, labels, limit, name, info)


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
