"""The import rules (DESIGN.md §2) as import-linter contracts (pyproject.toml [tool.importlinter]):
they hold for the tree, each one fails when its rule is broken, and the processes that must run
without the engine (an ingress replica, the CLI) import without torch."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> dict[str, str]:
    """Each contract's name -> KEPT / BROKEN, from `lint-imports` run on the tree under `root`."""
    out = subprocess.run([shutil.which("lint-imports") or "lint-imports", "--no-cache", "--no-logo"],
                         cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    results = dict(re.findall(r"^(.+) (KEPT|BROKEN)$", out.stdout, re.M))
    assert results, out.stdout + out.stderr
    return results


def test_the_tree_keeps_every_contract():
    results = lint_imports(ROOT)
    assert len(results) == 5 and set(results.values()) == {"KEPT"}, results


# one cut broken at a time: the line added, the file, and the contract that must then fail
CUTS = [
    ("import torch", "splitserve/ingress/http.py", "the edge (an ingress replica) runs without the engine or torch"),
    ("from splitserve.engine import sampler", "splitserve/ingress/frontend.py",
     "the edge (an ingress replica) runs without the engine or torch"),
    ("import torch", "splitserve/router/policy.py", "the router is pure placement: no Ray, no torch, no engine"),
    ("import ray", "splitserve/engine/sampler.py", "the engine runs without Ray"),
    ("from splitserve.engine.kv_cache import tensors", "splitserve/kv_transfer/base.py",
     "KV transfer moves bytes: it knows no engine and no Ray"),
    ("def f():\n    from splitserve.cli import main", "splitserve/config.py",
     "layers: each process's and role's code imports only the layers below it"),
    ("from splitserve.worker import rank_kv", "splitserve/engine/engine.py",
     "layers: each process's and role's code imports only the layers below it"),
]


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "splitserve", root / "splitserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize("line,path,contract", CUTS, ids=[f"{c[1]}: {c[0].splitlines()[-1].strip()}" for c in CUTS])
def test_breaking_a_cut_fails_its_contract(tree_copy, line, path, contract):
    f = tree_copy / path
    original = f.read_text()
    f.write_text(original + "\n\n" + line + "  # noqa\n")
    try:
        results = lint_imports(tree_copy)
    finally:
        f.write_text(original)
    assert results[contract] == "BROKEN", results


def test_the_serve_app_and_the_cli_import_without_torch():
    """What an ingress replica (num_cpus 0, no GPU) and `splitserve status` load: never torch."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *a):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import splitserve.cli.app, splitserve.deploy, splitserve.ingress.http, splitserve.cli.main\n"
            "import splitserve.control.admin, splitserve.orchestrator.cluster_backend\n"
            "from splitserve.deploy import build_app\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_public_api_is_where_the_readme_says():
    code = ("from splitserve import LLM, SamplingParams, Cluster\n"
            "from splitserve.deploy import build_app\n"
            "from splitserve.cli.main import main\n"
            "print(Cluster.__module__, LLM.__module__, build_app.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["splitserve.orchestrator.cluster", "splitserve.llm", "splitserve.cli.app"]
