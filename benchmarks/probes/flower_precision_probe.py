"""Why PEFTLeak recovers nothing from FedSGD *weight* replies through Flower (benchmarks/flower_dp.py): the recorded
update ``(sent − new) / lr`` against the update reply, per adapter tensor, with the weights' and gradients' sizes.

``OMP_NUM_THREADS=1 python benchmarks/probes/flower_precision_probe.py`` (about a minute): runs
``configs/peftleak/cifar_b32.yaml`` with ``data.batch_size=16`` through ``fl.engine=flower`` once per reply and
prints, for the first adapter tensors, the relative error of the weight-reply update, max |gradient| and max |w|.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import gradleak.fl.threat as threat  # noqa: E402
from gradleak.config.loading import load_yaml  # noqa: E402
from gradleak.run.runner import run_config  # noqa: E402


def main() -> int:
    seen, original = {}, threat.build_view

    def keep(**kw):  # the view's inputs: what the Flower strategy recorded
        seen["kw"] = kw
        return original(**kw)

    threat.build_view = keep
    got = {}
    for reply in ("update", "weights"):
        with tempfile.TemporaryDirectory() as d:
            run_config(load_yaml(ROOT / "configs/peftleak/cifar_b32.yaml"), Path(d) / "run",
                       overrides=["data.batch_size=16", "fl.engine=flower", f"fl.flower.reply={reply}"])
        got[reply] = (seen["kw"]["rounds"][0][0], seen["kw"]["round_states"][0])
    (ua, state), (ub, _) = got["update"], got["weights"]
    print("| tensor | relative error of the weight-reply update | max abs gradient | max abs weight |")
    print("|---|---|---|---|")
    for k in [k for k in ua.tensors if "adapter" in k][:8]:
        a, b = ua.tensors[k].double(), ub.tensors[k].double()
        print(f"| {k} | {float((a - b).norm() / a.norm()):.3g} | {float(a.abs().max()):.3g} | "
              f"{float(state[k].abs().max()):.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
