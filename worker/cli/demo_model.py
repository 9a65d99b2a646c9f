"""The scripted demo model: what the demo uses when no model endpoint is configured.

It is not a language model. It follows a fixed plan that exercises the real
machinery end to end: in its first step it searches the shipped documents for
the question (and computes any arithmetic in it, in parallel); in its second it
files a note of what it found; then it answers from the tool results it was
given. Everything around it — queues, Redis, tool services, events — is real.

Run on its own (the walk-through in docs/operations.md, "Running it by hand")::

    python -m worker.cli.demo_model --port 8099

serves ``http://127.0.0.1:8099/v1`` until Ctrl-C or SIGTERM; point a worker at it with
``LOOPWIRE_MODEL__BASE_URL=http://127.0.0.1:8099/v1`` and ``LOOPWIRE_MODEL__MODEL=loopwire-demo``.

For the ``triage`` workflow (``loopwire demo --workflow``) it plays each agent by what the
request offers: asked for structured output it classifies (billing words → ``billing``,
else ``technical``); offered the ``researcher`` agent as a tool it delegates the question to
it and answers from its report; offered ``search`` alone it researches; offered
``calculate`` alone it works out the amounts in the question.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
from typing import Any

from worker.testing.scripted_model import Reply, ScriptedModel

STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "does",
        "do",
        "for",
        "from",
        "how",
        "i",
        "in",
        "is",
        "it",
        "of",
        "on",
        "or",
        "the",
        "to",
        "what",
        "when",
        "where",
        "which",
        "who",
        "why",
        "with",
        "you",
        "your",
        "can",
        "could",
        "would",
        "should",
        "will",
        "loopwire",
    ]
)
ARITHMETIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:\s*(?:\*\*|[-+*/%])\s*\d+(?:\.\d+)?)+)")


def _question(messages: list[dict[str, Any]]) -> str:
    return next(
        (str(m.get("content") or "") for m in reversed(messages) if m["role"] == "user"), ""
    )


def _tool_results(messages: list[dict[str, Any]]) -> list[Any]:
    start = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
    results = []
    for message in messages[start:]:
        if message["role"] == "tool":
            text = str(message.get("content") or "")
            try:
                results.append(json.JSONDecoder().raw_decode(text)[0])
            except ValueError:
                results.append(text)
    return results


BILLING_WORDS = re.compile(
    r"\b(charged?|refunds?|invoices?|bill(?:ed|ing)?|paid|pay|price)\b", re.I
)


def demo_responder(request: dict[str, Any]) -> Reply:
    messages: list[dict[str, Any]] = request["messages"]
    question = _question(messages)
    results = _tool_results(messages)
    offered = {t["function"]["name"] for t in request.get("tools") or []}
    if request.get("response_format"):
        category = "billing" if BILLING_WORDS.search(question) else "technical"
        return Reply.text(json.dumps({"category": category, "reason": "by its words"}))
    if "researcher" in offered:
        if not results:
            return Reply.tool_calls(("researcher", {"input": question}), content="Asking research.")
        return Reply.text(f"Our researcher reports: {results[0]}")
    if offered == {"search"}:
        if not results:
            return Reply.tool_calls(("search", {"query": _keywords(question), "limit": 3}))
        return Reply.text(_answer(results, noted=False))
    if offered == {"calculate"}:
        arithmetic = ARITHMETIC.search(question)
        if not results and arithmetic:
            return Reply.tool_calls(("calculate", {"expression": arithmetic.group(1)}))
        owed = next((r for r in results if isinstance(r, dict) and "value" in r), None)
        return Reply.text(
            f"You are owed {owed.get('decimal', owed['value'])}; the refund is on its way."
            if owed
            else "I found no amount to refund in your message."
        )
    if not results:
        calls: list[tuple[str, dict[str, object]]] = []
        arithmetic = ARITHMETIC.search(question)
        calls.append(("search", {"query": _keywords(question), "limit": 3}))
        if arithmetic:
            calls.append(("calculate", {"expression": arithmetic.group(1)}))
        return Reply.tool_calls(*calls, content="Let me look that up.")
    if not any(isinstance(r, dict) and "note_id" in r for r in results):
        found = _best_hit(results)
        return Reply.tool_calls(
            ("file_note", {"title": "demo", "text": f"Q: {question[:200]} / A: {found[:300]}"})
        )
    return Reply.text(_answer(results))


def _keywords(question: str) -> str:
    words = [w for w in re.findall(r"[A-Za-z][\w-]+", ARITHMETIC.sub(" ", question))]
    return " ".join(w for w in words if w.lower() not in STOPWORDS) or question


def _best_hit(results: list[Any]) -> str:
    for result in results:
        if isinstance(result, dict) and result.get("results"):
            top = result["results"][0]
            return f"{top.get('title', '')}: {top.get('snippet', '')}"
    return "nothing in the documents"


def _answer(results: list[Any], *, noted: bool = True) -> str:
    parts = []
    hits: list[Any] = next(
        (r["results"] for r in results if isinstance(r, dict) and r.get("results")), []
    )
    if hits:
        titles = ", ".join(str(h.get("title", "?")) for h in hits[:3])
        snippet = re.sub(r"\s+", " ", str(hits[0].get("snippet", "")).replace("**", "")).strip()
        parts.append(f"From the documentation ({titles}): {snippet}")
    else:
        parts.append("The documentation has nothing on that.")
    for result in results:
        if isinstance(result, dict) and "value" in result and "expression" in result:
            parts.append(f"And {result['expression']} = {result['value']}.")
    if noted:
        parts.append("(I filed a note of this answer.)")
    return " ".join(parts)


def demo_model() -> ScriptedModel:
    model = ScriptedModel(model="loopwire-demo")
    model.respond_with(demo_responder)
    return model


async def _serve(host: str, port: int) -> None:
    model = demo_model()
    base_url = await model.start(host, port)
    sys.stdout.write(f"demo model listening on {base_url} (a fixed plan, not an LLM)\n")
    sys.stdout.flush()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await model.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m worker.cli.demo_model",
        description="The demo's scripted model on its own: an OpenAI-compatible server that "
        "plays the demo's tool-calling plan (search, calculate, file a note, answer).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()
