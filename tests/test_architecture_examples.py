"""docs/ARCHITECTURE.md explains the code it names: every file it names exists, and its worked examples (a defense, an
attack, a round engine, a modality) run as written, register where the text says, do what it says, and are taken
back after."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gradleak.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
TOP = ("src/", "tests/", "docs/", "benchmarks/", "configs/", "examples/", ".ci/")


def named_paths(text: str) -> list[str]:
    """The file and folder names in backticks: repository paths (``src/...``), and package paths (``run/audit.py``,
    ``attacks/``) read under ``src/gradleak``; placeholders such as ``<name>.py`` name where a new file goes and are
    checked by their folder."""
    out = []
    for tok in re.findall(r"`([^`\s]+)`", text):
        tok = tok.split("<", 1)[0]
        if tok.startswith(TOP) or re.fullmatch(r"[a-z_]+(/[a-z_0-9]+)*(\.py|/)", tok):
            out.append(tok)
    return out


def test_every_file_the_architecture_names_exists():
    paths = named_paths(DOC.read_text())
    assert len(paths) > 40  # the page names the tree; an empty parse would pass anything
    missing = [p for p in paths if not ((ROOT / p).exists() or (ROOT / "src" / "gradleak" / p).exists())]
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def test_the_path_reader_sees_a_missing_file():
    assert named_paths("`src/gradleak/run/nope.py` and `run/audit.py` and `defenses/<name>.py`") == [
        "src/gradleak/run/nope.py", "run/audit.py", "defenses/"]


def examples() -> dict[str, str]:
    blocks = re.findall(r"```python\n# worked example: (\w+)\n(.*?)```", DOC.read_text(), flags=re.S)
    return {kind: code for kind, code in blocks}


def test_the_page_has_a_worked_example_for_each_plug_in():
    assert set(examples()) == {"defense", "attack", "engine", "modality"}


@pytest.fixture
def run_example():
    """Executes a worked example and takes back what it registered."""
    from gradleak.fl.engines import ENGINES
    from gradleak.modalities import MODALITIES
    from gradleak.registry import ATTACKS, DEFENSES

    registries = (ATTACKS, DEFENSES, ENGINES, MODALITIES)
    before = {id(r): set(r.names()) for r in registries}

    def run(kind: str) -> dict:
        ns: dict = {"__name__": f"worked_example_{kind}"}
        exec(compile(examples()[kind], f"docs/ARCHITECTURE.md ({kind})", "exec"), ns)
        return ns

    yield run
    for r in registries:
        for name in set(r.names()) - before[id(r)]:
            r.unregister(name)


def test_the_defense_example_scales_the_upload_and_tells_the_server(run_example):
    from gradleak.defenses.base import build_defenses
    from gradleak.fl.core import Update

    ns = run_example("defense")
    (d,) = build_defenses([{"name": "example_scaling", "params": {"factor": 0.25}}])
    assert isinstance(d, ns["ExampleScaling"]) and d.server_knowledge() == {"scale": 0.25}
    up = Update({"w": torch.ones(3)}, num_samples=1)
    assert torch.equal(d.apply(up, {}).tensors["w"], torch.full((3,), 0.25))
    with pytest.raises(BadInput):
        build_defenses([{"name": "example_scaling", "params": {"factr": 0.25}}])


def test_the_attack_example_recovers_a_classifier_input(run_example):
    from gradleak.registry import ATTACKS

    ns = run_example("attack")
    cls = ATTACKS.get("example_bias_ratio")
    assert cls is ns["ExampleBiasRatio"] and cls.reconstruction == "images"
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(5, 3), torch.randn(1, 5)
    torch.nn.functional.cross_entropy(layer(x), torch.tensor([1])).backward()
    view = SimpleNamespace(updates=[SimpleNamespace(tensors={"classifier.weight": layer.weight.grad,
                                                               "classifier.bias": layer.bias.grad})])
    rec = cls.from_config(cls.Config(), None).reconstruct(view)
    assert torch.allclose(rec.data, x, atol=1e-5)


def test_the_engine_example_wraps_the_builtin_rounds(run_example, monkeypatch):
    from gradleak.fl.engines import ENGINES

    ns = run_example("engine")
    engine = ENGINES.get("example_logged")()
    monkeypatch.setitem(ns, "run_rounds", lambda *a, **k: ("rounds", a, k))
    assert engine.rounds(None)(1, lr=2) == ("rounds", (1,), {"lr": 2}) and ns["ExampleLoggedEngine"].calls == 1


def test_the_modality_example_owns_its_public_data_rule(run_example):
    from gradleak.modalities import MODALITIES, modality_of

    run_example("modality")
    plugin = modality_of("example_rows")
    assert isinstance(plugin, MODALITIES.get("example_rows"))
    with pytest.raises(BadInput) as e:
        plugin.check_public_data(SimpleNamespace(threat_model=SimpleNamespace(public_data=True)))
    assert e.value.field == "threat.public_data"
    plugin.check_public_data(SimpleNamespace(threat_model=SimpleNamespace(public_data=False)))
