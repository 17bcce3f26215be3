"""Short text for the core's messages and block lists, as ``replay``'s
commands print them.

* :func:`brief`: ``Name(field=value, ...)``, each field through
  ``replay.text.field``, long id lists summarised as ranges;
* :func:`blocks_text` / :func:`ranges_text`: ``blocks=12 [40-47, 90-93]``,
  sorted runs of consecutive ids, at most :data:`RUNS_SHOWN` runs; with
  ``verbose`` every id, in the store's own order.
"""

from __future__ import annotations

import attrs

from replay.text import field

__all__ = ["RUNS_SHOWN", "blocks_text", "brief", "ranges_text"]

RUNS_SHOWN = 4  # runs of consecutive block ids printed before "+N more"


def blocks_text(block_ids: tuple[int, ...] | list[int], verbose: bool = False) -> str:
    """``blocks=N [a-b, c, ...]``: the count, then runs of consecutive ids (sorted;
    a store's own order is what ``verbose`` prints, every id as listed)."""
    return f"blocks={len(block_ids)} {ranges_text(block_ids, verbose)}"


def ranges_text(values: tuple[int, ...] | list[int], verbose: bool = False) -> str:
    """``[a-b, c, ...]``: runs of consecutive values, sorted, at most
    :data:`RUNS_SHOWN`; ``verbose``: every value in its own order."""
    if verbose:
        return str(list(values))
    ids = sorted(set(values))
    runs: list[list[int]] = []
    for block_id in ids:
        if runs and block_id == runs[-1][1] + 1:
            runs[-1][1] = block_id
        else:
            runs.append([block_id, block_id])
    shown = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:RUNS_SHOWN]]
    if len(runs) > RUNS_SHOWN:
        shown.append(f"+{len(runs) - RUNS_SHOWN} more runs")
    return f"[{', '.join(shown)}]"


def brief(message: object, verbose: bool = False) -> str:
    """``Name(field=value, ...)`` with id lists summarised as ranges."""
    parts = []
    for attribute in attrs.fields(type(message)):  # type: ignore[arg-type]  # events etc.
        value = getattr(message, attribute.name)
        if isinstance(value, tuple) and len(value) > RUNS_SHOWN and all(
                type(v) is int for v in value):
            text = f"{len(value)} {ranges_text(value, verbose)}"
        elif isinstance(value, tuple) and len(value) > RUNS_SHOWN and not verbose:
            text = f"{len(value)} items"
        else:
            text = field(repr(getattr(value, "value", value)))
        parts.append(f"{attribute.name}={text}")
    return f"{type(message).__name__}({', '.join(parts)})"
