"""safeloop uses Hydra and OmegaConf through their public API: no ``hydra._internal``, no private
method of an OmegaConf config (``_get_node``, ``_is_missing``...), which change without notice."""
import ast
import inspect
from pathlib import Path

import omegaconf

PACKAGE = Path(__file__).resolve().parent.parent / "safeloop"


def sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def omegaconf_private_names() -> set[str]:
    """``_name`` members of OmegaConf's classes (configs, nodes, ``OmegaConf`` itself)."""
    classes = {cls for module in (omegaconf.base, omegaconf.basecontainer, omegaconf.dictconfig, omegaconf.listconfig,
                                  omegaconf.nodes, omegaconf.omegaconf)
               for _, cls in inspect.getmembers(module, inspect.isclass) if cls.__module__.startswith("omegaconf")}
    return {name for cls in classes for name in vars(cls) if name.startswith("_") and not name.endswith("_")}


def test_no_module_imports_hydra_internals():
    assert not [path.name for path in PACKAGE.rglob("*.py") if "hydra._internal" in path.read_text()]


def test_no_module_calls_a_private_method_of_omegaconf():
    private, trees = omegaconf_private_names(), sources()
    assert {"_get_node", "_is_missing", "_is_none", "_is_interpolation", "_set_value"} <= private
    # safeloop's own private names are its business, whatever OmegaConf calls its own
    own = {node.name for tree in trees.values() for node in ast.walk(tree)
           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {target.attr for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)}
    found = [f"{path.name}:{node.lineno} .{node.attr}" for path, tree in trees.items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in private - own]
    assert not found, found
