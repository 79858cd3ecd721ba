"""pstore on Ray, run in a network namespace of its own (the cases are in ``ray_cases.py``).

Ray's processes reach for the network beyond the cluster they make: its dashboard asks cloud
metadata addresses (169.254.169.254) and the system resolver which cloud it runs on, and reports
usage statistics, whatever ``RAY_USAGE_STATS_ENABLED`` says. This suite's traffic must stay on
this machine, so the cases run in a new network namespace that has only a loopback interface
(``unshare --net``): the Ray cluster, the store servers and the workers talk over that
namespace's 127.0.0.1, every other address fails at once with no route, and the namespace goes
away with its processes.

Run the cases by hand the same way, soak variants included:

    unshare --net sh -c 'ip link set lo up && python -m pytest -m soak tests/ray_cases.py'
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _netutil import CAN_UNSHARE_NET, UNSHARE_REASON, run_in_loopback_namespace

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not CAN_UNSHARE_NET, reason=UNSHARE_REASON)
def test_ray_cases_in_a_network_namespace_with_only_loopback() -> None:
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"]
    done = run_in_loopback_namespace([*pytest_cmd, "ray_cases.py"], cwd=HERE, timeout=1400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-20000:]
    summary = re.search(r"(\d+) passed", out)
    assert summary is not None and int(summary.group(1)) >= 7, out[-5000:]  # every case ran
    print(out[-2000:])


@pytest.mark.timeout(600)
@pytest.mark.skipif(not CAN_UNSHARE_NET, reason=UNSHARE_REASON)
def test_ray_replica_groups_in_a_network_namespace_with_only_loopback() -> None:
    """Replica groups on Ray (``ray_replica_cases.py``): a Ray cluster of its own, whose
    nodes are added and removed; groups scaled up and down; two failovers in a row."""
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"]
    done = run_in_loopback_namespace([*pytest_cmd, "ray_replica_cases.py"], cwd=HERE, timeout=540)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-20000:]
    summary = re.search(r"(\d+) passed", out)
    assert summary is not None and int(summary.group(1)) >= 5, out[-5000:]
    print(out[-2000:])
