"""The optimisation-based image attacks of an honest server: dummy images optimised until their gradient matches the
observed update.

* :mod:`.inverting_gradients` — Inverting Gradients (``inverting_gradients``, ``ig``), DLG (``dlg``), APRIL (``april``)
  and the machinery the others build on: the matching objective (paper 001 eq. 7 with the positional-embedding
  anchor), the FedAvg emulation, labels, batch size, eager attention, the iteration-cost timing;
* :mod:`.labels` — labels from the classification head's gradient (iDLG);
* :mod:`.glr` — group lazy regularisation: restarts optimised together towards their consensus;
* :mod:`.gradvit` — GradViT (``gradvit``): image priors and a feature prior on top of IG's matching, with GLR;
* :mod:`.gias` — GIAS (``gias``): latent search and generator fine-tuning on a DCGAN prior, with GLR.

Importing this package registers every attack above.
"""

from gradleak.attacks.optimization import gias, gradvit, inverting_gradients  # noqa: F401  (registration)
