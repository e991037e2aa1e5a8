"""The documentation: the API reference builds from the docstrings with pdoc, warnings as errors;
every public function and class has a docstring with an example, every public method one; the
user guide's links resolve; nothing in the repository points outside it."""

import inspect
import os
import re
import subprocess
import sys

import pytest

import rlx
import rlx.distributed
import rlx.models
import rlx.nn
import rlx.optim
import rlx.optim.lr_scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = [rlx, rlx.nn, rlx.optim, rlx.optim.lr_scheduler, rlx.models, rlx.distributed]


def public_objects():
    for mod in MODULES:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.ismodule(obj):
                continue
            yield f"{mod.__name__}.{name}", obj


def test_every_public_layer_is_exported():
    """A class missing from ``__all__`` is missing from the API reference (pdoc) and from the
    docstring checks below."""
    for mod, base in ((rlx.nn, (rlx.nn.Module, rlx.nn.Parameter)), (rlx.optim, (rlx.optim.Optimizer,))):
        missing = [n for n, o in vars(mod).items() if inspect.isclass(o) and issubclass(o, base)
                   and o.__module__ == mod.__name__ and not n.startswith("_") and n not in mod.__all__]
        assert not missing, f"{mod.__name__}.__all__ lacks {missing}"


def has_example(doc):
    return "Example" in doc or ">>>" in doc


def test_every_public_function_and_class_has_an_example():
    missing = [n for n, obj in public_objects()
               if (inspect.isfunction(obj) or inspect.isclass(obj)) and not has_example(inspect.getdoc(obj) or "")]
    assert not missing, f"no docstring example: {missing}"


def test_every_public_method_has_a_docstring():
    missing = []
    for qual, cls in public_objects():
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if (inspect.isfunction(member) or isinstance(member, property)) and not inspect.getdoc(member):
                missing.append(f"{qual}.{name}")
    assert not missing, f"no docstring: {missing}"


def test_api_reference_builds_without_warnings(tmp_path):
    pytest.importorskip("pdoc", reason="pdoc is in the 'test' extra: pip install '.[test]'")
    out = tmp_path / "api"
    p = subprocess.run([sys.executable, "-W", "error", os.path.join(ROOT, "docs", "build_api.py"), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for page in ("rlx.html", "rlx/nn.html", "rlx/optim.html", "rlx/optim/lr_scheduler.html"):
        assert (out / page).is_file(), page
    html = (out / "rlx" / "nn.html").read_text()
    assert "load_state_dict" in html and "ModuleList" in html


def test_guide_links_resolve():
    for doc in ("README.md", "docs/README.md", "docs/guide.md", "CHANGELOG.md"):
        text = open(os.path.join(ROOT, doc)).read()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
            assert os.path.exists(path), f"{doc} links to missing {target}"


def test_nothing_points_outside_the_repository():
    bad = []
    for top in ("README.md", "BENCHMARKS.md", "CHANGELOG.md", "docs", "python", "tests", "benches", "examples",
                "scripts", "crates"):
        base = os.path.join(ROOT, top)
        files = [base] if os.path.isfile(base) else [os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs]
        for f in files:
            if not f.endswith((".py", ".md", ".rs", ".toml", ".pyi")) or f.endswith("test_docs.py"):
                continue
            text = open(f, encoding="utf-8", errors="replace").read()
            if "../shared" in text or "/work/shared" in text or "bench-anchors" in text:
                bad.append(os.path.relpath(f, ROOT))
    assert not bad, f"references outside the repository in {bad}"
