"""``RolloutWorker``: plays ``RolloutRequest`` s with its own engine; plain data in, episodes out.

A worker is built from a ``RolloutSpec`` (``from_spec``: it resolves the environment, loads the
tokenizer and checks the chat template, loads the policy into its own engine) or handed an
engine. ``run(request)`` owns the event loop: it plays the request's episodes all at once and
returns them. ``load_weights(state, version=...)`` replaces the engine's weights between requests.
``play_partial(request, step_tokens)`` plays a step of partial rollouts instead: episodes that outlive the step
wait in the worker's pool (``ctxrl.rollout.partial``) and go on in the next one, on the weights loaded meanwhile.

What plays a request is the worker's episode runner (``ctxrl.rollout.runners``), chosen once from
the spec and the environment: the agent loop (``plain``), trials of attempts and annealed
demonstrations (``meta``), or a user's agent (``harness``). The worker counts the finished episodes for a
progress display, hands each finished training episode to its judge when the run has one (``reward.judge``: the
judge's calls overlap the episodes still playing; ``ctxrl.judge``) and shifts their group ids by the request's
``group_offset``.

Nothing here reads the run's configuration or the learner: the same worker runs in the
trainer's process, in a spawned subprocess (``ctxrl.rollout.process``), or on a remote worker,
and plays exactly the same episodes given the same spec, weights and request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ctxrl.chat.render import ChatRenderer
from ctxrl.engine.base import Engine
from ctxrl.envs.hooks import hook
from ctxrl.envs.mcp import start_tools, with_mcp_tools
from ctxrl.envs.registry import configured_env_class
from ctxrl.judge.judge import Judge
from ctxrl.rollout.partial import PartialRollouts, PartialStep
from ctxrl.rollout.runners import EpisodeRunner, make_runner
from ctxrl.rollout.spec import RolloutRequest, RolloutSpec, spec_engine
from ctxrl.tools.mcp import close_hub
from ctxrl.tools.python import configure_pool
from ctxrl.types import Episode

log = logging.getLogger(__name__)


class RolloutWorker:
    """Plays requests (see the module docstring). ``engine``: the worker's own (it is not shared).

    ``runner``: one built already (``make_runner``; the trainer builds it early, so that a missing
    demonstration file stops the run before the model loads); None: the spec's, built now. ``role_engines``: an
    engine per role with a trainable policy of its own (``ctxrl.run.roles``), the trainer's to update.
    """

    def __init__(self, spec: RolloutSpec, engine: Engine, renderer: ChatRenderer, env_cls: type | None = None, *,
                 runner: EpisodeRunner | None = None, role_engines: dict[str, Engine] | None = None) -> None:
        self.spec = spec
        self.engine = engine
        self.role_engines = dict(role_engines or {})
        """The engines of the roles with trainable policies of their own (``roles.policies`` ``ROLE=own``)."""
        self.renderer = renderer
        self.env_cls = env_cls if env_cls is not None else spec_env_class(spec)
        check = hook(self.env_cls, "check_tasks")
        if check is not None:  # now with the model's tokenizer (spec_env_class bounded them by characters)
            check(spec.train.max_total_tokens, lambda text: len(renderer.encode_plain(text)))
        configure_pool(spec.rollout.sandbox_workers)  # the python tool's interpreters, shared by every episode
        if spec.env.mcp_servers:  # started now: a server that cannot start stops the run before any episode
            start_tools(self.env_cls)
        self.runner = runner if runner is not None else make_runner(spec, self.env_cls, renderer)
        self.judge: Judge | None = None
        """Grades training episodes as they finish (``reward.judge``; ``ctxrl.judge``): built at the first training
        request, so an evaluation never loads a local judge it does not use."""
        self.partial: PartialRollouts | None = None
        """The episodes of partial rollouts that outlive a step (``play_partial``): built at the first such step."""

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
            if spec.lora.rank:  # the learner sends adapters: give the model the same ones to fill
                from ctxrl.models.lora import wrap_lora

                model = wrap_lora(model, spec.lora, adapter_dtype=next(model.parameters()).dtype).eval()
        return cls(spec, spec_engine(spec, model, renderer), renderer, env_cls)

    # -- weights ---------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def load_weights(self, state: Mapping[str, Any], *, version: int, partial: bool = False) -> None:
        """The engine's new weights; ``partial``: only the tensors that changed (a LoRA run's adapters)."""
        self.engine.load_weights(state, version=version, **({"partial": True} if partial else {}))

    def close(self) -> None:
        """Drop the episodes of partial rollouts still in flight (logged), shut down what the worker's tools run on
        (its MCP servers); safe to call more than once."""
        if self.partial is not None:
            self.partial.close()
        if self.spec.env.mcp_servers:
            close_hub(self.spec.env)

    # -- requests --------------------------------------------------------------------------------------
    def run(self, request: RolloutRequest, *, on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        """Play ``request`` to the end and return its episodes (one event loop per request).

        ``on_episode(done, total)`` after each episode (or trial) finishes, for a progress display.
        """
        return asyncio.run(self.play(request, on_episode=on_episode))

    def play_partial(self, request: RolloutRequest, step_tokens: int) -> PartialStep:
        """One step of partial rollouts (``ctxrl.rollout.partial``): ``request``'s episodes started beside the ones
        carried over, played until a group has finished and every episode has finished or spent ``step_tokens``
        sampled tokens this step; returns the groups that finished."""
        if self.partial is None:
            self.partial = PartialRollouts(self)
        return self.partial.play(request, step_tokens)

    async def play(self, request: RolloutRequest, *,
                   on_episode: Callable[[int, int], None] | None = None) -> list[Episode]:
        """``run`` inside a running event loop."""
        total, finished = len(request.tasks) * request.group_size, [0]
        if request.phase == "train" and self.spec.judge.enabled and self.judge is None:
            self.judge = Judge.from_spec(self.spec.judge, device=self.spec.model.device, dtype=self.spec.model.dtype)
        judging = self.judge.round() if self.judge is not None and request.phase == "train" else None

        def counter(episode: Episode) -> None:
            finished[0] += 1
            if judging is not None:  # graded now, while the request's other episodes still play
                judging.submit(episode)
            if on_episode is not None:
                on_episode(finished[0], total)

        episodes = await self.runner.play(self, request, counter)
        if judging is not None:
            await judging.wait()
        for episode in episodes:
            episode.group_id += request.group_offset
        return episodes


def spec_env_class(spec: RolloutSpec) -> type:
    """The environment class a spec names, bound to its data options, with its MCP servers' tools (``with_mcp_tools``:
    checked, not started), its tasks checked against the rollout's length (``check_tasks``, by characters: no
    tokenizer is loaded here)."""
    e = spec.env
    cls = with_mcp_tools(configured_env_class(e.name, spec.env_options, data=e.data), e)
    check = hook(cls, "check_tasks")
    if check is not None:  # (``ctxrl config`` too: a task too long to fit is an error before anything loads)
        check(spec.train.max_total_tokens)
    return cls


def spec_renderer(spec: RolloutSpec, *, tokenizer=None) -> ChatRenderer:
    """The spec's tokenizer and chat template as a renderer with the policy's tool-call format
    (``model.tool_format``; ``auto`` reads it from the template), checked prefix-preserving.

    What the renderer decided on its own (a format chosen without a marker, tools written into the
    system turn of a template that ignores them) is logged once, as a warning: the run trains on it.
    ``tokenizer``: one made before its model exists (a tiny model's, for the checks that need no model); the
    renderer then has no generation end ids (they are the model's), so it is for counting tokens, not for decoding.
    """
    from ctxrl.models.loader import generation_end_ids, load_tokenizer

    end_ids = [] if tokenizer is not None else generation_end_ids(spec.model.name)
    if tokenizer is None:
        tokenizer = load_tokenizer(spec.model.name, chat_template=spec.model.chat_template or None)
    renderer = ChatRenderer(tokenizer, template_name=spec.model.name, end_ids=end_ids,
                            tool_format=spec.model.tool_format)
    renderer.verify_prefix_preserving()
    for notice in renderer.notices:
        log.warning("%s", notice)
    return renderer
