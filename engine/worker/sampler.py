"""Vectorized sampling over the step's batch, with vLLM's SamplingParams semantics."""

import numpy as np
import torch
from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.engine.request import Request
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.kernels import cpu as cpu_kernels


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax (the first maximum, like torch's). On CPU numpy's is ~10x faster on [64, 49152] fp32."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


# Rows whose kept tokens provably lie among their K most likely are sampled from those K: torch.topk of
# K=64 on a 49,152-token row costs ~1/30 of the full sort, and at temperature 0.2 / top_p 0.9 (the
# bundled model's defaults) the nucleus is a handful of tokens. top_k up to MAX_CANDIDATES - 1 raises K
# to top_k + 1 (the extra candidate shows whether a tie at rank top_k reaches outside); beyond it, or
# where the nucleus does not fit, the row takes the full sort.
NUM_CANDIDATES = 64
MAX_CANDIDATES = 1024


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, max_candidates: int = MAX_CANDIDATES) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # 0 turns the top-K path off: every random row takes the full sort (the benchmark's baseline).
        self.max_candidates = max_candidates
        # Structured outputs: xgrammar's packed allowed-token bitmask (int32 words, bit j of word k is
        # token 32k+j), grown to the largest batch seen and reused; matchers fill it on the CPU.
        self._bitmask = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)
        self._batch_matcher = None  # built with the first grammar row: importing xgrammar takes 2 s of a start

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: float32 [len(reqs), vocab]. Returns one token per row and its logprobs where asked."""
        n, _vocab = logits.shape
        params = [r.params for r in reqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = None
        if any(want_logprobs):
            # Logprobs of the model's distribution before any processing (vLLM's default).
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self._apply_bias_and_masks(logits, reqs)
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_grammar(logits, reqs)

        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            tokens = _argmax(logits)
        else:
            tokens = self._sample_random(logits, reqs, greedy)

        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        if raw_logprobs is not None:
            k = max(p.logprobs or 0 for p in params)
            sampled_lp = raw_logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
            top_vals = top_ids = None
            if k > 0:
                top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                top = []
                if p.logprobs > 0 and top_ids is not None:
                    top = list(zip(top_ids[i][: p.logprobs], top_vals[i][: p.logprobs], strict=True))
                logprobs[i] = (sampled_lp[i], top)
        return token_list, logprobs

    # ---- processing ----------------------------------------------------------------------------
    def _apply_bias_and_masks(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            for tok, bias in p.logit_bias.items():
                rows.append(i)
                cols.append(tok)
                vals.append(bias)
            if r.num_output_tokens < p.min_tokens:
                # EOS and stop tokens may not end the output before min_tokens. With a grammar, the
                # grammar alone decides where EOS may come (banning it could leave no allowed token).
                banned = set(p.stop_token_ids)
                if not p.ignore_eos and r.grammar is None:
                    banned.update(r.eos_token_ids)
                for tok in banned:
                    mask_rows.append(i)
                    mask_cols.append(tok)
        if rows:
            idx = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            logits = logits.index_put(idx, torch.tensor(vals, device=self.device, dtype=logits.dtype), accumulate=True)
        if mask_rows:
            idx = (torch.tensor(mask_rows, device=self.device), torch.tensor(mask_cols, device=self.device))
            logits = logits.index_put(idx, torch.tensor(float("-inf"), device=self.device, dtype=logits.dtype))
        return logits

    def _apply_grammar(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """-inf wherever a row's grammar forbids the token: the matchers fill one packed bitmask for
        their rows in one call, and xgrammar's kernel applies it to those rows in one call (on CPU it
        is ~5x faster than unpacking the bits with torch ops and one masked_fill: 28 vs 141 ms at 64 rows
        on a loaded machine)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return logits
        import xgrammar as xgr  # loaded already: it compiled these rows' grammars

        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
        n = logits.shape[0]
        if self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(n, self._bitmask.shape[1], dtype=torch.int32)
        bitmask = self._bitmask[:n]
        self._batch_matcher.batch_fill_next_token_bitmask([reqs[i].grammar for i in rows], bitmask, rows)
        logits = logits.contiguous()
        # In place: the raw logprobs were taken before any processing, and the model's logits tensor is
        # not used after sampling.
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )
        return logits

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        if all(
            p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            for p in params
        ):
            return logits
        n, vocab = logits.shape
        outputs = [r.output_token_ids for r in reqs]
        counts = self._token_counts(outputs, n, vocab)
        rep = torch.tensor([p.repetition_penalty for p in params], device=self.device).unsqueeze(1)
        if (rep != 1.0).any():
            prompts = [r.token_ids[: r.num_prompt_tokens] for r in reqs]
            seen = (self._token_counts(prompts, n, vocab) > 0) | (counts > 0)
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalized, logits)
        freq = torch.tensor([p.frequency_penalty for p in params], device=self.device).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in params], device=self.device).unsqueeze(1)
        return logits - freq * counts - pres * (counts > 0).to(logits.dtype)

    def _token_counts(self, token_lists: list[list[int]], n: int, vocab: int) -> torch.Tensor:
        width = max((len(t) for t in token_lists), default=0)
        counts = torch.zeros(n, vocab + 1, device=self.device)
        if width:
            # Pad with an extra column `vocab` that is dropped afterwards.
            padded = torch.full((n, width), vocab, dtype=torch.long)
            for i, t in enumerate(token_lists):
                if t:
                    padded[i, : len(t)] = torch.tensor(t)
            counts.scatter_add_(1, padded.to(self.device), torch.ones(n, width, device=self.device))
        return counts[:, :vocab]

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request], greedy: list[bool]) -> torch.Tensor:
        """One token per row: argmax for greedy rows, a draw from the truncated distribution otherwise."""
        n, vocab = logits.shape
        rows = [i for i, g in enumerate(greedy) if not g]
        tokens = _argmax(logits) if len(rows) < n else None
        if tokens is not None:  # only the random rows go on
            reqs = [reqs[i] for i in rows]
            logits = logits[torch.tensor(rows, device=self.device)]
        for r in reqs:
            if r.generator is None and r.params.seed is not None:
                # Choice i of a seeded request draws from seed + i; made on its first draw and kept on the
                # sequence, so preemption and the other rows of a batch never change its stream.
                r.generator = torch.Generator(device=self.device).manual_seed(r.params.seed + r.index)
        params = [r.params for r in reqs]
        temps = _per_row([float(p.temperature) for p in params], self.device)  # an int from JSON too
        sampled = torch.empty(len(reqs), dtype=torch.long, device=self.device)

        fast = torch.zeros(len(reqs), dtype=torch.bool, device=self.device)
        k_cand = _num_candidates(params, vocab, self.max_candidates)
        if k_cand:
            cand_scores, cand_ids, ok = _candidates(logits, temps, params, k_cand)
            fast_rows = np.flatnonzero(ok).tolist()
            if fast_rows:
                every = len(fast_rows) == len(reqs)
                scores, ids = (cand_scores, cand_ids) if every else (cand_scores[fast_rows], cand_ids[fast_rows])
                q = self._exponentials([reqs[i] for i in fast_rows], k_cand, ids).cpu().numpy()
                picked = np.take_along_axis(ids, (scores / q).argmax(axis=-1)[:, None], axis=-1)[:, 0]
                picked_t = torch.from_numpy(picked).to(self.device)
                if every:
                    sampled = picked_t
                else:
                    sampled[torch.tensor(fast_rows, device=self.device)] = picked_t
            fast = torch.from_numpy(ok).to(self.device)
        slow_rows = (~fast).nonzero().view(-1).tolist()
        if len(slow_rows) == len(reqs):  # no row gathered or put back (12 MB at 64 rows of 49,152)
            sampled = self._draw_full(_full_sort_probs(logits / temps, params), reqs)
        elif slow_rows:
            sr = torch.tensor(slow_rows, device=self.device)
            t = temps if isinstance(temps, float) else temps[sr]
            probs = _full_sort_probs(logits[sr] / t, [params[i] for i in slow_rows])
            sampled[sr] = self._draw_full(probs, [reqs[i] for i in slow_rows])

        if tokens is None:
            return sampled
        tokens[torch.tensor(rows, device=self.device)] = sampled
        return tokens

    def _draw_full(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row of probs [m, V] (the kept probabilities over the whole vocabulary, 0 where
        dropped). An unseeded row inverts its CDF at one uniform draw: the exponential race drew V
        exponentials per row, and torch's CPU exponential_ took 114 ms for 64 rows of 49,152 (2-vCPU
        Xeon, 2 threads) where the float64 cumsum and search take 4.7. A seeded row keeps the race on its
        own generator, so a seed gives the same text as before and as on the top-K path."""
        m, vocab = probs.shape
        out = torch.empty(m, dtype=torch.long, device=probs.device)
        seeded = [i for i, r in enumerate(reqs) if r.generator is not None]
        plain = [i for i, r in enumerate(reqs) if r.generator is None]
        if plain:
            every = len(plain) == m
            rows = probs if every else probs[torch.tensor(plain, device=probs.device)]
            # float64: a float32 running sum near 1 would skip tokens whose probability is under its ulp.
            cdf = rows.double().cumsum_(dim=-1)
            u = torch.rand(len(plain), 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
            # The first token whose CDF passes u: cdf[t] > u >= cdf[t - 1], so p[t] > 0.
            picked = torch.searchsorted(cdf, u, right=True).view(-1).clamp_(max=vocab - 1)
            # u = total (rand's largest value times the total can round up to it) finds no such token:
            # that row takes its last kept one.
            past = rows.gather(1, picked.unsqueeze(1)).view(-1) <= 0
            if bool(past.any()):
                kept = rows[past] > 0
                picked[past] = vocab - 1 - kept.flip(-1).int().argmax(dim=-1)
            if every:
                return picked
            out[torch.tensor(plain, device=probs.device)] = picked
        for i in seeded:
            out[i] = (probs[i] / self._seeded_exponentials(reqs[i])).argmax()
        return out

    def _seeded_exponentials(self, req: Request) -> torch.Tensor:
        """A seeded request's Exp(1) draw for a step: always a whole vocabulary row from its own generator,
        whichever path reads it, so its text depends on its seed alone."""
        return torch.empty(self.vocab_size, device=self.device).exponential_(generator=req.generator)

    def _exponentials(self, reqs: list[Request], width: int, ids: np.ndarray) -> torch.Tensor:
        """Exp(1) draws for the exponential race over the top-K path's candidates (Gumbel-max equivalent):
        argmax(p / q), q ~ Exp(1), is a draw from p. Unseeded rows draw one per candidate from the global
        generator. A seeded request draws from its own generator so its tokens do not depend on the rest
        of the batch, and always a whole vocabulary row, read at the candidate columns `ids`: the generator
        then advances and the token comes out exactly as with the full sort over the vocabulary (the same
        seed gives the same text whichever path a step takes, and as before this sampler had the top-K
        path)."""
        q = torch.empty(len(reqs), width, device=self.device).exponential_()
        for i, r in enumerate(reqs):
            if r.generator is not None:
                q[i] = self._seeded_exponentials(r)[torch.from_numpy(ids[i]).to(self.device)]
        return q


def _per_row(values: list[float], device: torch.device) -> float | torch.Tensor:
    """A python scalar when every row has the same value (the common case: no [n, 1] tensor to build),
    else a column to broadcast against [n, K]."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return torch.tensor(values, device=device).unsqueeze(1)


def _num_candidates(params: list[SamplingParams], vocab: int, max_candidates: int) -> int:
    """K for the top-K path, or 0 when no row can use it (no truncation at all, or K >= the vocabulary)."""
    k = NUM_CANDIDATES
    truncating = False
    for p in params:
        if 0 < p.top_k < vocab:
            truncating = True
            if p.top_k < max_candidates:
                k = max(k, p.top_k + 1)
        elif p.top_p < 1.0 or p.min_p > 0.0:
            truncating = True
    k = min(k, max_candidates)
    return k if truncating and k < vocab else 0


def _candidates(
    logits: torch.Tensor, temps: float | torch.Tensor, params: list[SamplingParams], k_cand: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The K most likely tokens of each row of logits ([m, V], before temperature), their unnormalized
    kept probabilities after temperature (0 where top-k / top-p / min-p drop them) and which rows' kept
    set provably lies inside the K: for those rows the same set and proportions as the full sort over
    the vocabulary, ties ranked by lower token id (as a stable sort of the whole row does).

    Only topk and, where top_p needs the exact normalizer, one pass over the rows touch the vocabulary
    (torch, on the logits' device); the rest works on [m, K] in numpy, where each of its ~25 small
    operations costs ~1 us instead of torch's ~5-15 us."""
    vocab = logits.shape[1]
    raw_t, ids_t = _topk(logits, k_cand)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    cut_by_k = [0 < k < k_cand for k in top_k]
    top_p = [p.top_p for p in params]
    raw, ids = raw_t.cpu().numpy(), ids_t.cpu().numpy()
    # A positive temperature keeps the order; the K values are divided exactly as the full sort's are.
    vals = raw / (temps if isinstance(temps, float) else temps.cpu().numpy())
    # topk orders ties arbitrarily: rank them by token id, so the kept prefix is the stable sort's.
    order = np.lexsort((ids, -vals), axis=-1)
    vals, ids = np.take_along_axis(vals, order, -1), np.take_along_axis(ids, order, -1)
    # exp(logit - max): the probabilities up to the row's normalizer, 1 for the top token. A token whose
    # probability is 0 (masked to -inf, or underflowed) can never be drawn: it does not count as kept.
    e = np.exp(vals - vals[:, :1])
    keep = e > 0
    if any(cut_by_k):
        keep &= np.arange(k_cand) < _np_row([k if 0 < k < k_cand else k_cand for k in top_k])
    # Rows top_k alone bounds inside the K.
    ok = np.array(cut_by_k)
    if any(p < 1.0 for p in top_p):
        tp = _np_row([p if p < 1.0 else float("inf") for p in top_p])
        e_k = np.where(keep, e, 0.0)
        # The normalizer: over the row's top_k where top_k cut it (all inside the K), else over the whole
        # vocabulary, which lies between the K's sum and that plus (V - K) times the K-th candidate (no
        # token outside the K is likelier). A larger normalizer only keeps more tokens, so where both
        # ends keep the same prefix and the K's mass reaches top_p even at the upper end, that is the
        # answer without a pass over the vocabulary (peaked rows: temperature 0.2 nearly always).
        z = e_k.sum(axis=-1, keepdims=True)
        z_hi = np.where(ok[:, None], z, z + (vocab - k_cand) * e[:, -1:])
        keep_lo, _ = _top_p_keep(e_k, z, tp)
        keep_hi, fits = _top_p_keep(e_k, z_hi, tp)
        decided = ok | ((keep_lo == keep_hi).all(axis=-1) & fits)
        undecided = np.flatnonzero(~decided).tolist()
        if undecided:
            # The exact normalizer for those rows alone. (logit - max) / T below -87 is exp underflow to
            # denormals (3x slower) and adds < 1e-33 to a sum that is at least 1.
            rows = torch.tensor(undecided, device=logits.device)
            inv_t = 1.0 / (temps if isinstance(temps, float) else temps[rows])
            z_full = torch.sub(logits[rows], raw_t[rows, :1]).mul_(inv_t).clamp_(min=-87.0).exp_().sum(dim=-1)
            z_hi[undecided] = z_full.cpu().numpy()[:, None]
            keep_hi[undecided], fits[undecided] = _top_p_keep(e_k[undecided], z_hi[undecided], tp if
                                                              isinstance(tp, float) else tp[undecided])
        keep &= keep_hi
        # Every token outside the K is dropped when the K's mass already reaches top_p.
        ok |= fits
    # A tie between the last kept token and tokens outside the K: which of them the stable sort keeps
    # depends on ids outside the K, so such a row takes the full sort.
    last_kept = np.take_along_axis(vals, keep.sum(axis=-1, keepdims=True) - 1, -1)
    ok &= (last_kept > vals[:, -1:])[:, 0]
    min_p = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_p):
        mp = _np_row(min_p)
        # min_p is relative to the top token's probability, which e holds as 1.
        keep &= e >= mp
        # Where the K-th candidate falls below min_p, every token outside the K does too (ties included).
        ok |= (e[:, -1:] < mp)[:, 0]
    # A top_k too large for the K never fits.
    ok &= ~np.array([k >= k_cand for k in top_k])
    return np.where(keep, e, 0.0).astype(np.float32), ids, ok


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest, descending: the C++ kernel for fp32 rows on CPU (one compare per logit
    against a running threshold: 0.83 vs 2.7 ms for torch.topk at [64, 49152], k 64, 2 threads),
    torch.topk elsewhere. Which of several values tied at the k-th place are returned differs between
    the two; _candidates sends such rows to the full sort either way."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        ops = cpu_kernels.load()
        if ops is not None:
            return ops.topk_rows(logits, k)
    return logits.topk(k, dim=-1)


def _top_p_keep(e: np.ndarray, z: np.ndarray, tp: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The smallest prefix whose mass reaches top_p (always at least the top token) under normalizer z,
    and whether the K's whole mass reaches it (then every token outside the K is dropped)."""
    probs = e / z
    cum = probs.cumsum(axis=-1)
    return (cum - probs) < tp, (cum[:, -1:] >= tp)[:, 0]


def _np_row(values: list[float]) -> float | np.ndarray:
    """_per_row for numpy: a scalar when every row agrees, else a float32 column."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return np.array(values, dtype=np.float32)[:, None]


def _full_sort_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The rows' kept probabilities over the whole vocabulary (0 where dropped), by sorting each row:
    top_k, then top_p over the renormalized top_k, then min_p relative to the top token. A stable sort
    ranks ties by lower token id."""
    device = x.device
    vocab = x.shape[1]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = x.sort(dim=-1, descending=True, stable=True)
        if any(0 < k < vocab for k in top_k):
            # top_k beyond the vocabulary (or 0) keeps every token.
            k = _per_row([k if 0 < k < vocab else vocab for k in top_k], device)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        if any(p < 1.0 for p in top_p):
            probs = sorted_logits.softmax(dim=-1)
            cum = probs.cumsum(dim=-1)
            tp = _per_row([p if p < 1.0 else float("inf") for p in top_p], device)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            sorted_logits = sorted_logits.masked_fill(cum - probs >= tp, float("-inf"))
        x = torch.empty_like(x).scatter_(1, sorted_idx, sorted_logits)
    probs = x.softmax(dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        mp = _per_row(min_p, device)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
