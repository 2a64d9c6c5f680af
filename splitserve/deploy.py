"""`splitserve.deploy:build_app`, the import path every RayService's serveConfigV2 names: the builder is `cli.app.build_app`."""

from splitserve.cli.app import build_app  # noqa: F401
