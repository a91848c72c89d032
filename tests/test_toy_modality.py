"""A third modality, defined in this file only, validates without any edit to ``config/`` or ``run/``.

docs/DESIGN.md §7: a modality plug-in owns its specifics, and the config schema asks the plug-ins instead of naming
``image`` / ``text`` (:mod:`gradleak.modalities`: ``data_fields`` / ``model_fields``, ``default_layers``,
``check_peft``, ``check_architecture``, ``check_training``, ``check_public_data``, ``register_experiment``). The toy
modality ``tabular`` brings a tiny tensor dataset, a two-layer MLP and one analytic attack (the input of a linear
layer with a bias is its weight gradient's row over the bias gradient's entry, for one sample), registers them for
one test and takes them back after.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.errors import BadInput
from gradleak.modalities import MODALITIES, Modality, modality_of, register_experiment
from gradleak.models import MODELS, ModelHandle
from gradleak.registry import ATTACKS, DATASETS, EXPERIMENTS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "src" / "gradleak" / "config"
FEATURES = 6


def _toy_table(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``FEATURES`` standard-normal features, label 1 where the first feature is positive."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long()


_toy_table.modality = "tabular"


def _toy_mlp(mcfg, *, seed: int, dtype: str, **_) -> ModelHandle:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, mcfg.num_classes))
    model = model.to(torch.float64 if dtype == "float64" else torch.float32)
    return ModelHandle(model, "tabular", "toy-mlp", "tabular", 8, 2)


_toy_mlp.modality = "tabular"


class TabularModality(Modality):
    """Rows of numbers; the model reads them as they are."""

    name = "tabular"
    data_fields = frozenset({"limit"})  # shared with text: a field may belong to several modalities
    default_layers = 2

    def data(self, cfg):
        return _toy_table(cfg.data.limit or 16, cfg.data.seed)

    def encode(self, handle, x, cfg, dev):
        return x.to(next(handle.model.parameters()).dtype).to(dev), x, []

    def truth(self, handle, kept, raws, lengths, labels, threat, cfg, knowledge):
        return {"inputs": torch.cat(kept), "labels": labels}

    def check_public_data(self, cfg) -> None:
        if cfg.threat_model.public_data:
            raise BadInput("threat.public_data", "the toy table has no public rows to grant.",
                           "set threat.public_data=false.")


class TableConfig(AttackConfig):
    layer: str = "0"


class TableInversion(AttackBase):
    """The input row of one sample from the gradient of a linear layer with a bias: dL/dW[i] / dL/db[i]."""

    name = "table_inversion"
    Config = TableConfig
    modality = "tabular"
    peft_kinds = ("none",)
    reconstruction = "rows"

    def __init__(self, layer: str = "0"):
        self.layer = layer

    def reconstruct(self, view) -> Reconstruction:
        t = view.updates[0].tensors
        gw, gb = t[f"{self.layer}.weight"], t[f"{self.layer}.bias"]
        i = int(gb.abs().argmax())
        return Reconstruction(data=(gw[i] / gb[i]).unsqueeze(0), info={"row_used": i})


TOY_ENTRIES = ((EXPERIMENTS, "tabular"), (ATTACKS, "table_inversion"), (MODELS, "toy-mlp"), (DATASETS, "toy-table"),
               (MODALITIES, "tabular"))


@contextlib.contextmanager
def toy_registered():
    """The toy modality, its dataset, model, attack and preset registered; taken back on exit."""
    MODALITIES.register("tabular", "toy rows of numbers")(TabularModality)
    DATASETS.register("toy-table", "toy: 16 rows of 6 features")(_toy_table)
    MODELS.register("toy-mlp", "toy: 6 -> 8 -> classes MLP")(_toy_mlp)
    ATTACKS.register("table_inversion")(TableInversion)
    register_experiment("tabular", "toy rows", "tabular",
                        {"data": {"name": "toy-table", "batch_size": 1},
                         "model": {"name": "toy-mlp", "num_classes": 2, "train_all": True},
                         "peft": {"kind": "none"}, "attack": {"name": "table_inversion"}})
    try:
        yield
    finally:
        for reg, name in TOY_ENTRIES:
            reg.unregister(name)


@pytest.fixture
def tabular():
    with toy_registered():
        yield


def _validate(*overrides: str, experiment: str = "tabular"):
    from gradleak.run.runner import validate

    return validate({"experiment": experiment}, list(overrides))[1]


def test_a_third_modality_validates_through_the_config_and_the_runner(tabular):
    cfg = _validate()
    assert cfg.modality == "tabular" and isinstance(cfg.modality_plugin, TabularModality)
    assert cfg.attack_cls is TableInversion and cfg.model.name == "toy-mlp" and cfg.data.name == "toy-table"
    assert cfg.dump()["attack"] == {"name": "table_inversion", "layer": "0"}
    assert isinstance(modality_of(cfg), TabularModality)
    assert _validate("data.limit=8").data.limit == 8  # a field the toy owns (text owns it too)


def test_the_toy_modality_refuses_the_other_modalities_fields_naming_them(tabular):
    with pytest.raises(BadInput) as e:
        _validate("data.image_size=64")
    assert e.value.field == "data.image_size"
    assert e.value.problem == "applies to image experiments only; this one works on tabular."
    assert e.value.fix == "remove it, or use experiment: image."
    with pytest.raises(BadInput) as e:
        _validate("model.patch_size=8")
    assert e.value.field == "model.patch_size" and "image experiments only" in e.value.problem
    with pytest.raises(BadInput) as e:
        _validate("data.max_length=10")
    assert e.value.field == "data.max_length" and "text experiments only; this one works on tabular" in e.value.problem
    with pytest.raises(BadInput) as e:
        _validate("model.task=lm")
    assert e.value.field == "model.task" and "text experiments only" in e.value.problem
    with pytest.raises(BadInput) as e:
        _validate("fl.clients=2", "fl.client_images=[1,1]", "fl.algorithm=fedavg")
    assert e.value.field == "fl.client_images" and e.value.fix.endswith("for tabular.")


def test_the_toy_modality_owns_its_data_and_models(tabular):
    with pytest.raises(BadInput) as e:
        _validate("data.name=cifar-samples")
    assert e.value.field == "data.name"
    assert e.value.problem == "'cifar-samples' is a image dataset but experiment 'tabular' works on tabular."
    with pytest.raises(BadInput) as e:
        _validate("model.name=minilm")
    assert e.value.field == "model.name" and "'minilm' is a text model" in e.value.problem
    with pytest.raises(BadInput) as e:  # the other way round: the toy's own dataset is refused in an image experiment
        _validate("data.name=toy-table", "attack.name=inverting_gradients", experiment="image")
    assert e.value.field == "data.name" and "'toy-table' is a tabular dataset" in e.value.problem
    assert e.value.fix.endswith("or experiment: tabular.")
    with pytest.raises(BadInput) as e:  # a field two modalities own names both
        _validate("data.limit=3", experiment="image")
    assert e.value.problem == "applies to tabular or text experiments only; this one works on image."
    with pytest.raises(BadInput) as e:  # the toy's own hook decides its public data
        _validate("threat.public_data=true")
    assert e.value.field == "threat.public_data" and "toy table" in e.value.problem
    with pytest.raises(BadInput) as e:  # an image attack is not the toy's
        _validate("attack.name=dlg")
    assert e.value.field == "attack.name" and "attacks for tabular with peft.kind=none: table_inversion" in e.value.fix


def test_the_toy_pieces_compose_without_run(tabular):
    """The toy's model (built by gradleak.models.build from the validated config), its encoding and its attack on
    one client's upload (gradleak.fl.core): the attack recovers the client's row."""
    from gradleak.fl.core import Client, ServerView
    from gradleak.models import build

    cfg = _validate("model.dtype=float64")
    handle = build(cfg.model, cfg.modality, seed=cfg.seed, dtype="float64")
    mod = cfg.modality_plugin
    x, y = mod.data(cfg)
    inputs, raw, _ = mod.encode(handle, x[:1], cfg, "cpu")
    update = Client(0, inputs, y[:1]).local_update(handle.model)
    rec = TableInversion().reconstruct(ServerView(model=handle.model, updates=[update]))
    truth = mod.truth(handle, [raw], [raw], [], y[:1], cfg.threat_model, cfg, {})
    assert torch.allclose(rec.data, truth["inputs"], atol=1e-10)


def test_the_toy_is_registered_for_a_while_only():
    with toy_registered():
        assert all(name in reg for reg, name in TOY_ENTRIES)
        assert "tabular" in {e.name for e in EXPERIMENTS}
    assert not any(name in reg for reg, name in TOY_ENTRIES)
    with pytest.raises(BadInput) as e:
        _validate()
    assert e.value.field == "experiment" and "unknown experiment 'tabular'" in e.value.problem


def test_config_decides_nothing_by_a_modality_name():
    """No comparison in ``config/`` against a registered modality's name (``modality == "image"``,
    ``in ("image", "text")``): those decisions belong to the plug-ins."""
    names = set(MODALITIES.names())
    found = []
    for path in sorted(CONFIG_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for part in [node.left, *node.comparators] for c in ast.walk(part)
                          if isinstance(c, ast.Constant) and c.value in names]
                if consts:
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"modality names compared in config/: {found}"
