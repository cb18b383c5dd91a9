"""The ``meta`` episode runner: trials of several attempts and annealed demonstrations, for a ``RolloutWorker``.

A worker whose spec plays trials in either phase (``RolloutRequest.attempts(spec) > 1``) or shows annealed
demonstrations (``meta.demos.max > 0``) plays through this runner (``ctxrl.rollout.runners``
chooses it by name; importing ``ctxrl.meta`` registers it). Each request, by its phase:

- ``num_attempts > 1``: trials (``run_trials``), each opening with the demonstrations the schedule gives;
- else, a training request with demonstrations: single episodes of the agent loop that open with them
  (``with_demos``), each recording how many it was shown (``info["demos"]``);
- else: single episodes, as the ``plain`` runner plays them.

The demonstrations' pool is built with the runner (``build_demo_pool``), so a missing demo file or a
failing ``solve()`` stops the run then, not at step 1. Which demonstrations an episode sees is a pure
function of (seed, step, episode index) (``demo_chooser``), so every process makes the same choice;
evaluation is always zero-shot, and a task never sees its own demo.
"""

from __future__ import annotations

from collections.abc import Callable

from ctxrl.chat.render import ChatRenderer
from ctxrl.errors import ConfigError
from ctxrl.meta.anneal import DemoSchedule, DemoSettings, sample_demos
from ctxrl.meta.demos import Demo, demos_excluding, load_demos, solved_demos, with_demos
from ctxrl.meta.rollout import run_trials
from ctxrl.rollout.runners import META, EpisodeRunner, OnDone, Worker, play_episodes, register_runner
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec
from ctxrl.seeds import Seeds
from ctxrl.types import Episode

DemoChooser = Callable[[int, int], list[Demo]]


@register_runner
class MetaRunner(EpisodeRunner):
    """Trials and annealed demonstrations (see the module docstring)."""

    name = META

    def __init__(self, spec: RolloutSpec, env_cls: type, renderer: ChatRenderer) -> None:
        self.demos = DemoSettings(**spec.demos)
        self.seeds = Seeds(spec.seed)
        self.pool = build_demo_pool(self.demos, env_cls, renderer, seed=self.seeds.demo_pool)

    async def play(self, worker: Worker, request: RolloutRequest, on_done: OnDone) -> list[Episode]:
        policy = request.meta(worker.spec)
        demos = self.demo_chooser(request)
        if policy.num_attempts > 1:
            return await run_trials(worker.env_cls, request.tasks, worker.engine, worker.renderer,
                                    request.limits(worker.spec), policy, group_size=request.group_size,
                                    seed=request.seed, demos=demos, on_done=on_done, first_group=request.task_offset)
        if demos is None:
            return await play_episodes(worker, request, on_done)
        first = request.task_offset  # (a shard plays its tasks as the whole request would)
        shown = {(i, k): demos(i, k) for i in range(first, first + len(request.tasks))
                 for k in range(request.group_size)}
        episodes = await play_episodes(worker, request, on_done,
                                       opening=lambda i, k, messages: with_demos(messages, shown[i, k]))
        for n, episode in enumerate(episodes):  # episodes come in (task, k) order
            i, k = divmod(n, request.group_size)
            episode.info["demos"] = len(shown[first + i, k])
        return episodes

    def demo_chooser(self, request: RolloutRequest) -> DemoChooser | None:
        """``(i, k) -> demos`` for episode ``k`` of ``request.tasks[i]``, or None when the request gets none.

        Evaluation is always zero-shot; a task never sees its own demo. The choice is a pure
        function of (seed, step, episode index), so every process makes the same one.
        """
        spec = self.demos
        if request.phase != "train" or spec.max == 0:
            return None
        pool, schedule = self.pool, DemoSchedule.from_spec(spec)

        def choose(i: int, k: int) -> list[Demo]:  # i: the task's index in the whole request
            candidates = demos_excluding(pool, request.tasks[i - request.task_offset])
            picked = sample_demos(schedule, step=request.step, pool_size=len(candidates), seed=self.seeds.demo_choice,
                                  episode_index=request.first_episode + i * request.group_size + k, evaluation=False)
            return [candidates[j] for j in picked]

        return choose


def build_demo_pool(spec: DemoSettings, env_cls: type, renderer: ChatRenderer, *, seed: int) -> list[Demo]:
    """The demonstrations ``spec`` draws from: solved training tasks (drawn with ``seed``, the run's
    ``Seeds.demo_pool``) or a JSONL file ([] when off)."""
    if spec.max == 0:
        return []
    if spec.source != "solve":
        try:
            pool = load_demos(spec.source)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"meta.demos.source: {exc}") from None
    else:
        pool = solved_demos(env_cls, renderer, spec.pool, seed=seed)
    if len(pool) <= spec.max:
        raise ConfigError(f"meta.demos.max={spec.max} demonstrations per prompt, but the pool holds only "
                          f"{len(pool)} (a task's own demo is left out); add demonstrations or lower meta.demos.max")
    return pool
