"""The engine options of a command, derived from EngineArgs' fields (engine/config/engine_args.py).

`@engine_options("generate")` replaces the command's `engine` parameter by one Typer option per
EngineArgs field that belongs to the command, in field order, and calls the command with `engine`
holding the options given, as EngineArgs keywords: an option not given is left out, so the engine
keeps its default. Typer reads the command's parameters from `inspect.signature`, which returns
the `__signature__` set here. A command may restyle a shared option for itself (`overrides`: its
help, panel or default), never its name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

from llmctl.engine.config.engine_args import EngineArgs
from llmctl.engine.config.options import ENGINE, PARALLEL, EngineOption, cli_options

__all__ = ["ENGINE", "PARALLEL", "EngineKwargs", "Model", "engine_options"]

EngineKwargs = dict[str, Any]  # EngineArgs keywords: the engine options a user gave

Model = Annotated[
    str | None,
    typer.Argument(
        help="A Hugging Face model directory, a .gguf file, or a hub id already in the local "
        "Hugging Face cache; with --load-format dummy also a catalog name (llmctl plan "
        "--list-models). Omitted: the bundled SmolLM2-135M-Instruct.",
        metavar="MODEL",
        show_default=False,
    ),
]


def engine_options(
    command: str,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    args_class: type = EngineArgs,
    param: str = "engine",
) -> Callable[[Callable], Callable]:
    """Give a command the options of `args_class` (EngineArgs, a dataclass extending it, or
    another dataclass of OptionSpec fields such as ServerConfig) that belong to `command`, in
    place of its `param` parameter, which then receives the options given as keywords.

    `overrides` maps a field to OptionSpec fields (help, panel, default_help) and `default` (a
    value Typer shows and always passes) that differ for this command.
    """
    overrides = overrides or {}

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func, eval_str=True)
        params = list(signature.parameters.values())
        names = [p.name for p in params]
        options = cli_options(command, args_class)
        unknown = set(overrides) - {o.name for o in options}
        clash = set(names) & {o.name for o in options}
        if param not in names or unknown or clash:
            raise TypeError(
                f"{func.__name__}: needs a `{param}` parameter, and no parameter or override "
                f"other than the options of {args_class.__name__} ({sorted(clash | unknown)})"
            )
        at = names.index(param)
        derived = [_parameter(o, overrides.get(o.name, {})) for o in options]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            given = {o.name: kwargs.pop(o.name, None) for o in options}
            kwargs[param] = {name: value for name, value in given.items() if value is not None}
            return func(*args, **kwargs)

        new_params = params[:at] + derived + params[at + 1 :]
        run.__signature__ = signature.replace(parameters=new_params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in new_params}
        return run

    return decorate


def _parameter(option: EngineOption, override: Mapping[str, Any]) -> inspect.Parameter:
    """The Typer parameter of one option: `name: Annotated[T | None, typer.Option(...)] = None`."""
    override = dict(override)
    default = override.pop("default", None)
    if default is not None:
        override["show_default"] = True
    option = dataclasses.replace(option, spec=dataclasses.replace(option.spec, **override))
    show_default = option.spec.show_default
    value = default if default is not None else option.default if show_default else None
    info = typer.Option(
        *option.param_decls,
        help=option.help,
        show_default=show_default,
        rich_help_panel=option.spec.panel,
    )
    annotation = option.value_type if show_default else option.value_type | None
    return inspect.Parameter(
        option.name,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=value,
        annotation=Annotated[annotation, info],
    )
