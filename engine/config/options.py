"""OptionSpec: a dataclass field that is also a command-line option, declared once.

A field carries an `OptionSpec` in its metadata (help, panel, vLLM aliases such as -tp, bool
style, the commands it belongs to), as vLLM's EngineArgs carries its argparse options. EngineArgs
(config/engine_args.py) and ServerConfig (entrypoints/openai/server_config.py) declare their
fields this way; everything else is derived from the declarations: the commands' Typer options
(cli/engine_options.py), the options `plan` shares with the engine, the keys a Ray Serve app
accepts, and the argv that gives the keywords back to `llmctl serve` (`args_to_argv`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Help panels, and the commands an option can belong to.
ENGINE = "Engine"
PARALLEL = "Parallelism"
SERVER = "Server"
GENERATE, SERVE, PLAN = "generate", "serve", "plan"
RAY_SERVE = "ray-serve"  # a key of a Ray Serve application's `args:` (ray_serve_app.py)
ENGINE_COMMANDS = (GENERATE, SERVE)  # the commands that start an engine
PLANNER = (GENERATE, SERVE, PLAN)  # ... and `plan`, whose prediction depends on the option

_OPTION = "llmctl.option"  # the metadata key of a field's OptionSpec


@dataclass(frozen=True)
class OptionSpec:
    """How an EngineArgs field appears on the command line, as --field-name (underscores become
    dashes). A field without one is a keyword of LLM(...) only."""

    help: str
    panel: str | None = ENGINE  # the --help panel; None: the command's plain Options
    aliases: tuple[str, ...] = ()  # vLLM's short names, e.g. ("-tp",)
    negatable: bool = True  # a bool: --x/--no-x; False: --x alone, which sets True
    # Help's "(default: ...)": None derives it from the field's default ("enabled" for a true
    # bool, nothing for a false one); "" prints none.
    default_help: str | None = None
    # Give the command the field's default (Typer prints "[default: X]" and the value is always
    # passed) instead of None, which leaves the engine's default.
    show_default: bool = False
    value_type: type | None = None  # the value's type on the command line, when the field's
    # type is a union of several (pipeline_layer_partition: a str such as "10,11,9")
    commands: tuple[str, ...] = ENGINE_COMMANDS


def option(help: str, *, default: Any, **spec: Any) -> Any:
    """A field that is a command-line option: `block_size: int = option("...", default=16)`."""
    return field(default=default, metadata={_OPTION: OptionSpec(help, **spec)})


@dataclass(frozen=True)
class EngineOption:
    """One command-line option of an EngineArgs field, resolved from its OptionSpec."""

    name: str  # the field: the keyword of EngineArgs
    spec: OptionSpec
    default: Any  # the field's default
    value_type: type  # of the value on the command line (bool for a flag)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def param_decls(self) -> tuple[str, ...]:
        """The names to declare, in Click's spelling (a bool as "--x/--no-x", or "--x")."""
        if self.value_type is bool and self.spec.negatable:
            return (f"{self.flag}/--no-{self.flag[2:]}", *self.spec.aliases)
        return (self.flag, *self.spec.aliases)

    @property
    def help(self) -> str:
        if self.spec.show_default:
            return self.spec.help  # Typer prints "[default: X]"
        text = self.spec.default_help
        if text is None:
            text = _default_text(self.default)
        return f"{self.spec.help} (default: {text})" if text else self.spec.help

    def argv(self, value: Any, alias: bool = False) -> list[str]:
        """The flags that give `value` (None gives nothing: the engine's default), under the
        first alias with `alias` (-tp 2)."""
        if value is None:
            return []
        if self.value_type is bool:
            if value:
                return [self.flag]
            return [f"--no-{self.flag[2:]}"] if self.spec.negatable else []
        if isinstance(value, (tuple, list)):
            value = ",".join(str(v) for v in value)
        flag = self.spec.aliases[0] if alias and self.spec.aliases else self.flag
        return [flag, str(value)]


def cli_options(command: str | None, args_class: type) -> tuple[EngineOption, ...]:
    """The command-line options of `args_class` (a dataclass with OptionSpec fields), in field
    order: those of `command` ("generate", "serve", "plan", "ray-serve"), or all."""
    hints = typing.get_type_hints(args_class)
    options = []
    for f in dataclasses.fields(args_class):
        spec = f.metadata.get(_OPTION)
        if spec is None or (command is not None and command not in spec.commands):
            continue
        value_type = spec.value_type or _value_type(f.name, hints[f.name])
        if value_type is bool and not spec.negatable and f.default is not False:
            raise TypeError(f"{f.name}: a flag without --no-{f.name} needs the default False")
        options.append(EngineOption(f.name, spec, f.default, value_type))
    return tuple(options)


def args_to_argv(
    kwargs: Mapping[str, Any], args_class: type, *, aliases: bool = False
) -> list[str]:
    """The command-line flags that give these keywords of `args_class` to `llmctl serve` (or
    `generate`), in field order; a None value is left out (the default). `aliases` spells an
    option by its vLLM alias where it has one (-tp 2)."""
    by_name = {o.name: o for o in cli_options(None, args_class)}
    unknown = sorted(set(kwargs) - set(by_name))
    if unknown:
        raise ValueError(f"no command-line flag for {', '.join(unknown)}")
    return [
        arg
        for name, o in by_name.items()
        if name in kwargs
        for arg in o.argv(kwargs[name], alias=aliases)
    ]


def _value_type(name: str, hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if len(args) != 1:
            raise TypeError(f"{name}: give the OptionSpec a value_type for {hint}")
        return args[0]
    return hint


def _default_text(default: Any) -> str:
    if isinstance(default, bool):
        return "enabled" if default else ""
    if default is None or default is dataclasses.MISSING:
        return ""
    return f"{default:g}" if isinstance(default, float) else str(default)
