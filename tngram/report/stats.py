"""Paired significance of a difference between two methods (pure functions; scipy for the
distributions, imported lazily so `import tngram` stays cheap).

A "pair" is two runs that share everything but the method: the same seed (backbone
initialisation and data order) and the same corpus. For paired differences d_1..d_n:

  * mean difference and its 95% confidence interval  mean ± t_{0.975, n-1} · sd / sqrt(n);
  * paired t-test p (two-sided; H0: E[d] = 0, d roughly normal);
  * sign test p (two-sided exact binomial on the signs, zeros dropped; H0: median 0);
  * sign-flip permutation test p (two-sided; H0: d symmetric about 0): the share of the 2^n sign
    patterns whose |mean| is at least the observed one — exact for n <= 16, else 20,000 random
    patterns (seeded).

With n = 3 the smallest two-sided sign / permutation p is 0.25: few seeds cannot be "significant"
by these tests whatever the effect, which the report says rather than hides.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from tngram.common import require_extra

__all__ = ["PairedStats", "paired_stats", "sign_flip_p", "sign_test_p"]


@dataclass(frozen=True)
class PairedStats:
    n: int
    mean: float
    sd: float  # sample standard deviation (n - 1)
    ci_low: float  # 95% t interval (nan for n < 2)
    ci_high: float
    t_p: float  # paired t-test, two-sided (nan for n < 2 or sd = 0)
    sign_p: float  # exact sign test, two-sided
    perm_p: float  # sign-flip permutation test, two-sided
    wins: int  # d < 0 (the first method has the lower loss)
    losses: int  # d > 0


def sign_test_p(diffs: list[float] | np.ndarray) -> float:
    """Two-sided exact sign test: binomial(n_nonzero, 1/2) on the number of positive signs."""
    binomtest = require_extra("scipy.stats", "report", "significance tests").binomtest

    d = np.asarray(diffs, dtype=float)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    return float(binomtest(int((d > 0).sum()), int(d.size), 0.5, alternative="two-sided").pvalue)


def sign_flip_p(
    diffs: list[float] | np.ndarray, exact_max: int = 16, samples: int = 20_000, seed: int = 0
) -> float:
    """Two-sided sign-flip permutation p of the mean: P(|mean(s * d)| >= |mean(d)|) over random
    signs s (all 2^n patterns for n <= exact_max, else `samples` seeded patterns, counting the
    observed one)."""
    d = np.asarray(diffs, dtype=float)
    n = d.size
    if n == 0:
        return 1.0
    obs = abs(d.sum()) - 1e-12 * max(1.0, float(np.abs(d).sum()))  # tolerate float ties
    if n <= exact_max:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # (2^n, n)
        return float((np.abs(signs @ d) >= obs).mean())
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(samples, n))
    return float(((np.abs(signs @ d) >= obs).sum() + 1) / (samples + 1))


def paired_stats(diffs: list[float] | np.ndarray) -> PairedStats:
    """All statistics of paired differences d (e.g. val_loss(A) − val_loss(B) per seed)."""
    student_t = require_extra("scipy.stats", "report", "confidence intervals").t

    d = np.asarray(diffs, dtype=float)
    n = int(d.size)
    if n == 0:
        raise ValueError("paired_stats needs at least one difference")
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    if n > 1:
        half = float(student_t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
        lo, hi = mean - half, mean + half
        t_p = (
            float(2 * student_t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)) if sd > 0 else math.nan
        )
    else:
        lo = hi = t_p = math.nan
    return PairedStats(
        n=n,
        mean=mean,
        sd=sd,
        ci_low=lo,
        ci_high=hi,
        t_p=t_p,
        sign_p=sign_test_p(d),
        perm_p=sign_flip_p(d),
        wins=int((d < 0).sum()),
        losses=int((d > 0).sum()),
    )
