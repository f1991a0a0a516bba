"""The suite's fork server is used only where a forked worker is indistinguishable from ``python -m worker``."""

from tests import zygote


def test_per_test_and_run_time_variables_still_fork(monkeypatch):
    monkeypatch.setattr(zygote, "SPAWN", "fork")  # the default (TRIAGE_TEST_SPAWN=exec turns forking off)
    env = {
        **zygote.base_env(),
        "TRIAGE_MODEL": "/m",
        "PYTEST_CURRENT_TEST": "t.py::x (call)",
        "RAYON_NUM_THREADS": "2",  # set by a classifier built in-process earlier: the worker sets it itself
        "TQDM_DISABLE": "1",
    }
    assert zygote.forkable(env)
    monkeypatch.setattr(zygote, "SPAWN", "exec")
    assert not zygote.forkable(env)


def test_variables_read_at_import_make_a_fresh_interpreter():
    base = zygote.base_env()
    for changed in ({"HF_HUB_OFFLINE": "0"}, {"HF_HUB_CACHE": "/elsewhere"}, {"OMP_NUM_THREADS": "2"}):
        assert not zygote.forkable({**base, **changed}), changed
    assert not zygote.forkable({k: v for k, v in base.items() if k != "HF_HUB_OFFLINE"})
