"""The README's "Your own federation" section, followed literally: a CSV of sentences and a folder
of images written from the offline assets into a fresh folder, then the section's two commands on the shipped
configs/own/ configs (the sizes as shipped, the commands as printed), each exiting 0 with an audit.json."""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradleak.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section() -> str:
    m = re.search(r"^## Your own federation\n(.*?)(?=^## )", README, flags=re.S | re.M)
    assert m, "README has no 'Your own federation' section"
    return m.group(1)


def _commands() -> list[list[str]]:
    return [shlex.split(line.split("#")[0]) for line in _section().splitlines()
            if line.strip().startswith("gradleak audit configs/own/")]


def test_section_is_short_and_names_every_size_field():
    sec = _section()
    assert len(sec.strip().splitlines()) <= 15
    for key in ("batch_size", "test_size", "nonmembers", "samples_per_client", "validation_size", "prior_size",
                "public_size"):
        assert key in sec, key
    assert len(_commands()) == 2


def _write_data(root: Path) -> None:
    from gradleak.data import load
    from gradleak.data.text import load_text

    sents = load_text("rt-sentences")
    (root / "my_data").mkdir()
    with open(root / "my_data" / "sentences.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for t, y in list(zip(sents.texts, sents.labels))[:40]:
            w.writerow([t, int(y)])
    from PIL import Image

    imgs = load("cifar10-samples")
    for i in range(12):
        d = root / "my_data" / "images" / f"class{int(imgs.labels[i]) % 2}"
        d.mkdir(parents=True, exist_ok=True)
        arr = (imgs.images[i].permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        Image.fromarray(arr).save(d / f"{i}.png")


@pytest.mark.parametrize("which", [0, 1])
def test_readme_commands_audit_your_own_data(tmp_path, monkeypatch, which):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    _write_data(tmp_path)
    cmd = _commands()[which]
    assert cmd[0] == "gradleak"
    res = CliRunner().invoke(app, [*cmd[1:], "--workers", "1"])
    assert res.exit_code == 0, res.output[-3000:]
    out = tmp_path / cmd[cmd.index("--out") + 1]
    audit = json.loads((out / "audit.json").read_text())
    assert audit["verdict"] in ("leaks", "leaks_stronger_server", "no_leak_found")
