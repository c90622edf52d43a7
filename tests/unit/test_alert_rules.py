"""deploy/prometheus/alerts.yml with Prometheus's own tool: the rules parse (`promtool check
rules`) and fire when, and only when, their unit tests say (`promtool test rules`)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool missing: sudo apt-get install -y prometheus "
                                       "(scripts/setup.sh does it as root)")


def _promtool(*args: str, cwd: Path = RULES) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_rules_parse_and_their_unit_tests_pass():
    check = _promtool("check", "rules", "alerts.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    test = _promtool("test", "rules", "alerts_test.yml")
    assert test.returncode == 0, test.stdout + test.stderr


def test_a_wrong_expectation_fails_the_rule_tests(tmp_path):
    # The same tests with one expectation changed (another tenant burning): promtool fails them.
    shutil.copy(RULES / "alerts.yml", tmp_path)
    text = (RULES / "alerts_test.yml").read_text().replace("tenant: acme}", "tenant: globex}")
    (tmp_path / "alerts_test.yml").write_text(text)
    test = _promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert test.returncode != 0 and "LlmmeshBudgetBurning" in test.stdout + test.stderr
