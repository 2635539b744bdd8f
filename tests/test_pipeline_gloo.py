"""The pipeline on the torch backend: 2 gloo processes (one stage each): GPipe/1F1B equal unsplit
training, 2BW without flush equals the direct 2BW rule, also for the MeshTensor LM stages."""

from __future__ import annotations

import pytest
import torch

import meshtorch as mt
from meshtorch.errors import ProcessorError

pytestmark = pytest.mark.timeout(240)

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from test_pipeline import _failing, batches, make_stages, reference, run_pipeline  # noqa: E402
from test_pipeline_lm import _piped_2bw, _unsplit_2bw, config  # noqa: E402
from test_pipeline_semantics import _two_bw, two_bw_reference  # noqa: E402


def _all_schedules(stages, data, m, lm_cfg):
    # one spawn for everything: process start-up dominates these tests
    out = {s: run_pipeline(stages, data, s, m)[:2] for s in ("gpipe", "1f1b")}
    out["2bw"] = _two_bw(stages, data, m, "train")  # no flush between the 5 batches
    out["lm_2bw"] = _piped_2bw(lm_cfg)  # MeshTensor stages, tied table summed over the gloo pair
    out["p2p"] = _p2p_on_stage_axis()
    return out


def _p2p_on_stage_axis():
    comm = mt.current().comm
    me = comm.coords["stage"]
    comm.send(torch.full((2, me + 1), float(me), dtype=torch.float64), "stage", dst=1 - me, tag=5)
    got = comm.recv("stage", src=1 - me, tag=5)
    comm.wait_sends()
    return got.tolist()


def test_schedules_and_lm_stages_on_two_gloo_processes_equal_their_references():
    stages, data = make_stages(2), batches(5, 8)
    want, want_losses = reference(stages, data)
    want_2bw = two_bw_reference(stages, data)
    lm_cfg = config(True)
    (want_lm,) = mt.launch(_unsplit_2bw, lm_cfg)
    out = mt.launch(_all_schedules, stages, data, 4, lm_cfg, mesh="stage:2", backend="torch", timeout=180)
    assert set(out[0]["lm_2bw"]) | set(out[1]["lm_2bw"]) == set(want_lm)
    for s, per_stage in enumerate(out):
        for k, v in per_stage["2bw"].items():
            torch.testing.assert_close(v, want_2bw[f"{s}.{k}"], rtol=1e-10, atol=1e-12, msg=f"2bw {s} {k}")
        for name, v in per_stage["lm_2bw"].items():
            torch.testing.assert_close(v, want_lm[name], rtol=1e-4, atol=1e-5, msg=f"lm {s} {name}")
        for schedule in ("gpipe", "1f1b"):
            state, losses = per_stage[schedule]
            assert losses == pytest.approx(want_losses, rel=1e-12)
            for k, v in want[s].items():
                torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12, msg=f"{schedule} {s} {k}")
        # shapes differ per direction: the receiver learns them from the header
        assert per_stage["p2p"] == [[1.0 - s] * (2 - s)] * 2


def test_failing_stage_on_gloo_is_named():
    with pytest.raises(ProcessorError, match="stage 1 of axis 'stage' raised ValueError"):
        mt.launch(_failing, make_stages(2), mesh="stage:2", backend="torch", timeout=60)

