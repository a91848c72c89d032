"""UTR: exact text reconstruction from the adapter gradients of a frozen LM (UTR paper, paper 002 in docs/PAPERS.md).

Stage 1 (word bag, UTR paper Sec. 4.2): every row j of the embedding adapter's down-projection gradient is
``sum_l delta_jl f_0(x_l)`` (Sec. 4.2, 4.4), so the row space S_EA of the stacked gradient is span{f_0 of the batch's
tokens}. We build an orthonormal basis by SVD (float64, relative singular-value cut-off ``rank_rtol``) and test
*every* vocabulary token at once: relative residual ``||f - P f|| / ||f||`` < ``eps_bag``.

* RoPE / position-free models (Llama): f_0(v) = E[v], one (V x n) projection.
* BERT (absolute positions, token types, LayerNorm): f_0(v, p) = LN(E[v] + P[p] + T[0]). We never materialise the V x
  P x n tensor: the LayerNorm is affine in the centred sum, so ``||f||^2`` and ``||Q^T f||^2`` expand into V x P
  matrices built from three matmuls (see :func:`~gradleak.attacks.common.bert_pairs.bert_pair_residuals`). The test
  yields the token bag and the maximal length; it cannot place tokens once the batch has T + P + 1 distinct pairs
  (then every bag token passes at every seen position).
  :func:`~gradleak.attacks.common.bert_pairs.bert_pair_decompose` recovers the exact pairs from the gradient's
  coefficients and the ReLU masks (beyond the paper); the positions of [SEP] give the sentence lengths. When the
  upload holds the adapter's up-projection, :mod:`gradleak.attacks.common.pair_signals` solves every candidate pair's
  exact bottleneck signal from the up + down equations and drops the pairs no sentence holds (the support test keeps
  false pairs for tokens most sentences share, such as [SEP]).

Two methods (``search``): ``paper`` runs UTR as published -- the span test above without the exact pairs and pair
signals, and the paper's greedy constructive search (beam width 1, strict EICW, no CG/CS; the open points A3.1, A3.5,
A3.8 of docs/PAPERS.md are decided in :mod:`.greedy`), every extension below off; ``extended`` (the default) is ours, described next.
``info["method"]`` names the one that ran.

Stage 2 (sentences, Sec. 4.3) uses the first layer adapter's subspace S_LA = span{h_1 of the batch}:

* causal models (prefix-wise): a token's layer-1 state depends only on its prefix, so starting from BOS we
  extend each prefix by every word-bag token in one batched forward pass (KV cache of the prefix, stopping
  after layer 1) and keep the extensions whose newest state lies in S_LA. Several passing extensions mean
  several batch sentences share the prefix: the search branches (a trie), which *separates the sentences*.
  A sentence ends when no extension passes (the final EOS gets no gradient under the LM loss, so it is
  invisible; open point A3.6). With ``value_test`` (one-step uploads), :mod:`gradleak.attacks.utr.causal` then tests
  every complete sentence on the embedding adapter's gradient values, peels the verified ones from the upload and
  searches the rest again -- soft-graded by the upload's strongest directions while the states left still fill
  the bottleneck, strictly once they fit (beyond the paper). A causal backbone with a classification head (a Llama
  ``*ForSequenceClassification``, mean-pooled or not; no LM head) is causal all the same (``is_causal`` reads the
  config, not the head): its head pools every position, so the EOS gets a gradient (found, then stripped from the
  returned sentence), there is no LM prior (``info["lm_prior"]``), and the value test fits the head's C - 1
  coefficients per sentence instead of the LM's one batch scale (``info["head"]``, ``info["value_test_head"]``).
* bidirectional models (whole sentence): the exact (token, position) pairs and [SEP] positions of stage 1 turn
  the search into assigning each position's tokens to B sentences; :mod:`gradleak.attacks.common.encoder_search`
  solves it with Hungarian assignments scored by S_LA residuals (construction, point moves, splices, segment swaps) and
  accepts a sentence only when every position passes the membership test (``eps_sentence``). Past the first
  layer's bottleneck (more layer states than rows), :mod:`gradleak.attacks.utr.values` tests each candidate sentence
  on the embedding adapter's gradient values instead (``value_test``; exact for one-step uploads), and grades
  chains by the upload's strongest directions (``soft_rank``).

Filters (open point A3.1, not specified in the paper): EICW rejects an extension equal to the previous token unless
nothing else passes (real text does repeat tokens: "very very", "..."). CG/CS -- there is no grammar service
offline -- are built on the LM itself: when more extensions pass than ``max_branches``, the causal LM's own
next-token log-probability ranks them and prunes the tail (``lm_prior``); for the encoder the tie-break is the
EICW rule. Membership, not the prior, decides acceptance, so the prior never introduces wrong text.

Capacity (Sec. 4.4, Theorems 4.1/4.2): rank(S) <= d_bottleneck. When the numerical rank reaches the bottleneck width the
subspace is saturated and the word bag cannot be trusted: ``info["capacity_exhausted"]`` says so and the
attack still returns what it found (never fails silently).

Open decisions recorded (open points A3.2/A3.3): S from raw gradient rows (not row/bias ratios: same span, better
conditioned); relative residuals; rank cut-off relative to the largest singular value.

Noisy uploads (beyond the paper; docs/DESIGN.md §6): :mod:`.clipped` moves the chain search's sentences by their
exact share of the upload under DP-SGD's clipped-sum model -- each sentence at its own scale c_i / B >= 0 and label,
c_i = min(1, C / ||g_i||) -- against the chi-square law of the declared noise (sigma C / B); where that search does
not reach the noise under a declared per-sample clip norm, stage 1's pairs are read again by rank
(:func:`~gradleak.attacks.common.bert_pairs.bert_pair_ranked`: clipping shrinks every coefficient against the same
noise, so the support test places most tokens at position 1) and the batch with the lower clipped-sum z is kept
(``info["position_reading"]``); an empty chain never passes as a sentence while bag tokens are unplaced
(:meth:`~gradleak.attacks.common.encoder_search.EncoderChainSearch._vacuous`); the causal value test
fits one scale per sentence under a declared per-sample clip norm; and
:mod:`gradleak.attacks.common.sub_edge` scores every vocabulary token below the noise edge (``info["sub_edge_*"]``,
``metrics["subedge_p_value"]``; its tokens are the word bag when no direction stands above the edge).

Where the code lives: :mod:`.attack` (the registered attack and its config), :mod:`.greedy` (the published greedy
search, ``search: paper``), :mod:`.causal` and :mod:`.values` (the value tests past the first layer's bottleneck, UTR's
own), :mod:`.clipped` (the clipped-sum search on noisy uploads); the parts DAGER and LAMP share with UTR are in
:mod:`gradleak.attacks.common` (``subspace``, ``text``, ``bert_pairs``, ``pair_signals``, ``word_bag``, ``sub_edge``,
``prefix_search``, ``encoder_search`` with ``bert_layer`` and ``chain_lengths``).
"""

from gradleak.attacks.utr.attack import UTRAttack, UTRConfig

__all__ = ["UTRAttack", "UTRConfig"]
