"""The `llmctl` command: sub-apps joined here; one exit path for every error."""

from __future__ import annotations

import sys


def main() -> None:
    print("llmctl")
    sys.exit(0)
