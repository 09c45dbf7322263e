"""Expand Slurm host-list expressions (SLURM_JOB_NODELIST) into host names.

Slurm compresses node lists: ``frontier[00001-00004,00010]`` is five hosts, ``a[1-2]-b[3-4]`` is the product of
two bracket groups (``a1-b3, a1-b4, a2-b3, a2-b4``), and a top-level comma separates independent expressions
(``login1,frontier[00001-00002]``). Range ends keep the width of the lower bound (``[008-010]`` gives ``008 009
010``), as Slurm prints them.
"""

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class NodeListError(ValueError):
    """A Slurm node list that cannot be expanded; the message quotes the offending part."""


def expand_nodelist(nodelist: str) -> list[str]:
    """All host names of a Slurm node-list expression, in Slurm's order, without duplicates."""
    hosts: list[str] = []
    for expression in _split_top_level(nodelist.strip(), nodelist):
        for host in _expand_expression(expression, nodelist):
            if host not in hosts:
                hosts.append(host)
    if not hosts:
        raise NodeListError(f"node list {nodelist!r} names no hosts")
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise NodeListError(f"nested '[' in node list {whole!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise NodeListError(f"unmatched ']' in node list {whole!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise NodeListError(f"unclosed '[' in node list {whole!r}")
    parts.append(text[start:])
    for part in parts:
        if not part.strip():
            raise NodeListError(f"empty host name in node list {whole!r}")
        if any(c.isspace() for c in part.strip()):
            raise NodeListError(f"whitespace inside host expression {part!r} of node list {whole!r}")
    return [part.strip() for part in parts]


def _expand_expression(expression: str, whole: str) -> list[str]:
    """One comma-free expression: literal text interleaved with bracket groups, expanded as a product."""
    if "[]" in expression:
        raise NodeListError(f"empty bracket group in {expression!r} of node list {whole!r}")
    pieces: list[list[str]] = []
    for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", expression):
        if literal:
            pieces.append([literal])
        if group:
            pieces.append(_expand_group(group, expression, whole))
    return ["".join(combination) for combination in itertools.product(*pieces)]


def _expand_group(group: str, expression: str, whole: str) -> list[str]:
    """The inside of one bracket group: comma-separated numbers and inclusive ranges."""
    values: list[str] = []
    for item in group.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise NodeListError(f"bad range {item!r} in {expression!r} of node list {whole!r}")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise NodeListError(f"descending range {item!r} in {expression!r} of node list {whole!r}")
        values.extend(str(number).zfill(len(low_text)) for number in range(low, high + 1))
    return values
