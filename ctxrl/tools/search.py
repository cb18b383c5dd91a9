"""Local search: a BM25 index over documents (``bm25s``), the ``search`` tool, QA answer metrics.

``SearchIndex(docs)`` indexes ``Document`` s (id, title, text) once; ``SearchIndex.from_jsonl``
reads a user's own corpus (one JSON object per line with ``text`` and optional ``id``, ``title``);
``index.search(query, k)`` returns the best ``k`` documents with their scores. Scoring is the
``bm25s`` library's BM25 (English stop words removed), not a hand-written scorer.

``exact_match`` and ``token_f1`` use the usual SQuAD answer normalisation: lower case, no
punctuation, no articles (a, an, the), single spaces.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ctxrl.tools.base import Tool


def _bm25s():
    """``bm25s``, imported so that it cannot start JAX.

    ``bm25s`` imports JAX when it is installed and runs a top-k with it at import time. JAX then
    takes 75% of the GPU's memory for itself (its default preallocation): on a GPU machine with
    JAX, every process that built a search index held 61 GiB of an 80 GiB H100, and the other
    training processes on the GPU ran out of memory. Importing ``bm25s`` while ``jax`` cannot be
    imported makes it fall back to NumPy; a program that imported JAX itself keeps it. Retrieval
    also asks for NumPy explicitly, so rankings (ties included) do not depend on the machine.
    """
    import sys

    if "bm25s" in sys.modules or "jax" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["jax"] = None  # type: ignore[assignment]  # makes `import jax` raise ImportError
    try:
        import bm25s
    finally:
        del sys.modules["jax"]
    return bm25s


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


class SearchIndex:
    """BM25 over a fixed list of documents."""

    def __init__(self, docs: list[Document]) -> None:
        bm25s = _bm25s()

        if not docs:
            raise ValueError("a search index needs at least one document")
        self.docs = list(docs)
        self._bm25 = bm25s.BM25()
        self._bm25.index(bm25s.tokenize([f"{d.title} {d.text}" for d in self.docs], stopwords="en",
                                        show_progress=False), show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> SearchIndex:
        """Documents from a JSONL file: ``{"text": ..., "title": ..., "id": ...}`` per line."""
        docs = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not JSON ({exc.msg}); one document object per line") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"{path}:{line_no}: each line needs a string field 'text'")
                docs.append(Document(id=str(row.get("id", line_no)), title=str(row.get("title", "")), text=row["text"]))
        return cls(docs)

    def search(self, query: str, k: int = 3) -> list[tuple[Document, float]]:
        """The ``k`` best documents for ``query`` (fewer if the corpus is smaller), best first."""
        bm25s = _bm25s()
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # nothing but stop words
            return []
        k = min(k, len(self.docs))
        results, scores = self._bm25.retrieve(tokens, k=k, show_progress=False, backend_selection="numpy")
        return [(self.docs[int(i)], float(s)) for i, s in zip(results[0], scores[0]) if s > 0]


def search_tool(index: SearchIndex, *, k: int = 3, max_chars: int = 300) -> Tool:
    """The ``search`` tool: one string argument ``query``; the top ``k`` documents as text."""

    def search(query: str) -> str:
        hits = index.search(query, k)
        if not hits:
            return "No results."
        return "\n".join(f"[{i + 1}] {doc.title}: {doc.text[:max_chars]}" for i, (doc, _) in enumerate(hits))

    return Tool(name="search", description="Search the knowledge base; returns the best matching documents.",
                parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
                fn=search, timeout_s=10.0)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(given: str, gold: str) -> bool:
    return normalize_answer(given) == normalize_answer(gold)


def token_f1(given: str, gold: str) -> float:
    g, t = normalize_answer(given).split(), normalize_answer(gold).split()
    common = sum((Counter(g) & Counter(t)).values())
    if not g or not t or common == 0:
        return float(g == t)
    precision, recall = common / len(g), common / len(t)
    return 2 * precision * recall / (precision + recall)
