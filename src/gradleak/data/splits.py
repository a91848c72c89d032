"""The experiment's data splits (docs/DESIGN.md §2): disjoint seeded chunks of one dataset per role.

* :class:`ImageData` — one seeded draw of the private image set cut into client training images | validation
  images | domain-prior images | test images | the nulls' pool (in that order, disjoint); the server's *public*
  set comes from another source (:func:`gradleak.data.check_disjoint`).
* :class:`TextData` — one seeded permutation of a text set cut into members (every trial's clients: one batch each,
  or a dataset of ``data.samples_per_client``) | non-member candidates | test sentences | the clients' reference sets.
* :func:`load_images` — ``n`` images of a registered set at the experiment's size and channel count.

Both classes read the experiment config (``gradleak.config.schema.ExperimentConfig``) they are given.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gradleak.data.sources import check_disjoint, default_public
from gradleak.data.text import load_text
from gradleak.errors import BadInput

#: generated image sets (any number of images, drawn with the seed); every other set is a fixed list
GENERATED = ("natural-crops", "natural-crops-a", "natural-crops-b", "public-natural")
#: a user's own image sets (must have the configured size unless ``data.resize``)
USER_IMAGE_SETS = ("image-folder", "npz")
#: a user's own text sets: their labels are the task's, so they must lie in 0..model.num_classes-1
USER_TEXT_SETS = ("csv", "tsv", "hf", "cola", "sst5", "imdb-folder")
#: chance reconstructions the nulls draw from (:mod:`gradleak.evaluation.nulls`): ``null_pool``'s default size
NULL_POOL = 256


def load_images(name: str, n: int, size: int, seed: int, field: str, path: str | None = None, resize: bool = False,
                channels: int = 3, split: str | None = None):
    """``n`` images at size×size in [0, 1] with ``channels`` channels (grey is replicated to 3; RGB becomes grey by
    the ITU-R 601 luma weights for ``channels=1``). Generated sets (crops) use ``seed``; a fixed set returns
    its first ``n`` images for seed 0 and a seeded random subset of ``n`` otherwise. A user's own folder/npz
    must already have the configured size unless ``resize`` (``data.resize``) is set. ``split``: the dataset's split
    for a set that has several (fashion-mnist train|test); None: the loader's default."""
    from gradleak.data import load

    kwargs: dict = {"n": n} if name in GENERATED else {}
    if name in GENERATED or name == "imagenet-samples":
        kwargs["size"] = size
    if name in GENERATED:
        kwargs["seed"] = seed
    if path is not None:
        kwargs["path"] = path
    if split is not None:
        kwargs["split"] = split
    try:
        ds = _shared_set(name, tuple(sorted(kwargs.items()))) if name not in USER_IMAGE_SETS else load(name, **kwargs)
    except BadInput as err:
        if not (resize and name == "image-folder" and err.field == "data.resize"):
            raise
        # a folder of mixed sizes with data.resize: each image resized to size×size as it is read (PIL bicubic); a
        # folder of one size is read as is and resized below (as before)
        ds = load(name, **kwargs, size=size)
    imgs, labels = ds.images, ds.labels
    if name not in GENERATED and seed != 0 and len(imgs) > n:
        perm = torch.randperm(len(imgs), generator=torch.Generator().manual_seed(seed))[:n]
        imgs, labels = imgs[perm], labels[perm]
    imgs, labels = imgs[:n], labels[:n]  # before the resize below: a 60,000-image set is not resized whole for n
    if len(imgs) < n:
        raise BadInput(field, f"'{name}' has only {len(imgs)} images but {n} were asked for "
                       "(data.batch_size × fl.clients, or data.public_size).",
                       "lower the batch size / client count or use natural-crops (any number of images).")
    if imgs.shape[-1] != size or imgs.shape[-2] != size:
        if name in USER_IMAGE_SETS and not resize:
            raise BadInput("data.image_size", f"the images of '{path}' are {imgs.shape[-2]}×{imgs.shape[-1]} but "
                           f"data.image_size is {size}.",
                           f"set data.image_size={imgs.shape[-1]} (square images) or data.resize=true to resize them.")
        imgs = torch.nn.functional.interpolate(imgs, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if imgs.shape[1] == 1 and channels == 3:
        imgs = imgs.expand(-1, 3, -1, -1)
    elif imgs.shape[1] == 3 and channels == 1:
        imgs = (imgs * torch.tensor([0.299, 0.587, 0.114], dtype=imgs.dtype).reshape(1, 3, 1, 1)).sum(1, keepdim=True)
    elif imgs.shape[1] != channels:
        raise BadInput("model.num_channels", f"'{name}' has {imgs.shape[1]}-channel images; the model takes {channels}.",
                       "use model.num_channels=1 (grey) or 3 (RGB).")
    return imgs[:n].clamp(0, 1), labels[:n].clone()


@functools.lru_cache(maxsize=4)
def _shared_set(name: str, kwargs: tuple):
    """A built-in image set loaded once per process (read, never written: :func:`load_images` indexes and copies).
    Every client batch, null pool, prior and test chunk of every run in a process draws from the same set: loading
    (decoding, a 60,000-image copy) once instead of each time. A user's own folder/npz is read fresh each time."""
    from gradleak.data import load

    return load(name, **dict(kwargs))


def fold_labels(labels: torch.Tensor, num_classes: int, name: str, labels_matter: bool) -> torch.Tensor:
    """Labels in ``0..num_classes-1``. A built-in set's labels are folded modulo ``num_classes`` (their classes are
    not the model's task: ImageNet crops, LFW identities, news sentences); a user's own set (``labels_matter``) must
    already fit, since folding its real labels would train and score a different task."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    if labels_matter and len(labels) and int(labels.max()) >= num_classes:
        raise BadInput("model.num_classes", f"'{name}' has the label {int(labels.max())} but model.num_classes is "
                       f"{num_classes}: labels must lie in 0..{num_classes - 1} (gradleak does not fold a user's labels).",
                       f"set model.num_classes={int(labels.max()) + 1} (or more), or relabel the data.")
    return labels % num_classes


def fixed_image_count(cfg) -> int | None:
    """How many images the private image set holds, or None for a generated set (any number of images)."""
    from gradleak.data import load

    if cfg.data.name in GENERATED:
        return None
    kwargs = {"size": cfg.data.image_size} if cfg.data.name == "imagenet-samples" else {}
    if cfg.data.path is not None:
        kwargs["path"] = cfg.data.path
    if cfg.data.name in USER_IMAGE_SETS:
        return len(load(cfg.data.name, **kwargs).images)
    return len(_shared_set(cfg.data.name, tuple(sorted(kwargs.items()))).images)


def _public_name(cfg) -> str:
    name = cfg.data.public or default_public(cfg.data.name)  # default: photos the private set does not come from
    check_disjoint(cfg.data.name, name)
    return name


class ImageData:
    def __init__(self, cfg):
        self.cfg = cfg

    def _load(self, trial: int, n: int):
        c = self.cfg
        return load_images(c.data.name, n, c.data.image_size, c.data.seed + 7919 * trial, "data.name", c.data.path,
                           c.data.resize, channels=c.image_channels)

    def _layout(self) -> tuple[list[int], int, int]:
        """Per-client training-image counts, validation images per client, prior images (one draw, disjoint chunks:
        training | validation | prior)."""
        c = self.cfg
        sizes = [p["images"] for p in c.client_plan()]
        return sizes, c.data.validation_size, (c.data.prior_size if self.wants_prior else 0)

    def _test_size(self) -> int:
        return self.cfg.data.test_size

    @property
    def wants_prior(self) -> bool:
        """Whether the attack reads a domain prior image (granted under threat.public_data)."""
        return bool(self.cfg.attack_cls.uses_prior)

    def check_labels(self, num_classes: int) -> None:
        """Refuse a user's labels beyond ``model.num_classes`` (:func:`fold_labels`) before any model is built; a
        built-in set's labels fold, so there is nothing to check."""
        if self.cfg.data.name in USER_IMAGE_SETS:
            self.clients(0, num_classes)

    def clients(self, trial: int, num_classes: int):
        sizes, val, prior = self._layout()
        test = self._test_size()
        imgs, labels = self._load(trial, sum(sizes) + val * len(sizes) + prior + test)
        out, a = [], 0
        user = self.cfg.data.name in USER_IMAGE_SETS
        for n in sizes:
            out.append((imgs[a:a + n], fold_labels(labels[a:a + n], num_classes, self.cfg.data.name, user)))
            a += n
        b = a + val * len(sizes)
        self._extra = (imgs[a:b], imgs[b:b + prior])
        self._test = (imgs[b + prior:b + prior + test],
                      fold_labels(labels[b + prior:b + prior + test], num_classes, self.cfg.data.name, user))
        return out

    def test(self, num_classes: int):
        """``data.test_size`` held-out labelled images (after :meth:`clients`, disjoint from every other chunk) for the
        global model's accuracy (leakage experiments: the privacy–utility trade-off), or None."""
        x, y = getattr(self, "_test", (None, None))
        return (x, y) if x is not None and len(x) else None

    def validation(self) -> list[torch.Tensor]:
        """Each client's validation images (after :meth:`clients`): the identifiability pool's second half."""
        val = self.cfg.data.validation_size
        return [self._extra[0][i * val:(i + 1) * val] for i in range(self.cfg.fl.clients)]

    def prior_image(self) -> torch.Tensor | None:
        """The domain prior of Hatamizadeh et al. 2022 (§II-B: "dataset mean image"): the mean of
        ``data.prior_size`` held-out images of the private dataset, disjoint from every client's training and
        validation images (after :meth:`clients`)."""
        held = self._extra[1]
        return held.mean(0) if len(held) else None

    def prior_images(self) -> torch.Tensor | None:
        """The ``data.prior_size`` held-out images :meth:`prior_image` averages (after :meth:`clients`), disjoint from
        every client's training and validation images and from the null pool: the public images of the private
        set's own source a learned decoder trains on (:mod:`gradleak.attacks.learned_image`), or None."""
        held = self._extra[1]
        return held if len(held) else None

    def null_pool(self, trial: int, k: int | None = None) -> tuple[torch.Tensor, str]:
        """Up to ``k`` images of the private dataset's own source that no client, validation, prior or test chunk
        uses (the chunk after all of them, from the same seeded draw): the nulls' chance reconstructions
        (:mod:`gradleak.evaluation.nulls`). A fixed set too small to spare any falls back to the public set."""
        c = self.cfg
        k = NULL_POOL if k is None else k
        sizes, val, prior = self._layout()
        used = sum(sizes) + val * len(sizes) + prior + self._test_size()
        n = used + k
        total = fixed_image_count(c)
        if total is not None:
            n = min(n, total - 1 if c.data.seed + 7919 * trial else total)  # a permuted draw must stay a permutation
        if n > used:
            imgs, _ = self._load(trial, n)
            return imgs[used:], f"{c.data.name} (held-out images no client holds)"
        name = _public_name(c)
        imgs, _ = load_images(name, k, c.data.image_size, c.data.seed + 2000, "data.public", channels=c.image_channels)
        return imgs, f"{name} (the private set '{c.data.name}' spares no image)"

    def public(self):
        c = self.cfg
        imgs, _ = load_images(_public_name(c), c.data.public_size, c.data.image_size, c.data.seed + 1000, "data.public",
                              channels=c.image_channels)
        return imgs


class TextData:
    def __init__(self, cfg):
        self.cfg = cfg
        d = cfg.data
        kwargs = {k: v for k, v in {"path": d.path, "text_column": d.text_column, "label_column": d.label_column,
                                    "limit": d.limit}.items() if v is not None}
        if d.name == "hf":
            kwargs.update(split=d.split, subset=d.subset)
        self.ds = load_text(d.name, **kwargs)
        # disjoint chunks of one seeded permutation: members (every trial's clients), non-member candidates, test set
        self.per_client = self.client_size(cfg)
        self.members_end = self.per_client * cfg.fl.clients * cfg.trials
        self.nonmembers_end = self.members_end + d.nonmembers * cfg.fl.clients * cfg.trials
        need = self.nonmembers_end + d.test_size
        if need > len(self.ds):
            n, copies = len(self.ds), cfg.fl.clients * cfg.trials
            members = "data.samples_per_client" if d.samples_per_client is not None else "data.batch_size"
            # the field to change: the largest part beyond the clients' own sentences
            field = max((("data.test_size", d.test_size), ("data.nonmembers", d.nonmembers * copies),
                         (members, self.members_end)), key=lambda t: t[1])[0]
            fits = []
            if self.members_end <= n:
                nonm = min(d.nonmembers, (n - self.members_end) // copies)
                if nonm != d.nonmembers:
                    fits.append(f"data.nonmembers: {nonm}")
                test = min(d.test_size, n - self.members_end - nonm * copies)
                if test != d.test_size:
                    fits.append(f"data.test_size: {test}")
            raise BadInput(field, f"{self.per_client} sentences × {cfg.fl.clients} client(s) × {cfg.trials} trial(s)"
                           f" + {d.nonmembers} non-members per client + {d.test_size} test sentences = {need} is more "
                           f"than the {n} texts of '{d.name}'.",
                           f"use at most {n} in all" + (f", e.g. {' and '.join(fits)}" if fits else
                                                         f": lower {members} or fl.clients")
                           + " (data.test_size holds sentences out for the final model's accuracy, 0 turns it off; "
                           "data.nonmembers are the membership attacks' non-member candidates, 0 leaves those "
                           "attacks unmeasured).")

    @staticmethod
    def client_size(cfg) -> int:
        """Sentences each client holds: ``data.samples_per_client`` (a dataset; each round trains on a batch of
        ``data.batch_size`` drawn from it) or, by default, one batch (``data.batch_size``)."""
        return cfg.data.samples_per_client or cfg.data.batch_size

    def _chunk(self, n: int, offset: int):
        texts, labels = self.ds.batch(n, seed=self.cfg.seed, offset=offset)
        return list(texts), torch.as_tensor(labels, dtype=torch.long)

    def null_pool(self, trial: int, k: int | None = None) -> tuple[list[str], str]:
        """Up to ``k`` sentences of the same dataset that no client holds in any trial (seeded): the nulls' chance
        reconstructions (:mod:`gradleak.evaluation.nulls`)."""
        k = NULL_POOL if k is None else k
        members = {t for tr in range(self.cfg.trials) for texts, _ in self.clients(tr, 1 << 30) for t in texts}
        order = np.random.default_rng(self.cfg.seed + 104729).permutation(len(self.ds))
        pool = [self.ds.texts[i] for i in order if self.ds.texts[i] not in members][:k]
        return pool, f"{self.cfg.data.name} (sentences no client holds)"

    def nonmembers(self, trial: int, client: int) -> list[str]:
        k = self.cfg.data.nonmembers
        return self._chunk(k, self.members_end + (trial * self.cfg.fl.clients + client) * k)[0] if k else []

    def reference(self, client: int, n: int):
        """A client's reference set (min-max regularisation): ``n`` labelled samples after the test chunk, disjoint from
        every member, candidate and test sample."""
        start = self.nonmembers_end + self.cfg.data.test_size + client * n
        if start + n > len(self.ds):
            raise BadInput("defense.reference_size", f"{self.cfg.fl.clients} client(s) × {n} reference samples do not fit "
                           f"after the {start - client * n} texts of '{self.cfg.data.name}' already used "
                           f"({len(self.ds)} in all).", "lower defense.reference_size, data.nonmembers or data.test_size.")
        return self._chunk(n, start)

    def test(self, num_classes: int):
        if not self.cfg.data.test_size:
            return None
        texts, labels = self._chunk(self.cfg.data.test_size, self.nonmembers_end)
        return texts, fold_labels(labels, num_classes, self.cfg.data.name, self._labels_matter())

    def clients(self, trial: int, num_classes: int):
        """Each client's private sentences and labels (its whole data: one batch, or ``data.samples_per_client``)."""
        c = self.cfg
        n = self.per_client
        out = []
        for i in range(c.fl.clients):
            texts, labels = self.ds.batch(n, seed=c.seed, offset=(trial * c.fl.clients + i) * n)
            out.append((texts, fold_labels(labels, num_classes, c.data.name, self._labels_matter())))
        return out

    def check_labels(self, num_classes: int) -> None:
        """Refuse a user's labels beyond ``model.num_classes`` (:func:`fold_labels`) before any model is built."""
        if self._labels_matter():
            self.clients(0, num_classes)

    def _labels_matter(self) -> bool:
        """A user's own labelled text set trained as a classifier (an LM task, causal by default, ignores labels)."""
        m = self.cfg.model
        return self.cfg.data.name in USER_TEXT_SETS and (m.task == "classification" or (m.task is None and m.name == "minilm"))
