"""The optimisation-based image attacks of an honest server: dummy images optimised until their gradient matches the
observed update.

* :mod:`.inverting_gradients` — Inverting Gradients (``inverting_gradients``, ``ig``), DLG (``dlg``), APRIL (``april``),
  assembled from the machinery the others build on:

  * :mod:`.matching_config` — the shared configuration (:class:`~.matching_config.MatchingFields`, the step budgets)
    and the refusals of ``anchor`` / ``emulate``;
  * :mod:`.matching_setup` — the view reading: model copy, bound tensors, batch size, image shape, labels, eager
    attention, the groups of paper 001 eq. 7, the FedAvg emulation's schedule;
  * :mod:`.objective` — the matching objective (paper 001 eq. 7 with the positional-embedding anchor, the FedAvg
    emulation's simulated pseudo-gradient, the declared-noise likelihood) and the TV prior;
  * :mod:`.batched_restarts` — several restarts' matching terms through one double backward;
  * :mod:`.optimiser` — one restart's Adam loop and the iteration-cost timing;
* :mod:`.labels` — labels from the classification head's gradient (iDLG);
* :mod:`.glr` — group lazy regularisation: restarts optimised together towards their consensus;
* :mod:`.gradvit` — GradViT (``gradvit``): image priors and a feature prior on top of IG's matching, with GLR;
* :mod:`.gias` — GIAS (``gias``): latent search and generator fine-tuning on a DCGAN prior, with GLR.

Importing this package registers every attack above.
"""

from gradleak.attacks.optimization import gias, gradvit, inverting_gradients  # noqa: F401  (registration)
