"""tests/leaks.py on a real run: a test that leaves a splitserve app (its Controller) alive on
the shared cluster fails at its own teardown, naming the app; the next test runs on a clean
cluster and passes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint):
    """Built before pytester snapshots sys.modules: building imports transformers, torch._dynamo
    and triton, and pytester would drop them from sys.modules after the test, leaving triton's
    objects alive at exit (nanobind reports them as leaks)."""
    return tiny_checkpoint("llama")


def test_a_leaked_app_is_reported_against_the_test_that_leaked_it(ray_session, llama_dir, pytester, monkeypatch):
    import leaks

    from splitserve.control import controller

    monkeypatch.setattr(leaks, "TEARDOWN_S", 3.0)  # a real leak does not go away: no need to wait long
    pytester.makeconftest(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import pytest
        from leaks import no_leaked_ray_state, no_ray_state_between_modules


        @pytest.fixture(scope="session")
        def ray_session():
            import ray
            return ray  # the outer run's cluster, already joined
        """))
    pytester.makepyfile(test_inner=textwrap.dedent(f"""\
        from splitserve.control import controller
        from splitserve.control.deploy_config import DeployConfig


        def test_leaks_an_app(ray_session):
            app = controller.get_or_create(DeployConfig(model={str(llama_dir)!r}, name="leaky-app"))
            assert ray_session.get(app.status.remote()).workers == ()  # alive, and never stopped


        def test_runs_after_it(ray_session):
            try:
                controller.find("leaky-app")
            except ValueError:
                return  # gone: removed after the leak was reported
            raise AssertionError("the leaked app is still there")
        """))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.re_match_lines([r".*ERROR at teardown of test_leaks_an_app.*"])
    result.stdout.re_match_lines([r".*test_leaks_an_app\) left 1 thing\(s\) alive.*Controller 'leaky-app'.*"])
    assert "ERROR at teardown of test_runs_after_it" not in result.stdout.str()
    try:
        controller.find("leaky-app")
        raise AssertionError("the leaked app outlived the report")
    except ValueError:
        pass
