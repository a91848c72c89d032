"""One-shot empirical ε from canary statistics (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical
Privacy Estimation for Federated Learning", ICLR 2024, arXiv 2302.03098).

The measurement (paper Sec. 3, Alg. 1 and 2): ``k`` canary clients, each uploading a random isotropic direction of
the trainable parameter space, take part in the federation; after it, the statistic of each canary (the cosine of its
direction with the final model's change, or its largest cosine with a round's aggregate when every iterate is seen)
is compared with the same statistic of ``k`` canaries never inserted. Both sets are fitted with a Gaussian, and the
ε at the configured δ of the pair of Gaussians is the estimate: how well a threshold on the statistic tells a present
canary from an absent one, in the units of differential privacy. For the Gaussian mechanism the estimate is exact as
the dimension grows (paper Thm. 3.2).

Here (:func:`estimate`):

* ``epsilon`` is the paper's point estimate, :func:`epsilon_two_gaussians` of the two fitted Gaussians (both
  directions of the privacy loss taken, the larger δ(ε) decides), with one deviation: the two share one fitted
  spread (see :func:`estimate` for why and what was measured); the separate-spread fit is reported beside it.
* ``interval`` is ours: a 95 % percentile bootstrap over the canaries (seen and unseen resampled, refitted), seeded,
  so the same statistics give the same interval on any machine and thread count; the verdict reads its one-sided
  99.9 % lower end (``strict_lower``), so a correct mechanism is called violated about once in a thousand checks.
* ``lower_bound`` is the classic threshold bound (Jagielski et al. 2020) with Jeffreys intervals at confidence
  1 − ``alpha``, as the paper's own code reports beside the estimate: an ε that holds without the Gaussian assumption,
  weaker with few canaries (at most about log(k)).
* ``one_run_bound`` is the rigorous one-run bound of Steinke, Nasr & Jagielski ("Privacy Auditing with One (1)
  Training Run", NeurIPS 2023, Thm. 3.1 / 5.2; :func:`one_run_bound`): guesses of which canaries were inserted,
  counted against the Binomial an (ε, δ)-DP mechanism allows, on the check's inserted / never-inserted canaries
  (the conditioning on the inserted count, and the paired design of each upload, in its docstring); with its
  ``one_run_ceiling`` (every guess right). Its 99.9 % version (``one_run_strict``) above the claim refutes it.

The fit averages away what real DP bugs look like: a mechanism that skips the noise on a fraction of its uploads makes
the seen statistics a mixture (a few at cosine ≈ 1 among many near 0), whose one-spread fit *lowers* ε, and noise at
1.5× too small a scale moves the mean by less than the 99.9 % end can see. Beside it, :func:`claim_tests`
(ours) tests the inserted canaries' statistics against what the claim allows -- ``shift`` (the mean against the
claim's μ), ``spread`` (a Gaussian mechanism only shifts a canary's statistic: a larger spread is a mixture) and
``tail`` (the count beyond the cosine the claimed (ε, δ) allows, against an exact binomial) -- using that a
never-inserted canary's cosine has an exactly known distribution (:func:`sphere_tail`); family-wise α = 0.01 over
every test of a check (:data:`ALPHA`, Bonferroni; :func:`judge`).

:func:`dp_verdict` turns a claimed ε (an accountant's) and the measurement into ``claim_violated`` (the interval's low
end above the claim, or a claim test rejecting: the implementation does not do what its accountant assumes),
``vacuous`` (claimed ε > 10: no meaningful guarantee, whatever the measurement) or ``consistent``.

Where each part lives (this module is the check's public face: every name below is importable from here):

* :mod:`~gradleak.evaluation.dp_gaussian_pair`: δ(ε) and ε(δ) of two Gaussians, the μ-GDP mechanism's exact ε;
* :mod:`~gradleak.evaluation.dp_estimate`: the one-shot estimate (:func:`estimate`);
* :mod:`~gradleak.evaluation.dp_bounds`: the threshold bound and the one-run bound, with their ceilings;
* :mod:`~gradleak.evaluation.dp_claim_tests`: the claim tests and the per-tensor noise tests;
* :mod:`~gradleak.evaluation.dp_verdict`: :func:`judge`, :func:`dp_verdict` and their wording;
* :mod:`~gradleak.evaluation.dp_simulation`: simulated canary statistics and checks (tests and benchmarks).
"""

from gradleak.evaluation.dp_bounds import (ONE_RUN_GUESSES, bound_ceiling, one_run_bound, one_run_ceiling,
                                           one_run_epsilon, one_run_p_value, threshold_lower_bound)
from gradleak.evaluation.dp_claim_tests import (ALPHA, CLAIM_TESTS, claim_tests, claimed_mu, sphere_tail,
                                                sphere_threshold, tensor_ratios, tensor_test_names, tensor_tests)
from gradleak.evaluation.dp_estimate import BOOTSTRAP, STRICT, estimate
from gradleak.evaluation.dp_gaussian_pair import (EPSILON_CAP, delta_two_gaussians, epsilon_two_gaussians,
                                                  gaussian_mechanism_epsilon)
from gradleak.evaluation.dp_simulation import (TEXT_AUDIT_TENSORS, simulated_check, simulated_statistics,
                                               simulated_tensor_statistics)
from gradleak.evaluation.dp_verdict import TEST_WORDS, VACUOUS_EPSILON, dp_verdict, fmt_epsilon, judge, rejected_tests

__all__ = ["ALPHA", "BOOTSTRAP", "CLAIM_TESTS", "EPSILON_CAP", "ONE_RUN_GUESSES", "STRICT", "TEST_WORDS",
           "TEXT_AUDIT_TENSORS", "VACUOUS_EPSILON", "bound_ceiling", "claim_tests", "claimed_mu", "delta_two_gaussians",
           "dp_verdict", "epsilon_two_gaussians", "estimate", "fmt_epsilon", "gaussian_mechanism_epsilon", "judge",
           "one_run_bound", "one_run_ceiling", "one_run_epsilon", "one_run_p_value", "rejected_tests",
           "simulated_check", "simulated_statistics", "simulated_tensor_statistics", "sphere_tail", "sphere_threshold",
           "tensor_ratios", "tensor_test_names", "tensor_tests", "threshold_lower_bound"]
