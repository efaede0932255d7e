"""From an emulator's parsed command line to the keyword arguments of what it starts."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any


def flag_values(
    args: argparse.Namespace, *targets: Callable[..., Any], prefix: str = "", **given: Any
) -> dict[str, Any]:
    """The keyword arguments of `targets` that a flag sets, `given` on top.

    A parameter `name` takes the value of the flag `--<prefix><name>` (its dest `<prefix>_<name>` as
    argparse spells it); a parameter no flag names keeps its default, unless `given` sets it.
    """
    flags = vars(args)
    values = {}
    for target in targets:
        for name, parameter in inspect.signature(target).parameters.items():
            named = parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            if named and prefix + name in flags:
                values[name] = flags[prefix + name]
    return values | given
