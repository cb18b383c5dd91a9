"""A GGUF SentencePiece vocabulary that transformers converted into a tokenizer that cannot tokenize: rebuilt.

transformers 5.17 converts Gemma 3's GGUF tokenizer (``tokenizer.ggml.model = "llama"``, a SentencePiece BPE
vocabulary) into a ``Unigram`` model that scores pieces with the file's ``tokenizer.ggml.scores``. Those scores
fall with the piece's id, so the best-scoring split of any word is its single characters: "Hello" becomes five
tokens, a prompt three times its length, and ctxrl's prefix check fails at start-up. (5.24 converts the same
file correctly.)

A SentencePiece BPE vocabulary lists its pieces in the order training created them, so the merges are implied:
every piece that splits into two pieces of the vocabulary is one merge, ranked by the piece's id (the longest
left part first where a piece splits several ways). ``rebuild`` writes that BPE model, with the file's control
tokens as special added tokens, its user-defined tokens as added tokens, and the bos token the file asks for.
The result is the tokenizer transformers 5.24 builds from the same file (``tests/test_gguf_vocab.py``).

The repair runs only where it is needed: a ``llama`` vocabulary whose converted tokenizer encodes fewer than half
of a sample of its own multi-character pieces as one token (5.17's Unigram model; 5.24 reading that Unigram
tokenizer.json back as BPE without merges). Anything else is left as transformers made it.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # tokenizer.ggml.token_type values (llama.cpp's)
SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies, in rank order (see the module docstring)."""
    index = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                merges.append((left, right))
    return merges


def rebuild(backend: dict[str, Any], tokens: list[str], types: list[int], *, bos: str | None) -> dict[str, Any]:
    """``backend`` (a tokenizer.json as a dict) with the BPE model, added tokens and bos of the GGUF vocabulary
    ``tokens`` / ``types``; its normalizer, pre-tokenizer and decoder are kept."""
    pieces = [token.replace(" ", SPACE) for token in tokens]
    added = []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL or (kind == USER_DEFINED and " " not in token):
            added.append({"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == CONTROL})
    rebuilt = dict(backend)
    rebuilt["added_tokens"] = added
    rebuilt["model"] = {
        "type": "BPE", "dropout": None, "unk_token": "<unk>" if "<unk>" in pieces else None,
        "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
        "ignore_merges": False, "vocab": {piece: i for i, piece in enumerate(pieces)},
        "merges": [list(pair) for pair in sentencepiece_merges(pieces)],
    }
    if bos is not None:
        one = [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
        pair = one + [{"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]
        rebuilt["post_processor"] = {"type": "TemplateProcessing", "single": one, "pair": pair,
                                     "special_tokens": {bos: {"id": bos, "ids": [pieces.index(bos)], "tokens": [bos]}}}
    return rebuilt


def whole_piece_share(tokenizer, tokens: list[str], types: list[int], sample: int = 2000, seed: int = 0) -> float:
    """The share of a sample of the vocabulary's normal multi-character pieces that encode as one token."""
    candidates = [t for t, kind in zip(tokens, types) if kind == NORMAL and len(t) > 1 and not t.startswith("<")]
    if not candidates:
        return 1.0
    chosen = random.Random(seed).sample(candidates, min(sample, len(candidates)))
    whole = sum(len(tokenizer.encode(t.replace(SPACE, " "), add_special_tokens=False)) == 1 for t in chosen)
    return whole / len(chosen)


def gguf_vocabulary(path: Path) -> tuple[list[str], list[int]]:
    """The GGUF file's token strings and token types."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    return tokens, types


def repair(tokenizer, path: Path, metadata: dict[str, Any]) -> tuple[Any, list[str]]:
    """``tokenizer`` rebuilt as BPE where transformers made a SentencePiece (``llama``) vocabulary a tokenizer that
    splits its own pieces; (the tokenizer to use, the fixes made)."""
    from transformers import AutoTokenizer

    if metadata.get("tokenizer.ggml.model") != "llama":
        return tokenizer, []
    tokens, types = gguf_vocabulary(path)
    before = whole_piece_share(tokenizer, tokens, types)
    if before >= 0.5:
        return tokenizer, []
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    kind = backend["model"]["type"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    bos = tokens[bos_id] if metadata.get("tokenizer.ggml.add_bos_token") and isinstance(bos_id, int) else None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(rebuild(backend, tokens, types, bos=bos)))
        rebuilt = AutoTokenizer.from_pretrained(tmp)
    after = whole_piece_share(rebuilt, tokens, types)
    fix = (f"tokenizer model {kind} -> BPE with the merges its SentencePiece vocabulary implies: the converted "
           f"tokenizer encoded {before:.0%} of a sample of its own pieces as one token, the rebuilt one {after:.0%}")
    return rebuilt, [fix]
