"""The type stubs of the native module list every public class method and function it has."""

import ast
import os

import rlx
from rlx import _rlx

STUBS = os.path.join(os.path.dirname(rlx.__file__), "_rlx.pyi")


def test_stubs_cover_the_native_module():
    tree = ast.parse(open(STUBS).read())
    declared = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            declared[""].add(node.name)
    classes = [name for name in dir(_rlx) if isinstance(getattr(_rlx, name), type)]
    for cls in classes:
        public = {m for m in dir(getattr(_rlx, cls)) if not m.startswith("_")}
        assert public <= declared.get(cls, set()), f"{cls}: not in the stubs: {sorted(public - declared[cls])}"
    functions = {n for n in dir(_rlx) if not n.startswith("__") and callable(getattr(_rlx, n)) and n not in classes}
    assert functions <= declared[""], f"functions not in the stubs: {sorted(functions - declared[''])}"
    assert os.path.exists(os.path.join(os.path.dirname(rlx.__file__), "py.typed"))
