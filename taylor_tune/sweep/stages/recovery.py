"""The recovery stage of a trial: LoRA recovery of the pruned model (recovery.train), its adapters merged, so that
the evaluation scores the recovered model; each point of its held-out loss curve reported to Tune (ASHA's recovery
rungs)."""

from __future__ import annotations

from taylor_tune import schema
from taylor_tune.recovery.train import recover_pruned
from taylor_tune.sources.data import resolve_text
from taylor_tune.sweep.stages.run import TrialRun


def recover(run: TrialRun) -> dict:
    """The held-out loss before, every `eval_every` steps (each a report) and after."""
    spec, config, pruned = run.trial.recovery, run.config, run.pruning
    points = iter(range(1, spec.steps + 1))  # the curve's points after step 0, counted: ASHA's recovery rungs

    def report_curve(step: int, loss: float, train_loss: float) -> None:
        run.report({**run.metrics, "stage": schema.recovery_stage(step), "recovery_step": step,
                    "recovery_point": next(points), "recovery_heldout_loss": loss, "recovery_train_loss": train_loss})

    recovered = recover_pruned(pruned.model, pruned.tokenizer, spec, model_name=config.model,
                               heldout_text=resolve_text(run.trial.evaluation.ppl or "auto", config.model),
                               trust_remote_code=config.trust_remote_code, seed=config.seed, report=report_curve)
    pruned.model = recovered.model
    return recovered.metrics(spec) | {"recovery_point": next(points), "stage": schema.recovery_stage(None)}
