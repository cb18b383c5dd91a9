"""Intervals, paired tests and verdicts for the claims table of ``experiments/tables.py``.

Pure functions over plain numbers, standard library only (the machines that regenerate the pages have no
scipy), so a figure on a page can be recomputed anywhere and checked by hand in a test:

- ``bootstrap_difference``: a two-level percentile bootstrap of the mean difference between two arms run with
  the same seeds. Each resample draws seeds with replacement, then, within each drawn seed, that seed's held-out
  tasks with replacement, tasks paired by task id between the arms. Both sources of error a figure carries
  (which seeds ran, which tasks were drawn) are in the interval. Records that carry no per-task outcomes (every
  record committed before issue 49) resample seeds only, and the interval says so (``n_tasks == 0``).
- ``bootstrap_mean``: the same for one arm's mean; ``bootstrap_contrast``: the difference and both arms' means from
  the same resamples (a claim's figure and the two levels it is the difference of).
- ``paired_t_test`` over seed-level differences, with the Student-t tail computed here from the regularized
  incomplete beta function; and ``sign_flip_p``, the exact permutation test over seeds. The t-test is the
  primary one: the sign-flip test makes no assumption of normality but cannot go below ``2 / 2**n`` with n seeds
  (0.25 at 3, 0.0625 at 5), so with few seeds it cannot reject anything.
- ``verdict``: the rules that turn a claim's interval and RL's share into reproduced / direction only / not
  reproduced / no control (written out at ``verdict``).

What it does not do: no correction for the many claims tested at once, no bias-corrected (BCa) intervals, no
weighting of seeds by their number of tasks (each seed counts once, as each was one training run).
"""

from __future__ import annotations

import itertools
import math
import operator
import random
from typing import NamedTuple

RESAMPLES = 10_000
CONFIDENCE = 0.95
RESULT_SEEDS = 5  # fewer seeds than this is a pilot
MAX_SIGN_FLIP_SEEDS = 16  # 2**16 sign patterns; beyond that the exact test is too slow in pure Python


class SeedOutcome(NamedTuple):
    """One seed's figure: its value, the per-task outcomes it is the mean of (None where the record has none), and
    which draw of held-out tasks they come from (``eval.seed``; None where the record does not say)."""

    value: float
    tasks: dict[str, float] | None = None
    draw: int | None = None


class Interval(NamedTuple):
    """A mean and its percentile-bootstrap interval. ``low``/``high`` are NaN where no interval can be estimated
    (one seed and no per-task outcomes). ``n_tasks``: held-out tasks resampled within each seed (the fewest over
    seeds); 0 means seeds only."""

    mean: float
    low: float
    high: float
    n_seeds: int
    n_tasks: int

    @property
    def seeds_only(self) -> bool:
        return self.n_tasks == 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _same_draw(a: SeedOutcome, b: SeedOutcome) -> bool:
    """Whether two seeds' per-task outcomes can pair by task id: both have some, from the same draw of tasks (a
    shared id between two different draws would pair unrelated tasks), sharing at least one id."""
    known = a.draw is not None and b.draw is not None
    return bool(a.tasks and b.tasks and set(a.tasks) & set(b.tasks)) and (not known or a.draw == b.draw)


def paired_units(arm: list[SeedOutcome], baseline: list[SeedOutcome]) -> tuple[list[list[tuple[float, float]]], bool]:
    """What the bootstrap resamples: per seed (``arm[i]`` pairs with ``baseline[i]``), a list of (arm, baseline)
    values, one per task id both have. When any seed of either arm lacks per-task outcomes, or a seed's two arms
    come from different draws of tasks or share no task id, every seed falls back to the single pair of its means;
    the flag says which (True: by task)."""
    by_task = bool(arm) and all(_same_draw(a, b) for a, b in zip(arm, baseline))
    if not by_task:
        return [[(a.value, b.value)] for a, b in zip(arm, baseline)], False
    return [[(a.tasks[t], b.tasks[t]) for t in sorted(set(a.tasks) & set(b.tasks))]
            for a, b in zip(arm, baseline)], True


def _seed_means(unit: list[tuple[float, float]]) -> tuple[float, float]:
    """One seed's mean arm value and mean baseline value over its (resampled) tasks."""
    return sum(a for a, _ in unit) / len(unit), sum(b for _, b in unit) / len(unit)


def _columns(unit: list[tuple[float, float]]) -> tuple[range, tuple[float, ...], tuple[float, ...]]:
    """A seed's task indices, arm values and baseline values, laid out for ``_resampled_means``."""
    return range(len(unit)), tuple(a for a, _ in unit), tuple(b for _, b in unit)


def _resampled_means(columns: tuple[range, tuple[float, ...], tuple[float, ...]],
                     rng: random.Random) -> tuple[float, float]:
    """One seed's mean arm and baseline values over its tasks drawn with replacement (the same draws for both, so
    tasks stay paired). ``itemgetter`` picks the drawn values in C: this loop is where the page's time goes."""
    indices, arm, baseline = columns
    if len(indices) == 1:
        return arm[0], baseline[0]
    pick = operator.itemgetter(*rng.choices(indices, k=len(indices)))
    return sum(pick(arm)) / len(indices), sum(pick(baseline)) / len(indices)


def _statistics(seed_means: list[tuple[float, float]], relative: bool) -> tuple[float, float, float]:
    """(arm − baseline, arm, baseline): the means over seeds of the seeds' means (each seed counts once); the
    difference divided by the baseline's mean when ``relative`` (NaN where that is 0)."""
    arm, baseline = _seed_means(seed_means)
    if not relative:
        return arm - baseline, arm, baseline
    return ((arm - baseline) / baseline if baseline else math.nan), arm, baseline


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, interpolating linearly between order statistics."""
    position = q * (len(sorted_values) - 1)
    below = math.floor(position)
    above = min(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (position - below) * (sorted_values[above] - sorted_values[below])


def bootstrap_contrast(arm: list[SeedOutcome], baseline: list[SeedOutcome], *, relative: bool = False,
                       resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
                       seed: int = 0) -> tuple[Interval, Interval, Interval]:
    """(arm − baseline, the arm's mean, the baseline's mean) over seeds paired by index, each with its two-level
    percentile bootstrap interval (module docstring), all three from the same resamples. ``relative``: the
    difference as a fraction of the baseline's mean, recomputed in every resample. Seeded, so a page regenerates
    to the same digits."""
    if len(arm) != len(baseline):
        raise ValueError(f"arm and baseline must pair seed by seed: {len(arm)} against {len(baseline)}")
    units, by_task = paired_units(arm, baseline)
    n_seeds, n_tasks = len(units), (min(len(u) for u in units) if by_task else 0)
    if not units:
        return (Interval(math.nan, math.nan, math.nan, 0, 0),) * 3
    seed_means = [_seed_means(u) for u in units]
    means = _statistics(seed_means, relative)
    if n_seeds == 1 and not by_task:
        return tuple(Interval(m, math.nan, math.nan, 1, 0) for m in means)
    rng = random.Random(seed)
    columns = [_columns(u) for u in units]
    draws = []
    for _ in range(resamples):
        if by_task:  # seeds, then each drawn seed's tasks
            drawn = [_resampled_means(c, rng) for c in rng.choices(columns, k=n_seeds)]
        else:
            drawn = rng.choices(seed_means, k=n_seeds)
        draws.append(_statistics(drawn, relative))
    tail = (1 - confidence) / 2
    intervals = []
    for mean, values in zip(means, zip(*draws)):
        values = sorted(values)
        if any(math.isnan(v) for v in values):  # a resample whose baseline mean is 0: the ratio is undefined
            intervals.append(Interval(mean, math.nan, math.nan, n_seeds, n_tasks))
        else:
            intervals.append(Interval(mean, percentile(values, tail), percentile(values, 1 - tail), n_seeds, n_tasks))
    return tuple(intervals)


def seed_differences(arm: list[SeedOutcome], baseline: list[SeedOutcome], *, relative: bool = False) -> list[float]:
    """Arm − baseline per seed, from the same units the bootstrap resamples (``paired_units``: the means over the
    tasks both have, or the seeds' own values): what a paired test over seeds must test, so that the test and the
    interval are about one figure."""
    units, _ = paired_units(arm, baseline)
    out = []
    for unit in units:
        a, b = _seed_means(unit)
        out.append(((a - b) / b if b else math.nan) if relative else a - b)
    return out


def bootstrap_difference(arm: list[SeedOutcome], baseline: list[SeedOutcome], **kwargs) -> Interval:
    """Mean of arm − baseline over seeds paired by index, with its two-level interval (``bootstrap_contrast``)."""
    return bootstrap_contrast(arm, baseline, **kwargs)[0]


def bootstrap_mean(arm: list[SeedOutcome], **kwargs) -> Interval:
    """One arm's mean over seeds, with the same two-level interval (a baseline of zeros on the same task ids)."""
    zeros = [SeedOutcome(0.0, dict.fromkeys(a.tasks, 0.0) if a.tasks else None, a.draw) for a in arm]
    return bootstrap_difference(arm, zeros, relative=False, **kwargs)


def _continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method (Numerical Recipes,
    ``betacf``)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 301):
        m2 = 2 * m
        even = m * (b - m) * x / ((qam + m2) * (a + m2))
        odd = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        for numerator in (even, odd):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b): the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # where the fraction converges fast; else by symmetry
        return front * _continued_fraction(a, b, x) / a
    return 1.0 - front * _continued_fraction(b, a, 1.0 - x) / b


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)


def paired_t_test(differences: list[float]) -> tuple[float, int, float]:
    """(t, degrees of freedom, two-sided p) of the one-sample t-test that the mean seed-level difference is 0.
    NaN for fewer than two differences. Every difference the same: t is infinite and p is 0 if they are not 0,
    and p is 1 if they are all 0 (no spread to test against; the sign-flip test is the honest figure then)."""
    n = len(differences)
    if n < 2:
        return math.nan, max(n - 1, 0), math.nan
    mean = _mean(differences)
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    if sd <= 1e-12 * max(1.0, abs(mean)):
        return (0.0, n - 1, 1.0) if abs(mean) <= 1e-12 else (math.copysign(math.inf, mean), n - 1, 0.0)
    t = mean / (sd / math.sqrt(n))
    return t, n - 1, student_t_two_sided_p(t, n - 1)


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided exact sign-flip permutation test over seeds: the fraction of the 2^n sign patterns whose mean is
    at least as far from 0 as the observed one. NaN for no differences; refused above 16 seeds."""
    n = len(differences)
    if n == 0:
        return math.nan
    if n > MAX_SIGN_FLIP_SEEDS:
        raise ValueError(f"the exact sign-flip test enumerates 2^n patterns; {n} seeds is more than "
                         f"{MAX_SIGN_FLIP_SEEDS}: use the t-test")
    observed = abs(sum(differences)) - 1e-12  # a tolerance, so the observed pattern always counts itself
    hits = sum(abs(sum(s * d for s, d in zip(signs, differences))) >= observed
               for signs in itertools.product((1, -1), repeat=n))
    return hits / 2 ** n


def sign_flip_floor(n_seeds: int) -> float:
    """The smallest two-sided p the sign-flip test can give with ``n_seeds`` seeds: 2 / 2^n."""
    return 2 / 2 ** n_seeds


DIRECTIONS = ("up", "down", "within")


def effect(interval: Interval, direction: str, goal: float) -> str:
    """How far an interval supports a claim: ``"size"`` (the paper's direction, and the size goal), ``"direction"``,
    ``"none"``, or ``"no interval"``.

    - ``up`` / ``down``: direction when the interval excludes 0 on that side; size when, in addition, the mean is
      at least ``goal`` that way (``goal`` 0: direction is enough).
    - ``within`` (an effect that should be absent, e.g. OTC's success within 0.03): size when the whole interval
      lies within ±goal; direction when only the mean does.
    """
    if math.isnan(interval.mean):
        return "none"
    if direction == "within":
        if math.isnan(interval.low):
            return "no interval" if abs(interval.mean) <= goal else "none"
        if -goal <= interval.low and interval.high <= goal:
            return "size"
        return "direction" if abs(interval.mean) <= goal else "none"
    sign = {"up": 1.0, "down": -1.0}[direction]
    if math.isnan(interval.low):
        return "no interval"
    if sign * interval.low > 0 and sign * interval.high > 0:
        return "size" if sign * interval.mean >= goal else "direction"
    return "none"


def verdict(figure: Interval, share: Interval | None, *, direction: str, goal: float) -> tuple[str, str]:
    """(verdict, what it rests on) for a claim, from ctxrl's figure and RL's share (None: no SFT-only control).

    1. No pairs: ``not run``. One seed without per-task outcomes: ``no interval``.
    2. The figure's interval does not exclude 0 on the paper's side (``within``: its mean lies outside the goal):
       ``not reproduced`` (a control cannot rescue it).
    3. ``within`` claims (no effect expected) stand on the figure alone: ``reproduced`` when the interval is
       within the goal, else ``direction only``.
    4. No SFT-only control: ``no control`` - the effect is there, but nothing says RL rather than the warm start
       or more SFT made it.
    5. RL's share (after RL − the SFT-only control) against the paper's direction: ``not reproduced``.
    6. RL's share excludes 0 in the paper's direction and the figure meets the size goal: ``reproduced``;
       otherwise ``direction only``.
    Fewer than ``RESULT_SEEDS`` seeds marks the verdict a pilot."""
    if figure.n_seeds == 0:
        return "not run", "no paired records"
    seen = effect(figure, direction, goal)
    met = {"size": "direction and size met", "direction": "direction met, size not"}
    pilot = f"; pilot: {figure.n_seeds} seed{'s' * (figure.n_seeds > 1)}" if figure.n_seeds < RESULT_SEEDS else ""
    if seen == "no interval":
        return "no interval", f"one seed, no per-task outcomes{pilot}"
    if seen == "none":
        missed = "the mean lies outside the goal" if direction == "within" else \
            "the interval does not exclude 0 on the paper's side"
        return "not reproduced", missed + pilot
    if direction == "within":
        within = {"size": "the interval lies within the goal", "direction": "the mean lies within the goal, the "
                  "interval does not"}
        return ("reproduced" if seen == "size" else "direction only"), within[seen] + pilot
    if share is None:
        return "no control", f"{met[seen]}; RL's share not measured{pilot}"
    sign = {"up": 1.0, "down": -1.0}[direction]
    if math.isnan(share.mean) or sign * share.mean <= 0:
        return "not reproduced", f"{met[seen]}, but RL's share is not in the paper's direction{pilot}"
    if effect(share, direction, 0.0) == "size" and seen == "size":
        return "reproduced", f"{met[seen]}; RL's share excludes 0{pilot}"
    share_note = "RL's share excludes 0" if effect(share, direction, 0.0) == "size" else "RL's share includes 0"
    return "direction only", f"{met[seen]}; {share_note}{pilot}"
