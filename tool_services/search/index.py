"""An in-memory SQLite FTS5 index over a directory of Markdown/text documents.

Ranking is FTS5's bm25 (the title weighs 5x the body); snippets come from
FTS5's ``snippet()``. User queries never reach FTS5 syntax: the query is split
into word terms, each term is quoted, and the terms are combined first with AND
(every term must match) and, if that finds nothing, with OR. A query with no
word characters finds nothing. So ``"``, ``*``, ``NEAR``, ``-`` or ``:`` in a
query can never cause an error.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAX_TERMS: Final = 32
SUFFIXES: Final = (".md", ".txt")
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True, slots=True)
class Hit:
    title: str
    path: str
    snippet: str
    score: float


class SearchIndex:
    """Build once from a directory; query many times (one thread)."""

    def __init__(self, documents: list[tuple[str, str, str]]) -> None:
        """``documents``: ``(title, path, body)`` triples."""
        self._db = sqlite3.connect(":memory:")
        self._db.execute(
            "CREATE VIRTUAL TABLE docs USING fts5("
            "title, path UNINDEXED, body, tokenize = 'porter unicode61')"
        )
        self._db.executemany("INSERT INTO docs (title, path, body) VALUES (?, ?, ?)", documents)
        self._db.commit()
        self.size = len(documents)

    @classmethod
    def from_directory(cls, root: Path, *, label: str = "docs") -> SearchIndex:
        documents = []
        for file in sorted(root.rglob("*")):
            if file.is_file() and file.suffix in SUFFIXES:
                body = file.read_text(encoding="utf-8")
                path = f"{label}/{file.relative_to(root).as_posix()}"
                documents.append((_title(body, file), path, body))
        if not documents:
            raise ValueError(f"no documents ({', '.join(SUFFIXES)}) under {root}")
        return cls(documents)

    def search(self, query: str, limit: int = 5) -> list[Hit]:
        terms = [t.lower() for t in _WORD.findall(query)][:MAX_TERMS]
        if not terms:
            return []
        quoted = ['"' + t.replace('"', '""') + '"' for t in dict.fromkeys(terms)]
        hits = self._match(" AND ".join(quoted), limit)
        if not hits and len(quoted) > 1:
            hits = self._match(" OR ".join(quoted), limit)
        return hits

    def _match(self, expression: str, limit: int) -> list[Hit]:
        rows = self._db.execute(
            "SELECT title, path, snippet(docs, 2, '**', '**', ' … ', 24), bm25(docs, 5.0, 0.0, 1.0)"
            " FROM docs WHERE docs MATCH ? ORDER BY bm25(docs, 5.0, 0.0, 1.0) LIMIT ?",
            (expression, limit),
        ).fetchall()
        return [
            Hit(title=title, path=path, snippet=_clean(snippet), score=round(-rank, 4))
            for title, path, snippet, rank in rows
        ]

    def close(self) -> None:
        self._db.close()


def _title(body: str, file: Path) -> str:
    for line in body.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return file.stem.replace("-", " ").replace("_", " ")


def _clean(snippet: str) -> str:
    """One line, without Markdown heading marks."""
    return " ".join(word for word in snippet.split() if word.strip("#"))
