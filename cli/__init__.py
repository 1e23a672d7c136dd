"""llmctl command line: one Typer sub-app per command group, joined in main.py."""
