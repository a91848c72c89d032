"""Defenses are discovered like attacks and engines (docs/DESIGN.md §2, §7): importing :mod:`gradleak.defenses`
imports every module of the package, so a new defense module registers itself without a central list."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_defenses_package_imports_every_defense_module():
    code = ("import pkgutil, sys; import gradleak.defenses as d; "
            "mods = [m.name for m in pkgutil.iter_modules(d.__path__) if not m.name.startswith('_')]; "
            "missing = [m for m in mods if f'gradleak.defenses.{m}' not in sys.modules]; "
            "assert not missing, missing; assert {'base', 'nvflare', 'training', 'update'} <= set(mods), mods; "
            "from gradleak.registry import DEFENSES; "
            "outside = [e.name for e in DEFENSES if not e.obj.__module__.startswith('gradleak.defenses.')]; "
            "assert not outside, outside")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_experiment_presets_come_from_the_modality_plug_ins():
    """Reading the presets imports the modality plug-ins that register them (``EXPERIMENTS``' home), and every
    preset names a registered modality."""
    code = ("from gradleak.registry import EXPERIMENTS; from gradleak.modalities import MODALITIES; "
            "names = EXPERIMENTS.names(); assert {'image', 'text', 'peftleak', 'utr', 'leakage'} <= set(names), names; "
            "assert all(e.obj['modality'] in MODALITIES for e in EXPERIMENTS)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_modality_shapes_its_clients_loss_with_a_defense_s_options():
    """A training-time defense's loss options (label smoothing) go to the modality (run/ names no loss of its own):
    text smooths its cross-entropy; a modality whose loss takes no options refuses them, naming the field."""
    from types import SimpleNamespace

    import pytest
    import torch

    from gradleak.errors import BadInput
    from gradleak.modalities import Modality, modality_of

    class Head(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return SimpleNamespace(logits=torch.tensor([[4.0, -4.0]]).expand(input_ids.shape[0], 2))

    handle = SimpleNamespace(kind="bidirectional", info={})
    inputs, labels = torch.ones(3, 2, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    plain = modality_of("text").loss_with_options(handle, {"label_smoothing": 0.0})(Head(), inputs, labels)
    smooth = modality_of("text").loss_with_options(handle, {"label_smoothing": 0.2})(Head(), inputs, labels)
    assert float(smooth) > float(plain) + 0.5  # a confident, correct head pays for smoothing
    with pytest.raises(BadInput) as e:
        Modality().loss_with_options(handle, {"label_smoothing": 0.2})
    assert e.value.field == "defense.name" and "label_smoothing" in e.value.problem
