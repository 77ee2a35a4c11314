"""A stage process whose models run on a GPU runs torch's CPU ops on few threads (kfrl.host_threads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(r"""
    import json, sys
    import torch
    torch.set_num_threads(4)  # what torch would take on a 4-core machine, whatever this one has
    from kfrl.host_threads import settle_host_threads

    seen = {"cpu": settle_host_threads("cpu"), "after_cpu": torch.get_num_threads()}
    seen["cuda"] = settle_host_threads(sys.argv[1])
    seen["after_cuda"] = torch.get_num_threads()
    seen["again"] = settle_host_threads("cuda")
    print(json.dumps(seen))
""")


def settle(device: str = "cuda", **env):
    result = subprocess.run([sys.executable, "-c", CHECK, device], capture_output=True, text=True, timeout=120,
                            env={**{k: v for k, v in os.environ.items() if k != "KFRL_HOST_THREADS"}, **env})
    return result


def seen(device: str = "cuda", **env) -> dict:
    result = settle(device, **env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_gpu_process_runs_torch_cpu_ops_on_one_thread_once_and_a_cpu_process_keeps_its_threads():
    got = seen("cuda:0")
    assert got["cpu"] is None and got["after_cpu"] == 4  # the model's own work is CPU work: untouched
    assert got["cuda"] == 1 and got["after_cuda"] == 1
    assert got["again"] is None  # once per process


@pytest.mark.parametrize("value, threads", [("3", 3), ("0", 4)])
def test_kfrl_host_threads_sets_the_count_or_leaves_torch_alone(value, threads):
    got = seen(KFRL_HOST_THREADS=value)
    assert got["after_cuda"] == threads and got["cuda"] == (threads if value != "0" else None)


def test_a_bad_kfrl_host_threads_names_the_variable():
    result = settle(KFRL_HOST_THREADS="many")
    assert result.returncode != 0 and "KFRL_HOST_THREADS must be a whole number" in result.stderr
