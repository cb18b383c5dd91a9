"""Statistics of trials: success by attempt, pass@k of independent samples, exploration.

The question these answer is whether a policy *learns across attempts*: does attempt 2 of a
trial, with attempt 1's feedback and reflection in its context, do better than a fresh
independent sample would? Definitions, for trials of one budget ``K`` (attempts 0-based here,
reported 1-based as ``@1..@K``):

- ``success_at_attempt[k]``: of the trials that *played* attempt ``k``, the fraction whose
  attempt ``k`` succeeded. Attempts absent after an early stop are left out (not counted as
  successes, not as failures), so under stop-on-success ``k >= 1`` reads "how often a retry
  recovers a failed trial". NaN where no trial played attempt ``k``.
- ``success_by_attempt[k]``: of all trials, the fraction with a success among attempts
  ``0..k``. An absent attempt counts as a success because the trial already succeeded; the
  curve never decreases and its last point is the trial success rate.
- ``independent_pass_at_k(trials, k)``: the unbiased pass@k (Chen et al. 2021) of the *first*
  attempts, which are independent samples of the zero-context policy (same prompt, no
  reflection), computed per task over its trials and averaged over tasks. Set against
  ``success_by_attempt[k-1]``: ``k`` sequential attempts with feedback vs ``k`` independent ones;
  the difference is what the trial context buys. With the same number of trials per task both
  weigh tasks equally.
- ``independent_success_at_attempt(trials, k)``: the baseline for ``success_at_attempt[k-1]``. Of
  the tasks' first attempts (independent samples), drawn in a random order without replacement:
  the chance that sample ``k`` succeeds given that samples ``1..k-1`` failed, pooled over tasks
  (``sum_t P_t(k-1 fail, then success) / sum_t P_t(k-1 fail)``). ``success_at_attempt`` is
  conditional on the earlier failures too, so it falls with ``k`` even for a policy that gains
  nothing and loses nothing from its notes (the tasks left are the hard ones); this says how far.
- Exploration (``exploration_stats``): per trial, ``distinct_actions`` = distinct actions over all
  attempts; ``repeated_failed_actions`` = over attempts ``k >= 1``, the distinct actions of
  attempt ``k`` that failed in an earlier attempt ``j < k`` of the same trial
  (``Attempt.failed``); its rate divides by the distinct actions of attempts ``k >= 1``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from ctxrl.meta.trial import Trial


def _budget(trials: Sequence[Trial]) -> int:
    """Check the trials and return their common budget K."""
    if not trials:
        raise ValueError("no trials: statistics need at least one trial")
    for trial in trials:
        trial.check()
    budgets = sorted({t.num_attempts for t in trials})
    if len(budgets) > 1:
        raise ValueError(f"trials have different budgets num_attempts={budgets}; compute statistics per budget")
    return budgets[0]


def success_at_attempt(trials: Sequence[Trial]) -> list[float]:
    """``[K]``: success rate of attempt ``k`` among the trials that played it (NaN if none did)."""
    k_budget = _budget(trials)
    out = []
    for k in range(k_budget):
        played = [t.attempts[k].success for t in trials if len(t.attempts) > k]
        out.append(sum(played) / len(played) if played else math.nan)
    return out


def success_by_attempt(trials: Sequence[Trial]) -> list[float]:
    """``[K]``: fraction of trials solved within attempts ``0..k`` (absent attempts count as solved)."""
    k_budget = _budget(trials)
    first = [t.solved_at for t in trials]
    return [sum(s is not None and s <= k for s in first) / len(trials) for k in range(k_budget)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``.

    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code".) Exact integer
    binomials; 1.0 when ``n - c < k`` (every k-subset holds a correct sample).
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k} with n={n} samples; sample at least k per task")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def independent_pass_at_k(trials: Sequence[Trial], k: int) -> float:
    """pass@k of the trials' first attempts, per task (``Trial.task_id``), averaged over tasks."""
    _budget(trials)
    by_task: dict[str, list[bool]] = defaultdict(list)
    for trial in trials:
        by_task[trial.task_id].append(trial.attempts[0].success)
    for task_id, firsts in by_task.items():
        if len(firsts) < k:
            raise ValueError(f"task {task_id!r} has {len(firsts)} trials, fewer than k={k}: pass@{k} needs at least "
                             f"{k} independent first attempts per task; raise the group size or lower k")
    return sum(pass_at_k(len(f), sum(f), k) for f in by_task.values()) / len(by_task)


def independent_success_at_attempt(trials: Sequence[Trial], k: int) -> float:
    """Success of independent sample ``k`` given ``k-1`` failed ones, from the first attempts (NaN if none fail)."""
    _budget(trials)
    by_task: dict[str, list[bool]] = defaultdict(list)
    for trial in trials:
        by_task[trial.task_id].append(trial.attempts[0].success)
    reach = solved = 0.0
    for task_id, firsts in by_task.items():
        n, c = len(firsts), sum(firsts)
        if n < k:
            raise ValueError(f"task {task_id!r} has {n} trials, fewer than k={k}: the independent baseline of attempt "
                             f"{k} needs at least {k} first attempts per task; raise the group size or lower k")
        all_failed = math.comb(n - c, k - 1) / math.comb(n, k - 1)  # the first k-1 draws all failed
        reach += all_failed
        solved += all_failed * c / (n - k + 1)
    return solved / reach if reach else math.nan


def trial_exploration(trial: Trial) -> dict[str, int]:
    """Exploration counts of one trial (definitions in the module docstring)."""
    distinct: set[str] = set()
    failed_before: set[str] = set()
    total = repeated = later = 0
    for k, attempt in enumerate(trial.attempts):
        actions = set(attempt.actions)
        total += len(attempt.actions)
        distinct |= actions
        if k >= 1:
            later += len(actions)
            repeated += len(actions & failed_before)
        failed_before |= attempt.failed()
    return {"actions": total, "distinct_actions": len(distinct), "repeated_failed_actions": repeated,
            "later_attempt_actions": later}


def exploration_stats(trials: Sequence[Trial]) -> dict[str, float]:
    """Means over trials of ``trial_exploration``, and the pooled repeated-failed rate."""
    _budget(trials)
    per_trial = [trial_exploration(t) for t in trials]
    n = len(per_trial)
    later = sum(p["later_attempt_actions"] for p in per_trial)
    repeated = sum(p["repeated_failed_actions"] for p in per_trial)
    return {
        "actions": sum(p["actions"] for p in per_trial) / n,
        "distinct_actions": sum(p["distinct_actions"] for p in per_trial) / n,
        "repeated_failed_actions": repeated / n,
        "repeated_failed_rate": repeated / later if later else 0.0,
    }


def meta_metrics(trials: Sequence[Trial]) -> dict[str, float]:
    """One flat dict for the metrics log: ``success_at_{k}``, ``success_by_{k}``, ``pass_at_{k}`` and
    ``independent_success_at_{k}`` (1-based; the last two only where every task has at least k trials),
    ``attempts`` and exploration."""
    k_budget = _budget(trials)
    out: dict[str, float] = {}
    for k, value in enumerate(success_at_attempt(trials), start=1):
        out[f"success_at_{k}"] = value
    for k, value in enumerate(success_by_attempt(trials), start=1):
        out[f"success_by_{k}"] = value
    trials_per_task = min(Counter(t.task_id for t in trials).values())
    for k in range(1, min(k_budget, trials_per_task) + 1):
        out[f"pass_at_{k}"] = independent_pass_at_k(trials, k)
        out[f"independent_success_at_{k}"] = independent_success_at_attempt(trials, k)
    out["attempts"] = sum(len(t.attempts) for t in trials) / len(trials)
    out.update({f"exploration/{name}": value for name, value in exploration_stats(trials).items()})
    return out
