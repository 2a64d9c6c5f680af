"""What the command line prints for a failure raised inside a Ray task or actor call."""

import argparse

from ray.exceptions import RayTaskError

from splitserve.cli.errors import explain


def test_an_error_raised_in_an_actor_call_is_explained_by_its_cause():
    cause = OSError(98, "Address already in use")
    wrapped = RayTaskError("ProxyActor.ready", "\x1b[36mray::ProxyActor.ready()\x1b[39m (pid=7, ip=192.0.2.2)\nTraceback", cause,
                           pid=7, ip="192.0.2.2", actor_repr="<ProxyActor>").as_instanceof_cause()
    said = explain(wrapped, argparse.Namespace(address=None))
    assert said.startswith("ProxyActor.ready failed inside Ray: ")
    assert "Address already in use" in said
    assert "pid=" not in said and "Traceback" not in said


def test_our_own_error_keeps_its_words():
    assert explain(ValueError("--prefill must be >= 0"), argparse.Namespace()) == "--prefill must be >= 0"
