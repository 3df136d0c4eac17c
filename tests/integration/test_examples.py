"""The README's example runs against the session's servers, named only by EOSFLOW_* variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_counts_every_click_once_when_pointed_at_servers_by_environment(
    kafka_endpoint: tuple[str, str], redis_url: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOSFLOW_")}
    env.update(
        EOSFLOW_KAFKA_BROKERS=kafka_endpoint[0],
        EOSFLOW_REDIS_URL=redis_url,
        EOSFLOW_STATE_DIR=str(tmp_path),  # no dev cluster: only the variables say where servers are
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--records", "20000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kafka: {kafka_endpoint[0]} (env)" in result.stdout
    assert "OK: every click counted exactly once" in result.stdout
    assert "0 missing, 0 wrong" in result.stdout
