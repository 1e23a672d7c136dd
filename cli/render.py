"""Completions as the user reads them (rich text) and as programs read them (JSON records)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from llmctl.engine.outputs import RequestOutput


def completion_records(
    prompts: Sequence[str], outputs: Sequence[RequestOutput | None]
) -> list[dict[str, Any]]:
    """One record per completion, in prompt order; prompts without an output are skipped."""
    return [
        {
            "prompt": prompt,
            "index": completion.index,
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
        }
        for prompt, output in zip(prompts, outputs, strict=True)
        if output is not None
        for completion in output.outputs
    ]


def print_json(
    console: Console, prompts: Sequence[str], outputs: Sequence[RequestOutput | None]
) -> None:
    """Print the completion records as a JSON list, one record per line; no colours, no wrap."""
    records = [json.dumps(r, ensure_ascii=False) for r in completion_records(prompts, outputs)]
    console.out("[\n  " + ",\n  ".join(records) + "\n]" if records else "[]", highlight=False)


def print_completions(
    console: Console, prompts: Sequence[str], outputs: Sequence[RequestOutput | None]
) -> None:
    """Print each prompt, then its completion(s); text is never wrapped nor read as markup."""
    for prompt, output in zip(prompts, outputs, strict=True):
        if output is None:
            continue
        console.print(Text.assemble(("Prompt: ", "bold cyan"), prompt), soft_wrap=True)
        n = len(output.outputs)
        for completion in output.outputs:
            label = "Completion: " if n == 1 else f"Completion {completion.index + 1}/{n}: "
            console.print(Text.assemble((label, "bold green"), completion.text), soft_wrap=True)
        console.print()
