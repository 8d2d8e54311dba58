"""A sweep's status from its saved experiment state, read as JSON: trial counts by state and the best trial so far
per model. Must import neither torch nor Ray (a test checks): `taylor-tune status` reads files, nothing more."""

from __future__ import annotations

import time

import pandas as pd

from taylor_tune.compat.tune_state import saved_trials
from taylor_tune.errors import ConfigError
from taylor_tune.reporting import stats
from taylor_tune.reporting.frame import same_value
from taylor_tune.schema import CONFIG_COLUMNS, zero_shot_stage
from taylor_tune.storage.folder import read_reports, trial_folders
from taylor_tune.storage.location import open_location


def sweep_status(path: str) -> dict:
    """Trial counts by state and the best trial so far per model by the sweep's metric, from the saved experiment
    state."""
    filesystem, root = open_location(path)
    # a running driver rewrites the state file every second, not atomically: a read can catch it half written
    for attempt in range(3):
        try:
            trials, saved_at = saved_trials(filesystem, root)  # JSON only: nothing from the folder is unpickled
            break
        except (OSError, ValueError, UnicodeDecodeError) as error:  # missing folder or file, a half-written file
            if attempt == 2:
                raise ConfigError(f"{path}: not a readable Tune experiment ({type(error).__name__}: {error})") from None
            time.sleep(0.5)
    counts = {"PENDING": 0, "RUNNING": 0, "TERMINATED": 0, "ERROR": 0, "PAUSED": 0}
    finals: dict[str, list[dict]] = {}
    objective = stats.ACCURACY
    folders, disagree = trial_folders(filesystem, root), []
    for trial in trials:
        counts[trial["status"]] = counts.get(trial["status"], 0) + 1
        result, config = trial["last_result"], trial["config"]
        metric = (config.get("fixed", {}).get("objective") or {}).get("metric")
        differ = _differs(filesystem, folders.get(trial["trial_id"]), result, metric)
        if differ:  # the state says what the trial's own record does not: named, and left out of the best
            disagree.append(f"trial {trial['trial_id']}: the experiment state and its result.json disagree on "
                            f"{', '.join(differ[:3])}; left out of the best")
            continue
        # only a trial's full evaluation counts (a cheap pass, or a trial ASHA stopped after one, is not comparable)
        fixed = config.get("fixed", {})
        fidelities = fixed.get("evaluation", {}).get("fidelities") or [None]
        objective = stats.Objective(**fixed["objective"]) if fixed.get("objective") else objective
        if (
            result.get("stage") != zero_shot_stage(fidelities[-1])
            or "acc_mean" not in result
            or objective.metric not in result
        ):
            continue
        finals.setdefault(config.get("model"), []).append(
            {
                "trial_id": trial["trial_id"],
                "acc_mean": result["acc_mean"],
                "ppl": result.get("ppl"),
                **{k: result[k] for k in ("decode_speedup", "memory_ratio") if k in result},  # measured speed
                objective.metric: result[objective.metric],
                **{k: result.get(k, config.get(k)) for k in CONFIG_COLUMNS[1:]},  # the trial reports them all
            }
        )
    # ranked and tied as the report ranks them, so that both name the same trial
    best = {
        model: {
            "metric": objective.metric,
            **{k: stats.plain(v) for k, v in stats.best_trial(pd.DataFrame(rows), objective).items()},
        }
        for model, rows in finals.items()
    }
    return {"pending": counts["PENDING"], "running": counts["RUNNING"], "finished": counts["TERMINATED"],
            "errored": counts["ERROR"], "paused": counts["PAUSED"], "total": len(trials), "best": best,
            "saved_s_ago": None if saved_at is None else max(0.0, time.time() - saved_at), "disagree": disagree}


# what status reads of a trial's last result, besides its configuration and the sweep's metric
STATUS_KEYS = ("stage", "acc_mean", "ppl", "decode_speedup", "memory_ratio")


def _differs(filesystem, folder: str | None, result: dict, metric: str | None) -> list[str]:
    """The keys on which the state's last result of a trial and the same report in its result.json (the line of the
    same training iteration) differ; [] when they agree, or when result.json has no such line yet (it is written a
    moment after the state, and a driver killed in between leaves it behind)."""
    if folder is None or not result:
        return []
    _, reports, _ = read_reports(filesystem, folder)
    iteration = result.get("training_iteration")
    same = next((r for r in reversed(reports) if isinstance(r, dict) and r.get("training_iteration") == iteration),
                None)
    if same is None:
        return []
    keys = [k for k in (*STATUS_KEYS, *CONFIG_COLUMNS[1:], metric) if k and (k in result or k in same)]
    return sorted(k for k in keys if not same_value(result.get(k), same.get(k)))
