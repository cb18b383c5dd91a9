"""The advantage-estimator protocol and its registry: episodes in, training rows with per-token advantages out.

An estimator is a registered class. It declares what it needs, and the trainer and the
configuration read those declarations instead of testing names:

- ``needs_groups``: group statistics over the episodes of one task (GRPO, RLOO, ...). The trainer
  leaves out groups with fewer than two valid episodes, and ``rollout.group_size`` must be >= 2;
- ``needs_critic``: values of a learned critic; the trainer builds one and passes ``values``;
- ``one_per_episode``: one advantage per episode, broadcast to every sampled token of every
  segment. Only such estimators combine with context managers that cut episodes into segments;
- ``credits_attempts``: credit across the attempts of a trial (meta-RL, ``meta.num_attempts > 1``);
- ``accepts_token_rewards``: it adds per-token rewards (a KL penalty placed in the reward,
  ``algo.kl_placement = "reward"``) to its returns; one that does not may not be given any;
- ``needs_teacher``: a teacher's log-probs of the sampled tokens (on-policy distillation); the trainer loads the
  teacher its settings name and passes ``teacher_logprobs``;
- ``handles_segments``: it computes every segment's rows itself (per-token advantages that need no return across
  segments), so it combines with context managers that cut episodes into segments, as ``one_per_episode`` does.

``check_config(options, config)`` is where an estimator refuses what its own settings cannot run with (a
``ConfigError`` naming the key); the configuration calls it once it has read the estimator's table.

``estimate(episodes, ...)`` returns, per episode, the ``TrainSequence`` rows it trains as (one
per unsegmented episode; one per segment or attempt otherwise), each with its advantage on every
token (0 where the loss mask is 0). The maths lives in pure functions of ``ctxrl.algo``
(``grpo_advantages``, ``gae_advantages``, ...); an estimator only arranges episodes into their
tensors and back. Adding one is one file: a subclass with a ``name`` and ``estimate``, decorated
with ``@register_estimator`` or named by a ``ctxrl.estimators`` entry point (docs/algorithms.md
shows a complete example); a built-in one is also named in the package's ``__init__``. An estimator gets the
``[algo]`` section as ``self.settings`` (``gamma`` is shared); settings of its own are a dataclass in its
``Settings``: the configuration reads them from the table ``[algo.NAME]`` (``[algo.gae]``, ``[algo.meta]``) and the
estimator finds them in ``self.options``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

from ctxrl.registry import Registry
from ctxrl.sections import AlgoConfig
from ctxrl.types import Episode, Segment, TrainSequence

ESTIMATORS: Registry[type[Estimator]] = Registry("advantage estimator", entry_point_group="ctxrl.estimators")
"""The estimators by name; the built-ins, which import this module, are named by ``ctxrl.algo.estimators``."""

E = TypeVar("E", bound="type[Estimator]")
DEFAULT_ALGO = AlgoConfig()
"""The ``[algo]`` section at its defaults: an estimator built without a config."""
SegmentBonus = Callable[[Segment], float]


class Estimator:
    """Base of the registered estimators (see the module docstring)."""

    name: ClassVar[str] = ""
    needs_groups: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False
    one_per_episode: ClassVar[bool] = False
    credits_attempts: ClassVar[bool] = False
    accepts_token_rewards: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = False
    handles_segments: ClassVar[bool] = False
    Settings: ClassVar[type | None] = None
    """The estimator's own settings, a dataclass read from its table ``[algo.NAME]`` (``ctxrl.settings``)."""

    def __init__(self, settings: AlgoConfig = DEFAULT_ALGO, options=None, *, num_attempts: int | None = None) -> None:
        self.settings = settings
        """The ``[algo]`` section: what estimators share (``gamma``)."""
        self.options = options if options is not None or self.Settings is None else self.Settings()
        """An instance of ``Settings`` (its defaults unless given), or None for an estimator that declares none."""
        self.num_attempts = num_attempts
        """The trial budget K (``meta.num_attempts``) for an estimator that ``credits_attempts``; None: the longest
        trial of the batch."""

    @classmethod
    def check_config(cls, options, config) -> None:
        """Raise ``ConfigError`` where ``options`` (its ``Settings``, or None) cannot run with ``config``; nothing to
        check unless an estimator says so."""

    def estimate(self, episodes: list[Episode], *, token_rewards: list[list[float]] | None = None,
                 values: list[list[float]] | None = None,
                 segment_bonus: SegmentBonus | None = None) -> list[list[TrainSequence]]:
        """Per episode, its training rows.

        ``token_rewards``: optional per-token rewards (one list per episode aligned with its
        ``input_ids``, on sampled tokens), e.g. a KL penalty placed in the reward. ``values``: the
        critic's per-token values (``needs_critic``). ``segment_bonus(segment)``: an extra advantage
        for a segment's sampled tokens (the context manager's process reward). An estimator that
        ``needs_teacher`` is also given ``teacher_logprobs``: per episode, one list per sequence of
        ``trained_sequences(episode)``, aligned with its ``input_ids`` (0 where the mask is 0).
        """
        raise NotImplementedError(f"{type(self).__name__} must define estimate()")

    def state_dict(self) -> dict:
        """What the estimator carries from step to step (``rae``'s baselines), as JSON values: saved in checkpoints
        and restored on resume (``load_state_dict``). Most estimators carry nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        if state:
            raise ValueError(f"the {self.name} estimator carries no state, but the checkpoint holds {sorted(state)}")


def trained_sequences(episode: Episode) -> list[Segment]:
    """The sequences of ``episode`` that become training rows: the episode itself when it is one sequence, else
    each segment (and the live sequence) that sampled something."""
    if not episode.segments:
        return episode.sequences()
    return [seq for seq in episode.sequences() if any(seq.loss_mask)]


def broadcast(episode: Episode, advantage: float, segment_bonus: SegmentBonus | None = None) -> list[TrainSequence]:
    """One row per sequence of ``episode``, every sampled token carrying ``advantage`` (+ its segment's bonus).

    An unsegmented episode is one row. A segmented one (a context manager rewrote its context)
    gives one row per segment that sampled something; with ``token-mean`` aggregation a token
    then weighs the same whether or not its episode was cut (SUPO / ReSum broadcast).
    """
    if not episode.segments:
        return [TrainSequence.of(episode, [advantage * m for m in episode.loss_mask],
                                 group_id=episode.group_id, policy_version=episode.policy_version)]
    rows = []
    for seq in trained_sequences(episode):  # (a segment that sampled nothing has nothing to train)
        value = advantage + (segment_bonus(seq) if segment_bonus is not None else 0.0)
        rows.append(TrainSequence.of(seq, [value * m for m in seq.loss_mask], group_id=episode.group_id,
                                     policy_version=episode.policy_version))
    return rows


def one_row_each(episodes: list[Episode], advantages: list[list[float]]) -> list[list[TrainSequence]]:
    """Each unsegmented episode as its one row, with its per-token ``advantages``."""
    return [[TrainSequence.of(e, a, group_id=e.group_id, policy_version=e.policy_version)]
            for e, a in zip(episodes, advantages, strict=True)]


def unsegmented(name: str, episodes: list[Episode]) -> None:
    """Raise unless every episode is one sequence (for estimators whose advantages are per token)."""
    cut = [e.task.id for e in episodes if e.segments]
    if cut:
        raise ValueError(f"the {name} estimator computes per-token advantages over one sequence per episode, but "
                         f"{len(cut)} episodes have segments (e.g. task {cut[0]}: a context manager rewrote its "
                         "context, or its chat template rewrote history at a user message); use an estimator "
                         "with one_per_episode (grpo, dr_grpo, rloo)")


def register_estimator(cls: E) -> E:
    """Class decorator: make ``algo.advantage = cls.name`` choose ``cls``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a class attribute name to register as an estimator")
    return ESTIMATORS.register(cls.name, cls)


def estimator_names() -> list[str]:
    """Every registered estimator, built-ins first."""
    return ESTIMATORS.names()


def get_estimator(name: str) -> type[Estimator]:
    """The estimator class registered as ``name``; an unknown name is an error listing the known ones."""
    return ESTIMATORS.get(name)


def token_advantages(name: str, episodes: list[Episode], settings: AlgoConfig = DEFAULT_ALGO, *,
                     token_rewards: list[list[float]] | None = None) -> list[list[float]]:
    """Per-token advantages of unsegmented episodes (one list per episode, aligned with ``input_ids``)."""
    rows = get_estimator(name)(settings).estimate(episodes, token_rewards=token_rewards)
    return [r[0].advantages for r in rows]
