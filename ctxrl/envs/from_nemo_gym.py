"""``nemo_gym:NAME``: NeMo Gym environments, refused here with the reason.

NeMo Gym (the ``nemo-gym`` package) cannot be installed beside ctxrl on the interpreters ctxrl supports: every
release needs Python 3.12 or later (0.5 and later: 3.13.14), and its pins conflict with ctxrl's own extras:
``mcp < 2`` (ctxrl's ``serve`` and ``mcp`` extras need mcp >= 2.3, the 2026 protocol), ``openai <= 2.7.2`` and
``anthropic <= 0.109.2`` (the clients ``ctxrl serve`` is tested with are newer). Its resource servers also run as a
Ray cluster of HTTP services started by its own CLI, which a ctxrl environment cannot start faithfully without the
package. So ``nemo_gym:NAME`` is an error that says this, rather than an adapter tested against a stand-in.

What does work: a NeMo Gym agent speaks OpenAI's Responses API to its model, and ``ctxrl serve`` speaks it
(``/sessions/<id>/v1/responses``, docs/serve.md), so a NeMo Gym rollout run in its own environment (its own Python)
can point its model server at ctxrl and have every call recorded as a token-faithful episode.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ctxrl.envs.base import EnvError

REFUSED = (
    "nemo_gym:{rest}: NeMo Gym cannot be installed beside ctxrl: every nemo-gym release needs Python >= 3.12 (this "
    "is {python}), and it pins mcp < 2, openai <= 2.7.2 and anthropic <= 0.109.2, against ctxrl's serve extra (mcp "
    ">= 2.3). Run NeMo Gym in its own environment and point its Responses model server at ctxrl serve "
    "(/sessions/<id>/v1/responses; docs/serve.md) to record its rollouts.")


@dataclass(frozen=True)
class Settings:
    """The table ``[env.nemo_gym]``: nothing is read (the family is refused)."""


def environment(rest: str) -> type:
    raise EnvError(REFUSED.format(rest=rest, python=".".join(map(str, sys.version_info[:3]))))
