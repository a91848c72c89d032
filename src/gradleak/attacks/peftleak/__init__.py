"""PEFTLeak (Sami et al., CVPR 2025; paper 000 in docs/PAPERS.md): exact patch recovery from the
adapter gradients of a ViT poisoned by a malicious server.

The attack is split into the two parties' pieces, composed by the registered attack
:class:`~gradleak.attacks.peftleak.attack.PEFTLeak` (the round protocol of :mod:`gradleak.attacks.base`):

* :class:`PEFTLeakServer` — the malicious server: poisons the model once, plans the rounds, writes each
  round's malicious adapters. It owns the secrets the analysis needs (positional embeddings, the
  embedding map ``M``, every slot's read-out direction and thresholds) and the binning geometry
  (:meth:`~PEFTLeakServer.geometry`, :meth:`~PEFTLeakServer.stats`, :meth:`~PEFTLeakServer.adapter_inputs`)
  both pieces use.
* :class:`PEFTLeakRecovery` — the attacker's analysis, built as ``PEFTLeakRecovery(server)``: it reads the
  server's secrets through ``self.server`` and, at reconstruction time, only the
  :class:`~gradleak.fl.core.ServerView`. It holds no reference to the model or to any client data.

Pipeline (Algorithm 1):

1. :meth:`PEFTLeakServer.prepare` poisons the backbone once (Sec. 4.1–4.5; Algorithm 1 lines 3–15): positional embeddings
   i.i.d. with std ``sigma`` (open point A1.1: "N(0, σ)" read as std), patch embedding ``E = 0.5·M``,
   LayerNorm weights ``sigma`` and bias 0, identity attention (Q = K = V = W_O = I, Q scaled by
   ``q_scale`` so the softmax is an exact one-hot in float64), identity MLP with ±γ biases (γ = 1e4);
   then it plans the rounds (:meth:`PEFTLeakServer._plan_rounds`, A1.8).
2. :meth:`PEFTLeakServer.adapter_state` writes the malicious adapters of one round (Sec. 4.3, eqs. 15–23):
   every down-projection row of an adapter assigned to position t reads the target token through
   ``w = E_pos(t)`` (+ ``α·d_k`` in the improved design), the biases are thresholds from the public-data
   statistic (inverse Gaussian CDF in the paper design), the up-projection is ``up_scale·u_out·1ᵀ``.
   :meth:`PEFTLeak.server_model` loads it, and the poisoned head again (:meth:`PEFTLeakServer.round_state`),
   into the model the server sends that round.
3. :meth:`PEFTLeakRecovery.reconstruct` reads only the :class:`~gradleak.fl.core.ServerView`: eq. (24)
   (differences of consecutive neurons) isolates the adapter input of a lone patch in a bin, eq. (25)
   maps it back to pixels, then patches are grouped into images.

Decisions the paper leaves open (open points A1.x of docs/PAPERS.md), each recorded here:

* A1.2 open quantiles: paper design uses probabilities ``i/(k+1)`` over the ``k = S_t·r`` neurons of a
  position, so no threshold is infinite.
* A1.3 the interval between the last neuron of one adapter and the first of the next cannot be
  differenced (different upstream coefficients) and is lost in the paper design, as are both tails.
  The improved design puts neuron 1 below every target statistic (but above every non-target one) and
  uses the top neuron alone for the top interval, so an adapter of width r gives r bins, not r−1.
* A1.4 "first neuron ≈ 1e-6": the up-projection is ``up_scale·u_out·1ᵀ`` — every hidden unit writes the
  same tiny vector, so every neuron of an adapter sees the same upstream coefficient per token and
  eq. (24) holds. ``up_scale = 1e-9`` (float64) keeps the forward perturbation negligible.
* A1.5/A1.9 LayerNorm. A LayerNorm destroys each token's mean and rescales it. We (i) set every
  LayerNorm's ``eps = sigma²`` (the server ships the config), so the norm of a LayerNorm output
  reveals the input's variance and the scale can be undone exactly; (ii) choose ``E = 0.5·M`` with
  ``M`` orthogonal mapping the *lowest-energy* pixel direction of the public patches (not the patch
  mean, as ``E = 0.5·I`` does) onto the all-ones direction the LayerNorm removes; that one pixel
  coordinate is filled with its public mean. When ``D > P²C`` (ViT-L/16) no pixel direction is lost.
  The authors' code leaves both effects uncorrected (≈17 dB patches).
* A1.6 float64 throughout (γ = 1e4 would cost ~1e-3 per pixel in float32).
* A1.8 placement: positions are served round-robin in blocks of ``positions_per_round``; each gets
  ``adapters_per_position`` consecutive adapter slots (paper: 5 per position, 4 positions a round,
  which reproduces its 1 round for CIFAR, 4 rounds for TinyImageNet, 2 rounds on ViT-L/16).
* Public statistics: the pixel distribution is pooled over all patches of the public images (the
  attacked images are never used); the per-position statistic is then exact, because a patch's
  adapter input is a known function of its pixels and E_pos(t) (identity attention, see
  :func:`slot_scales`).
* A1.9 grouping. The paper's image tag (first-MSA uniform head) overwrites 64 pixel values of every
  patch. We group *without a tag*: the head is rank one (logit 0 = ``head_scale·ŵᵀ pooled``) and the
  model mean-pools patch tokens, so the upstream coefficient of a lone patch in its bin is
  ``g_m·κ(x)`` with ``g_m = ∂L/∂logit_0`` shared by every token of image m and ``κ(x)`` a derivative
  the server computes from the recovered patch alone (tokens never mix under identity attention).
  ``g = Δb / κ(x)`` is therefore identical (to ~1e-10) for all patches of one image and differs
  between images; patches are grouped by it. This also enables *peeling* (improved design): the
  contribution of an already recovered patch to a collided bin is known exactly and can be removed.
* A1.10 the classification head is mean pooling over patch tokens (``model.pooling = mean``); with
  the CLS head and exactly-identity attention patch tokens get no gradient at all.

Modules of this package:

* :mod:`.config` — :class:`~.config.PEFTLeakConfig`, the ``attack:`` parameters (their one source of defaults);
* :mod:`.geometry` — the linear algebra both parties share (slot scales, per-patch quantities);
* :mod:`.server` — :class:`~.server.PEFTLeakServer`: poisoning, round planning, per-round adapters;
* :mod:`.recovery` — :class:`~.recovery.PEFTLeakRecovery`: recovery from the server view, grouping;
* :mod:`.denoise` — the noise mode (``attack.noise``): σ declared or read off the upload, calibrated bin tests,
  patch estimates with their errors, combination of one patch's bins (beyond the paper, which reads exact gradients);
* :mod:`.limit` — the information limit of the attacked bins under the declared noise (bins above the noise edge,
  the strongest margin, the signal scale as a noise std) and the oracle restriction to the K strongest bins
  (``attack.keep_bins``: the ceiling of benchmarks/defended.py);
* :mod:`.attack` — :class:`~.attack.PEFTLeak`, registered as ``peftleak``.

The patch geometry of the ViT grid (``image_to_patches`` and its inverses) is in :mod:`gradleak.metrics.patches`.
"""

from gradleak.attacks.peftleak import attack  # noqa: F401  (registers "peftleak")
