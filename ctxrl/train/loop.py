"""The RL run: warm start, then GRPO steps of rollout -> advantages -> PPO updates, with evals.

One RL step:
  1. sample ``tasks_per_step`` fresh training tasks and play ``group_size`` episodes of each with
     the current policy (all concurrently, batched by the engine);
  2. group-relative advantages from the episodes' final rewards (``grpo`` or ``dr_grpo``);
     errored episodes are left out of the loss and of the group statistics;
  3. ``ppo_epochs`` x ``mini_batches`` PPO-clip updates with exact token normalisation;
  4. the engine shares the learner's module, so the new weights serve the next rollout at once;
     only its ``version`` is bumped.

What the default "GRPO" is: group-normalised outcome advantages (Bessel std), a PPO-clip
surrogate with the behaviour log-probs as the old policy, token-mean aggregation, optional
k1/k2/k3 KL to the warm-start policy (off by default), no value function. Other estimators,
losses, filters and shaping are chosen by name (``[algo]``, ``[reward]``; docs/algorithms.md).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxrl.algo.estimators import episode_advantages, gae_episode_advantages
from ctxrl.algo.filters import informative_groups, void_turn_free
from ctxrl.chat.render import ChatRenderer
from ctxrl.config import Config, ConfigError, to_toml
from ctxrl.contexts.curriculum import make_curriculum
from ctxrl.engine.hf import HFEngine
from ctxrl.envs.registry import configured_env_class
from ctxrl.eval.evaluate import evaluate_split, evaluate_trials, summarize
from ctxrl.meta.anneal import DemoSchedule, sample_demos
from ctxrl.meta.stats import meta_metrics
from ctxrl.models.loader import load_model, load_tokenizer
from ctxrl.report.writer import LogRewindError, RunWriter
from ctxrl.rollout.agent import RolloutLimits, run_episodes
from ctxrl.rollout.context import ContextPolicy, scheduled_budget
from ctxrl.rollout.demos import Demo, demos_excluding, load_demos, solved_demos
from ctxrl.rollout.meta import MetaPolicy, run_trials, to_trial
from ctxrl.train.checkpoint import (STEP_PREFIX, CheckpointError, clean_partial, commit_checkpoint, latest_checkpoint,
                                   load_state, rng_state,
                                   save_state, set_rng_state, step_name)
from ctxrl.train.critic import Critic, episode_values
from ctxrl.train.learner import Learner, PPOSettings
from ctxrl.train.rewards import shape_rewards
from ctxrl.train.segments import context_stats, episode_outcome_advantages, expand_segments
from ctxrl.train.sft import DEMO_MAX_TURNS, build_demos, sft_train
from ctxrl.train.trial_demos import build_trial_demos, has_trial_hooks
from ctxrl.train.trials import attempt_advantages, expand_trials


class TrainingAborted(RuntimeError):
    """The run stopped itself (too many skipped updates, too many errored episodes); the message says why."""


# Config keys that may differ between a checkpoint and the run resuming it: they change how long
# the run goes on, what it logs or evaluates, or the warm start (already done), never a step.
RESUMABLE_CHANGES = ("train.steps", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
                     "train.max_consecutive_skips", "run.progress", "run.samples_per_step", "run.name", "context.eval_max_summaries",
                     "rollout.episode_timeout_s", "rollout.max_error_rate", "sft.", "eval.", "meta.eval_attempts",
                     "meta.eval_trials")


def config_differences(saved: Config, current: Config) -> list[str]:
    """``key: saved -> current`` for every setting that differs and matters to a resumed step."""
    out = []
    a, b = saved.to_dict(), current.to_dict()
    for section, fields in a.items():
        for key, value in fields.items():
            name = f"{section}.{key}"
            if any(name == r or (r.endswith(".") and name.startswith(r)) for r in RESUMABLE_CHANGES):
                continue
            if b[section][key] != value:
                out.append(f"{name}: {value!r} -> {b[section][key]!r}")
    return out


def load_weights(model, file: Path) -> None:
    """Load a safetensors state dict into ``model``; tied weights (absent from the file) must share storage."""
    from safetensors.torch import load_file

    state = load_file(str(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise CheckpointError(f"{file} does not fit the model: unexpected {unexpected[:5]}, missing {untied[:5]}; "
                              "was model.name changed since the checkpoint was written?")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={name!r} but CUDA is not available; use model.device=cpu")
    return name


class Run:
    """Everything a run holds: model, tokenizer, renderer, engine, env class, writer."""

    def __init__(self, config: Config, run_dir: str | Path) -> None:
        self.config = config
        seed_everything(config.run.seed)
        self.device = pick_device(config.model.device)
        self.env_cls = configured_env_class(config.env.name, data=config.env.data, tools=config.env.tools,
                                            verifier=config.env.verifier)
        self.context_demos = self._context_demos()
        if config.sft.enabled and config.sft.trial_demos > 0 and not has_trial_hooks(self.env_cls):
            raise ConfigError(f"sft.trial_demos={config.sft.trial_demos:g}, but environment {config.env.name!r} has "
                              "no failure(task) and reflection(task, messages) hooks to script a trial; add them "
                              "(docs/meta.md) or set sft.trial_demos = 0")
        self.tokenizer = load_tokenizer(config.model.name, chat_template=config.model.chat_template or None)
        self.renderer = ChatRenderer(self.tokenizer, template_name=config.model.name)
        self.renderer.verify_prefix_preserving()
        m = config.meta
        self.demo_schedule = DemoSchedule(max_demos=m.demos_max, steps=m.demos_steps, kind=m.demos_kind,
                                          mode=m.demos_mode)
        self.demo_pool = self._demo_pool()  # before the model loads: a missing demo file stops the run at once
        self.model = load_model(config.model.name, dtype=config.model.dtype, device=self.device)
        self.engine = HFEngine(self.model, pad_token_id=self.tokenizer.pad_token_id,
                               max_batch_size=config.rollout.max_batch_size, seed=config.run.seed)
        self.writer = RunWriter(run_dir)
        self.writer.write_config(to_toml(config))
        r = config.rollout
        self.train_limits = RolloutLimits(max_turns=config.env.max_turns, max_new_tokens=r.max_new_tokens,
                                          max_total_tokens=r.max_total_tokens, temperature=r.temperature,
                                          top_p=r.top_p, top_k=r.top_k, timeout_s=r.episode_timeout_s,
                                          context=self.context_policy(config.context.max_summaries))
        cc = config.curriculum
        self.curriculum = make_curriculum(cc.kind, horizon_start_turns=cc.horizon_start_turns,
                                          horizon_warmup_steps=cc.horizon_warmup_steps,
                                          horizon_stages=cc.horizon_stages, self_paced_pool=cc.self_paced_pool,
                                          self_paced_floor=cc.self_paced_floor)
        self.consecutive_skips = 0
        self.ref_model = None
        self.eval_limits = RolloutLimits(max_turns=config.env.max_turns, max_new_tokens=r.max_new_tokens,
                                         max_total_tokens=r.max_total_tokens, temperature=config.eval.temperature,
                                         timeout_s=r.episode_timeout_s,
                                         context=self.context_policy(config.context.eval_max_summaries))
        m = config.meta
        self.train_meta = MetaPolicy(num_attempts=m.num_attempts, context=m.context, reflect=m.reflect,
                                     stop_on_success=m.stop_on_success, instruction=m.reflection_instruction,
                                     reflection_max_tokens=m.reflection_max_tokens,
                                     max_context_tokens=m.max_context_tokens)
        self.eval_meta = dataclasses.replace(self.train_meta, num_attempts=m.eval_attempts or m.num_attempts)

    def context_policy(self, max_summaries: int) -> ContextPolicy:
        c = self.config.context
        return ContextPolicy(manager=c.manager, max_context_tokens=c.max_context_tokens, max_summaries=max_summaries,
                             summary_max_tokens=c.summary_max_tokens, instruction=c.summary_instruction,
                             max_branches=c.max_branches)

    def _context_demos(self) -> bool:
        """Whether the warm start plays its demos under the summarize policy (``sft.context_demos``).

        ``on`` with an environment that cannot script summaries is a config error, raised here so
        the run stops before the model loads; ``auto`` then plays full-context demos, and the warm
        start says so once.
        """
        c = self.config
        if c.sft.context_demos == "off" or c.context.manager != "summarize":
            return False
        if getattr(self.env_cls, "summary", None) is not None:
            return True
        if c.sft.context_demos == "on":
            raise ConfigError(f"sft.context_demos=on, but environment {c.env.name!r} has no summary(task, messages) "
                              "hook to script its demos' summaries; add one (docs/environments.md) or set "
                              "sft.context_demos=auto or off")
        return False

    def _demo_pool(self) -> list[Demo]:
        """The annealed demonstrations' pool (``meta.demos_source``); empty when ``meta.demos_max`` is 0."""
        m = self.config.meta
        if m.demos_max == 0:
            return []
        if m.demos_source != "solve":
            try:
                pool = load_demos(m.demos_source)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"meta.demos_source: {exc}") from None
        else:
            pool = solved_demos(self.env_cls, self.renderer, m.demos_pool, seed=self.config.run.seed + 991)
        if len(pool) <= m.demos_max:
            raise ConfigError(f"meta.demos_max={m.demos_max} demonstrations per prompt, but the pool holds only "
                              f"{len(pool)} (a task's own demo is left out); add demonstrations or lower demos_max")
        return pool

    def demo_chooser(self, tasks: list, step: int, *, evaluation: bool, first_index: int = 0):
        """``(i, k) -> demos`` for episode ``k`` of ``tasks[i]`` at RL ``step``, or None when there are none to give.

        Evaluation is always zero-shot: ``sample_demos(evaluation=True)`` gives none, and
        ``Run.evaluate`` never asks (and checks that no episode saw any). A task never sees its own demo.
        """
        if not self.demo_pool or evaluation:
            return None
        group_size = self.config.rollout.group_size

        def choose(i: int, k: int) -> list[Demo]:
            pool = demos_excluding(self.demo_pool, tasks[i])
            picked = sample_demos(self.demo_schedule, step=step, pool_size=len(pool), seed=self.config.run.seed,
                                  episode_index=first_index + i * group_size + k, evaluation=evaluation)
            return [pool[j] for j in picked]

        return choose

    def demo_limits(self) -> RolloutLimits | None:
        """The limits warm-start demos are played under: the run's summarize policy at its final budget, or None.

        None: the demos' generous full-context defaults. Under summarize, the run's turn and total
        limits too, since where a summary is asked for depends on them; the budget is
        ``context.max_context_tokens`` (a budget curriculum's last and smallest, the one evaluation uses).
        """
        if not self.context_demos:
            return None
        r = self.config.rollout
        return RolloutLimits(max_turns=DEMO_MAX_TURNS, max_new_tokens=r.max_new_tokens,
                             max_total_tokens=r.max_total_tokens,
                             context=self.context_policy(self.config.context.max_summaries))

    def context_budget(self, step: int) -> int:
        """The working-context budget of RL step ``step`` (the budget curriculum, if any)."""
        c = self.config.context
        return scheduled_budget(step, final=c.max_context_tokens, start=c.budget_start_tokens, steps=c.budget_steps)

    def decode(self, ids: list[int]) -> str:
        return self.renderer.decode(ids)

    # -- phases ----------------------------------------------------------------------------------
    def warm_start(self, on_step=None) -> dict[str, Any]:
        c = self.config.sft
        t0 = time.perf_counter()
        if self.config.context.manager == "summarize" and not self.context_demos and c.context_demos == "auto":
            warnings.warn(f"environment {self.config.env.name!r} has no summary(task, messages) hook: its warm-start "
                          "demos use the full context and show no summaries (sft.context_demos=auto)", stacklevel=2)
        n_trials = round(c.demos * c.trial_demos)
        demos = asyncio.run(build_demos(self.env_cls, self.renderer, c.demos - n_trials,
                                        shortcut_fraction=c.shortcut_fraction, seed=self.config.run.seed + 77,
                                        other_worlds=c.other_worlds, limits=self.demo_limits()))
        if n_trials:
            # the notes say "attempt 2 of K" for the largest K the run plays (eval_meta differs only in num_attempts)
            k = max(2, self.train_meta.num_attempts, self.eval_meta.num_attempts)
            policy = dataclasses.replace(self.train_meta, num_attempts=k)
            demos += asyncio.run(build_trial_demos(self.env_cls, self.renderer, n_trials, policy,
                                                   seed=self.config.run.seed + 78))
        losses = sft_train(self.model, demos, pad_token_id=self.tokenizer.pad_token_id, epochs=c.epochs,
                           batch_size=c.batch_size, lr=c.lr, seed=self.config.run.seed, on_step=on_step)
        row = {"phase": "sft", "step": 0, "demos": len(demos), "sft_steps": len(losses),
               "sft_loss_first": losses[0], "sft_loss_last": losses[-1], "seconds": time.perf_counter() - t0,
               "context_demos": self.context_demos, "trial_demos": n_trials,
               "demo_summaries_per_episode": sum(e.info.get("summaries", 0) for e in demos) / len(demos)}
        self.writer.log_metrics(row)
        self.writer.log_samples(0, demos[:2], self.decode, phase="sft")
        return row

    def evaluate(self, step: int, splits=("train", "heldout", "ood")) -> dict[str, dict[str, float]]:
        """Greedy success (and tool use) on ``eval.tasks`` tasks of each split; logged per split.

        With ``meta.eval_attempts`` (or ``num_attempts``) above 1 each task is played as trials; the
        usual keys are then attempt 1's and ``meta_metrics`` adds success at / by each attempt.
        """
        results = {}
        for split in splits:
            t0 = time.perf_counter()
            if self.eval_meta.num_attempts > 1:  # trials: success is attempt 1's, plus success at / by attempt k
                summary, episodes = asyncio.run(evaluate_trials(
                    self.env_cls, split, self.config.eval.tasks, self.engine, self.renderer, self.eval_limits,
                    self.eval_meta, trials_per_task=self.config.meta.eval_trials, seed=self.config.eval.seed))
            else:
                summary, episodes = asyncio.run(evaluate_split(
                    self.env_cls, split, self.config.eval.tasks, self.engine, self.renderer, self.eval_limits,
                    seed=self.config.eval.seed))
            if any(e.info.get("demos") for e in episodes):
                raise RuntimeError("an evaluation episode was shown demonstrations; evaluation must be zero-shot")
            summary["seconds"] = time.perf_counter() - t0
            if self.config.context.manager != "full":
                summary.update(context_stats(episodes))
            self.writer.log_metrics({"phase": "eval", "step": step, "split": split, **summary})
            self.writer.log_samples(step, episodes[:2], self.decode, phase=f"eval-{split}")
            results[split] = summary
        return results

    def make_learner(self) -> Learner:
        a, t, r = self.config.algo, self.config.train, self.config.rollout
        ref = None
        if a.kl_coef > 0:
            ref = copy.deepcopy(self.model).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
        self.ref_model = ref
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                      betas=(0.9, 0.99))
        critic = critic_optimizer = None
        if a.advantage == "gae":  # the critic starts as a copy of the warm-started policy
            critic = Critic(copy.deepcopy(self.model)).train()
            critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=t.critic_lr, weight_decay=t.weight_decay,
                                                 betas=(0.9, 0.99))
        settings = PPOSettings(clip_low=a.clip_low, clip_high=a.clip_high,
                               kl_coef=a.kl_coef if a.kl_placement == "loss" else 0.0, kl_kind=a.kl_kind,
                               entropy_coef=a.entropy_coef, agg=a.agg,
                               temperature=r.temperature if r.temperature > 0 else 1.0,
                               max_grad_norm=t.max_grad_norm, ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                               micro_batch_size=t.micro_batch_size, loss=a.loss, dual_clip=a.dual_clip or None,
                               old_logprobs=a.old_logprobs, tis_cap=a.tis_cap, vf_clip=a.vf_clip,
                               norm_length=min(self.config.env.max_turns * r.max_new_tokens, r.max_total_tokens))
        return Learner(self.model, optimizer, settings, pad_token_id=self.tokenizer.pad_token_id, ref_model=ref,
                       seed=self.config.run.seed, critic=critic, critic_optimizer=critic_optimizer)

    def rollout_round(self, step: int, round_: int) -> list:
        """One round of ``tasks_per_step`` fresh tasks x ``group_size`` episodes, rewards shaped.

        Round 0 of step ``s`` always draws the same tasks and seeds; later rounds (dynamic
        sampling) draw new ones, and their group ids follow on from the earlier rounds'.
        """
        c = self.config
        n = c.rollout.tasks_per_step
        tasks = self.curriculum.sample_tasks(self.env_cls, n, c.run.seed * 100_003 + step + round_ * 7_777_777, step)
        limits = dataclasses.replace(self.train_limits,
                                     max_turns=self.curriculum.max_turns(step, self.train_limits.max_turns),
                                     context=dataclasses.replace(self.train_limits.context,
                                                                 max_context_tokens=self.context_budget(step)))
        demos = self.demo_chooser(tasks, step, evaluation=False, first_index=round_ * n * c.rollout.group_size)
        seed = c.run.seed * 7919 + step + round_ * 1_000_033
        if self.train_meta.num_attempts > 1:
            episodes = asyncio.run(run_trials(self.env_cls, tasks, self.engine, self.renderer, limits, self.train_meta,
                                              group_size=c.rollout.group_size, seed=seed, demos=demos))
        else:
            episodes = asyncio.run(run_episodes(self.env_cls, tasks, self.engine, self.renderer, limits,
                                                group_size=c.rollout.group_size, seed=seed, demos=demos))
        for e in episodes:
            e.group_id += round_ * n
        shape_rewards(episodes, c.reward, max_total_tokens=c.rollout.max_total_tokens)
        return episodes

    def rl_step(self, learner: Learner, step: int) -> dict[str, Any]:
        c = self.config
        a = c.algo
        t0 = time.perf_counter()
        episodes, train_eps, sampling = [], [], {}
        if not a.dynamic_sampling:
            episodes = train_eps = self.rollout_round(step, 0)
        else:
            kept: list[int] = []
            rounds = 0
            for round_ in range(1 + a.dynamic_sampling_rounds):
                batch = self.rollout_round(step, round_)
                rounds += 1
                episodes += batch
                ok = [e for e in batch if _trainable(e)]
                informative = informative_groups([e.reward for e in ok], [e.group_id for e in ok])
                for g in dict.fromkeys(e.group_id for e, keep in zip(ok, informative) if keep):
                    if len(kept) < c.rollout.tasks_per_step:
                        kept.append(g)
                if len(kept) >= c.rollout.tasks_per_step:
                    break
            chosen = set(kept)
            train_eps = [e for e in episodes if e.group_id in chosen]
            sampling = {"dynamic_sampling_rounds": rounds, "dynamic_sampling_groups_kept": len(kept),
                        "dynamic_sampling_groups_dropped": rounds * c.rollout.tasks_per_step - len(kept)}
        t_rollout = time.perf_counter() - t0
        sampling.update(self.curriculum.update([e for e in episodes if e.truncation != "error"]))
        sampling["max_turns"] = self.curriculum.max_turns(step, self.train_limits.max_turns)
        if c.context.manager != "full":
            sampling["context_budget"] = self.context_budget(step)
        errored = [e for e in episodes if e.truncation == "error"]
        if errored:  # every errored episode is kept, with its reason, whatever samples_per_step says
            self.writer.log_samples(step + 1, errored, self.decode, phase="rl-errored")
        error_rate = len(errored) / max(len(episodes), 1)
        if error_rate > c.rollout.max_error_rate:
            raise TrainingAborted(
                f"step {step + 1}: {len(errored)} of {len(episodes)} episodes errored (rate {error_rate:.2f} > "
                f"rollout.max_error_rate={c.rollout.max_error_rate}); first error: {errored[0].info.get('error')}. "
                f"The episodes are in {self.writer.dir / 'samples.jsonl'} (phase rl-errored)."
                + self._resume_hint())
        trainable = valid = [e for e in train_eps if _trainable(e)]
        dropped_groups = 0
        if a.advantage not in ("gae", "reinforce_pp"):  # group statistics need two valid episodes
            trainable, dropped_groups = drop_small_groups(valid)
            valid = trainable
        sampling["errored_episodes"] = len(errored)
        sampling["deadline_episodes"] = sum(e.info.get("error_kind") == "deadline" for e in errored)
        sampling["error_rate"] = error_rate
        sampling["episodes_dropped_small_groups"] = dropped_groups
        targets: dict[str, list] = {}
        penalties = None
        if a.kl_coef > 0 and a.kl_placement == "reward" and valid:
            penalties, sampling["kl_reward"] = kl_reward_penalties(
                self.ref_model, valid, self.tokenizer.pad_token_id, coef=a.kl_coef, kind=a.kl_kind,
                temperature=learner.settings.temperature, micro_batch_size=c.train.micro_batch_size)
        if a.advantage == "gae":
            values = episode_values(learner.critic, valid, self.tokenizer.pad_token_id,
                                    micro_batch_size=c.train.micro_batch_size)
            advantages, returns, value_mask = gae_episode_advantages(valid, values, gamma=a.gamma, lam=a.lam,
                                                                     token_rewards=penalties, level=a.gae_level)
            targets = {"returns": returns, "old_values": values}
            if value_mask is not None:
                targets["value_mask"] = value_mask
        elif a.advantage == "meta":  # one advantage per attempt, group statistics over the trials of a task
            m = c.meta
            advantages = attempt_advantages(valid, credit=m.credit, gamma_trial=m.gamma_trial, normalize=m.normalize,
                                            baseline=m.baseline, num_attempts=m.num_attempts)
        else:
            advantages = episode_advantages(a.advantage, valid, gamma=a.gamma, token_rewards=penalties)
        segmented = a.advantage != "meta" and any(e.segments for e in valid)
        # segmented episodes: one advantage per episode, group statistics over episodes (before any filter)
        scalars = episode_outcome_advantages(a.advantage, valid) if segmented else []
        free = void_turn_free(valid)
        sampling["void_turn_rate"] = (1.0 - sum(free) / len(free)) if free else 0.0
        if a.void_turn_filter:
            sampling["void_turn_filtered"] = len(free) - sum(free)
            advantages = [adv for adv, keep in zip(advantages, free) if keep]
            scalars = [x for x, keep in zip(scalars, free) if keep] if segmented else []
            targets = {k: [x for x, keep in zip(v, free) if keep] for k, v in targets.items()}
            valid = [e for e, keep in zip(valid, free) if keep]
        trained_episodes = len(valid)
        if a.advantage == "meta":  # one sequence per attempt: the attempt's advantage, then its reflection's
            valid, advantages = expand_trials(valid, advantages)
        elif segmented:  # one sequence per segment, each with its episode's advantage
            valid, advantages = expand_segments(valid, scalars, branch_reward=c.context.branch_reward)
        sampled = [x for adv, e in zip(advantages, valid) for x, m in zip(adv, e.loss_mask) if m]
        t1 = time.perf_counter()
        update = learner.update(valid, advantages, **targets) if valid else {}
        if update and update.get("skipped", 0.0) >= 1.0:  # every mini-batch update of the step was skipped
            self.consecutive_skips += 1
        elif update:
            self.consecutive_skips = 0
        update["skipped_updates_total"] = float(learner.skipped_updates)
        t_update = time.perf_counter() - t1
        self.engine.set_version(step + 1)
        stats = summarize(episodes)
        row = {"phase": "rl", "step": step + 1, **stats, **_mean_terms(episodes), **sampling,
               **(context_stats(episodes) if c.context.manager != "full" else {}),
               **(trial_stats(episodes) if self.train_meta.num_attempts > 1 else {}),
               **({"demos_per_episode": float(np.mean([e.info.get("demos", 0) for e in episodes]))}
                  if self.demo_pool else {}),
               "trained_episodes": trained_episodes, "trained_sequences": len(valid),
               "advantage_abs_mean": float(np.mean(np.abs(sampled))) if sampled else 0.0,
               "advantage_std": float(np.std(sampled)) if sampled else 0.0,
               "zero_variance_groups": _zero_variance_groups(trainable),
               **update,
               "tokens": sum(len(s.input_ids) for e in episodes for s in e.sequences()),
               "time_rollout": t_rollout, "time_update": t_update, "time_step": time.perf_counter() - t0}
        self.writer.log_metrics(row)
        if c.run.samples_per_step:
            self.writer.log_samples(step + 1, episodes[: c.run.samples_per_step], self.decode, phase="rl")
        if self.consecutive_skips >= c.train.max_consecutive_skips:
            raise TrainingAborted(
                f"{self.consecutive_skips} RL steps in a row had every update skipped (non-finite loss or gradient "
                f"norm; train.max_consecutive_skips={c.train.max_consecutive_skips}). The weights were not touched "
                "by those steps." + self._resume_hint())
        return row

    def _resume_hint(self) -> str:
        """Where to resume from: the newest checkpoint written before any skipped update streak."""
        root = self.writer.dir / "checkpoints"
        good = []
        for path in sorted(root.glob(f"{STEP_PREFIX}*")):
            try:
                state = json.loads((path / "state.json").read_text())
            except (OSError, ValueError):
                continue
            if state.get("consecutive_skips", 0) == 0:
                good.append(path)
        if not good:
            why = ("train.checkpoint_every=0" if not self.config.train.checkpoint_every
                   else "none was written before the problem began")
            return f" No checkpoint from before the problem is available ({why})."
        return (f" The last good checkpoint is {good[-1]}: point {root / 'latest'} at it (its name on one line), "
                f"fix the cause and resume with --resume (settings that may change: {', '.join(RESUMABLE_CHANGES)}; "
                "any other change needs a new run).")

    # -- checkpoints -----------------------------------------------------------------------------
    def save_training_checkpoint(self, step: int, learner: Learner) -> Path:
        """A resumable checkpoint after RL step ``step`` (atomic; ``latest`` updated; old ones pruned)."""
        from safetensors.torch import save_model

        def write(tmp: Path) -> None:
            # One file, with the model's own parameter names (what load_weights reads back): no
            # sharding, and no conversion to a hub layout (transformers 5 converts some families).
            options: dict[str, Any] = {"max_shard_size": "100000GB"}
            if "save_original_format" in inspect.signature(self.model.save_pretrained).parameters:
                options["save_original_format"] = False
            self.model.save_pretrained(tmp, safe_serialization=True, **options)
            self.tokenizer.save_pretrained(tmp)
            save_state(learner.optimizer.state_dict(), tmp, "optimizer")
            if learner.critic is not None:
                save_model(learner.critic, str(tmp / "critic.safetensors"))
                save_state(learner.critic_optimizer.state_dict(), tmp, "critic_optimizer")
            if self.ref_model is not None:
                save_model(self.ref_model, str(tmp / "reference.safetensors"))
            save_state(rng_state({"learner": learner.generator}), tmp, "rng")
            state = {"format": 1, "step": step, "policy_version": self.engine.version,
                     "skipped_updates": learner.skipped_updates, "consecutive_skips": self.consecutive_skips,
                     "curriculum": self.curriculum.state_dict(), "logs": self.writer.offsets(),
                     "critic": learner.critic is not None, "reference": self.ref_model is not None,
                     "device": self.device, "dtype": self.config.model.dtype}
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
            (tmp / "config.toml").write_text(to_toml(self.config))

        return commit_checkpoint(self.writer.dir / "checkpoints", step_name(step), write,
                                 keep=self.config.train.keep_checkpoints)

    def resume(self, learner: Learner) -> int:
        """Restore the state of ``checkpoints/latest`` into this run; returns the step it ends after.

        Every piece is required; a missing file or a config change that matters is an error that
        names it. The logs are rewound to the checkpoint (lines written after it move to
        ``*.orphaned.jsonl``), so after the resumed run every step appears exactly once.
        """
        from safetensors.torch import load_model

        from ctxrl.config import load_config

        clean_partial(self.writer.dir / "checkpoints")  # temporaries of a save that was killed
        path = latest_checkpoint(self.writer.dir / "checkpoints")
        differences = config_differences(load_config(path / "config.toml"), self.config)
        if differences:
            raise CheckpointError(f"cannot resume from {path}: the config changed in ways that matter: "
                                  + "; ".join(differences) + ". Undo these changes, or start a new run directory.")
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != 1:
            raise CheckpointError(f"{path}/state.json has format {state.get('format')!r}; this ctxrl reads format 1")
        for flag, have, what, files in (
                ("critic", learner.critic is not None, "a critic (algo.advantage=gae)",
                 ("critic.safetensors", "critic_optimizer.safetensors", "critic_optimizer.json")),
                ("reference", self.ref_model is not None, "a reference model (algo.kl_coef > 0)",
                 ("reference.safetensors",))):
            if bool(state.get(flag)) != have:
                raise CheckpointError(f"{path}: the checkpoint {'has' if state.get(flag) else 'lacks'} {what}, "
                                      "the run does not match it")
            missing = [f for f in files if have and not (path / f).exists()]
            if missing:
                raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
        if state.get("device", self.device).split(":")[0] != self.device.split(":")[0]:
            warnings.warn(f"resuming on {self.device} a run checkpointed on {state['device']}: it continues "
                          "correctly, but not with the numbers an uninterrupted run would have given", stacklevel=2)
        load_weights(self.model, path / "model.safetensors")
        learner.optimizer.load_state_dict(load_state(path, "optimizer"))
        if learner.critic is not None:
            load_model(learner.critic, str(path / "critic.safetensors"))
            learner.critic_optimizer.load_state_dict(load_state(path, "critic_optimizer"))
        if self.ref_model is not None:
            load_model(self.ref_model, str(path / "reference.safetensors"))
        set_rng_state(load_state(path, "rng"), {"learner": learner.generator})
        self.engine.set_version(int(state["policy_version"]))
        learner.skipped_updates = int(state["skipped_updates"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.curriculum.load_state_dict(state["curriculum"])
        try:
            self.writer.rewind(state["logs"])
        except LogRewindError as exc:
            raise CheckpointError(str(exc)) from None
        return int(state["step"])

    def save_checkpoint(self, name: str) -> Path:
        path = self.writer.dir / "checkpoints" / name
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path


@torch.no_grad()
def kl_reward_penalties(ref_model, episodes, pad_token_id: int, *, coef: float, kind: str, temperature: float,
                        micro_batch_size: int) -> tuple[list[list[float]], float]:
    """``-coef * KL(behaviour || reference)`` per sampled token (aligned with ``input_ids``), and its
    mean KL per sampled token. The behaviour log-probs are the sampler's, as the rollout saw them."""
    from ctxrl.algo.losses import kl_penalty
    from ctxrl.train.learner import per_token_rows, token_logprobs

    sums = {"kl": 0.0, "tokens": 0.0}

    def penalty(batch) -> torch.Tensor:
        ref = token_logprobs(ref_model, batch.input_ids, batch.attention_mask, temperature=temperature)
        kl = kl_penalty(batch.old_logprobs, ref, kind) * batch.loss_mask
        sums["kl"] += float(kl.sum())
        sums["tokens"] += float(batch.loss_mask.sum())
        return -coef * kl

    rows = per_token_rows(episodes, pad_token_id, next(ref_model.parameters()).device, micro_batch_size, penalty)
    return rows, sums["kl"] / max(sums["tokens"], 1.0)


def trial_stats(trials) -> dict[str, float]:
    """Training trials' statistics: success at / by attempt, attempts and reflections per trial (errored left out)."""
    played = [t for t in trials if t.truncation != "error"]
    if not played:
        return {}
    return {**meta_metrics([to_trial(t) for t in played]),
            "reflections_per_trial": sum(t.info["reflections"] for t in played) / len(played),
            "reflections_skipped_per_trial": sum(t.info["reflections_skipped"] for t in played) / len(played),
            "reflection_tokens_mean": sum(t.info["reflection_tokens"] for t in played)
            / max(sum(t.info["reflections"] for t in played), 1)}


def _mean_terms(episodes) -> dict[str, float]:
    """Mean of each shaped reward term (``info["reward_terms"]``) over all of a step's episodes."""
    sums: dict[str, float] = {}
    for e in episodes:
        for k, v in e.info.get("reward_terms", {}).items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(episodes) for k, v in sums.items()}


def drop_small_groups(episodes: list) -> tuple[list, int]:
    """The episodes of groups with at least 2 of them (group statistics need two), and how many episodes went.

    Used after errored episodes are removed: a group left with one valid episode has no baseline.
    """
    counts: dict[int, int] = {}
    for e in episodes:
        counts[e.group_id] = counts.get(e.group_id, 0) + 1
    kept = [e for e in episodes if counts[e.group_id] >= 2]
    return kept, len(episodes) - len(kept)


def _trainable(e) -> bool:
    return e.truncation != "error" and any(any(s.loss_mask) for s in e.sequences())


def _zero_variance_groups(episodes) -> int:
    by_group: dict[int, set[float]] = {}
    for e in episodes:
        by_group.setdefault(e.group_id, set()).add(e.reward)
    return sum(1 for rewards in by_group.values() if len(rewards) == 1)
