"""Text datasets (UTR paper Sec. 5.1) registered in ``DATASETS``: real sentences from offline assets, local files, HF.

Every loader returns a :class:`TextDataset` (sentences + integer labels). Built-in sources (ASSETS.md):

* ``rt-sentences``     -- 200 Rotten Tomatoes sentences (gensim test data, latin-1, ``__label__pos/neg``).
* ``news-sentences``   -- sentences split from the 299 ABC news documents of gensim's ``lee_background.cor``.
* ``imdb-samples``     -- the 10 IMDb reviews of gensim's ``alldata-id-10.txt`` (first sentence of 4+ words of each).
* ``wordnet-examples`` -- quoted example sentences of the WordNet 3.0 glosses (Debian ``wordnet-base``), labelled
  by part of speech: 0 noun, 1 verb, 2 adjective, 3 adverb.
* ``fortunes-topics``  -- short quotes of the Debian ``fortunes`` files computers / politics / science / work (0..3).
* ``cola``             -- the user's CoLA ``in_domain_train.tsv`` (source, label, mark, sentence): 0/1 acceptability.
* ``sst5``             -- the user's SST-5 file: ``__label__N sentence`` lines (N 1..5) or PTB trees ``(3 (2 a) ...)``.
* ``imdb-folder``      -- the user's ``aclImdb`` folder (``train/{neg,pos}/*.txt``): 0 neg, 1 pos.
* ``csv`` / ``tsv``    -- a local file (e.g. CoLA / SST-2 dumps): ``path=``, ``text_column=``, ``label_column=``.
* ``hf``               -- an HF ``datasets`` dataset the user has cached (``path=``, ``split=``, columns).

``info`` of every set: ``source``; ``labelled`` (False where every label is a placeholder 0); for labelled sets
``num_classes`` (labels lie in ``[0, num_classes)``) and, where the classes have names, ``label_names``.
:meth:`TextDataset.split` cuts a set into disjoint seeded parts (e.g. members / held-out test / non-member pool).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradleak.errors import BadInput, MissingAsset
from gradleak.registry import DATASETS

GENSIM_INSTALL = "pip install --no-deps gensim==4.4.0"
WORDNET_INSTALL = "sudo apt-get install -y wordnet-base"
WORDNET_DIR = Path("/usr/share/wordnet")
#: WordNet data files in reading order (sorted names, as before the labels) and their part-of-speech label.
WORDNET_FILES = (("data.adj", 2), ("data.adv", 3), ("data.noun", 0), ("data.verb", 1))
WORDNET_LABELS = ("noun", "verb", "adjective", "adverb")
FORTUNES_INSTALL = "sudo apt-get install fortunes"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
#: The fortune files used as topics, in label order (all four ship in Debian ``fortunes``, not ``fortunes-min``).
FORTUNE_TOPICS = ("computers", "politics", "science", "work")


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

    def subset(self, indices: Sequence[int], name: str | None = None,
               info: dict[str, Any] | None = None) -> TextDataset:
        """The sentences at ``indices`` (in that order); ``info`` is this set's updated with ``info``."""
        idx = np.asarray(indices, dtype=np.int64)
        return TextDataset(name or self.name, [self.texts[i] for i in idx], self.labels[idx].copy(),
                           {**self.info, **(info or {})})

    def split(self, parts: Sequence[float | int], seed: int = 0, *, dedup: bool = True,
              field: str = "data.name") -> list[TextDataset]:
        """Disjoint, seeded random parts, e.g. ``members, test, pool = ds.split([480, 200, 1000], seed=0)``.

        ``parts``: all counts (ints >= 1, summing to at most ``len(self)``) or all fractions (floats in
        (0, 1], summing to at most 1; a part is ``round(cumulative fraction * n)`` minus the previous
        boundary, so fractions summing to 1 use every sentence). Sentences not given to a part are left out.
        With ``dedup`` (default) a sentence that occurs more than once counts once (its first label), so
        the parts are disjoint as texts, not only as positions. Each part keeps its original order; its
        ``info`` adds ``parent``, ``part``, ``parts``, ``split_seed`` and ``indices`` (positions in this set).
        A set too small for the parts, or a part of size 0, raises :class:`BadInput` naming ``field``
        (default ``data.name``: pick a larger set; callers pass e.g. ``data.nonmembers``).
        """
        if isinstance(parts, np.ndarray) and parts.ndim == 1:
            parts = parts.tolist()
        if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
            raise BadInput(field, f"expected a list of counts or fractions, got {parts!r}.",
                           "e.g. [480, 1000] (counts) or [0.8, 0.2] (fractions).")
        is_int = [isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in parts]
        is_frac = [isinstance(p, (float, np.floating)) for p in parts]
        if not (all(is_int) or all(is_frac)):
            raise BadInput(field, f"{list(parts)} mixes counts (ints) and fractions (floats) or holds other values.",
                           "give all counts, e.g. [480, 1000], or all fractions, e.g. [0.8, 0.2].")
        if dedup:
            first: dict[str, int] = {}
            for i, t in enumerate(self.texts):
                first.setdefault(t, i)
            pool = np.fromiter(first.values(), dtype=np.int64, count=len(first))
        else:
            pool = np.arange(len(self.texts), dtype=np.int64)
        n = len(pool)
        what = f"'{self.name}' has {n} {'distinct ' if dedup and n < len(self.texts) else ''}sentences"
        if all(is_int):
            sizes = [int(p) for p in parts]
            if min(sizes) < 1:
                raise BadInput(field, f"every part needs at least 1 sentence, got {sizes}.", "use counts >= 1.")
            if sum(sizes) > n:
                raise BadInput(field, f"the parts {sizes} need {sum(sizes)} sentences but {what}.",
                               f"use counts summing to at most {n}, or a larger dataset.")
            bounds = np.concatenate([[0], np.cumsum(sizes)])
        else:
            fr = [float(p) for p in parts]
            if min(fr) <= 0 or max(fr) > 1 or sum(fr) > 1 + 1e-9:
                raise BadInput(field, f"fractions must lie in (0, 1] and sum to at most 1, got {fr}.",
                               "e.g. [0.8, 0.2] or [0.5, 0.25].")
            cum = np.cumsum(fr)
            bounds = np.concatenate([[0], np.rint(cum * n).astype(np.int64)])
            if abs(cum[-1] - 1) < 1e-9:
                bounds[-1] = n
            sizes = np.diff(bounds).tolist()
            if min(sizes) < 1:
                raise BadInput(field, f"the fractions {fr} of {n} sentences give parts of sizes {sizes}: {what}, "
                               "too few for every part.", "use larger fractions, counts, or a larger dataset.")
        order = pool[np.random.default_rng(seed).permutation(n)]
        out = []
        for i in range(len(sizes)):
            idx = np.sort(order[bounds[i]:bounds[i + 1]])
            out.append(self.subset(idx, f"{self.name}[{i}]", {"parent": self.name, "part": i, "parts": len(sizes),
                                                             "split_seed": seed, "indices": idx.tolist()}))
        return out


def _gensim_file(name: str) -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset("gensim test data", GENSIM_INSTALL)
    p = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / name
    if not p.exists():
        raise MissingAsset(f"gensim/test/test_data/{name}", GENSIM_INSTALL)
    return p


def _limit(texts: list[str], labels: list[int], limit: int | None, name: str, info: dict | None = None,
           label_names: Sequence[str] | None = None, labelled: bool = True) -> TextDataset:
    """The dataset (first ``limit`` sentences). ``info`` gains ``labelled`` and, for a labelled set,
    ``num_classes`` (``len(label_names)``, else max label + 1 over the whole file, before ``limit``)."""
    info = dict(info or {})
    info["labelled"] = labelled
    if labelled:
        if label_names is not None:
            info["label_names"] = list(label_names)
            info["num_classes"] = len(label_names)
        elif labels and min(labels) >= 0:
            info["num_classes"] = int(max(labels)) + 1
    if limit is not None:
        texts, labels = texts[:limit], labels[:limit]
    return TextDataset(name, texts, np.asarray(labels, dtype=np.int64), info)


def _dedup(texts: list[str], labels: list[int]) -> tuple[list[str], list[int], int]:
    """Texts without repeats (the first occurrence and its label kept) and the number dropped."""
    seen: set[str] = set()
    t2, l2 = [], []
    for t, y in zip(texts, labels):
        if t not in seen:
            seen.add(t)
            t2.append(t)
            l2.append(y)
    return t2, l2, len(texts) - len(t2)


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
    return _limit(texts, labels, limit, "rt-sentences", {"source": str(p)}, label_names=("neg", "pos"))


def _split_sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text.strip())
    return [s.strip() for s in parts if 4 <= len(s.split()) <= 40]


@DATASETS.register("news-sentences", "sentences of the 299 ABC news documents (gensim lee_background.cor)")
def news_sentences(limit: int | None = None, **_: Any) -> TextDataset:
    p = _gensim_file("lee_background.cor")
    texts = []
    for doc in p.read_text(encoding="latin-1").splitlines():
        texts.extend(_split_sentences(doc))
    return _limit(texts, [0] * len(texts), limit, "news-sentences", {"source": str(p)}, labelled=False)


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
    return _limit(texts, [0] * len(texts), limit, "imdb-samples", {"source": str(p)}, labelled=False)


@DATASETS.register("wordnet-examples", "WordNet 3.0 gloss examples labelled by part of speech (Debian wordnet-base)")
def wordnet_examples(limit: int | None = None, root: str | None = None, **_: Any) -> TextDataset:
    """The quoted example sentences of the WordNet 3.0 glosses (``| gloss; "example"``) of at least 3 words,
    labelled by the data file they come from: 0 noun, 1 verb, 2 adjective, 3 adverb. Files are read in the
    order adj, adv, noun, verb; a sentence seen twice keeps its first occurrence (and label)."""
    d = Path(root) if root else WORDNET_DIR
    missing = [f for f, _ in WORDNET_FILES if not (d / f).is_file()]
    if missing:
        raise MissingAsset(f"WordNet 3.0 ({d}/{', '.join(missing)})", WORDNET_INSTALL)
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    for fname, label in WORDNET_FILES:
        for line in (d / fname).read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            gloss = line.split("|", 1)[1]
            for ex in re.findall(r'"([^"]+)"', gloss):
                ex = ex.strip()
                if len(ex.split()) >= 3 and ex not in seen:
                    seen.add(ex)
                    texts.append(ex)
                    labels.append(label)
    return _limit(texts, labels, limit, "wordnet-examples", {"source": str(d)}, label_names=WORDNET_LABELS)


def _clean_fortune(quote: str) -> str:
    """One fortune as a single line: overstrikes (``_\\bX``, ``___\\b\\b\\bword``) resolved to the
    printed characters, attribution lines (``-- Author``, and the indented lines that continue one)
    removed, whitespace normalised."""
    while True:
        q = re.sub(r"[^\x08]\x08", "", quote)
        if q == quote:
            break
        quote = q
    quote = quote.replace("\x08", "")
    kept: list[str] = []
    in_attribution = False
    for line in quote.splitlines():
        s = line.strip()
        if s.startswith("--"):
            in_attribution = True
            continue
        if in_attribution and s and line[:1] in (" ", "\t"):
            continue
        in_attribution = False
        kept.append(s)
    return " ".join(" ".join(kept).split())


@DATASETS.register("fortunes-topics", "short Debian fortunes quotes, topics computers/politics/science/work (0..3)")
def fortunes_topics(limit: int | None = None, root: str | None = None, min_words: int = 3, max_words: int = 40,
                    **_: Any) -> TextDataset:
    """Quotes of the fortune files ``computers``, ``politics``, ``science``, ``work`` (labels 0..3) of the
    Debian ``fortunes`` package, one per ``%``-separated entry (:func:`_clean_fortune`), kept when they
    have ``min_words``..``max_words`` words; a quote seen twice keeps its first topic. About 2,440 quotes
    (fortunes 1:1.99.1: 785 computers, 611 politics, 502 science, 543 work)."""
    d = Path(root) if root else FORTUNES_DIR
    missing = [t for t in FORTUNE_TOPICS if not (d / t).is_file()]
    if missing:
        raise MissingAsset(f"fortunes ({d}/{', '.join(missing)})", FORTUNES_INSTALL)
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    for label, topic in enumerate(FORTUNE_TOPICS):
        raw = (d / topic).read_text(encoding="utf-8", errors="replace")
        for entry in re.split(r"^%[ \t]*$", raw, flags=re.M):
            q = _clean_fortune(entry)
            if q and min_words <= len(q.split()) <= max_words and q not in seen:
                seen.add(q)
                texts.append(q)
                labels.append(label)
    info = {"source": str(d), "min_words": min_words, "max_words": max_words}
    return _limit(texts, labels, limit, "fortunes-topics", info, label_names=FORTUNE_TOPICS)


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
    return _limit(texts, labels, limit, name, info, labelled=li is not None)


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
    labelled = bool(label_column) and label_column in ds.column_names
    labels = list(ds[label_column]) if labelled else [0] * len(texts)
    names = getattr(ds.features.get(label_column), "names", None) if labelled else None
    return _limit(texts, labels, limit, f"hf:{path}", {"source": path, "split": split},
                  label_names=names, labelled=labelled)


# --- users' own copies of standard benchmarks ---------------------------------------------------------

COLA_LABELS = ("unacceptable", "acceptable")
SST5_LABELS = ("very negative", "negative", "neutral", "positive", "very positive")
IMDB_LABELS = ("neg", "pos")
_PTB_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}"}


def _user_path(path: str | None, name: str, what: str, want_dir: bool = False) -> Path:
    """``path`` as an existing file (or folder), else :class:`BadInput` naming ``data.path``."""
    if not path:
        raise BadInput("data.path", f"the '{name}' dataset needs the path of {what}.",
                       f"set data.path=/path/to/{what}.")
    p = Path(path).expanduser()
    if not p.exists():
        raise BadInput("data.path", f"'{p}' does not exist.", f"give the path of {what}.")
    if want_dir and not p.is_dir():
        raise BadInput("data.path", f"'{p}' is a file, but '{name}' reads a folder.", f"give the path of {what}.")
    if not want_dir and not p.is_file():
        raise BadInput("data.path", f"'{p}' is a folder, but '{name}' reads one file.", f"give the path of {what}.")
    return p


def _finish_user(texts: list[str], labels: list[int], p: Path, name: str, limit: int | None, dedup: bool,
                 label_names: Sequence[str], **info: Any) -> TextDataset:
    if not texts:
        raise BadInput("data.path", f"'{p}' holds no sentences for '{name}'.", "check the file/folder and its format.")
    dropped = 0
    if dedup:
        texts, labels, dropped = _dedup(texts, labels)
    return _limit(texts, labels, limit, name, {"source": str(p), "duplicates_dropped": dropped, **info},
                  label_names=label_names)


@DATASETS.register("cola", "the user's CoLA in_domain_train.tsv (source, label, mark, sentence): path")
def cola(path: str | None = None, limit: int | None = None, dedup: bool = True, **_: Any) -> TextDataset:
    """CoLA's raw TSV (``in_domain_train.tsv``, ``in_domain_dev.tsv``, ``out_of_domain_dev.tsv``, or GLUE's
    ``CoLA/train.tsv``): no header, 4 tab-separated columns ``source, label, original mark, sentence``;
    label 1 acceptable, 0 unacceptable. ``path`` may also be a folder holding ``in_domain_train.tsv``
    (directly or in ``raw/``). With ``dedup`` a repeated sentence keeps its first row."""
    p = Path(path).expanduser() if path else None
    if p is not None and p.is_dir():
        p = next((c for c in (p / "in_domain_train.tsv", p / "raw" / "in_domain_train.tsv") if c.is_file()), p)
        if p.is_dir():
            raise BadInput("data.path", f"the folder '{p}' holds no in_domain_train.tsv (nor raw/in_domain_train.tsv).",
                           "give the path of the CoLA .tsv file itself.")
    p = _user_path(str(p) if p else None, "cola", "CoLA's in_domain_train.tsv")
    texts, labels = [], []
    for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 4 or cols[1].strip() not in ("0", "1"):
            raise BadInput("data.path", f"line {n} of '{p}' is not a CoLA row (4 tab-separated columns: source, label "
                           f"0/1, mark, sentence): {line[:80]!r}.",
                           "give CoLA's raw in_domain_train.tsv; for other TSVs use data.name=tsv.")
        if cols[3].strip():
            texts.append(cols[3].strip())
            labels.append(int(cols[1]))
    return _finish_user(texts, labels, p, "cola", limit, dedup, COLA_LABELS)


def _ptb_tree(line: str) -> tuple[int, str] | None:
    """Root label and sentence (leaves joined by spaces, ``-LRB-`` etc. unescaped) of an SST PTB tree
    ``(3 (2 It) (4 (2 's) ...))``, or None when the line is not a well-formed tree."""
    tokens = re.findall(r"\(|\)|[^\s()]+", line)
    if len(tokens) < 4 or tokens[0] != "(" or not tokens[1].isdigit():
        return None
    depth, words = 0, []
    for i, tok in enumerate(tokens):
        if tok == "(":
            depth += 1
            if i + 1 >= len(tokens) or not tokens[i + 1].isdigit():
                return None
        elif tok == ")":
            depth -= 1
            if depth < 0 or (depth == 0 and i != len(tokens) - 1):
                return None
        elif tokens[i - 1] != "(":  # not the node label: a leaf
            words.append(_PTB_ESCAPES.get(tok, tok))
    if depth != 0 or not words:
        return None
    return int(tokens[1]), " ".join(words)


@DATASETS.register("sst5", "the user's SST-5 file (__label__1..5 lines or PTB trees): path")
def sst5(path: str | None = None, limit: int | None = None, dedup: bool = True, **_: Any) -> TextDataset:
    """Stanford Sentiment Treebank, 5 classes (0 very negative .. 4 very positive), one sentence a line in
    either format (mixed per line is accepted):

    * ``__label__N sentence`` with N in 1..5 (the common ``sst_train.txt``) -> label N - 1;
    * a PTB tree (``trainDevTestTrees_PTB/trees/train.txt``) ``(3 (2 It) (4 ...))`` -> the root's label
      (0..4), the sentence being the leaves joined by spaces.
    """
    p = _user_path(path, "sst5", "an SST-5 file (sst_train.txt or trees/train.txt)")
    texts, labels = [], []
    for n, line in enumerate(p.read_text(encoding="utf-8-sig", errors="replace").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        m = re.match(r"__label__(\S+)\s+(.*)", line)
        if m and m.group(1) in ("1", "2", "3", "4", "5") and m.group(2).strip():
            texts.append(m.group(2).strip())
            labels.append(int(m.group(1)) - 1)
            continue
        tree = _ptb_tree(line) if line.startswith("(") else None
        if tree is not None and 0 <= tree[0] <= 4:
            labels.append(tree[0])
            texts.append(tree[1])
            continue
        raise BadInput("data.path", f"line {n} of '{p}' is neither '__label__N sentence' (N in 1..5) nor an SST tree "
                       f"with a root label 0..4: {line[:80]!r}.",
                       "give SST-5's sst_train.txt or trees/train.txt; for other files use data.name=csv/tsv.")
    return _finish_user(texts, labels, p, "sst5", limit, dedup, SST5_LABELS)


def _imdb_dir(p: Path, split: str) -> Path | None:
    for d in (p, p / split, p / "aclImdb" / split):
        if (d / "neg").is_dir() and (d / "pos").is_dir():
            return d
    return None


def _review_key(f: Path) -> tuple[int, str]:
    m = re.match(r"(\d+)", f.name)
    return (int(m.group(1)) if m else -1, f.name)


@DATASETS.register("imdb-folder", "the user's aclImdb folder (train/{neg,pos}/*.txt -> 0/1): path")
def imdb_folder(path: str | None = None, split: str = "train", limit: int | None = None, dedup: bool = True,
                max_words: int | None = None, **_: Any) -> TextDataset:
    """The Large Movie Review Dataset as unpacked from ``aclImdb_v1.tar.gz``: ``path`` is ``aclImdb`` (its
    ``split`` folder, default ``train``, is read), the split folder itself, or any folder with ``neg/`` and
    ``pos/``. One review per ``*.txt`` (``<br />`` and runs of whitespace made single spaces); label 0 neg,
    1 pos; negatives first, each class in file-id order. ``max_words`` keeps each review's first words only."""
    root = _user_path(path, "imdb-folder", "the aclImdb folder", want_dir=True)
    d = _imdb_dir(root, split)
    if d is None:
        raise BadInput("data.path", f"'{root}' has no neg/ and pos/ folders (nor {split}/neg, {split}/pos).",
                       "give the unpacked aclImdb folder, e.g. data.path=/data/aclImdb.")
    texts, labels = [], []
    for label, sub in enumerate(IMDB_LABELS):
        for f in sorted((d / sub).glob("*.txt"), key=_review_key):
            words = re.sub(r"<br\s*/?>", " ", f.read_text(encoding="utf-8", errors="replace")).split()
            if max_words is not None:
                words = words[:max_words]
            if words:
                texts.append(" ".join(words))
                labels.append(label)
    return _finish_user(texts, labels, d, "imdb-folder", limit, dedup, IMDB_LABELS, split=split)


def load_text(name: str, **kwargs: Any) -> TextDataset:
    """Load a registered text dataset by name (``field`` data.name in errors)."""
    loader = DATASETS.get(name, field="data.name")
    ds = loader(**kwargs)
    if not isinstance(ds, TextDataset):
        raise BadInput("data.name", f"'{name}' is not a text dataset.", "use rt-sentences, news-sentences, csv, tsv, hf, ...")
    return ds
