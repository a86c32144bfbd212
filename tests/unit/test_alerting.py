"""Which alerts go out, from what happened (tunerd.alerting): pure, plan + result in."""

from __future__ import annotations

from tunerd.alerting import Acted, Did, plan_alerts, saga_alerts
from tunerd.outcomes import Mode, Outcome, SagaKind, SagaResult
from tunerd.policy.engine import ActionPlan, NotifyRequest
from tunerd.tune import TuneResult

SEED = {"gpu_memory_utilization": 0.92, "max_num_seqs": 8}
LOWER = {**SEED, "gpu_memory_utilization": 0.89}


def _plan(mode: Mode, notify: tuple[NotifyRequest, ...] = (NotifyRequest("oom", "warning"),)) -> ActionPlan:
    return ActionPlan(
        engine="main",
        time=0.0,
        policies=("oom",),
        mode=mode,
        before=SEED,
        after=LOWER,
        tunes=(TuneResult("gpu_memory_utilization", 0.92, 0.89, "-0.03"),),
        notify=notify,
        reasons=("oom: gpu_memory_utilization 0.92 → 0.89",),
    )


def test_a_restart_that_took_says_so_and_offers_the_undo() -> None:
    result = SagaResult(SagaKind.RESTART, Outcome.SUCCEEDED, 7, 3, "passed start-up and probation")
    [out] = plan_alerts(_plan(Mode.ACT), Acted(Did.FINISHED, result=result), "box", 1.0)
    assert out.alert.severity == "warning"
    assert out.alert.undo == "tunerd rollback main"
    assert out.alert.action is not None
    assert out.alert.action.outcome == "succeeded"
    assert "what tunerd did: restart succeeded: passed start-up and probation" in out.alert.summary


def test_a_change_that_did_not_take_pages_even_a_quiet_policy() -> None:
    result = SagaResult(SagaKind.ROLLBACK, Outcome.ROLLED_BACK, 7, 2, "rolled back: vLLM refused")
    [out] = plan_alerts(_plan(Mode.ACT, notify=()), Acted(Did.FINISHED, result=result), "box", 1.0)
    assert (out.alert.severity, out.alert.policy) == ("critical", "oom")
    assert out.alert.undo is None
    # titled by what became of the change, not as the alarm that asked for it (issue 21)
    assert out.alert.title == (
        "main: the change oom asked for did not start; rolled back to the last good settings"
    )
    gave_up = plan_alerts(_plan(Mode.ACT), Acted(Did.GAVE_UP, "the restart budget is spent"), "box", 1.0)
    assert gave_up[0].alert.title == "main: the change oom asked for did not take (skipped)"
    took = SagaResult(SagaKind.RESTART, Outcome.SUCCEEDED, 7, 3, "passed")
    assert (
        plan_alerts(_plan(Mode.ACT), Acted(Did.FINISHED, result=took), "box", 1.0)[0].alert.title
        == "oom on main"
    )


def test_a_crash_restarted_with_the_same_settings_never_reports_the_proposal_as_done() -> None:
    """Found in review: in advise mode the plan of a crash was stored against the same-settings
    restart, and its end alerted `tune … succeeded` with an undo, for a change never made."""
    acted = Acted(
        Did.RECOVERING,
        "restarting after cuda_oom with the same settings; the policies' change: proposed, not applied",
    )
    [out] = plan_alerts(_plan(Mode.ADVISE), acted, "box", 1.0)
    assert out.alert.action is not None
    assert out.alert.action.outcome == "skipped"
    assert out.alert.undo is None
    assert "proposed, not applied" in out.alert.summary


def test_a_start_tunerd_made_on_its_own_that_failed_pages() -> None:
    failed = SagaResult(
        SagaKind.RECOVER,
        Outcome.FAILED,
        9,
        None,
        "the start failed: GPU memory still short",
        crash="cuda_oom",
    )
    [out] = saga_alerts("main", failed, "box", 1.0, Mode.OBSERVE)
    assert (out.alert.severity, out.alert.title) == ("critical", "main: restart after cuda_oom failed")
    assert out.mode == Mode.OBSERVE
    fine = SagaResult(SagaKind.RECOVER, Outcome.SUCCEEDED, 9, 3, "ok", crash="cuda_oom")
    assert saga_alerts("main", fine, "box", 1.0, Mode.ACT) == []


def test_a_ratchets_alert_names_the_prefill_plateau() -> None:
    """Issue 21: the user's word for it (the seed's nvidia-smi rectangle) beside tunerd's."""
    plan = _plan(Mode.ACT)
    plan = ActionPlan(
        **{**plan.__dict__, "evidence": {"memory_ratchet": {"height_bytes": 1 << 30, "at": 0.0}}}
    )
    [out] = plan_alerts(plan, Acted(Did.RESTARTING), "box", 1.0)
    assert out.alert.summary.startswith(
        "the engine's memory stepped up 1.00 GiB at a prefill and stayed (the 'prefill plateau' of nvidia-smi"
    )
