"""What a run's parts are built from: the values the learner is told beside its config sections.

Today the ``Trainer`` (``ctxrl.train.trainer``) assembles the run and calls these; ``build(config) -> Run`` lands here
later (issue 50's C23). A value derived from several sections is computed once, here, not inside the part that reads
it: the learner takes ``[algo]`` and ``[train]`` as they are and these few numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctxrl.config import Config
    from ctxrl.learner.learner import LearnerSettings


def learner_settings(config: Config, micro_batch_tokens: int | None = None) -> LearnerSettings:
    """The learner's settings for ``config``: its ``[algo]`` and ``[train]`` sections, the sampler's temperature (1 for
    greedy), Dr.GRPO's constant length (the most sampled tokens an episode can have), the distillation top-K weight,
    the critic's value clip (``[algo.gae]``: a critic's settings are GAE's) and the token budget of a micro-batch
    (``micro_batch_tokens``: the memory plan's or the CPU bound's; None takes the user's
    ``train.max_tokens_per_microbatch``), and the policy loss's and the off-policy correction's own settings
    (``[algo.NAME]``). A KL placed in the
    reward is not the loss's (``LearnerSettings.kl_coef``)."""
    from ctxrl.learner.learner import LearnerSettings

    r = config.rollout
    return LearnerSettings(config.algo, config.train, temperature=r.temperature if r.temperature > 0 else 1.0,
                           norm_length=min(config.env.max_turns * r.max_new_tokens, r.max_total_tokens),
                           micro_batch_tokens=(config.train.max_tokens_per_microbatch if micro_batch_tokens is None
                                               else micro_batch_tokens),
                           distill_top_k_coef=distill_top_k_coef(config),
                           vf_clip=config.settings_of("algo", "gae").vf_clip,
                           loss_options=config.settings_of("algo", config.algo.loss),
                           offpolicy_options=(config.settings_of("algo", config.algo.offpolicy)
                                              if config.algo.offpolicy else None))


def distill_top_k_coef(config: Config) -> float:
    """``algo.distill.top_k_coef`` when the run distils with a top-K term (``algo.distill.top_k > 0``), else 0."""
    if config.algo.advantage != "distill":
        return 0.0
    options = config.settings_of("algo", "distill")
    return float(options.top_k_coef) if options.top_k else 0.0
