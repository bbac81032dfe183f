"""A picture of a loss's graph (Graphviz DOT, and SVG where ``dot`` is installed)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def render(root, path: Path, highlight=(), limit: int = 400) -> str:
    """Write the graph below ``root`` to ``path`` (.dot), offending nodes in red; return the path."""
    marked = {id(n) for n in highlight}
    lines = ["digraph loss {", '  node [shape=box, fontname="monospace", fontsize=10];']
    seen, stack = {}, [root]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        label = type(node).__name__
        var = getattr(node, "variable", None)
        if var is not None:
            label += f"\\n{tuple(var.shape)}"
        style = ', style=filled, fillcolor="#ff9999"' if id(node) in marked else ""
        lines.append(f'  n{id(node)} [label="{label}"{style}];')
        for nxt, _ in node.next_functions:
            if nxt is not None:
                lines.append(f"  n{id(nxt)} -> n{id(node)};")
                stack.append(nxt)
    if stack:
        lines.append(f'  more [label="... graph cut at {limit} nodes", shape=plaintext];')
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    dot = shutil.which("dot")
    if dot:
        svg = path.with_suffix(".svg")
        if subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], capture_output=True).returncode == 0:
            return str(svg)
    return str(path)
