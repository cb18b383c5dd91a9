"""Which episodes enter the policy update: DAPO dynamic sampling and SimpleTIR void-turn filtering.

Both return keep-masks (plain lists of bools) so the training loop can log what it dropped.

- ``informative_groups``: DAPO (Yu et al. 2025) drops groups whose rewards all agree: their
  group-relative advantages are 0, so they only dilute the batch. The loop keeps sampling more
  tasks until the batch has enough informative groups, up to a cap.
- ``void_turn_free``: SimpleTIR (Xue et al. 2025) leaves out any trajectory with a *void turn*, a
  turn that yields neither a tool call nor a final answer. Such turns mark a drifting policy, and
  their low-probability tokens cause the gradient-norm spikes SimpleTIR reports.
"""

from __future__ import annotations

from ctxrl.types import Episode


def informative_groups(rewards: list[float], groups: list[int], *, tol: float = 1e-8) -> list[bool]:
    """Per episode: does its group's reward vary (max - min > tol)? Groups of one never do."""
    spread: dict[int, tuple[float, float]] = {}
    for r, g in zip(rewards, groups):
        lo, hi = spread.get(g, (r, r))
        spread[g] = (min(lo, r), max(hi, r))
    return [spread[g][1] - spread[g][0] > tol for g in groups]


def void_turns(episode: Episode) -> list[int]:
    """Indices of the episode's void turns.

    A turn is void when it made no well-formed tool call (a malformed one does not count; one
    that parsed but failed when run does, as SimpleTIR counts a complete code block) and gave no
    final answer. Whether a turn answered is the environment's word (``Turn.answered``, from its
    ``info["answered"]``); for an environment that does not say, the last turn of an episode the
    environment ended (no truncation) counts as the answer. A cut-off turn with no call is void.
    """
    last = len(episode.turns) - 1
    void = []
    for k, turn in enumerate(episode.turns):
        answered = turn.answered if turn.answered is not None else (k == last and episode.truncation is None)
        if turn.tool_calls - turn.malformed_calls <= 0 and not answered:
            void.append(turn.index)
    return void


def void_turn_free(episodes: list[Episode]) -> list[bool]:
    """Per episode: True if it has no void turn (keep it), False to leave it out of the update."""
    return [not void_turns(e) for e in episodes]


def drop_small_groups(episodes: list[Episode]) -> tuple[list[Episode], int]:
    """The episodes of groups with at least 2 of them (group statistics need two), and how many episodes went.

    Used after errored episodes are removed: a group left with one valid episode has no baseline. A group is a
    task group's episodes of one role (``Episode.baseline_group``): the seats of a match are compared by role.
    """
    counts: dict[tuple[int, str], int] = {}
    for e in episodes:
        counts[e.baseline_group] = counts.get(e.baseline_group, 0) + 1
    kept = [e for e in episodes if counts[e.baseline_group] >= 2]
    return kept, len(episodes) - len(kept)
