"""benchmarks/advise.py reads a stored row as measured on the shipped config only where it was: the same file, or an
earlier version that differs in comments only (:data:`SAME_CONFIG`), checked here against the git history."""

from __future__ import annotations

import hashlib
import subprocess

import pytest
import yaml

from conftest import bench_module


def test_each_listed_config_version_differs_from_the_file_now_in_comments_only():
    adv = bench_module("advise")
    root = adv.ROOT
    assert adv.SAME_CONFIG, "nothing listed: the test would check nothing"
    for name, versions in adv.SAME_CONFIG.items():
        path = adv.CONFIGS[name][0]
        now_text = (root / path).read_text()
        for sha, commit in versions.items():
            old = subprocess.run(["git", "show", f"{commit}^:{path}"], cwd=root, capture_output=True)
            if old.returncode != 0:
                pytest.skip(f"no git history of {path} at {commit}^ here (a shallow or exported tree)")
            assert hashlib.sha256(old.stdout).hexdigest()[:12] == sha, f"{name}: {commit}^ is not the version {sha}"
            assert old.stdout.decode() != now_text and yaml.safe_load(old.stdout) == yaml.safe_load(now_text), (
                f"{name}: version {sha} differs from {path} in more than comments")


def test_a_row_of_another_config_version_is_not_current():
    adv = bench_module("advise")
    now = adv.config_sha("vit_lora")
    assert adv.on_current_config({"config": "vit_lora", "config_sha": now})
    assert adv.on_current_config({"config": "vit_lora", "config_sha": "f8bf0826cd3e"})  # the comment-only version
    assert not adv.on_current_config({"config": "vit_lora", "config_sha": "0" * 12})
    assert not adv.on_current_config({"config": "text_adapters", "config_sha": "f8bf0826cd3e"})
