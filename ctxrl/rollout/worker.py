"""``RolloutWorker``: plays ``RolloutRequest`` s with its own engine; plain data in, episodes out.

A worker is built from a ``RolloutSpec`` (``from_spec``: it resolves the environment, loads the
tokenizer and checks the chat template, loads the policy into its own engine) or handed an
engine. ``run(request)`` owns the event loop: it plays the request's episodes (or trials of
attempts, when the phase's ``MetaPolicy`` has more than one) all at once and returns them.
``load_weights(state, version=...)`` replaces the engine's weights between requests.

Nothing here reads the run's configuration or the learner: the same worker runs in the
trainer's process, in a spawned subprocess (``ctxrl.rollout.process``), or on a remote worker,
and plays exactly the same episodes given the same spec, weights and request.

Trials and annealed demonstrations are meta-RL (``ctxrl.meta``); the worker is the one place in
``rollout`` that dispatches to them, importing them when a spec uses them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.envs.registry import configured_env_class
from ctxrl.errors import ConfigError
from ctxrl.rollout.agent import run_episodes
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec, spec_engine
from ctxrl.tools.python import configure_pool
from ctxrl.types import Episode

log = logging.getLogger(__name__)


class RolloutWorker:
    """Plays requests (see the module docstring). ``engine``: the worker's own (it is not shared)."""

    def __init__(self, spec: RolloutSpec, engine: Engine, renderer: ChatRenderer, env_cls: type | None = None, *,
                 demo_pool: list | None = None) -> None:
        self.spec = spec
        self.engine = engine
        self.renderer = renderer
        self.env_cls = env_cls if env_cls is not None else spec_env_class(spec)
        self._demo_pool = demo_pool
        configure_pool(spec.sandbox_workers)  # the python tool's interpreters, shared by every episode
        if spec.demos.max_demos > 0:
            self.demo_pool()  # a missing demo file or a failing solve() stops the run now, not at step 1

    @classmethod
    def from_spec(cls, spec: RolloutSpec, *, model: Any | None = None) -> RolloutWorker:
        """Resolve the environment, load the tokenizer (its template checked) and the policy into its engine.

        ``model``: a module to serve instead of loading ``spec.model.name`` (the worker takes it
        over: nothing else may change its weights).
        """
        from ctxrl.models.loader import load_model

        env_cls = spec_env_class(spec)
        renderer = spec_renderer(spec)
        if model is None:
            model = load_model(spec.model.name, dtype=spec.model.dtype, device=spec.model.device)
            if spec.model.lora.rank:  # the learner sends adapters: give the model the same ones to fill
                from ctxrl.models.lora import wrap_lora

                model = wrap_lora(model, spec.model.lora, adapter_dtype=next(model.parameters()).dtype).eval()
        return cls(spec, spec_engine(spec, model, renderer), renderer, env_cls)

    # -- weights ---------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def load_weights(self, state: Mapping[str, Any], *, version: int, partial: bool = False) -> None:
        """The engine's new weights; ``partial``: only the tensors that changed (a LoRA run's adapters)."""
        self.engine.load_weights(state, version=version, **({"partial": True} if partial else {}))

    # -- requests --------------------------------------------------------------------------------------
    def run(self, request: RolloutRequest, *, on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        """Play ``request`` to the end and return its episodes (one event loop per request).

        ``on_episode(done, total)`` after each episode (or trial) finishes, for a progress display.
        """
        return asyncio.run(self.play(request, on_episode=on_episode))

    async def play(self, request: RolloutRequest, *,
                   on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        """``run`` inside a running event loop."""
        limits, policy = request.limits(self.spec), request.meta(self.spec)
        demos = self.demo_chooser(request)
        first = request.task_offset  # (a shard plays its tasks as the whole request would)
        total, finished = len(request.tasks) * request.group_size, [0]

        def counter(_episode: Episode) -> None:
            finished[0] += 1
            if on_episode is not None:
                on_episode(finished[0], total)

        if getattr(self.env_cls, "harness", None) is not None:
            if policy.num_attempts > 1 or demos is not None:
                raise ConfigError("a harness environment plays single episodes: meta.num_attempts = 1 and no "
                                  "annealed demos (meta.demos_max = 0)")
            from ctxrl.serve.harness import run_harness

            episodes = await run_harness(self.env_cls, request.tasks, self.engine, self.renderer, limits,
                                         group_size=request.group_size, seed=request.seed, on_done=counter,
                                         first_group=first)
        elif policy.num_attempts > 1:
            from ctxrl.meta.rollout import run_trials

            episodes = await run_trials(self.env_cls, request.tasks, self.engine, self.renderer, limits, policy,
                                        group_size=request.group_size, seed=request.seed, demos=demos,
                                        on_done=counter, first_group=first)
        elif demos is None:
            episodes = await run_episodes(self.env_cls, request.tasks, self.engine, self.renderer, limits,
                                          group_size=request.group_size, seed=request.seed, on_done=counter,
                                          first_group=first)
        else:
            from ctxrl.meta.demos import with_demos

            shown = {(i, k): demos(i, k) for i in range(first, first + len(request.tasks))
                     for k in range(request.group_size)}
            episodes = await run_episodes(self.env_cls, request.tasks, self.engine, self.renderer, limits,
                                          group_size=request.group_size, seed=request.seed, on_done=counter,
                                          opening=lambda i, k, messages: with_demos(messages, shown[i, k]),
                                          first_group=first)
            for n, episode in enumerate(episodes):  # episodes come in (task, k) order
                i, k = divmod(n, request.group_size)
                episode.info["demos"] = len(shown[first + i, k])
        for episode in episodes:
            episode.group_id += request.group_offset
        return episodes

    def demo_pool(self) -> list:
        """The annealed demonstrations' pool (``spec.demos``), built on first use; empty when they are off."""
        if self._demo_pool is None:
            self._demo_pool = build_demo_pool(self.spec, self.env_cls, self.renderer)
        return self._demo_pool

    def demo_chooser(self, request: RolloutRequest):
        """``(i, k) -> demos`` for episode ``k`` of ``request.tasks[i]``, or None when the request gets none.

        Evaluation is always zero-shot; a task never sees its own demo. The choice is a pure
        function of (seed, step, episode index), so every process makes the same one.
        """
        spec = self.spec.demos
        if request.phase != "train" or spec.max_demos == 0:
            return None
        from ctxrl.meta.anneal import DemoSchedule, sample_demos
        from ctxrl.meta.demos import demos_excluding

        pool, schedule = self.demo_pool(), DemoSchedule.from_spec(spec)

        def choose(i: int, k: int) -> list:  # i: the task's index in the whole request
            candidates = demos_excluding(pool, request.tasks[i - request.task_offset])
            picked = sample_demos(schedule, step=request.step, pool_size=len(candidates), seed=spec.choice_seed,
                                  episode_index=request.first_episode + i * request.group_size + k, evaluation=False)
            return [candidates[j] for j in picked]

        return choose


def spec_env_class(spec: RolloutSpec) -> type:
    """The environment class a spec names, bound to its data options."""
    e = spec.env
    options = {"data": e.data, "tools": e.tools, "verifier": e.verifier}
    if e.harness or e.name == "harness":
        options["harness"] = e.harness
    return configured_env_class(e.name, **options)


def spec_renderer(spec: RolloutSpec) -> ChatRenderer:
    """The spec's tokenizer and chat template as a renderer with the policy's tool-call format
    (``model.tool_format``; ``auto`` reads it from the template), checked prefix-preserving.

    What the renderer decided on its own (a format chosen without a marker, tools written into the
    system turn of a template that ignores them) is logged once, as a warning: the run trains on it.
    """
    from ctxrl.models.loader import generation_end_ids, load_tokenizer

    tokenizer = load_tokenizer(spec.model.name, chat_template=spec.model.chat_template or None)
    renderer = ChatRenderer(tokenizer, template_name=spec.model.name, end_ids=generation_end_ids(spec.model.name),
                            tool_format=spec.model.tool_format)
    renderer.verify_prefix_preserving()
    for notice in renderer.notices:
        log.warning("%s", notice)
    return renderer


def build_demo_pool(spec: RolloutSpec, env_cls: type, renderer: ChatRenderer) -> list:
    """The demonstrations ``spec.demos`` draws from: solved training tasks or a JSONL file ([] when off)."""
    d = spec.demos
    if d.max_demos == 0:
        return []
    from ctxrl.meta.demos import load_demos, solved_demos

    if d.source != "solve":
        try:
            pool = load_demos(d.source)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"meta.demos_source: {exc}") from None
    else:
        pool = solved_demos(env_cls, renderer, d.pool, seed=d.pool_seed)
    if len(pool) <= d.max_demos:
        raise ConfigError(f"meta.demos_max={d.max_demos} demonstrations per prompt, but the pool holds only "
                          f"{len(pool)} (a task's own demo is left out); add demonstrations or lower demos_max")
    return pool
