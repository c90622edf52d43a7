"""`llmmesh whatif`, against costd and locally: the seed's case (600 tok/s at $4/h → $1.85 per
1M tokens) end to end, and an infeasible scenario said plainly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from costd_proc import GOLDEN, REPO, start_costd, stop
from llmmesh.apikeys import ADMIN_KEY_ENV, DEMO_ADMIN_KEY

pytestmark = pytest.mark.timeout(60)
PROFILE = str(GOLDEN / "whatif_profile.json")  # 0.6 req/s × 1,000 tokens = 600 tok/s all day
CURVE = str(GOLDEN / "curves" / "seed-a100.json")


def whatif(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmmesh.cli", "whatif", "--profile", PROFILE,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, ADMIN_KEY_ENV: DEMO_ADMIN_KEY})


def test_seed_case_through_costd_and_locally(tmp_path):
    costd = start_costd(str(tmp_path / "ledger.sqlite"), tmp_path / "costd.log",
                        "--curves-dir", str(GOLDEN / "curves"))
    try:
        remote = whatif("--costd", costd.address, "--device", "a100", "--json")
    finally:
        stop(costd)
    assert remote.returncode == 0, remote.stderr
    answer = json.loads(remote.stdout)
    assert answer["costPerMillionTokens"] == "1.851852"  # $4/h ÷ (600 tok/s × 3600) × 1e6
    assert (answer["devicesNeeded"], answer["feasible"], answer["curve"]) == (1, True,
                                                                              "seed-a100")
    local = whatif("--local", "--device", "a100", "--curve", CURVE)
    assert local.returncode == 0, local.stderr
    assert "cost per 1M tokens: 1.851852 USD" in local.stdout


def test_infeasible_scenario_is_said_plainly():
    # ~2,315 tok/s (200M tokens a day) on at most one 600 tok/s GPU.
    profile = json.loads((GOLDEN / "whatif_profile.json").read_text())
    profile["requests_per_s_by_hour"] = [200e6 / 86400 / 1000] * 24
    done = subprocess.run(
        [sys.executable, "-m", "llmmesh.cli", "whatif", "--local", "--profile", "/dev/stdin",
         "--device", "a100", "--curve", CURVE, "--max-devices", "1"],
        cwd=REPO, input=json.dumps(profile), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "feasible: NO" in done.stdout
    assert "needs 4 devices" in done.stdout and "only 1 available" in done.stdout
