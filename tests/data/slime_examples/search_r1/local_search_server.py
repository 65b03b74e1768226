"""Stub of slime's examples/search-r1/local_search_server.py: `local_search(url, query, topk, proxy)`
answers from a fixed table instead of a retrieval server, and records each query."""

from __future__ import annotations

from typing import Any

QUERIES: list[str] = []

DOCS = {
    "capital of france": ["Paris\nParis is the capital of France.", "France\nA country in Europe."],
}


async def local_search(search_url: str, query: str, top_n: int = 3, proxy: str | None = None) -> list[dict[str, Any]]:
    QUERIES.append(query)
    found = DOCS.get(query.strip().lower(), ["Nothing\nNo document matches."])
    return [{"document": {"contents": text}} for text in found[:top_n]]
