"""``prepare(name)``: a model made ready before anything loads it, by the stage its name's scheme registers.

A model name may need work before it loads: a ``tiny`` model is built (minutes on a CPU), a GGUF file converted.
Conversion is the loader's own (``ctxrl.models.loader.resolve``); building a tiny model needs the environments'
text and the learner's numerics, a stage above this package, so it joins by name (``register_preparer``:
``ctxrl.train.tiny`` registers ``tiny``; the entry points import it first, ``ctxrl.run.validate.STAGE_PACKAGES``).
Nothing here imports that stage: the path from a command to the loader does not pass through it unless the name
asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ctxrl.models import loader
from ctxrl.models.tiny import Progress
from ctxrl.registry import Registry

Preparer = Callable[..., None]
"""``preparer(name, *, on_progress=None)``: make the model ``name`` ready (its scheme's stage)."""
P = TypeVar("P", bound=Preparer)

PREPARERS: Registry[Preparer] = Registry("model preparer", entry_point_group="ctxrl.model_preparers",
                                         error=loader.ModelLoadError)
"""Preparers by the scheme of the names they prepare (``tiny``)."""


def register_preparer(scheme: str) -> Callable[[P], P]:
    """Decorator: ``preparer(name, *, on_progress=None)`` makes the models whose names have ``scheme`` ready."""

    def add(preparer: P) -> P:
        return PREPARERS.register(scheme, preparer)

    return add


def scheme(name: str) -> str | None:
    """The scheme of a model name that needs a stage's preparation (``tiny``), or None."""
    return "tiny" if loader.parse_tiny(name) is not None else None


def prepare(name: str, *, on_progress: Progress | None = None) -> str:
    """The directory ``name`` loads from, made ready first: its scheme's preparer runs (a ``tiny`` model is built if
    it is not cached yet), then the loader resolves it (a GGUF file converted once). A directory of LoRA adapters
    loads as its base plus the adapters: a base named by a scheme is made ready the same way."""
    base = loader.adapter_base(name)
    if base and loader.resolves_to_cache(base):
        prepare(base, on_progress=on_progress)
    found = scheme(name)
    if found is not None:
        if found not in PREPARERS:
            raise loader.ModelLoadError(f"no stage prepares {found!r} models in this process (import "
                                        f"ctxrl.train.tiny, which registers it, before preparing {name!r})")
        PREPARERS.get(found)(name, on_progress=on_progress)
    return loader.resolve(name, on_progress=on_progress)
