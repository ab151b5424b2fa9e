"""Fixtures of the data tests: the real default corpus built once per session, small local files.

Hub access is switched off: a hub name must fail fast with a DataError, never wait on a network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402

from moetrain.config import DataConfig  # noqa: E402
from moetrain.data import Tokenizer, check_data, load_tokenizer  # noqa: E402

# A few real paragraphs per document so that packing crosses document boundaries.
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Packing joins documents with an end-of-text token between them.",
    "A mixture of experts routes every token to a few of its feed-forward networks.",
    "Évaluer le modèle sur des données réservées évite de se tromper soi-même.",
    "def f(x):\n    return x * 2\n",
    "Load balancing keeps every expert busy; dropped tokens skip the layer.",
]


def make_docs(n: int, tag: str = "doc") -> list[str]:
    """``n`` distinct documents of a few sentences each."""
    return [
        f"{tag} {i}: " + " ".join(_SENTENCES[(i + j) % len(_SENTENCES)] for j in range(1 + i % 5))
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session", autouse=True)
def _offline_hub() -> Iterator[None]:
    # The variables above are read when datasets / huggingface_hub are imported; if another
    # test module imported them first, switch their module-level flags off as well.
    import datasets
    import huggingface_hub.constants

    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A session cache holding the real default corpus, tokenizer and token caches."""
    root = tmp_path_factory.mktemp("moetrain-cache")
    check_data(DataConfig(cache_dir=str(root)))
    return str(root)


@pytest.fixture(scope="session")
def tokenizer(cache_dir: str) -> Tokenizer:
    return load_tokenizer("default", cache_dir)


@pytest.fixture
def data_cfg(cache_dir: str) -> Callable[..., DataConfig]:
    """``DataConfig`` factory with the session cache; keyword arguments override fields."""

    def make(**kw) -> DataConfig:
        kw.setdefault("cache_dir", cache_dir)
        cfg = DataConfig(**kw)
        cfg.validate()
        return cfg

    return make


@pytest.fixture
def helpers() -> SimpleNamespace:
    """``make_docs`` and ``write_jsonl`` (handed out as a fixture: conftests are not imported
    by name, whatever pytest's import mode)."""
    return SimpleNamespace(make_docs=make_docs, write_jsonl=write_jsonl)


@pytest.fixture
def docs() -> list[str]:
    return make_docs(120)


@pytest.fixture
def jsonl_file(tmp_path: Path, docs: list[str]) -> Path:
    return write_jsonl(tmp_path / "docs.jsonl", [{"text": t, "id": i} for i, t in enumerate(docs)])
