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
