"""The files a sweep's folder holds by name (its own, beside Tune's): the settings record, the race's state, and each
trial's per-item outcomes and perplexity windows. Their readers and writers are `storage.folder`'s and the stages'
that make them."""

# per-item outcomes of a zero-shot pass, in the trial's folder: one row per item (task, doc_id, acc, acc_norm)
OUTCOME_COLUMNS = ("task", "doc_id", "acc", "acc_norm")
# the settings a sweep started with, in the experiment folder (written before Tune saves any state)
EXPERIMENT_RECORD = "taylor_tune_experiment.json"
# a racing sweep's state, in a folder of the experiment that Tune's restore leaves alone (`sweep.race_state`): each
# raced trial's last pass and every decision (JSON); sweeps of older versions kept it at the top
RACE_FILE = "taylor_tune/race.json"
LEGACY_RACE_FILE = "race.json"
# the perplexity's windows, in the trial's folder: each window's summed NLL and its predicted tokens
PPL_WINDOWS_FILE = "ppl_windows.parquet"


def outcomes_file(stage: str) -> str:
    """The trial folder's file of a zero-shot pass's per-item outcomes (`outcomes_<stage>.parquet`)."""
    return f"outcomes_{stage}.parquet"
