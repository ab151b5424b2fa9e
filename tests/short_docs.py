"""A local dataset of short documents, for the tests of document masking.

The embedded corpus's documents are long (about a thousand tokens): a 16- or 32-token
training sequence rarely holds a boundary. This one cuts the corpus's prose into its lines of
8 to 120 characters, one document each (a few to a few dozen tokens of the default tokenizer),
so that every sequence packs several documents and some are cut by a sequence boundary. Made
once per machine and corpus, published atomically; import it as ``from short_docs import
short_docs_dataset``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

DOCS = 3000


def short_docs_dataset() -> str:
    """Path of ``short-docs.jsonl`` (``DOCS`` documents, a ``text`` column)."""
    from moetrain.data.corpus import corpus_files

    source = corpus_files(None)["train"]
    key = hashlib.sha1(f"{source.stat().st_size}:{DOCS}:v1".encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"moetrain-short-docs-{key}" / "short-docs.jsonl"
    if path.is_file():
        return str(path)
    docs: list[str] = []
    with open(source) as f:
        for line in f:
            record = json.loads(line)
            if record.get("domain") == "code":
                continue
            docs += [t.strip() for t in record["text"].splitlines() if 8 <= len(t.strip()) <= 120]
            if len(docs) >= DOCS:
                break
    staging = Path(tempfile.mkdtemp(prefix=path.parent.name + ".", dir=path.parent.parent))
    with open(staging / path.name, "w") as f:
        for text in docs[:DOCS]:
            f.write(json.dumps({"text": text}) + "\n")
    try:
        os.rename(staging, path.parent)
    except OSError:  # another process published it first
        shutil.rmtree(staging, ignore_errors=True)
    return str(path)
