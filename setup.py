"""Build hook: generate the gRPC Python code from protos/ before packaging (also for `pip install -e .`).

The generated modules land in splitserve/v1/ (the proto package `splitserve.v1`), are ignored by
git and are never edited by hand; everything else is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = "splitserve.v1"


def generate_protos() -> None:
    import importlib.resources

    from grpc_tools import protoc

    protos = sorted(str(p) for p in (PROTO_ROOT / "splitserve" / "v1").glob("*.proto"))
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    init = ROOT / "splitserve" / "v1" / "__init__.py"
    init.write_text('"""Generated from protos/splitserve/v1 at build time; do not edit."""\n')


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        if self.packages is not None and OUT_PACKAGE not in self.packages:
            self.packages.append(OUT_PACKAGE)  # discovered before it existed
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
