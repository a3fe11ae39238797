"""The engine's command-line options, derived from ``EngineConfig``: one set of names, defaults and help.

Every field of ``EngineConfig`` is one option, named after the field (``max_num_batched_tokens`` is
``--max-num-batched-tokens``), with the field's default and the ``help`` (and optional ``choices``) of its
metadata. A boolean field that defaults to True, ``enable_<x>``, becomes the switch ``--no-<x>``; one
that defaults to False becomes ``--<name>``. Every option's ``dest`` is its field name.

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, exclude=("seed",))
    config = engine_config_from_args(parser.parse_args(argv))

Standard library only: commands that never load torch may import it.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection, Iterator
from dataclasses import Field, fields
from typing import Any

from pdserve.engine.config import EngineConfig

# Where add_engine_arguments records, on the parsed namespace, which fields it made options of; other
# options of the same command may share a field's name (`pdserve bench --seed` seeds the workload).
ENGINE_OPTIONS_DEST = "engine_options"


def engine_fields() -> tuple[str, ...]:
    """Names of ``EngineConfig``'s fields, in declaration order: the possible options."""
    return tuple(f.name for f in fields(EngineConfig))


def option_flag(name: str) -> str:
    """The flag of one field: ``"--block-size"``, ``"--no-chunked-prefill"`` for ``enable_chunked_prefill``."""
    f = _field(name)
    dashed = name.replace("_", "-")
    if _value_type(f) is bool and f.default is True:
        return "--no-" + dashed.removeprefix("enable-")
    return "--" + dashed


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    title: str = "engine",
) -> argparse._ArgumentGroup:
    """Add one option per ``EngineConfig`` field (those in ``only`` when given, less ``exclude``) as a group.

    Raises ``ValueError`` for a name that is not a field. Returns the group.
    """
    names = _selected(only, exclude)
    group = parser.add_argument_group(title, "engine options (EngineConfig; the same in every pdserve command)")
    for name in names:
        f = _field(name)
        kind = _value_type(f)
        description = f.metadata.get("help")
        if not description:
            raise ValueError(f"EngineConfig.{name} has no help in its metadata")
        if kind is bool:
            action, description = (
                ("store_false", f"turn off: {description}") if f.default else ("store_true", description)
            )
            group.add_argument(option_flag(name), dest=name, action=action, default=f.default, help=description)
            continue
        shown = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(
            option_flag(name),
            dest=name,
            type=kind,
            default=f.default,
            choices=f.metadata.get("choices"),
            help=description + shown,
        )
    parser.set_defaults(**{ENGINE_OPTIONS_DEST: names})
    return group


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` of the engine options that ``add_engine_arguments`` added to ``args``' parser;
    fields without an option keep their defaults and ``overrides`` win over both.

    Raises ``ValueError`` when the parser had no engine options, or for an invalid config.
    """
    names = getattr(args, ENGINE_OPTIONS_DEST, None)
    if names is None:
        raise ValueError("engine_config_from_args: the parser has no engine options (add_engine_arguments)")
    values = {name: getattr(args, name) for name in names}
    values.update(overrides)
    return EngineConfig(**values)


def _selected(only: Collection[str] | None, exclude: Collection[str]) -> tuple[str, ...]:
    known = engine_fields()
    unknown = sorted({*(only or ()), *exclude} - set(known))
    if unknown:
        raise ValueError(f"not EngineConfig fields: {', '.join(unknown)}")
    return tuple(n for n in known if (only is None or n in only) and n not in exclude)


def _field(name: str) -> Field[Any]:
    for f in fields(EngineConfig):
        if f.name == name:
            return f
    raise ValueError(f"EngineConfig has no field {name!r}")


def _value_type(f: Field[Any]) -> type:
    """``int`` for ``int | None``, and so on: what the option's text converts to."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    kinds = [k for k in _union_members(hint) if k is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
        raise ValueError(f"EngineConfig.{f.name}: type {hint} has no command-line form")
    return kinds[0]


def _union_members(hint: Any) -> Iterator[Any]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        yield from typing.get_args(hint)
    else:
        yield hint
