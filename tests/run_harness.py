"""Test harness for ``meshtorch train`` runs: a tiny model's flags, a tiny corpus, and what a run's
latest checkpoint holds."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import safetensors.torch
import torch

import meshtorch as mt

# a model and run that train in about a second on a CPU: quiet, one evaluation batch, 4 sampled tokens
TINY_TRAIN = {"d_model": 16, "heads": 2, "d_kv": 8, "d_ff": 32, "layers": 1, "batch": 4, "length": 16,
              "eval_batches": 1, "sample_tokens": 4, "warmup": 0, "no_progress": True}


def tiny_train(**flags) -> list[str]:
    """The ``meshtorch train`` flags of ``TINY_TRAIN`` with ``flags`` (the test's own) set or replacing
    them: ``lr_schedule="constant"`` is ``--lr-schedule constant``, ``True`` a flag without a value
    (``no_memory_check=True``), ``None`` leaves a flag out (``warmup=None``: train's default).

    >>> tiny_train(layers=2, sample_tokens=None, rules="")[8:]  # doctest: +NORMALIZE_WHITESPACE
    ['--layers', '2', '--batch', '4', '--length', '16', '--eval-batches', '1', '--warmup', '0',
     '--no-progress', '--rules', '']
    """
    argv = []
    for name, value in {**TINY_TRAIN, **flags}.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def write_corpus(d, files: int) -> str:
    """A tiny corpus of ``files`` Python files in directory ``d`` (a pathlib.Path); its path."""
    for i in range(files):
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(30)))
    return str(d)


def checkpoint_tensors(out: str) -> dict[str, torch.Tensor]:
    """Every stored piece of the latest checkpoint in run directory ``out``, by its key."""
    ckpt, tensors = mt.checkpoint.latest(os.path.join(out, "checkpoint")), {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            tensors.update(safetensors.torch.load_file(os.path.join(ckpt, f)))
    return tensors


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def run_in_session(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 150):
    """Run ``cmd`` in its own session with this environment plus ``env`` (unbuffered), killed as a
    group on timeout (the test fails, with the end of its stderr); (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{cmd} did not finish in {timeout} s:\n{err[-3000:]}")
    return p.returncode, out, err
