"""The one argument check the kernel launchers share: a ValueError whose message names the
argument and what was wrong."""


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)
