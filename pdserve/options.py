"""Command-line options derived from config dataclasses: one declaration, the same flag in every command.

A dataclass field is an option when its metadata has a ``help`` text (declare it with ``option(...)``).
Its flag is the field's name with dashes (``push_timeout_s`` is ``--push-timeout-s``) unless the metadata
names another (``flag``); its default, choices and help are the field's. A boolean field that defaults to
True is the switch ``--no-<name>`` (an ``enable_`` prefix dropped); one that defaults to False is
``--<name>``. Every option's ``dest`` is its field name, so ``config_from_args`` finds it again.

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_config_arguments(parser, DeploymentConfig, only=("mode", "transport"))
    config = config_from_args(DeploymentConfig, parser.parse_args(argv))

``HelpFormatter`` shows each default once, after the help text, and none for switches.
Standard library only: commands that never load torch or Ray import it.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Collection, Iterator
from dataclasses import MISSING, Field, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def option(
    default: Any, help: str, *, choices: Collection[Any] | None = None, flag: str | None = None, env: str | None = None
) -> Any:
    """A dataclass field that is a command-line option: ``x: int = option(4, "what x is")``.

    ``flag`` overrides the derived flag name; ``env`` names an environment variable whose value, when
    set, is the option's default on the command line (the field's default stays ``default``)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if flag is not None:
        metadata["flag"] = flag
    if env is not None:
        metadata["env"] = env
    return field(default=default, metadata=metadata)


def option_fields(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s fields that are options (those with a help text), in declaration order."""
    return tuple(f.name for f in fields(cls) if f.metadata.get("help"))


def option_flag(cls: type, name: str) -> str:
    """The flag of one field: ``"--block-size"``, ``"--no-chunked-prefill"`` for ``enable_chunked_prefill``."""
    f = _field(cls, name)
    if "flag" in f.metadata:
        return f.metadata["flag"]
    dashed = name.replace("_", "-")
    if _value_type(cls, f) is bool and f.default is True:
        return "--no-" + dashed.removeprefix("enable-")
    return "--" + dashed


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    title: str | None = None,
    description: str | None = None,
) -> argparse._ArgumentGroup:
    """Add one option per option field of ``cls`` (those in ``only`` when given, less ``exclude``), as a
    group titled ``title`` (default: the class name). Raises ``ValueError`` for a name that is not an
    option field of ``cls``. Returns the group."""
    names = _selected(cls, only, exclude)
    group = parser.add_argument_group(title or cls.__name__, description)
    for name in names:
        f = _field(cls, name)
        kind = _value_type(cls, f)
        description_text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        default = _default(f)
        if kind is bool:
            action = "store_false" if default else "store_true"
            text = f"turn off: {description_text}" if default else description_text
            group.add_argument(option_flag(cls, name), dest=name, action=action, default=default, help=text)
            continue
        env = f.metadata.get("env")
        if env is not None:
            default = os.environ.get(env, default)
            description_text += f" (default: ${env})"
        flag = option_flag(cls, name)
        group.add_argument(
            flag,
            dest=name,
            metavar=None if f.metadata.get("choices") else flag.removeprefix("--").replace("-", "_").upper(),
            type=kind,
            default=default,
            choices=f.metadata.get("choices"),
            help=description_text,
        )
    # a command may add a class's options in two groups
    parser.set_defaults(**{_dest(cls): (*offered(parser, cls), *names)})
    return group


def offered(parser: argparse.ArgumentParser, cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s options that ``add_config_arguments`` added to ``parser``."""
    return tuple(parser.get_default(_dest(cls)) or ())


def config_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the options of ``cls`` that ``add_config_arguments`` added to ``args``' parser.

    Raises ``ValueError`` when the parser had none."""
    names = getattr(args, _dest(cls), None)
    if names is None:
        raise ValueError(f"the parser has no {cls.__name__} options (add_config_arguments)")
    return {name: getattr(args, name) for name in names}


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` of its options in ``args`` (fields without an option keep their defaults; ``overrides``
    win over both). Raises ``ValueError`` when the parser had no such options, or for an invalid config."""
    return cls(**{**config_values(cls, args), **overrides})


class HelpFormatter(argparse.HelpFormatter):
    """Each option's default once, after its help: none for switches, none where the help already
    says what the default is, none when there is no default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))
            or action.default == ""
            or "default" in text
        ):
            return text
        return text + " (default: %(default)s)"


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``HelpFormatter`` that keeps the description's line breaks (examples stay as written)."""


def plain_text(doc: str) -> str:
    """A docstring as help text: without its reStructuredText markup (````code```` is ``code``, ``::`` is ``:``)."""
    return doc.replace("``", "").replace("::\n", ":\n")


def _dest(cls: type) -> str:
    return f"_options_of_{cls.__module__}.{cls.__qualname__}"


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    raise ValueError(f"option {f.name!r} has no plain default")


def _selected(cls: type, only: Collection[str] | None, exclude: Collection[str]) -> tuple[str, ...]:
    known = option_fields(cls)
    unknown = sorted({*(only or ()), *exclude} - set(known))
    if unknown:
        raise ValueError(f"not {cls.__name__} options: {', '.join(unknown)}")
    return tuple(n for n in known if (only is None or n in only) and n not in exclude)


def _field(cls: type, name: str) -> Field[Any]:
    for f in fields(cls):
        if f.name == name:
            return f
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def _value_type(cls: type, f: Field[Any]) -> type:
    """``int`` for ``int | None``, and so on: what the option's text converts to."""
    hint = typing.get_type_hints(cls)[f.name]
    kinds = [k for k in _union_members(hint) if k is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
        raise ValueError(f"{cls.__name__}.{f.name}: type {hint} has no command-line form")
    return kinds[0]


def _union_members(hint: Any) -> Iterator[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        yield from typing.get_args(hint)
    else:
        yield hint
