"""The fastest engine that gives a tokenizer's own ids: tiktoken for a byte-level BPE.

A byte-level BPE (GPT-2's pre-tokenizer regex, or a ``Split`` regex before a regex-free
``ByteLevel``; no normalizer, no dropout, no word prefixes or suffixes) whose merged tokens'
ids increase with their merge order can be run by tiktoken, which merges the pair whose merged
token has the lowest id: several times faster than ``tokenizers`` on one thread. Whether the two
agree is a property of the vocabulary (a token reachable by two different splits could be
merged by tiktoken where the BPE's rules would not), so it is not assumed: ``choose_engine``
builds the tiktoken encoding when the tokenizer's structure allows it, encodes a sample of the
data (and a few awkward strings) with both engines, and uses tiktoken only when every id
agrees; otherwise, or without tiktoken installed, ``tokenizers`` encodes.

Literal special tokens: "text" (``data.literal_special_tokens``) is tiktoken's
``encode_ordinary``, "special" its ``encode`` with every special token allowed.

This module imports the standard library only (tokenizing workers import it); tiktoken and
tokenizers are imported where used.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

log = logging.getLogger(__name__)

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The pre-tokenizer regex of ``tokenizers``' ``ByteLevel(use_regex=True)`` (GPT-2's)."""

PROOF_STRINGS = (
    "plain words, numbers 12345 and punctuation!?",
    "  leading spaces\n\n\ttabs\r\nand line ends   ",
    "unicode: café naïve 日本語 emoji 🙂 combining é",
    "special-token text <|endoftext|> inside a document",
    "code: def f(x):\n    return x ** 2  # comment",
)
"""Strings every proof encodes besides the sample of the data."""


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character of each byte -> the byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _pattern(pre: dict[str, Any] | None) -> str | None:
    """tiktoken's pattern for the pre-tokenizer, or None when it has none."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        ok = not pre.get("add_prefix_space") and pre.get("use_regex", True)
        return GPT2_PATTERN if ok else None
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        if len(steps) != 2:
            return None
        split, byte_level = steps
        if (
            split.get("type") == "Split"
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and "Regex" in split.get("pattern", {})
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex", True)
        ):
            return split["pattern"]["Regex"]
    return None


def tiktoken_encoding(tokenizer_json: str) -> Any | None:
    """A tiktoken ``Encoding`` of the byte-level BPE ``tokenizer_json``, or None when its
    structure is not one tiktoken runs (or tiktoken is not installed)."""
    try:
        import tiktoken
    except ImportError:
        return None
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer") is not None
        or model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or model.get("byte_fallback")
        or (spec.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        return None
    pattern = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None
    vocab: dict[str, int] = model.get("vocab", {})
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    decoder = _byte_decoder()
    ranks: dict[bytes, int] = {}
    for token, i in vocab.items():
        if token in special:
            continue
        try:
            ranks[bytes(decoder[c] for c in token)] = i
        except KeyError:
            return None
    if len(ranks) < 256 or len(set(ranks.values())) != len(ranks):
        return None
    # Merged tokens' ids must follow the merge order (tiktoken merges by id).
    last = -1
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        i = vocab.get(a + b)
        if i is None or i <= last:
            return None
        last = i
    try:
        return tiktoken.Encoding(
            name="moetrain-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
    except ValueError:
        return None


def tiktoken_ids(encoding: Any, texts: list[str], literal_special_tokens: str) -> list[list[int]]:
    """Ids of each text with tiktoken, literal special tokens as ``data.literal_special_tokens``
    says (one thread: the callers parallelise over processes)."""
    if literal_special_tokens == "text":
        return encoding.encode_ordinary_batch(texts, num_threads=1)
    return encoding.encode_batch(texts, num_threads=1, allowed_special="all")


def tokenizers_ids(
    tokenizer: Any, texts: list[str], literal_special_tokens: str
) -> list[list[int]]:
    """Ids of each text with ``tokenizers`` (the reference engine)."""
    tokenizer.encode_special_tokens = literal_special_tokens == "text"
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def choose_engine(tokenizer_json: str, sample: list[str], literal_special_tokens: str) -> str:
    """ "tiktoken" when it builds from ``tokenizer_json`` and gives the ids of ``tokenizers``
    on ``sample`` and ``PROOF_STRINGS``, else "tokenizers" (logged either way)."""
    encoding = tiktoken_encoding(tokenizer_json)
    if encoding is None:
        log.info("tokenizing with tokenizers (the tokenizer is not a BPE tiktoken can run)")
        return "tokenizers"
    from tokenizers import Tokenizer

    texts = [*PROOF_STRINGS, *sample]
    want = tokenizers_ids(Tokenizer.from_str(tokenizer_json), texts, literal_special_tokens)
    got = tiktoken_ids(encoding, texts, literal_special_tokens)
    bad = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
    if bad is not None:
        log.warning(
            "tokenizing with tokenizers: tiktoken gives other ids for text %d of the proof "
            "sample (%r...)",
            bad,
            texts[bad][:40],
        )
        return "tokenizers"
    chars = sum(len(t) for t in texts)
    log.info("tokenizing with tiktoken: identical ids on a sample of %d texts, %d chars",
             len(texts), chars)  # fmt: skip
    return "tiktoken"
