"""A SentencePiece BPE vocabulary that transformers 5.17 converts into a degenerate Unigram model is rebuilt as BPE.

Small vocabularies check the merges and the added tokens against hand-derived values; Gemma 3 270M's real
vocabulary (installed by ``make test``) checks that the rebuild of a Unigram tokenizer as 5.17 writes it is the
tokenizer transformers 5.24 converts, and that ``repair`` finds and fixes only the broken one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ctxrl.models.gguf_vocab import CONTROL, NORMAL, USER_DEFINED, rebuild, sentencepiece_merges

BACKEND = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": {"type": "Unigram"}}


def test_merges_follow_the_order_pieces_were_created_longest_left_part_first():
    pieces = ["<unk>", "a", "b", "c", "ab", "abc", "bc", "cab"]
    # "ab" = a+b; "abc" = ab+c before a+bc (longest left first); "bc" = b+c; "cab" = c+ab ("ca" is no piece)
    assert sentencepiece_merges(pieces) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c"), ("c", "ab")]
    assert sentencepiece_merges(["a", "b"]) == []


def test_rebuild_writes_bpe_with_control_tokens_special_and_spaces_as_sentencepiece_spaces():
    tokens = ["<unk>", "<bos>", "<tool>", "  ", "a", "\u2581a", "a\u2581a"]
    types = [CONTROL, CONTROL, USER_DEFINED, USER_DEFINED, NORMAL, NORMAL, NORMAL]
    out = rebuild(BACKEND, tokens, types, bos="<bos>")
    model = out["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] and model["unk_token"] == "<unk>"
    assert model["vocab"] == {"<unk>": 0, "<bos>": 1, "<tool>": 2, "\u2581\u2581": 3, "a": 4, "\u2581a": 5,
                              "a\u2581a": 6}
    assert model["merges"] == [["a", "\u2581a"]]  # "\u2581" alone is no piece: "\u2581a", "\u2581\u2581" are no merges
    added = {a["content"]: a["special"] for a in out["added_tokens"]}
    assert added == {"<unk>": True, "<bos>": True, "<tool>": False}  # a user-defined run of spaces stays a piece
    assert out["post_processor"]["special_tokens"]["<bos>"]["ids"] == [1]
    assert rebuild(BACKEND, tokens, types, bos=None)["post_processor"] is None  # kept as it was
    assert BACKEND["model"] == {"type": "Unigram"}  # the input is not changed


# -- the real vocabulary -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    from ctxrl.models.loader import resolve
    from ctxrl.models.named import named_file, named_model

    directory = Path(resolve("gemma3-270m"))
    return directory, named_file(named_model("gemma3-270m"))


def _as_517_writes_it(good: dict, tokens: list[str], path: Path) -> dict:
    """transformers 5.17's conversion of the file: the same pieces as a Unigram model scored by the GGUF's scores,
    five special tokens added and no bos in the post-processor."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["tokenizer.ggml.scores"]
    scores = [float(field.parts[i][0]) for i in field.data]
    bad = dict(good)
    pieces = [t.replace(" ", "\u2581") for t in tokens]
    bad["model"] = {"type": "Unigram", "unk_id": 3, "byte_fallback": True, "vocab": [[p, s] for p, s in
                                                                                       zip(pieces, scores)]}
    bad["added_tokens"] = [a for a in good["added_tokens"] if a["id"] < 5]
    bad["post_processor"] = None
    return bad


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_the_rebuilt_gemma_tokenizer_is_the_one_transformers_524_converts(gemma):
    from ctxrl.models.gguf_vocab import gguf_vocabulary

    directory, path = gemma
    good = json.loads((directory / "tokenizer.json").read_text())
    tokens, types = gguf_vocabulary(path)
    bad = _as_517_writes_it(good, tokens, path)
    out = rebuild(bad, tokens, types, bos="<bos>")
    assert out["model"] == good["model"] and len(out["model"]["merges"]) == 514906
    assert out["added_tokens"] == good["added_tokens"] and out["post_processor"] == good["post_processor"]


@pytest.mark.slow  # minutes on a 2-core CPU: out of the default run (`-m slow` runs it)
def test_repair_rebuilds_only_a_degenerate_unigram_tokenizer(gemma, tmp_path):
    from transformers import AutoTokenizer

    from ctxrl.models.gguf import gguf_metadata
    from ctxrl.models.gguf_vocab import gguf_vocabulary, repair, whole_piece_share

    directory, path = gemma
    metadata = gguf_metadata(path)
    good = AutoTokenizer.from_pretrained(str(directory))
    assert repair(good, path, metadata) == (good, [])  # a BPE tokenizer is left alone
    tokens, types = gguf_vocabulary(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    bad_json = _as_517_writes_it(json.loads((directory / "tokenizer.json").read_text()), tokens, path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(bad_json))
    bad = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(bad.tokenize("Hello world")) > 5 and whole_piece_share(bad, tokens, types) < 0.5  # as on the card
    fixed, fixes = repair(bad, path, metadata)
    assert fixes and "-> BPE with the merges" in fixes[0] and "100%" in fixes[0]
    text = "<start_of_turn>user\nWhat is 3 + 4?<end_of_turn>\n"
    assert fixed.encode(text, add_special_tokens=False) == good.encode(text, add_special_tokens=False)
    assert fixed.tokenize("Hello world") == ["Hello", "\u2581world"]
