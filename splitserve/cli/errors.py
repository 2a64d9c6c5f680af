"""What the command line says when a command fails: one line, in our words, naming what to do.

Our own failures (ConfigError, ValueError, ...) already say it; Ray's are recognised here and
put in our words (a cluster that is not there, one that refused this process's token); anything
else is named as unexpected, and `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import socket

# Raised by splitserve itself with a message meant for the user.
_OURS = (ValueError, RuntimeError, FileExistsError, FileNotFoundError, PermissionError, TimeoutError)

TOKEN_HINT = ("run it where the cluster's token is readable (~/.ray/auth_token), or set RAY_AUTH_TOKEN_PATH or "
              "RAY_AUTH_TOKEN to the cluster's token")


def explain(e: BaseException, args: argparse.Namespace) -> str:
    task, e = _raised_in_ray(e)
    if task is not None:
        return f"{task} failed inside Ray: {explain(e, args)}"
    address = getattr(args, "address", None)
    where = f" at {address}" if address not in (None, "auto") else ""
    if _is_ray_auth_error(e):
        return f"the Ray cluster{where} refused this process's authentication token: {TOKEN_HINT}"
    if isinstance(e, ConnectionError):  # Ray's "Failed to connect to Ray cluster at ..."
        return _unreachable(e, where)
    if isinstance(e, _OURS):
        return _first_line(e)
    if type(e).__module__.startswith("ray"):
        return f"Ray failed: {_first_line(e)} (`--debug` shows the traceback)"
    return f"unexpected {type(e).__name__}: {_first_line(e)} (`--debug` shows the traceback)"


def _raised_in_ray(e: BaseException) -> tuple[str | None, BaseException]:
    """A task or actor call that raised carries its error as `cause`; its own message starts with
    the call's pid, IP and actor id, which say nothing about what went wrong."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # pragma: no cover - ray is a dependency
        return None, e
    if isinstance(e, RayTaskError) and e.cause is not None and e.cause is not e:
        import re

        # the wrapper Ray raises in the caller delegates its attributes to the cause: the call's
        # name is only in its message ("ray::ProxyActor.ready() (pid=...)", coloured)
        m = re.search(r"ray::([\w.]+)\(", re.sub(r"\x1b\[[0-9;]*m", "", str(e)))
        return (m.group(1) if m else "a Ray call"), e.cause
    return None, e


def _is_ray_auth_error(e: BaseException) -> bool:
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(e, AuthenticationError)


def _unreachable(e: BaseException, where: str) -> str:
    """Ray says only that it failed to connect. When its GCS port answers TCP, the cluster is
    there and refused us — in Ray 2.60 that is an authentication token missing or wrong."""
    target = _address_in(str(e))
    if target is not None and _answers(*target):
        return (f"the Ray cluster at {target[0]}:{target[1]} did not accept this process (with token "
                f"authentication on, it needs the cluster's token): {TOKEN_HINT}")
    shown = f" at {target[0]}:{target[1]}" if target else where
    return (f"cannot reach the Ray cluster{shown}: start one with `splitserve serve`, or name a running one with "
            "--address HOST:PORT")


def _address_in(text: str) -> tuple[str, int] | None:
    import re

    m = re.search(r"at ([\w.\-]+|\[[0-9a-fA-F:]+\]):(\d+)", text)
    return (m.group(1).strip("[]"), int(m.group(2))) if m else None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
