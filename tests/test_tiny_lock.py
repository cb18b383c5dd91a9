"""First runs started at once share one build of the tiny model: a file lock lets one build while the others wait
and reuse it (a sweep's runs each spent minutes building the same model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# A run's build, with the minutes of building replaced by writing the directory: the lock and the check after
# waiting are ensure_tiny's own.
RUN = """
import sys, time
from pathlib import Path
import ctxrl.train.tiny as tiny
log = Path(sys.argv[1])

def build(spec, path, on_progress=None):
    with log.open("a") as f:
        f.write("built\\n")
    time.sleep(0.5)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")

tiny.build_tiny = build
def heard(stage, done, total):
    with log.open("a") as f:
        f.write(stage + "\\n")
print(tiny.ensure_tiny(tiny.TinySpec(pretrain_steps=0), on_progress=heard))
"""


def test_two_first_runs_build_the_tiny_model_once(tmp_path: Path, monkeypatch) -> None:
    from ctxrl.models.tiny import TinySpec, tiny_path
    from ctxrl.train.tiny import build_lock

    monkeypatch.setenv("CTXRL_CACHE", str(tmp_path / "cache"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    log = tmp_path / "log"
    path = tiny_path(TinySpec(pretrain_steps=0))
    with build_lock(path):  # held here until both runs wait for it: neither can build before the other asks
        runs = [subprocess.Popen([sys.executable, "-c", RUN, str(log)], env=env, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
        deadline = time.monotonic() + 60
        while (log.read_text().count("waiting") if log.exists() else 0) < 2:
            assert time.monotonic() < deadline, "the runs did not wait for the lock"
            time.sleep(0.1)
    outputs = [run.communicate(timeout=60)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert outputs == [str(path), str(path)]
    assert log.read_text().count("built") == 1  # the second found the first's build after waiting
