"""The engine's command-line options, derived from ``EngineConfig``: one set of names, defaults and help.

Every field of ``EngineConfig`` is one option (``pdserve.options``' rules): named after the field
(``max_num_batched_tokens`` is ``--max-num-batched-tokens``), with the field's default and the ``help``
(and optional ``choices``) of its metadata. A boolean field that defaults to True, ``enable_<x>``, becomes
the switch ``--no-<x>``; one that defaults to False becomes ``--<name>``. Every option's ``dest`` is its
field name.

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, exclude=("seed",))
    config = engine_config_from_args(parser.parse_args(argv))

Standard library only: commands that never load torch may import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from pdserve import options
from pdserve.engine.config import EngineConfig


def engine_fields() -> tuple[str, ...]:
    """Names of ``EngineConfig``'s fields, in declaration order: the possible options."""
    return tuple(f.name for f in fields(EngineConfig))


def option_flag(name: str) -> str:
    """The flag of one field: ``"--block-size"``, ``"--no-chunked-prefill"`` for ``enable_chunked_prefill``."""
    return options.option_flag(EngineConfig, name)


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    title: str = "engine",
) -> argparse._ArgumentGroup:
    """Add one option per ``EngineConfig`` field (those in ``only`` when given, less ``exclude``) as a group.

    Raises ``ValueError`` for a name that is not a field, or a field without help. Returns the group.
    """
    missing = [name for name in engine_fields() if name not in options.option_fields(EngineConfig)]
    if missing:
        raise ValueError(f"EngineConfig.{missing[0]} has no help in its metadata")
    unknown = sorted({*(only or ()), *exclude} - set(engine_fields()))
    if unknown:
        raise ValueError(f"not EngineConfig fields: {', '.join(unknown)}")
    return options.add_config_arguments(
        parser,
        EngineConfig,
        only=only,
        exclude=exclude,
        title=title,
        description="engine options (EngineConfig; the same in every pdserve command)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The ``EngineConfig`` of the engine options that ``add_engine_arguments`` added to ``args``' parser;
    fields without an option keep their defaults and ``overrides`` win over both.

    Raises ``ValueError`` when the parser had no engine options, or for an invalid config.
    """
    try:
        values = options.config_values(EngineConfig, args)
    except ValueError:
        raise ValueError("engine_config_from_args: the parser has no engine options (add_engine_arguments)") from None
    return EngineConfig(**{**values, **overrides})
