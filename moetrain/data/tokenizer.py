"""Tokenizers: the default byte-level BPE trained on the embedded corpus, or a user's file.

``load_tokenizer(spec, cache_dir)`` accepts ``"default"``, a ``tokenizer.json`` file or a local
Hugging Face tokenizer folder holding one, and returns a small wrapper with what the data layer
and the model need: ``vocab_size``, ``eos_id``, ``encode_batch`` and ``decode``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from moetrain.data._cache import publish
from moetrain.data.corpus import corpus_dir, corpus_files
from moetrain.data.dataset import load_local_files
from moetrain.data.errors import DataError
from moetrain.data.fast_bpe import tokenizers_ids

EOS_TOKEN = "<|endoftext|>"
"""Special token of the default tokenizer; it separates documents in the packed stream."""

DEFAULT_VOCAB_SIZE = 4096
"""Vocabulary of the default BPE: small enough for toy models, large enough to compress text."""

# End-of-text tokens of common tokenizers, tried in order when a folder does not name one.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the document separator it is used with.

    ``fingerprint`` is a digest of the serialized tokenizer: token caches are keyed by it.
    """

    def __init__(self, tokenizer: HFTokenizer, eos_token: str, source: str) -> None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"data.tokenizer: {source} has no token {eos_token!r}")
        self._tok = tokenizer
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        """Id of the end-of-text token that separates packed documents."""
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # Some tokenizer.json files have ids past get_vocab_size(); the model must cover them.
        self.vocab_size: int = max(
            tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1
        )
        """Number of token ids (largest id + 1)."""
        self.source = source
        self.fingerprint: str = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
        """Digest of the serialized tokenizer: token caches and prepared datasets carry it."""

    def encode_batch(
        self, texts: list[str], literal_special_tokens: str = "text"
    ) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS (the packer adds the separators). Text
        that spells a special token is ordinary text ("text", ``data.literal_special_tokens``)
        or that token's id ("special")."""
        return tokenizers_ids(self._tok, texts, literal_special_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, without BOS/EOS; text that spells a special token is that
        token (a prompt may hold one)."""
        self._tok.encode_special_tokens = False
        return self._tok.encode(text, add_special_tokens=False).ids

    def to_str(self) -> str:
        """The serialized tokenizer (tokenizer.json); ``fingerprint`` is a digest of it."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens kept by default so document boundaries show."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"eos={self.eos_token!r}:{self.eos_id})"
        )


def load_tokenizer(spec: str, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: "default", a tokenizer.json or an HF folder.

    "default" is trained once on the default corpus's train split and cached as
    ``<cache_dir>/corpus-<hash>/tokenizer.json``; later calls only read that file.
    """
    if spec == "default":
        return _default_tokenizer(cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise DataError(
                f"data.tokenizer: folder {str(path)!r} has no tokenizer.json "
                "(only fast Hugging Face tokenizers are supported)"
            )
        tok = _read(file)
        return Tokenizer(tok, _folder_eos(path, tok), str(path))
    if path.is_file():
        tok = _read(path)
        return Tokenizer(tok, _guess_eos(tok, str(path)), str(path))
    raise DataError(
        f"data.tokenizer: {spec!r} does not exist; use 'default', a tokenizer.json "
        "file or a local Hugging Face tokenizer folder"
    )


def _read(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise DataError(
            f"data.tokenizer: {str(path)!r} is not a valid tokenizer.json: {exc}"
        ) from None


def _guess_eos(tok: HFTokenizer, source: str) -> str:
    for candidate in _EOS_CANDIDATES:
        if tok.token_to_id(candidate) is not None:
            return candidate
    raise DataError(
        f"data.tokenizer: {source} has none of the end-of-text tokens "
        f"{', '.join(_EOS_CANDIDATES)}; add one as a special token"
    )


def _folder_eos(folder: Path, tok: HFTokenizer) -> str:
    """The folder's declared ``eos_token`` (tokenizer_config.json / special_tokens_map.json)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            eos = json.loads(file.read_text()).get("eos_token")
        except (ValueError, AttributeError) as exc:
            raise DataError(f"data.tokenizer: {str(file)!r} is not valid JSON: {exc}") from None
        if isinstance(eos, dict):  # serialized AddedToken
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos
    return _guess_eos(tok, str(folder))


def _default_tokenizer(cache_dir: str | None) -> Tokenizer:
    path = corpus_dir(cache_dir) / "tokenizer.json"
    if not path.is_file():
        tok = train_bpe(_corpus_texts(cache_dir), DEFAULT_VOCAB_SIZE)
        publish(path, lambda f: f.write(tok.to_str().encode()))
    # Always read back the published file: if several ranks trained at once, all use one.
    return Tokenizer(_read(path), EOS_TOKEN, "default")


def _corpus_texts(cache_dir: str | None) -> Iterator[str]:
    ds = load_local_files([str(corpus_files(cache_dir)["train"])], "json", cache_dir)["train"]
    for batch in ds.iter(batch_size=1000):
        yield from batch["text"]


def train_bpe(texts: Iterator[str] | list[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` as its only special token.

    Byte-level: every string round-trips through encode/decode, whatever its script.
    """
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok
